/* y = x @ w.T for a few rows of x, with w row-major [out][in] in fp32 or bf16.
 *
 * A decode step of a small batch streams every weight once and does little else: it
 * is bound by memory bandwidth. Each output feature's weight row is read once from
 * memory (each thread streams its own contiguous share of rows) and dotted with every
 * row of x from L1, so the bytes crossing memory are the weight's, once. oneDNN's
 * blocked GEMM, built for wide batches, reaches about half of that bandwidth at one
 * to four rows here (docs/benchmarks.md). Sums are fp32; bf16 weights are widened to
 * fp32 exactly (a shift), and x stays fp32 (not rounded to bf16 as oneDNN does).
 *
 * Built with -fopenmp: in a worker the OpenMP runtime is torch's own (the same
 * libgomp soname, loaded first), so these parallel regions use the compute thread's
 * team instead of starting a second pool. */
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_ROWS_PER_PASS 8

#ifdef __AVX512F__
/* 16 weights from i on (only the first n < 16 when m is not full), as fp32 */
static inline __m512 load_w(const void *w, int64_t i, int is_bf16, __mmask16 m, int64_t n)
{
    if (is_bf16) {
        __m256i h;
        if (m == 0xFFFF) {
            h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        } else {  /* a masked 16-bit load needs AVX512BW; the tail is copied instead */
            uint16_t tail[16] = {0};
            memcpy(tail, (const uint16_t *)w + i, (size_t)n * sizeof(uint16_t));
            h = _mm256_loadu_si256((const __m256i *)tail);
        }
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

/* nb rows of x against one weight row; nb is a constant at each call site below, so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_rows(
    const float *x, int64_t x_stride, int nb, const void *wrow, int is_bf16, int64_t in,
    float *y, int64_t y_stride)
{
    __m512 acc[MAX_ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int b = 0; b < nb; b++)
        acc[b] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
        const __m512 wv = load_w(wrow, i, is_bf16, 0xFFFF, 16);
#pragma GCC unroll 8
        for (int b = 0; b < nb; b++)
            acc[b] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + b * x_stride + i), acc[b]);
    }
    if (i < in) {
        const __mmask16 m = (__mmask16)((1u << (in - i)) - 1u);
        const __m512 wv = load_w(wrow, i, is_bf16, m, in - i);
        for (int b = 0; b < nb; b++)
            acc[b] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + b * x_stride + i),
                                     acc[b]);
    }
    for (int b = 0; b < nb; b++)
        y[b * y_stride] = _mm512_reduce_add_ps(acc[b]);
}
#else
static inline void dot_rows(const float *x, int64_t x_stride, int nb, const void *wrow,
                            int is_bf16, int64_t in, float *y, int64_t y_stride)
{
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * x_stride;
        float acc = 0.0f;
        if (is_bf16) {
            const uint16_t *w = (const uint16_t *)wrow;
#pragma omp simd reduction(+:acc)
            for (int64_t i = 0; i < in; i++) {
                uint32_t bits = (uint32_t)w[i] << 16;
                float wf;
                memcpy(&wf, &bits, sizeof wf);
                acc += wf * xb[i];
            }
        } else {
            const float *w = (const float *)wrow;
#pragma omp simd reduction(+:acc)
            for (int64_t i = 0; i < in; i++)
                acc += w[i] * xb[i];
        }
        y[b * y_stride] = acc;
    }
}
#endif

static void pass(const float *x, int64_t x_stride, int nb, const void *w, int is_bf16,
                 int64_t out, int64_t in, float *y, int64_t y_stride, int num_threads)
{
    const int64_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const void *wrow = (const char *)w + o * in * elem;
        switch (nb) {  /* constant row counts: see dot_rows */
        case 1: dot_rows(x, x_stride, 1, wrow, is_bf16, in, y + o, y_stride); break;
        case 2: dot_rows(x, x_stride, 2, wrow, is_bf16, in, y + o, y_stride); break;
        case 3: dot_rows(x, x_stride, 3, wrow, is_bf16, in, y + o, y_stride); break;
        case 4: dot_rows(x, x_stride, 4, wrow, is_bf16, in, y + o, y_stride); break;
        case 5: dot_rows(x, x_stride, 5, wrow, is_bf16, in, y + o, y_stride); break;
        case 6: dot_rows(x, x_stride, 6, wrow, is_bf16, in, y + o, y_stride); break;
        case 7: dot_rows(x, x_stride, 7, wrow, is_bf16, in, y + o, y_stride); break;
        default: dot_rows(x, x_stride, 8, wrow, is_bf16, in, y + o, y_stride); break;
        }
    }
}

/* y [rows][out] = x [rows][in] (row stride x_stride) @ w.T; w [out][in] contiguous,
 * fp32 (is_bf16 0) or bf16 bits (is_bf16 1). Rows go MAX_ROWS_PER_PASS at a time. */
void small_linear_f32(const float *x, int64_t x_stride, int64_t rows, const void *w,
                      int is_bf16, int64_t out, int64_t in, float *y, int num_threads)
{
    for (int64_t r = 0; r < rows; r += MAX_ROWS_PER_PASS) {
        const int nb = (int)(rows - r < MAX_ROWS_PER_PASS ? rows - r : MAX_ROWS_PER_PASS);
        pass(x + r * x_stride, x_stride, nb, w, is_bf16, out, in, y + r * out, out,
             num_threads);
    }
}
