/* y = x @ w^T (+ b) for float32 x [M, K] and a row-major weight w [N, K], read in place.
 *
 * Why this kernel exists: at decode sizes (1-64 rows) a float32 linear on a CPU is bound by
 * streaming its weight from memory, and MKL's sgemm first packs the weight it is given: one
 * more pass over it on every call. This kernel reads the weight once, where it lies, as dot
 * products along K: a block of 4 weight rows meets the input rows 4 at a time (16 vector
 * accumulators in registers), while the next block's rows are prefetched.
 *
 * Rounding (why it is no less accurate than MKL): each output is 16 vector lanes, each lane
 * summing its own K/16 products in blocks of KC/16 (a fresh register per block, added to a
 * running sum), then a fixed tree over the lanes. Every output element is computed by one
 * thread in one fixed order that depends only on K: results are bit-identical whatever the
 * thread count, and a row's result does not depend on the other rows (batch invariant).
 *
 * Contract (the Python side checks it, fh_linear re-checks the cheap parts): K a positive
 * multiple of 16; unit stride along K for x and w; row strides ldx >= K, ldw >= K,
 * ldy >= N; y does not overlap x, w or b. Vector types are GCC's generic ones, so the same
 * source builds for AVX-512, AVX2 or NEON with -march=native.
 */
#include <stdint.h>

typedef float vec __attribute__((vector_size(64), aligned(4)));  /* unaligned loads */
typedef float acc_t __attribute__((vector_size(64)));

#define KC 256 /* K block: one block of 4 weight rows and 32 input rows stays in L1 */
#define MB 32  /* input rows per pass over a weight block (accumulator array size) */

int fh_abi_version(void) { return 1; }

static inline float lane_sum(acc_t v) {
  float t[16];
  __builtin_memcpy(t, &v, sizeof t);
  for (int width = 8; width >= 1; width >>= 1)
    for (int i = 0; i < width; i++) t[i] += t[i + width];
  return t[0];
}

#define LOAD(p) (*(const vec *)(p))
/* Keep a loaded vector in a register: without it GCC re-reads operands from L1 as memory
   operands of every FMA (2-4x the loads; the loop then waits on loads, not FMAs). */
#if defined(__x86_64__)
#define HOLD(v) __asm__("" : "+v"(v))
#else
#define HOLD(v) ((void)0)
#endif

/* Rows [0, rows) of x against weight rows n0 .. n0+nb-1 (nb <= 4), whole K. */
static void weight_block(const float *x, int64_t ldx, const float *w, int64_t ldw,
                         const float *b, float *y, int64_t ldy, int rows, int64_t n0,
                         int nb, int64_t K) {
  acc_t sum[MB][4];
  const acc_t zero = {0};
  for (int m = 0; m < rows; m++)
    for (int j = 0; j < 4; j++) sum[m][j] = zero;
  /* Missing rows of a short block repeat row n0: in bounds, results dropped. */
  const float *w0 = w + n0 * ldw;
  const float *w1 = w + (n0 + (nb > 1 ? 1 : 0)) * ldw;
  const float *w2 = w + (n0 + (nb > 2 ? 2 : 0)) * ldw;
  const float *w3 = w + (n0 + (nb > 3 ? 3 : 0)) * ldw;
  /* The next block's rows: prefetch never faults, so past the end is harmless. */
  const int64_t ahead = 4 * ldw;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = k0 + KC < K ? k0 + KC : K;
    int m = 0;
    for (; m + 4 <= rows; m += 4) {
      acc_t a00 = zero, a01 = zero, a02 = zero, a03 = zero;
      acc_t a10 = zero, a11 = zero, a12 = zero, a13 = zero;
      acc_t a20 = zero, a21 = zero, a22 = zero, a23 = zero;
      acc_t a30 = zero, a31 = zero, a32 = zero, a33 = zero;
      const float *x0 = x + m * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
      for (int64_t k = k0; k < k1; k += 16) {
        __builtin_prefetch(w0 + ahead + k);
        __builtin_prefetch(w1 + ahead + k);
        __builtin_prefetch(w2 + ahead + k);
        __builtin_prefetch(w3 + ahead + k);
        acc_t v0 = LOAD(w0 + k), v1 = LOAD(w1 + k), v2 = LOAD(w2 + k), v3 = LOAD(w3 + k);
        HOLD(v0); HOLD(v1); HOLD(v2); HOLD(v3);
        acc_t u = LOAD(x0 + k);
        HOLD(u);
        a00 += u * v0; a01 += u * v1; a02 += u * v2; a03 += u * v3;
        u = LOAD(x1 + k);
        HOLD(u);
        a10 += u * v0; a11 += u * v1; a12 += u * v2; a13 += u * v3;
        u = LOAD(x2 + k);
        HOLD(u);
        a20 += u * v0; a21 += u * v1; a22 += u * v2; a23 += u * v3;
        u = LOAD(x3 + k);
        HOLD(u);
        a30 += u * v0; a31 += u * v1; a32 += u * v2; a33 += u * v3;
      }
      sum[m][0] += a00; sum[m][1] += a01; sum[m][2] += a02; sum[m][3] += a03;
      sum[m + 1][0] += a10; sum[m + 1][1] += a11; sum[m + 1][2] += a12; sum[m + 1][3] += a13;
      sum[m + 2][0] += a20; sum[m + 2][1] += a21; sum[m + 2][2] += a22; sum[m + 2][3] += a23;
      sum[m + 3][0] += a30; sum[m + 3][1] += a31; sum[m + 3][2] += a32; sum[m + 3][3] += a33;
    }
    for (; m < rows; m++) {
      acc_t a0 = zero, a1 = zero, a2 = zero, a3 = zero;
      const float *x0 = x + m * ldx;
      for (int64_t k = k0; k < k1; k += 16) {
        __builtin_prefetch(w0 + ahead + k);
        __builtin_prefetch(w1 + ahead + k);
        __builtin_prefetch(w2 + ahead + k);
        __builtin_prefetch(w3 + ahead + k);
        const acc_t u = LOAD(x0 + k);
        a0 += u * LOAD(w0 + k); a1 += u * LOAD(w1 + k);
        a2 += u * LOAD(w2 + k); a3 += u * LOAD(w3 + k);
      }
      sum[m][0] += a0; sum[m][1] += a1; sum[m][2] += a2; sum[m][3] += a3;
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
  const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < blocks; i++) {
    const int64_t n0 = 4 * i;
    const int nb = N - n0 < 4 ? (int)(N - n0) : 4;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int rows = M - m0 < MB ? (int)(M - m0) : MB;
      weight_block(x + m0 * ldx, ldx, w, ldw, b, y + m0 * ldy, ldy, rows, n0, nb, K);
    }
  }
  return 0;
}
