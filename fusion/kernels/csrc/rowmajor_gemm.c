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
 * bfloat16 (fh_linear_bf16): the same kernel reading a bf16 weight [N, K] where it lies, each
 * 16-bit value widened exactly to float32 in registers (a bf16 is a float32's top half); the
 * few input rows and the bias are widened into a float32 buffer first and each float32 output
 * is rounded once to bf16. Half the bytes streamed, the same sums: what PyTorch's bf16 linear
 * on a CPU computes (float32 accumulation, one rounding of each output), in another fixed
 * order.
 *
 * One input row (decode) takes its own loop (`row_block`): wider blocks of weight rows, the
 * same operations per output. Both loops prefetch the next block into L1, or only as far as L2
 * (`hint` 1), chosen per machine by measurement (fusion/kernels/native/prefetch.py): a hint
 * changes where lines wait, never the arithmetic.
 *
 * Contract (the Python side checks it, fh_linear re-checks the cheap parts): K a positive
 * multiple of 16; unit stride along K for x and w; row strides ldx >= K, ldw >= K,
 * ldy >= N; y does not overlap x, w or b. Vector types are GCC's generic ones sized to the
 * machine (-march=native): 16 lanes with AVX-512, 8 with AVX, else 4.
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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
/* One input row (a decode step): no input rows to share a weight load with, so the registers
   go to more weight rows in flight instead (more independent streams for the memory system,
   fewer block calls). Each output's arithmetic is the same as in `weight_block`. */
#if defined(__AVX512F__) || defined(__AVX__)
#define NR1 8
#else
#define NR1 4
#endif
#define KC 256 /* K block: NR weight rows and MB input rows of it stay in L1 */
#define MB 32  /* input rows per pass over a weight block (accumulator array size) */

typedef float vec __attribute__((vector_size(VL * 4), aligned(4))); /* unaligned loads */
typedef float acc_t __attribute__((vector_size(VL * 4)));
typedef uint16_t hvec __attribute__((vector_size(VL * 2), aligned(2))); /* VL bf16 values */
typedef uint32_t uvec __attribute__((vector_size(VL * 4)));

int fh_abi_version(void) { return 6; }

static inline float lane_sum(acc_t v) {
#if defined(__AVX512F__) || defined(__AVX__)
  /* The same tree in registers (halves, then quarters, then pairs, then the last two lanes:
     lane i + lane i + width at each step; float addition commutes, so the same bits), a few
     shuffles where a trip through memory costs a decode step's short rows noticeably. */
#if defined(__AVX512F__)
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256((__m512)v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd((__m512d)v, 1)));
#else
  const __m256 t8 = (__m256)v;
#endif
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
#else
  float t[VL];
  __builtin_memcpy(t, &v, sizeof t);
  for (int width = VL / 2; width >= 1; width >>= 1)
    for (int i = 0; i < width; i++) t[i] += t[i + width];
  return t[0];
#endif
}

#define LOAD(p) (*(const vec *)(p))
/* The next block's line: into L1, or only as far as L2 where `l2` (prefetcht2: no L1 miss
   buffer held while the line travels); a constant at every call site. */
#define PREFETCH(p, l2) ((l2) ? __builtin_prefetch((p), 0, 1) : __builtin_prefetch(p))

/* VL bf16 values widened to float32: exact (the 16 bits become the float's top half). On x86
   one zero-extending move and a shift: GCC lowers the generic conversion of a whole 512-bit
   vector to two 256-bit halves and an insert (where -march=native prefers 256-bit vectors),
   three more instructions per load in a loop that has little else to do. */
static inline acc_t load_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
  const uvec wide = __builtin_convertvector(*(const hvec *)p, uvec) << 16;
#endif
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
    int64_t ldy, int rows, int64_t n0, int nb, int64_t K, const int bf16, const int l2) {
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
          PREFETCH(wr[j] + ahead + k * esize, l2);
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
          PREFETCH(wr[j] + ahead + k * esize, l2);
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

/* One input row against weight rows n0 .. n0+nb-1 (nb <= NR1), whole K. Per output, the
   very operations of `weight_block`'s single-row loop (a fresh register per KC block added to
   a running sum, then `lane_sum`, then the bias): a row's result is the same bits whichever
   path computed it, so results still do not depend on the other rows of a call. */
static inline __attribute__((always_inline)) void row_block(
    const float *x, const void *w, int64_t ldw, const float *b, float *y, int64_t n0, int nb,
    int64_t K, const int bf16, const int l2) {
  const int64_t esize = bf16 ? 2 : 4;
  acc_t sum[NR1];
  const acc_t zero = {0};
  const char *wr[NR1];
#pragma GCC unroll 16
  for (int j = 0; j < NR1; j++) {
    sum[j] = zero;
    wr[j] = (const char *)w + (n0 + (j < nb ? j : 0)) * ldw * esize;
  }
  const int64_t ahead = NR1 * ldw * esize;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = k0 + KC < K ? k0 + KC : K;
    acc_t a[NR1];
#pragma GCC unroll 16
    for (int j = 0; j < NR1; j++) a[j] = zero;
    for (int64_t k = k0; k < k1; k += VL) {
      acc_t u = LOAD(x + k);
      HOLD(u);
#pragma GCC unroll 16
      for (int j = 0; j < NR1; j++) {
        /* once per 64-byte line (a bf16 step reads half a line) */
        if (((k * esize) & 63) == 0) PREFETCH(wr[j] + ahead + k * esize, l2);
        a[j] += u * LOAD_W(wr[j], k);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < NR1; j++) sum[j] += a[j];
  }
  for (int j = 0; j < nb; j++) {
    float s = lane_sum(sum[j]);
    if (b) s += b[n0 + j];
    y[n0 + j] = s;
  }
}

typedef void (*block_fn)(const float *, int64_t, const void *, int64_t, const float *, float *,
                         int64_t, int, int64_t, int, int64_t);

/* One weight block per (element type, prefetch hint): each a copy of `weight_block` with both
   fixed. */
#define BLOCK_FN(name, bf16, l2)                                                               \
  static void name(const float *x, int64_t ldx, const void *w, int64_t ldw, const float *b,    \
                   float *y, int64_t ldy, int rows, int64_t n0, int nb, int64_t K) {           \
    weight_block(x, ldx, w, ldw, b, y, ldy, rows, n0, nb, K, bf16, l2);                        \
  }
BLOCK_FN(block_f32, 0, 0)
BLOCK_FN(block_bf16, 1, 0)
BLOCK_FN(block_f32_l2, 0, 1)
BLOCK_FN(block_bf16_l2, 1, 1)

/* One row loop per (element type, prefetch hint): each a copy of `row_block` with both fixed. */
#define ROW_FN(name, bf16, l2)                                                                 \
  static void name(const float *x, const void *w, int64_t ldw, const float *b, float *y,       \
                   int64_t n0, int nb, int64_t K) {                                            \
    row_block(x, w, ldw, b, y, n0, nb, K, bf16, l2);                                           \
  }
ROW_FN(row_f32, 0, 0)
ROW_FN(row_bf16, 1, 0)
ROW_FN(row_f32_l2, 0, 1)
ROW_FN(row_bf16_l2, 1, 1)

typedef void (*row_fn)(const float *, const void *, int64_t, const float *, float *, int64_t, int,
                       int64_t);

/* The row-block loop both entry points share (`block` is called once per NR weight rows and
   MB input rows: a call's cost is nothing beside a whole-K block); returns 0, or a negative
   code when the cheap parts of the contract do not hold. */
static int linear_rows(const float *x, int64_t ldx, const void *w, int64_t ldw, const float *b,
                       float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads,
                       block_fn block, row_fn row) {
  if (M < 1 || N < 1 || K < 16 || K % 16 != 0) return -1;
  if (ldx < K || ldw < K || ldy < N || threads < 1) return -2;
  if (M == 1) {
    const int64_t row_blocks = (N + NR1 - 1) / NR1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < row_blocks; i++) {
      const int64_t n0 = NR1 * i;
      row(x, w, ldw, b, y, n0, N - n0 < NR1 ? (int)(N - n0) : NR1, K);
    }
    return 0;
  }
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

/* y = x @ w^T (+ b), all float32; `hint` 1: both loops prefetch only as far as L2. */
int fh_linear(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *b,
              float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads, int hint) {
  return linear_rows(x, ldx, w, ldw, b, y, ldy, M, N, K, threads,
                     hint ? block_f32_l2 : block_f32, hint ? row_f32_l2 : row_f32);
}

/* float32 -> bf16, round to nearest even; NaN -> the quiet NaN 0x7FC0: c10::BFloat16's rule,
   which `Tensor.to(torch.bfloat16)` applies on a CPU. */
static inline uint16_t round_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float widen_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

/* y = x @ w^T (+ b) with every operand bf16 (uint16_t bit patterns): the input rows and bias
   widened exactly to float32 (a compact copy), the float32 kernel over the bf16 weight, each
   output rounded once to bf16. The conversions are here rather than in the caller's
   `Tensor.to` calls: three tensor operations a call cost a good part of a one-row product.
   Returns -3 where a buffer cannot be allocated. */
int fh_linear_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,
                   const uint16_t *b, uint16_t *y, int64_t ldy, int64_t M, int64_t N, int64_t K,
                   int threads, int hint) {
  if (M < 1 || N < 1 || K < 16 || K % 16 != 0) return -1;
  if (ldx < K || ldw < K || ldy < N || threads < 1) return -2;
  float *xf = malloc(sizeof(float) * (size_t)(M * K + M * N + (b ? N : 0)));
  if (!xf) return -3;
  float *yf = xf + M * K;
  float *bf = b ? yf + M * N : 0;
  for (int64_t m = 0; m < M; m++)
    for (int64_t k = 0; k < K; k++) xf[m * K + k] = widen_bf16(x[m * ldx + k]);
  for (int64_t n = 0; b && n < N; n++) bf[n] = widen_bf16(b[n]);
  const int code = linear_rows(xf, K, w, ldw, bf, yf, N, M, N, K, threads,
                               hint ? block_bf16_l2 : block_bf16, hint ? row_bf16_l2 : row_bf16);
  if (code == 0)
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) y[m * ldy + n] = round_bf16(yf[m * N + n]);
  free(xf);
  return code;
}

