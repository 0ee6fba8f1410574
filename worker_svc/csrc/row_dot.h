/* The fp32 dot of a few rows of x with one weight row (fp32, or bf16 widened exactly
 * by a shift), shared by small_linear.c and quant_linear.c (which widens its blocks
 * into an fp32 row first), so both libraries run one loop: AVX-512, AVX2 + FMA, and a
 * portable loop for the baseline build (native.py's variants). nb rows of x (at most
 * ROW_DOT_MAX_ROWS), row stride x_stride; y[b * y_stride] gets row b's sum. Call it with
 * nb and is_bf16 constant at the call site: the accumulators then stay in registers.
 * The includer brings <stdint.h>, <string.h> and <immintrin.h> (when built for AVX2). */
#ifndef GAPSERVE_ROW_DOT_H
#define GAPSERVE_ROW_DOT_H

#define ROW_DOT_MAX_ROWS 8

#if defined(__AVX2__) && defined(__FMA__)  /* the AVX-512 build has AVX2 too */
static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* weight i of a row, as fp32 (bf16 widened exactly by a shift) */
static inline float w_at(const void *w, int64_t i, int is_bf16)
{
    if (!is_bf16)
        return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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
    __m512 acc[ROW_DOT_MAX_ROWS];
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
#elif defined(__AVX2__) && defined(__FMA__)
/* 8 weights from i on, as fp32 (bf16 widened exactly by a shift) */
static inline __m256 load_w8(const void *w, int64_t i, int is_bf16)
{
    if (is_bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* At five to eight rows an iteration below is nine loads and eight multiply-adds for
 * 32 bytes of weights, so the out-of-order window reaches too few lines ahead to keep
 * memory busy: asking for the line 4 KiB ahead took the model's fp32 matmuls at eight
 * rows from 72.2 to 60.2 ms and at six from 61.5 to 56.9 (Zen 3, 3 and 5 alternations;
 * 8 KiB ahead did no better, and at two to four rows, and at one, it gained nothing).
 * A prefetch past the end of w is harmless: it never faults. */
#define WIDE_PREFETCH_BYTES 4096

/* Five to eight rows: their lo and hi accumulators would take all 16 registers, so
 * the first halves of every 16-weight chunk go in one sweep and the second halves in
 * another (the weight row is in L1 by then), with lo kept in memory between them.
 * Each accumulator sees the same values in the same order as in dot_rows below, so an
 * output has the same bits whatever the number of rows in its pass. */
static inline __attribute__((always_inline)) void dot_rows_wide(
    const float *x, int64_t x_stride, int nb, const void *wrow, int is_bf16, int64_t in,
    float *y, int64_t y_stride)
{
    __m256 acc[ROW_DOT_MAX_ROWS];
    float lo[ROW_DOT_MAX_ROWS][8];
    for (int half = 0; half < 2; half++) {
#pragma GCC unroll 8
        for (int b = 0; b < nb; b++)
            acc[b] = _mm256_setzero_ps();
        for (int64_t i = 8 * half; i + 16 - 8 * half <= in; i += 16) {
            if (half == 0)  /* one 64-byte line of fp32 an iteration */
                _mm_prefetch((const char *)wrow + i * (is_bf16 ? 2 : 4) + WIDE_PREFETCH_BYTES,
                             _MM_HINT_T0);
            const __m256 wv = load_w8(wrow, i, is_bf16);
#pragma GCC unroll 8
            for (int b = 0; b < nb; b++)
                acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * x_stride + i), acc[b]);
        }
        if (half == 0) {
#pragma GCC unroll 8
            for (int b = 0; b < nb; b++)
                _mm256_storeu_ps(lo[b], acc[b]);
        }
    }
    const int64_t tail = in - in % 16;
    for (int b = 0; b < nb; b++) {
        float sum = hsum256(_mm256_add_ps(_mm256_loadu_ps(lo[b]), acc[b]));
        for (int64_t t = tail; t < in; t++)
            sum += w_at(wrow, t, is_bf16) * x[b * x_stride + t];
        y[b * y_stride] = sum;
    }
}

/* as the AVX-512 dot_rows, 16 weights an iteration in two halves with an accumulator
 * each: a lone row does not wait on one chain of dependent multiply-adds */
static inline __attribute__((always_inline)) void dot_rows(
    const float *x, int64_t x_stride, int nb, const void *wrow, int is_bf16, int64_t in,
    float *y, int64_t y_stride)
{
    if (nb > 4) {
        dot_rows_wide(x, x_stride, nb, wrow, is_bf16, in, y, y_stride);
        return;
    }
    __m256 lo[4], hi[4];
#pragma GCC unroll 4
    for (int b = 0; b < nb; b++)
        lo[b] = hi[b] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
        const __m256 w0 = load_w8(wrow, i, is_bf16), w1 = load_w8(wrow, i + 8, is_bf16);
#pragma GCC unroll 4
        for (int b = 0; b < nb; b++) {
            lo[b] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + b * x_stride + i), lo[b]);
            hi[b] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + b * x_stride + i + 8), hi[b]);
        }
    }
    for (int b = 0; b < nb; b++) {
        float acc = hsum256(_mm256_add_ps(lo[b], hi[b]));
        for (int64_t t = i; t < in; t++)
            acc += w_at(wrow, t, is_bf16) * x[b * x_stride + t];
        y[b * y_stride] = acc;
    }
}
#else
/* Eight partial sums in a fixed order, then a fixed tree: an `omp simd` reduction
 * here let the compiler vectorize each inlined row count its own way, so an output's
 * bits depended on how many rows shared its pass (the argmax screen needs them not
 * to). Without -ffast-math the compiler may not reorder these sums. */
static inline void dot_rows(const float *x, int64_t x_stride, int nb, const void *wrow,
                            int is_bf16, int64_t in, float *y, int64_t y_stride)
{
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * x_stride;
        float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        int64_t i = 0;
        if (is_bf16) {  /* two straight loops: a branch per weight stops vectorizing */
            for (; i + 8 <= in; i += 8)
                for (int k = 0; k < 8; k++)
                    part[k] += w_at(wrow, i + k, 1) * xb[i + k];
        } else {
            const float *w = (const float *)wrow;
            for (; i + 8 <= in; i += 8)
                for (int k = 0; k < 8; k++)
                    part[k] += w[i + k] * xb[i + k];
        }
        float acc = ((part[0] + part[1]) + (part[2] + part[3]))
            + ((part[4] + part[5]) + (part[6] + part[7]));
        for (; i < in; i++)
            acc += w_at(wrow, i, is_bf16) * xb[i];
        y[b * y_stride] = acc;
    }
}
#endif

#endif
