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

int fh_abi_version(void) { return 3; }

static inline float lane_sum(acc_t v) {
  float t[VL];
  __builtin_memcpy(t, &v, sizeof t);
  for (int width = VL / 2; width >= 1; width >>= 1)
    for (int i = 0; i < width; i++) t[i] += t[i + width];
  return t[0];
}

#define LOAD(p) (*(const vec *)(p))
/* Keep a loaded vector in a register: without it GCC re-reads operands from L1 as memory
   operands of every FMA (2-4x the loads; the loop then waits on loads, not FMAs). */
#if defined(__AVX512F__)
#define HOLD(v) __asm__("" : "+v"(v))
#elif defined(__x86_64__)
#define HOLD(v) __asm__("" : "+x"(v))
#else
#define HOLD(v) ((void)0)
#endif

/* Rows [0, rows) of x against weight rows n0 .. n0+nb-1 (nb <= NR), whole K. */
static void weight_block(const float *x, int64_t ldx, const float *w, int64_t ldw,
                         const float *b, float *y, int64_t ldy, int rows, int64_t n0,
                         int nb, int64_t K) {
  acc_t sum[MB][NR];
  const acc_t zero = {0};
  for (int m = 0; m < rows; m++)
    for (int j = 0; j < NR; j++) sum[m][j] = zero;
  /* Missing rows of a short block repeat row n0: in bounds, results dropped. */
  const float *wr[NR];
  for (int j = 0; j < NR; j++) wr[j] = w + (n0 + (j < nb ? j : 0)) * ldw;
  /* The next block's rows: prefetch never faults, so past the end is harmless. */
  const int64_t ahead = NR * ldw;
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
          __builtin_prefetch(wr[j] + ahead + k);
          v[j] = LOAD(wr[j] + k);
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
          __builtin_prefetch(wr[j] + ahead + k);
          a[j] += u * LOAD(wr[j] + k);
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

/* Returns 0, or a negative code when the cheap parts of the contract do not hold. */
int fh_linear(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *b,
              float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  if (M < 1 || N < 1 || K < 16 || K % 16 != 0) return -1;
  if (ldx < K || ldw < K || ldy < N || threads < 1) return -2;
  const int64_t blocks = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < blocks; i++) {
    const int64_t n0 = NR * i;
    const int nb = N - n0 < NR ? (int)(N - n0) : NR;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int rows = M - m0 < MB ? (int)(M - m0) : MB;
      weight_block(x + m0 * ldx, ldx, w, ldw, b, y + m0 * ldy, ldy, rows, n0, nb, K);
    }
  }
  return 0;
}
