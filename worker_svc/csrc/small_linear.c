/* y = x @ w.T for a few rows of x, with w row-major [out][in] in fp32 or bf16, or int8
 * with an fp32 scale per Q8_GROUP inputs (small_linear_q8).
 *
 * A decode step of a small batch streams every weight once and does little else: it
 * is bound by memory bandwidth. Each output feature's weight row is read once from
 * memory (each thread streams its own contiguous share of rows) and dotted with every
 * row of x from L1, so the bytes crossing memory are the weight's, once. oneDNN's
 * blocked GEMM, built for wide batches, reaches about half of that bandwidth at one
 * to four rows here (docs/benchmarks.md). Sums are fp32; bf16 weights are widened to
 * fp32 exactly (a shift), and x stays fp32 (not rounded to bf16 as oneDNN does).
 *
 * Intrinsics for AVX-512 and for AVX2 + FMA (16 vector registers: from five rows a
 * pass, a row's two halves in turn there), and a portable loop for the baseline build
 * (native.py's variants).
 *
 * Built with -fopenmp: in a worker the OpenMP runtime is torch's own (the same
 * libgomp soname, loaded first), so these parallel regions use the compute thread's
 * team instead of starting a second pool. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* Rows of x per pass over the weights: each row's accumulators live in registers,
 * 32 vector registers with AVX-512, 16 with AVX2 (two accumulators a row there, so
 * five to eight rows take a row's two halves in turn: dot_rows_wide). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MAX_ROWS_PER_PASS 8
#else
#define MAX_ROWS_PER_PASS 4
#endif
/* int8 weights (--quantization int8): one fp32 scale per Q8_GROUP consecutive inputs
 * of an output row, w ~= q * scale, as llama.cpp's Q8_0 groups */
#define Q8_GROUP 32

#include "row_dot.h"

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
#if MAX_ROWS_PER_PASS == 4
        default: dot_rows(x, x_stride, 4, wrow, is_bf16, in, y + o, y_stride); break;
#else
        case 4: dot_rows(x, x_stride, 4, wrow, is_bf16, in, y + o, y_stride); break;
#endif
#if MAX_ROWS_PER_PASS == 8
        case 5: dot_rows(x, x_stride, 5, wrow, is_bf16, in, y + o, y_stride); break;
        case 6: dot_rows(x, x_stride, 6, wrow, is_bf16, in, y + o, y_stride); break;
        case 7: dot_rows(x, x_stride, 7, wrow, is_bf16, in, y + o, y_stride); break;
        default: dot_rows(x, x_stride, 8, wrow, is_bf16, in, y + o, y_stride); break;
#endif
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

/* ---- int8 weights, a scale per Q8_GROUP inputs ---------------------------------
 * x's rows are first put as int16 with one scale per group (max|x| / 32767: within
 * 1/65534 of the group's largest value, far below the int8 weights' own rounding), so
 * a group's 32 products sum exactly in int32 (16-bit multiply-adds: 127 * 32767 * 32
 * stays below 2^31) and meet the two scales once, in fp32. Per 32 weights that is a
 * handful of integer instructions instead of widening each weight to fp32. */

static void quantize_rows_i16(const float *x, int64_t x_stride, int64_t rows, int64_t in,
                              int16_t *xq, float *xs)
{
    const int64_t groups = in / Q8_GROUP;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * x_stride + g * Q8_GROUP;
            int16_t *qg = xq + (r * groups + g) * Q8_GROUP;
            float m = 0.0f;
            for (int i = 0; i < Q8_GROUP; i++) {
                const float a = xg[i] < 0 ? -xg[i] : xg[i];
                m = a > m ? a : m;
            }
            const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
            for (int i = 0; i < Q8_GROUP; i++) {
                float v = xg[i] * inv;
                v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);
                qg[i] = (int16_t)(v + (v >= 0.0f ? 0.5f : -0.5f));  /* to nearest */
            }
            xs[r * groups + g] = m / 32767.0f;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)  /* the AVX-512 build has AVX2 too */
/* A thread's share of an int8 matrix is short (rows of 576 bytes, ~100 us of reading
 * a matmul) and the hardware prefetcher ramps up on each anew: asking for the line
 * 8 KiB ahead took the model's int8 matmuls at one row from 14.2 to 16.1 GB/s (Zen 3,
 * 15 alternations), near the 16.5 a flat read of one buffer got there (docs/worker.md).
 * fp32 rows, four times longer, gained nothing from it; from four rows, where the
 * integer work and not memory sets the pace, it cost 5%. A prefetch past the end of
 * w is harmless: it never faults. */
#define Q8_PREFETCH_BYTES 8192
#define Q8_PREFETCH_MAX_ROWS 2

static inline __attribute__((always_inline)) void dot_rows_q8(
    const int16_t *xq, const float *xs, int64_t groups, int nb, const int8_t *wrow,
    const float *srow, float *y, int64_t y_stride)
{
    __m256 acc[MAX_ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int b = 0; b < nb; b++)
        acc[b] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *wg = wrow + g * Q8_GROUP;
        if (nb <= Q8_PREFETCH_MAX_ROWS)
            _mm_prefetch((const char *)(wg + Q8_PREFETCH_BYTES), _MM_HINT_T0);
        const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wg));
        const __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + 16)));
        const float sw = srow[g];
#pragma GCC unroll 8
        for (int b = 0; b < nb; b++) {
            const int16_t *xg = xq + (b * groups + g) * Q8_GROUP;
            const __m256i p = _mm256_add_epi32(
                _mm256_madd_epi16(wa, _mm256_loadu_si256((const __m256i *)xg)),
                _mm256_madd_epi16(wb, _mm256_loadu_si256((const __m256i *)(xg + 16))));
            acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                     _mm256_set1_ps(sw * xs[b * groups + g]), acc[b]);
        }
    }
    for (int b = 0; b < nb; b++)
        y[b * y_stride] = hsum256(acc[b]);
}
#else
static inline void dot_rows_q8(const int16_t *xq, const float *xs, int64_t groups, int nb,
                               const int8_t *wrow, const float *srow, float *y,
                               int64_t y_stride)
{
    for (int b = 0; b < nb; b++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            const int16_t *xg = xq + (b * groups + g) * Q8_GROUP;
            int32_t isum = 0;
#pragma omp simd reduction(+:isum)
            for (int i = 0; i < Q8_GROUP; i++)
                isum += (int32_t)wrow[g * Q8_GROUP + i] * xg[i];
            acc += (float)isum * (srow[g] * xs[b * groups + g]);
        }
        y[b * y_stride] = acc;
    }
}
#endif

static void pass_q8(const int16_t *xq, const float *xs, int nb, const int8_t *w,
                    const float *scales, int64_t out, int64_t in, float *y, int64_t y_stride,
                    int num_threads)
{
    const int64_t groups = in / Q8_GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t o = 0; o < out; o++) {
        const int8_t *wrow = w + o * in;
        const float *srow = scales + o * groups;
        switch (nb) {  /* constant row counts: see dot_rows */
        case 1: dot_rows_q8(xq, xs, groups, 1, wrow, srow, y + o, y_stride); break;
        case 2: dot_rows_q8(xq, xs, groups, 2, wrow, srow, y + o, y_stride); break;
        case 3: dot_rows_q8(xq, xs, groups, 3, wrow, srow, y + o, y_stride); break;
#if MAX_ROWS_PER_PASS == 4
        default: dot_rows_q8(xq, xs, groups, 4, wrow, srow, y + o, y_stride); break;
#else
        case 4: dot_rows_q8(xq, xs, groups, 4, wrow, srow, y + o, y_stride); break;
        case 5: dot_rows_q8(xq, xs, groups, 5, wrow, srow, y + o, y_stride); break;
        case 6: dot_rows_q8(xq, xs, groups, 6, wrow, srow, y + o, y_stride); break;
        case 7: dot_rows_q8(xq, xs, groups, 7, wrow, srow, y + o, y_stride); break;
        default: dot_rows_q8(xq, xs, groups, 8, wrow, srow, y + o, y_stride); break;
#endif
        }
    }
}

/* y [rows][out] = x [rows][in] @ (w * scales).T; w int8 [out][in], scales fp32
 * [out][in / Q8_GROUP]; in must be a multiple of Q8_GROUP (the caller checks).
 * Returns 0, or -1 when the int16 copy of x cannot be allocated. */
int small_linear_q8(const float *x, int64_t x_stride, int64_t rows, const int8_t *w,
                    const float *scales, int64_t out, int64_t in, float *y, int num_threads)
{
    const int64_t groups = in / Q8_GROUP;
    int16_t *xq = malloc((size_t)(rows * in) * sizeof *xq + 64);
    float *xs = malloc((size_t)(rows * groups) * sizeof *xs + 64);
    if (xq == NULL || xs == NULL) {
        free(xq);
        free(xs);
        return -1;
    }
    quantize_rows_i16(x, x_stride, rows, in, xq, xs);
    /* As few passes as MAX_ROWS_PER_PASS allows, the rows spread evenly over them: a
     * pass of one row reads every weight for little work, and from a few rows a pass
     * is bound by the integer work, so 9 rows go as 5 + 4, not 8 + 1. The model's int8
     * matmuls (Zen 3, 9 alternations, medians): 9 rows 29.4 -> 27.3 ms, 17 rows 47.2
     * -> 44.5, 25 rows 70.3 -> 67.9, 12 rows 29.4 -> 29.0 (docs/worker.md). An
     * output's bits do not depend on the rows beside it, so the split changes none. */
    const int64_t passes = (rows + MAX_ROWS_PER_PASS - 1) / MAX_ROWS_PER_PASS;
    for (int64_t p = 0, r = 0; p < passes; p++) {
        const int nb = (int)(rows / passes + (p < rows % passes));
        pass_q8(xq + r * in, xs + r * groups, nb, w, scales, out, in, y + r * out, out,
                num_threads);
        r += nb;
    }
    free(xq);
    free(xs);
    return 0;
}
