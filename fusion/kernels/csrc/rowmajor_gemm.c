/* y = x @ w^T (+ b) for float32 x [M, K] and a row-major weight w [N, K], read in place.
 *
 * Why this kernel exists: at decode sizes (1-256 rows) a float32 linear on a CPU is bound by
 * streaming its weight from memory, and MKL's sgemm first packs the weight it is given: one
 * more pass over it on every call. This kernel reads the weight once, where it lies, as dot
 * products along K: a block of NR weight rows meets the input rows MR at a time (MR * NR
 * vector accumulators in registers), while the next block's rows are prefetched.
 *
 * Rounding (why it is no less accurate than MKL): each output is VL vector lanes, each lane
 * summing its own K/VL products in blocks of KC/VL (a fresh register per block, added to a
 * running sum), then a fixed tree over the lanes. Every output element is computed by one
 * thread in one fixed order that depends only on K and the machine's vector width: results
 * are bit-identical whatever the thread count, and a row's result does not depend on the
 * other rows (batch invariant).
 *
 * bfloat16 weights (fh_linear_bf16w): the same kernel reading a bf16 weight [N, K] where it
 * lies, each 16-bit value widened exactly to float32 in registers (a bf16 is a float32's top
 * half); x, b and y stay float32 (the caller widens the few input rows and rounds the
 * outputs once). Half the bytes streamed, the same sums: what PyTorch's bf16 linear on a CPU
 * computes (float32 accumulation, one rounding of each output), in another fixed order.
 *
 * Contract (the Python side checks it, fh_linear re-checks the cheap parts): K a positive
 * multiple of 16; unit stride along K for x and w; row strides ldx >= K, ldw >= K,
 * ldy >= N; y does not overlap x, w or b. Vector types are GCC's generic ones sized to the
 * machine (-march=native): 16 lanes with AVX-512, 8 with AVX, else 4.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#define VL 16 /* lanes per vector */
#define MR 4  /* input rows per register block */
#define NR 4  /* weight rows per block: MR * NR + NR + 1 = 21 of 32 vector registers */
#elif defined(__AVX__)
#define VL 8
#define MR 2 /* 2 x 4 rather than 4 x 2 (both 13 of 16 registers): every weight block */
#define NR 4 /* re-reads the whole input, so fewer, wider blocks halve that traffic */
#else
#define VL 4
#define MR 4
#define NR 2
#endif
#define KC 256 /* K block: NR weight rows and MB input rows of it stay in L1 */
#define MB 32  /* input rows per pass over a weight block (accumulator array size) */

typedef float vec __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned loads */
typedef float acc_t __attribute__((vector_size(VL * 4)));
typedef uint16_t hvec __attribute__((vector_size(VL * 2), aligned(2))); /* VL bf16 values */
typedef uint32_t uvec __attribute__((vector_size(VL * 4)));

int fh_abi_version(void) { return 4; }

static inline float lane_sum(acc_t v) {
  float t[VL];
  __builtin_memcpy(t, &v, sizeof t);
  for (int width = VL / 2; width >= 1; width >>= 1)
    for (int i = 0; i < width; i++) t[i] += t[i + width];
  return t[0];
}

#define LOAD(p) (*(const vec *)(p))

/* VL bf16 values widened to float32: exact (the 16 bits become the float's top half). */
static inline acc_t load_bf16(const uint16_t *p) {
  const uvec wide = __builtin_convertvector(*(const hvec *)p, uvec) << 16;
  acc_t f;
  __builtin_memcpy(&f, &wide, sizeof f);
  return f;
}

/* Element k of a weight row, VL of them, float32 or bf16 (`bf16` is a constant at every
   call site, so each caller's copy of the kernel has one kind of load). */
#define LOAD_W(row, k) (bf16 ? load_bf16((const uint16_t *)(row) + (k)) : LOAD((const float *)(row) + (k)))
/* Keep a loaded vector in a register: without it GCC re-reads operands from L1 as memory
   operands of every FMA (2-4x the loads; the loop then waits on loads, not FMAs). */
#if defined(__AVX512F__)
#define HOLD(v) __asm__("" : "+v"(v))
#elif defined(__x86_64__)
#define HOLD(v) __asm__("" : "+x"(v))
#else
#define HOLD(v) ((void)0)
#endif

/* Rows [0, rows) of x against weight rows n0 .. n0+nb-1 (nb <= NR), whole K; the weight's
   elements are float32, or bf16 where `bf16` (inlined into each caller with a constant). */
static inline __attribute__((always_inline)) void weight_block(
    const float *x, int64_t ldx, const void *w, int64_t ldw, const float *b, float *y,
    int64_t ldy, int rows, int64_t n0, int nb, int64_t K, const int bf16) {
  const int64_t esize = bf16 ? 2 : 4; /* bytes per weight element */
  acc_t sum[MB][NR];
  const acc_t zero = {0};
  for (int m = 0; m < rows; m++)
    for (int j = 0; j < NR; j++) sum[m][j] = zero;
  /* Missing rows of a short block repeat row n0: in bounds, results dropped. */
  const char *wr[NR];
  for (int j = 0; j < NR; j++) wr[j] = (const char *)w + (n0 + (j < nb ? j : 0)) * ldw * esize;
  /* The next block's rows, in bytes: prefetch never faults, so past the end is harmless. */
  const int64_t ahead = NR * ldw * esize;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = k0 + KC < K ? k0 + KC : K;
    int m = 0;
    for (; m + MR <= rows; m += MR) {
      acc_t a[MR][NR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; i++)
#pragma GCC unroll 16
        for (int j = 0; j < NR; j++) a[i][j] = zero;
      const float *xr = x + m * ldx;
      for (int64_t k = k0; k < k1; k += VL) {
        acc_t v[NR];
#pragma GCC unroll 16
        for (int j = 0; j < NR; j++) {
          __builtin_prefetch(wr[j] + ahead + k * esize);
          v[j] = LOAD_W(wr[j], k);
          HOLD(v[j]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
          acc_t u = LOAD(xr + i * ldx + k);
          HOLD(u);
#pragma GCC unroll 16
          for (int j = 0; j < NR; j++) a[i][j] += u * v[j];
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; i++)
#pragma GCC unroll 16
        for (int j = 0; j < NR; j++) sum[m + i][j] += a[i][j];
    }
    for (; m < rows; m++) {
      acc_t a[NR];
#pragma GCC unroll 16
      for (int j = 0; j < NR; j++) a[j] = zero;
      const float *xr = x + m * ldx;
      for (int64_t k = k0; k < k1; k += VL) {
        const acc_t u = LOAD(xr + k);
#pragma GCC unroll 16
        for (int j = 0; j < NR; j++) {
          __builtin_prefetch(wr[j] + ahead + k * esize);
          a[j] += u * LOAD_W(wr[j], k);
        }
      }
#pragma GCC unroll 16
      for (int j = 0; j < NR; j++) sum[m][j] += a[j];
    }
  }
  for (int m = 0; m < rows; m++)
    for (int j = 0; j < nb; j++) {
      float s = lane_sum(sum[m][j]);
      if (b) s += b[n0 + j];
      y[m * ldy + n0 + j] = s;
    }
}

/* One weight block per element type: each a copy of `weight_block` with its loads fixed. */
typedef void (*block_fn)(const float *, int64_t, const void *, int64_t, const float *, float *,
                         int64_t, int, int64_t, int, int64_t);

static void block_f32(const float *x, int64_t ldx, const void *w, int64_t ldw, const float *b,
                      float *y, int64_t ldy, int rows, int64_t n0, int nb, int64_t K) {
  weight_block(x, ldx, w, ldw, b, y, ldy, rows, n0, nb, K, 0);
}

static void block_bf16(const float *x, int64_t ldx, const void *w, int64_t ldw, const float *b,
                       float *y, int64_t ldy, int rows, int64_t n0, int nb, int64_t K) {
  weight_block(x, ldx, w, ldw, b, y, ldy, rows, n0, nb, K, 1);
}

/* The row-block loop both entry points share (`block` is called once per NR weight rows and
   MB input rows: a call's cost is nothing beside a whole-K block); returns 0, or a negative
   code when the cheap parts of the contract do not hold. */
static int linear_rows(const float *x, int64_t ldx, const void *w, int64_t ldw, const float *b,
                       float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads,
                       block_fn block) {
  if (M < 1 || N < 1 || K < 16 || K % 16 != 0) return -1;
  if (ldx < K || ldw < K || ldy < N || threads < 1) return -2;
  const int64_t blocks = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < blocks; i++) {
    const int64_t n0 = NR * i;
    const int nb = N - n0 < NR ? (int)(N - n0) : NR;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int rows = M - m0 < MB ? (int)(M - m0) : MB;
      block(x + m0 * ldx, ldx, w, ldw, b, y + m0 * ldy, ldy, rows, n0, nb, K);
    }
  }
  return 0;
}

/* y = x @ w^T (+ b), all float32. */
int fh_linear(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *b,
              float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  return linear_rows(x, ldx, w, ldw, b, y, ldy, M, N, K, threads, block_f32);
}

/* y = x @ w^T (+ b) for a bf16 weight (uint16_t bit patterns); x, b, y float32. */
int fh_linear_bf16w(const float *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                    const float *b, float *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                    int threads) {
  return linear_rows(x, ldx, w, ldw, b, y, ldy, M, N, K, threads, block_bf16);
}
