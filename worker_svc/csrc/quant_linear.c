/* y = x @ w.T with w held in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q4_K, Q5_K, Q6_K; F32, F16 and BF16 rows too), dequantized inside the matmul.
 *
 * A lone stream's decode step streams every weight once: it is bound by the bytes
 * read. A Q4_1 weight is 5 bits a value against fp32's 32, so reading the blocks and
 * widening them in the core beats reading a dequantized fp32 copy. Each output row's
 * blocks are widened once into an fp32 row in L1 (`dequant_row`, the same arithmetic
 * as gguf.quants.dequantize, so the widened values are its values bit for bit: this
 * file builds with -ffp-contract=off) and dotted with every row of x, up to
 * ROWS_PER_PASS rows at a time from registers. However many rows x has, each weight
 * row is read from memory and widened once a call: wide steps (a long prefill, many
 * concurrent decodes) go through the same loop, x's rows streaming from cache.
 *
 * x stays fp32 (llama.cpp quantizes it to 8 bits; here only the order of the fp32
 * sums differs from dequantize-then-matmul). Intrinsics for AVX-512 and AVX2 + FMA, a
 * portable loop for the baseline build (native.py's variants).
 *
 * A weight is described by an int64 array: nseg, then per segment its ggml type,
 * rows, address of its first block row, bytes per row. A fused projection
 * ([q; k; v], [gate; up]) is several segments when its parts have different types
 * (Q4_K_M files mix them); output rows run through the segments in order. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* ggml_type values (ggml.h) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };
#define QK 32
#define QK_K 256
#define MAX_SEGMENTS 8

/* weight rows a lone stream's pass takes at once (dot_fused32_rows) */
#define OUT_ROWS 8
#if defined(__AVX512F__)
#define ROWS_PER_PASS 8
#else
#define ROWS_PER_PASS 4
#endif

static inline float f16(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                   man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        const float f = (float)man * (1.0f / 16777216.0f);  /* subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* bytes of one row of `in` values of type t, or -1 for a type not handled here */
int64_t quant_row_bytes(int type, int64_t in)
{
    switch (type) {
    case T_F32: return in * 4;
    case T_F16: case T_BF16: return in * 2;
    case T_Q4_0: return in / QK * 18;
    case T_Q4_1: return in / QK * 20;
    case T_Q5_0: return in / QK * 22;
    case T_Q5_1: return in / QK * 24;
    case T_Q8_0: return in / QK * 34;
    case T_Q4_K: return in / QK_K * 144;
    case T_Q5_K: return in / QK_K * 176;
    case T_Q6_K: return in / QK_K * 210;
    default: return -1;
    }
}

/* the int8-activation path's repacking, and the one decoder of the block layouts the
 * portable widening below shares with it */
#include "quant_packed.h"

#if defined(__AVX512F__)
/* AVX-512 widening of the common block types, 16 values a vector, the same products
 * in the same order as the portable code below (so the same bits). GCC leaves the
 * portable nibble loops scalar: this took a Q4_1 layer of the default model from
 * 5.7 to ~1 ms at one row (one thread). */
static inline void nibbles(const uint8_t *q, __m512i *lo, __m512i *hi)
{
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(0x0F);
    *lo = _mm512_cvtepu8_epi32(_mm_and_si128(v, m));
    *hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m));
}

/* One group of a K-quant super-block's values, widened into registers as
 * dequant_row_simd widens them (the same products), its 16-value chunks in memory
 * order: Q4_K/Q5_K group j of 4 (two 32-value sub-blocks: 4 chunks), Q6_K group n of 2
 * (128 values: 8 chunks). sb is the super-block. */
static inline __attribute__((always_inline)) void widen_k_group(int type, const uint8_t *sb,
                                                                int g, __m512 *w)
{
    if (type == T_Q6_K) {
        const __m512i low4 = _mm512_set1_epi32(0xF), three = _mm512_set1_epi32(3),
                      bias = _mm512_set1_epi32(32);
        const uint8_t *ql = sb + 64 * g, *qh = sb + 128 + 32 * g;
        const int8_t *sc = (const int8_t *)(sb + 192) + 8 * g;
        const float d = f16(u16(sb + 208));
        for (int h = 0; h < 2; h++) {
            const int l = 16 * h;
            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + l)));
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ql + l + 32)));
            const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + l)));
            const __m512i q1 = _mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(a, low4),
                _mm512_slli_epi32(_mm512_and_si512(e, three), 4)), bias);
            const __m512i q2 = _mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(c, low4),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 2), three), 4)), bias);
            const __m512i q3 = _mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(a, 4),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 4), three), 4)), bias);
            const __m512i q4 = _mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(c, 4),
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 6), three), 4)), bias);
            w[h] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h]), _mm512_cvtepi32_ps(q1));
            w[2 + h] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h + 2]), _mm512_cvtepi32_ps(q2));
            w[4 + h] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h + 4]), _mm512_cvtepi32_ps(q3));
            w[6 + h] = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[h + 6]), _mm512_cvtepi32_ps(q4));
        }
        return;
    }
    const int five = type == T_Q5_K;
    const float d = f16(u16(sb)), dmin = f16(u16(sb + 2));
    const uint8_t *scales = sb + 4, *qh = sb + 16;
    const uint8_t *q = sb + (five ? 48 : 16) + 32 * g;
    const __m512i sixteen = _mm512_set1_epi32(16);
    uint8_t sc, mn;
    scale_min_k4(2 * g, scales, &sc, &mn);
    const __m512 d1 = _mm512_set1_ps(d * (float)sc), m1 = _mm512_set1_ps(dmin * (float)mn);
    scale_min_k4(2 * g + 1, scales, &sc, &mn);
    const __m512 d2 = _mm512_set1_ps(d * (float)sc), m2 = _mm512_set1_ps(dmin * (float)mn);
    for (int h = 0; h < 2; h++) {  /* values 16h..16h+15 of each sub-block */
        __m512i lo, hi;
        nibbles(q + 16 * h, &lo, &hi);
        if (five) {
            const __m512i hb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * h)));
            const __mmask16 mlo = _mm512_test_epi32_mask(hb, _mm512_set1_epi32(1 << (2 * g)));
            const __mmask16 mhi = _mm512_test_epi32_mask(hb, _mm512_set1_epi32(2 << (2 * g)));
            lo = _mm512_mask_add_epi32(lo, mlo, lo, sixteen);
            hi = _mm512_mask_add_epi32(hi, mhi, hi, sixteen);
        }
        w[h] = _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(lo)), m1);
        w[2 + h] = _mm512_sub_ps(_mm512_mul_ps(d2, _mm512_cvtepi32_ps(hi)), m2);
    }
}

static int dequant_row_simd(int type, const uint8_t *src, int64_t in, float *dst)
{
    switch (type) {
    case T_Q8_0:
        for (int64_t b = 0; b < in / QK; b++, src += 34, dst += QK) {
            const __m512 d = _mm512_set1_ps(f16(u16(src)));
            for (int h = 0; h < 2; h++) {
                const __m512i q = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(src + 2 + 16 * h)));
                _mm512_storeu_ps(dst + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
            }
        }
        return 0;
    case T_Q4_0:
    case T_Q4_1: {
        const int with_min = type == T_Q4_1;
        const int64_t size = with_min ? 20 : 18;
        const __m512i eight = _mm512_set1_epi32(8);
        for (int64_t b = 0; b < in / QK; b++, src += size, dst += QK) {
            const __m512 d = _mm512_set1_ps(f16(u16(src)));
            __m512i lo, hi;
            nibbles(src + (with_min ? 4 : 2), &lo, &hi);
            if (with_min) {
                const __m512 m = _mm512_set1_ps(f16(u16(src + 2)));
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
                _mm512_storeu_ps(dst + 16,
                                 _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
            } else {
                _mm512_storeu_ps(dst, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                                           _mm512_sub_epi32(lo, eight))));
                _mm512_storeu_ps(dst + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                                                _mm512_sub_epi32(hi, eight))));
            }
        }
        return 0;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int with_min = type == T_Q5_1;
        const int64_t size = with_min ? 24 : 22;
        const __m512i sixteen = _mm512_set1_epi32(16);
        for (int64_t b = 0; b < in / QK; b++, src += size, dst += QK) {
            const __m512 d = _mm512_set1_ps(f16(u16(src)));
            uint32_t qh;
            memcpy(&qh, src + (with_min ? 4 : 2), 4);
            __m512i lo, hi;
            nibbles(src + (with_min ? 8 : 6), &lo, &hi);
            lo = _mm512_mask_add_epi32(lo, (__mmask16)(qh & 0xFFFFu), lo, sixteen);
            hi = _mm512_mask_add_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
            if (with_min) {
                const __m512 m = _mm512_set1_ps(f16(u16(src + 2)));
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
                _mm512_storeu_ps(dst + 16,
                                 _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
            } else {
                _mm512_storeu_ps(dst, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                                           _mm512_sub_epi32(lo, sixteen))));
                _mm512_storeu_ps(dst + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                                                _mm512_sub_epi32(hi, sixteen))));
            }
        }
        return 0;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int64_t size = type == T_Q5_K ? 176 : 144;
        for (int64_t b = 0; b < in / QK_K; b++, src += size)
            for (int j = 0; j < 4; j++, dst += 64) {  /* two sub-blocks: 4 chunks */
                __m512 w[4];
                widen_k_group(type, src, j, w);
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(dst + 16 * c, w[c]);
            }
        return 0;
    }
    case T_Q6_K:
        for (int64_t b = 0; b < in / QK_K; b++, src += 210)
            for (int n = 0; n < 2; n++, dst += 128) {  /* 128 values: 8 chunks */
                __m512 w[8];
                widen_k_group(T_Q6_K, src, n, w);
                for (int c = 0; c < 8; c++)
                    _mm512_storeu_ps(dst + 16 * c, w[c]);
            }
        return 0;
    default:
        return 1;  /* the portable code below */
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA widening, 8 values a vector, the same products in the same order as the
 * portable code below (so the same bits). GCC leaves those loops scalar or nearly
 * (the nibble and bit picking): a lone Q4_1 step of the default model took 31.8 ms
 * on the AVX2 build against 5.4 on the AVX-512 one before this (Xeon VM). */
static inline __m256i u8x8(const uint8_t *p)  /* 8 bytes widened to int32 lanes */
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

static inline __m256i bits_at(uint32_t word, int first)  /* bits first..first+7, 0/1 */
{
    const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32(first));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts),
                            _mm256_set1_epi32(1));
}

/* an fp16 scale: F16C converts it in one instruction (every fp16 value exactly, as
 * f16() does) where the build has it; f16() otherwise */
static inline float scale_at(const uint8_t *p)
{
#if defined(__F16C__)
    return _cvtsh_ss(u16(p));
#else
    return f16(u16(p));
#endif
}

/* bytes of one 32-value block of each type */
static inline int64_t block32_bytes(int type)
{
    switch (type) {
    case T_Q8_0: return 34;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    default: return 24;  /* T_Q5_1 */
    }
}

/* One 32-value block (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) widened into 4 registers, values
 * 8c..8c+7 in w[c], the portable code's products: dequant_row_simd stores them, the
 * lone stream's pass (dot_4_rows_fused32) multiplies them in from registers. */
static inline __attribute__((always_inline)) void widen32_avx2(int type, const uint8_t *src,
                                                                __m256 *w)
{
    const __m256 d = _mm256_set1_ps(scale_at(src));
    if (type == T_Q8_0) {
        for (int c = 0; c < 4; c++)
            w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                       _mm_loadl_epi64((const __m128i *)(src + 2 + 8 * c)))), d);
        return;
    }
    const __m256i low4 = _mm256_set1_epi32(0xF);
    const int with_min = type == T_Q4_1 || type == T_Q5_1;
    const int five = type == T_Q5_0 || type == T_Q5_1;
    const __m256i off = _mm256_set1_epi32(five ? 16 : 8);
    const __m256 m = _mm256_set1_ps(with_min ? scale_at(src + 2) : 0.0f);
    uint32_t qh = 0;
    if (five)
        memcpy(&qh, src + (with_min ? 4 : 2), 4);
    const uint8_t *q = src + (five ? (with_min ? 8 : 6) : (with_min ? 4 : 2));
    for (int c = 0; c < 4; c++) {  /* values 8c..8c+7: lo nibbles, then hi */
        const __m256i bytes = u8x8(q + 8 * (c & 1));
        __m256i v = c < 2 ? _mm256_and_si256(bytes, low4) : _mm256_srli_epi32(bytes, 4);
        if (five)
            v = _mm256_or_si256(v, _mm256_slli_epi32(bits_at(qh, 8 * c), 4));
        if (with_min)
            w[c] = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(v)), m);
        else
            w[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(v, off)));
    }
}

static int dequant_row_simd(int type, const uint8_t *src, int64_t in, float *dst)
{
    const __m256i low4 = _mm256_set1_epi32(0xF);
    switch (type) {
    case T_Q8_0:
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1: {
        const int64_t size = block32_bytes(type);
        for (int64_t b = 0; b < in / QK; b++, src += size, dst += QK) {
            __m256 w[4];
            widen32_avx2(type, src, w);
            for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(dst + 8 * c, w[c]);
        }
        return 0;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t b = 0; b < in / QK_K; b++, src += size) {
            const float d = scale_at(src), dmin = scale_at(src + 2);
            const uint8_t *scales = src + 4, *qh = src + 16;
            const uint8_t *q = src + (five ? 48 : 16);
            for (int j = 0; j < 4; j++, q += 32, dst += 64) {  /* two sub-blocks */
                uint8_t sc, mn;
                scale_min_k4(2 * j, scales, &sc, &mn);
                const __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)mn);
                scale_min_k4(2 * j + 1, scales, &sc, &mn);
                const __m256 d2 = _mm256_set1_ps(d * (float)sc), m2 = _mm256_set1_ps(dmin * (float)mn);
                for (int c = 0; c < 4; c++) {
                    const __m256i bytes = u8x8(q + 8 * c);
                    __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_srli_epi32(bytes, 4);
                    if (five) {
                        const __m256i hb = u8x8(qh + 8 * c), one = _mm256_set1_epi32(1);
                        lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(
                                 _mm256_srli_epi32(hb, 2 * j), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(
                                 _mm256_srli_epi32(hb, 2 * j + 1), one), 4));
                    }
                    _mm256_storeu_ps(dst + 8 * c, _mm256_sub_ps(
                        _mm256_mul_ps(d1, _mm256_cvtepi32_ps(lo)), m1));
                    _mm256_storeu_ps(dst + 32 + 8 * c, _mm256_sub_ps(
                        _mm256_mul_ps(d2, _mm256_cvtepi32_ps(hi)), m2));
                }
            }
        }
        return 0;
    }
    case T_Q6_K: {
        const __m256i three = _mm256_set1_epi32(3), bias = _mm256_set1_epi32(32);
        for (int64_t b = 0; b < in / QK_K; b++, src += 210) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *sc = (const int8_t *)(src + 192);
            const float d = scale_at(src + 208);
            for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, dst += 128) {
                for (int c = 0; c < 4; c++) {  /* l = 8c..8c+7 */
                    const int is = c / 2;
                    const __m256i a = u8x8(ql + 8 * c), e = u8x8(qh + 8 * c);
                    const __m256i f = u8x8(ql + 32 + 8 * c);
                    const __m256i q1 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(a, low4),
                        _mm256_slli_epi32(_mm256_and_si256(e, three), 4)), bias);
                    const __m256i q2 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(f, low4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 2), three), 4)), bias);
                    const __m256i q3 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(a, 4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 4), three), 4)), bias);
                    const __m256i q4 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(f, 4),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(e, 6), three), 4)), bias);
                    _mm256_storeu_ps(dst + 8 * c, _mm256_mul_ps(
                        _mm256_set1_ps(d * (float)sc[is]), _mm256_cvtepi32_ps(q1)));
                    _mm256_storeu_ps(dst + 32 + 8 * c, _mm256_mul_ps(
                        _mm256_set1_ps(d * (float)sc[is + 2]), _mm256_cvtepi32_ps(q2)));
                    _mm256_storeu_ps(dst + 64 + 8 * c, _mm256_mul_ps(
                        _mm256_set1_ps(d * (float)sc[is + 4]), _mm256_cvtepi32_ps(q3)));
                    _mm256_storeu_ps(dst + 96 + 8 * c, _mm256_mul_ps(
                        _mm256_set1_ps(d * (float)sc[is + 6]), _mm256_cvtepi32_ps(q4)));
                }
            }
        }
        return 0;
    }
    default:
        return 1;  /* the portable code below */
    }
}
#endif

/* One row of `in` values (a whole number of blocks) widened to fp32, as gguf.quants.
 * dequantize computes them (same products in the same order). 0, or -1 for an
 * unknown type. */
int quant_dequant_row(int type, const uint8_t *src, int64_t in, float *dst)
{
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (dequant_row_simd(type, src, in, dst) == 0)
        return 0;
#endif
    switch (type) {
    case T_F32:
        memcpy(dst, src, (size_t)in * 4);
        return 0;
    case T_F16:
        for (int64_t i = 0; i < in; i++)
            dst[i] = f16(u16(src + 2 * i));
        return 0;
    case T_BF16:
        for (int64_t i = 0; i < in; i++) {
            const uint32_t bits = (uint32_t)u16(src + 2 * i) << 16;
            memcpy(dst + i, &bits, 4);
        }
        return 0;
    default:  /* the block types: their layouts decoded once, in quant_packed.h */
        return pk_widen_blocks(type, src, in, dst);
    }
}

/* ---- dot products of nb rows of x with one widened weight row: row_dot.h ------- */

#include "row_dot.h"

#if defined(__AVX512F__)
/* A pass of up to ROWS_PER_PASS rows over a row of 32-value blocks (Q8_0, Q4_0, Q4_1,
 * Q5_0), each block widened into two registers and multiplied in at once, without
 * the round trip through the fp32 row (the widening of dequant_row_simd, the sums in
 * dot_rows' order, so the same bits). type and nb are constants at each call. */
/* an fp16 scale converted by the CPU into all 16 lanes: f16()'s value for every finite
 * one (a NaN stays a NaN), without its branches on the hot path */
static inline __m512 f16_splat(const uint8_t *p)
{
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)u16(p)));
}

static inline __attribute__((always_inline)) void widen32(int type, const uint8_t *src,
                                                          __m512 *w0, __m512 *w1)
{
    const __m512 d = f16_splat(src);
    if (type == T_Q8_0) {
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                  _mm_loadu_si128((const __m128i *)(src + 2)))), d);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                  _mm_loadu_si128((const __m128i *)(src + 18)))), d);
        return;
    }
    if (type == T_Q4_1 || type == T_Q4_0) {
        /* a 4-bit block has 16 possible values: computed once (the same products, so
         * the same bits) and looked up by each nibble (vpermps reads an index's low 4
         * bits, so the low nibble needs no mask): fewer ops than widening 32 values */
        const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = type == T_Q4_1
            ? _mm512_add_ps(_mm512_mul_ps(d, k), f16_splat(src + 2))
            : _mm512_mul_ps(d, _mm512_sub_ps(k, _mm512_set1_ps(8.0f)));
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i *)(src + (type == T_Q4_1 ? 4 : 2))));
        *w0 = _mm512_permutexvar_ps(v, table);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        return;
    }
    __m512i lo, hi;
    const __m512i off = _mm512_set1_epi32(16);
    {  /* Q5_0 */
        uint32_t qh;
        memcpy(&qh, src + 2, 4);
        nibbles(src + 6, &lo, &hi);
        lo = _mm512_mask_add_epi32(lo, (__mmask16)(qh & 0xFFFFu), lo, off);
        hi = _mm512_mask_add_epi32(hi, (__mmask16)(qh >> 16), hi, off);
    }
    *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)));
    *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)));
}

static inline __attribute__((always_inline)) void dot_fused32(
    int type, int64_t size, const uint8_t *row, const float *x, int64_t x_stride, int nb,
    int64_t in, float *y, int64_t y_stride)
{
    __m512 acc[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int b = 0; b < nb; b++)
        acc[b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += QK, row += size) {
        __m512 w0, w1;
        widen32(type, row, &w0, &w1);
#pragma GCC unroll 8
        for (int b = 0; b < nb; b++) {
            acc[b] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + b * x_stride + i), acc[b]);
            acc[b] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + b * x_stride + i + 16), acc[b]);
        }
    }
    for (int b = 0; b < nb; b++)
        y[b * y_stride] = _mm512_reduce_add_ps(acc[b]);
}

#define FUSED_NB(T, SIZE)                                                                 \
    switch (nb) {                                                                         \
    case 1: dot_fused32(T, SIZE, row, x, x_stride, 1, in, y, y_stride); return 1;          \
    case 2: dot_fused32(T, SIZE, row, x, x_stride, 2, in, y, y_stride); return 1;          \
    case 3: dot_fused32(T, SIZE, row, x, x_stride, 3, in, y, y_stride); return 1;          \
    case 4: dot_fused32(T, SIZE, row, x, x_stride, 4, in, y, y_stride); return 1;          \
    case 5: dot_fused32(T, SIZE, row, x, x_stride, 5, in, y, y_stride); return 1;          \
    case 6: dot_fused32(T, SIZE, row, x, x_stride, 6, in, y, y_stride); return 1;          \
    case 7: dot_fused32(T, SIZE, row, x, x_stride, 7, in, y, y_stride); return 1;          \
    default: dot_fused32(T, SIZE, row, x, x_stride, 8, in, y, y_stride); return 1;         \
    }

/* A lone stream's pass (one or two token rows): OUT_ROWS consecutive weight rows at
 * once. dot_fused32 on one row is a single chain of dependent multiply-adds (two a
 * block, each waiting for the last: FMA latency, not bandwidth, bound it); OUT_ROWS
 * independent chains keep both FMA ports busy, and each x block is loaded once for
 * all of them. Each output's sum runs in dot_fused32's order: the same bits. */
static inline __attribute__((always_inline)) void dot_fused32_rows(
    int type, int64_t size, const uint8_t *row, int64_t row_bytes, const float *x,
    int64_t x_stride, int nb, int64_t in, float *y, int64_t y_stride)
{
    __m512 acc[2][OUT_ROWS];
#pragma GCC unroll 16
    for (int k = 0; k < nb * OUT_ROWS; k++)
        acc[k / OUT_ROWS][k % OUT_ROWS] = _mm512_setzero_ps();
    /* the next group's rows (the next bytes in memory) fetched while these compute:
     * rows are a few hundred bytes, too short for the hardware prefetcher to ramp up,
     * and a weight read from DRAM on demand stalled the pass about half its time */
    const char *next = (const char *)(row + OUT_ROWS * row_bytes);
    const int64_t lines = (OUT_ROWS * row_bytes + 63) / 64, blocks = in / QK;
    const int64_t per_block = (lines + blocks - 1) / blocks;
    for (int64_t i = 0, off = 0, pf = 0; i < in; i += QK, off += size) {
        for (int64_t p = 0; p < per_block; p++, pf += 64)
            _mm_prefetch(next + pf, _MM_HINT_T0);
        __m512 x0[2], x1[2];
#pragma GCC unroll 2
        for (int b = 0; b < nb; b++) {
            x0[b] = _mm512_loadu_ps(x + b * x_stride + i);
            x1[b] = _mm512_loadu_ps(x + b * x_stride + i + 16);
        }
#pragma GCC unroll 8
        for (int k = 0; k < OUT_ROWS; k++) {
            __m512 w0, w1;
            widen32(type, row + k * row_bytes + off, &w0, &w1);
#pragma GCC unroll 2
            for (int b = 0; b < nb; b++) {
                acc[b][k] = _mm512_fmadd_ps(w0, x0[b], acc[b][k]);
                acc[b][k] = _mm512_fmadd_ps(w1, x1[b], acc[b][k]);
            }
        }
    }
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < OUT_ROWS; k++)
            y[b * y_stride + k] = _mm512_reduce_add_ps(acc[b][k]);
}

/* dot_fused32_rows for the K-quants: OUT_ROWS weight rows at once, each widened a
 * group at a time into registers (never through the fp32 row), the next rows
 * prefetched. Each output's sum runs over the 16-value chunks in order, as dot_rows
 * on the widened row: the same bits as the few-row and wide passes. */
static inline __attribute__((always_inline)) void dot_k_rows(
    int type, int64_t sb_bytes, const uint8_t *row, int64_t row_bytes, const float *x,
    int64_t x_stride, int nb, int64_t in, float *y, int64_t y_stride)
{
    const int chunks = type == T_Q6_K ? 8 : 4, groups = QK_K / (16 * chunks);
    __m512 acc[2][OUT_ROWS];
#pragma GCC unroll 16
    for (int k = 0; k < nb * OUT_ROWS; k++)
        acc[k / OUT_ROWS][k % OUT_ROWS] = _mm512_setzero_ps();
    const char *next = (const char *)(row + OUT_ROWS * row_bytes);
    const int64_t steps = in / QK_K * groups, lines = (OUT_ROWS * row_bytes + 63) / 64;
    const int64_t per_step = (lines + steps - 1) / steps;
    int64_t pf = 0;
    for (int64_t s = 0; s < in / QK_K; s++) {
        for (int g = 0; g < groups; g++) {
            for (int64_t p = 0; p < per_step; p++, pf += 64)
                _mm_prefetch(next + pf, _MM_HINT_T0);
            const float *xs = x + s * QK_K + g * 16 * chunks;
#pragma GCC unroll 8
            for (int k = 0; k < OUT_ROWS; k++) {
                __m512 w[8];
                widen_k_group(type, row + k * row_bytes + s * sb_bytes, g, w);
#pragma GCC unroll 8
                for (int c = 0; c < chunks; c++)
#pragma GCC unroll 2
                    for (int b = 0; b < nb; b++)
                        acc[b][k] = _mm512_fmadd_ps(
                            w[c], _mm512_loadu_ps(xs + b * x_stride + 16 * c), acc[b][k]);
            }
        }
    }
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < OUT_ROWS; k++)
            y[b * y_stride + k] = _mm512_reduce_add_ps(acc[b][k]);
}

/* FN (dot_fused32_rows or dot_k_rows) for type T of SIZE bytes a block, nb a constant */
#define ROWS_NB(FN, T, SIZE)                                                              \
    if (nb == 1)                                                                          \
        FN(T, SIZE, row, row_bytes, x, x_stride, 1, in, y, y_stride);                     \
    else                                                                                  \
        FN(T, SIZE, row, row_bytes, x, x_stride, 2, in, y, y_stride);                     \
    return 1;

/* 1 if OUT_ROWS weight rows of this type (row_bytes apart) took the fused pass for
 * nb (1 or 2) token rows, 0 for the one-row passes */
static int fused_rows_pass(int type, const uint8_t *row, int64_t row_bytes, const float *x,
                           int64_t x_stride, int nb, int64_t in, float *y, int64_t y_stride)
{
    switch (type) {
    case T_Q8_0: ROWS_NB(dot_fused32_rows, T_Q8_0, 34)
    case T_Q4_0: ROWS_NB(dot_fused32_rows, T_Q4_0, 18)
    case T_Q4_1: ROWS_NB(dot_fused32_rows, T_Q4_1, 20)
    case T_Q5_0: ROWS_NB(dot_fused32_rows, T_Q5_0, 22)
    case T_Q4_K: ROWS_NB(dot_k_rows, T_Q4_K, 144)
    case T_Q5_K: ROWS_NB(dot_k_rows, T_Q5_K, 176)
    case T_Q6_K: ROWS_NB(dot_k_rows, T_Q6_K, 210)
    default: return 0;
    }
}
#undef ROWS_NB

/* 1 if this type took the fused pass, 0 for the widened-row path */
static int fused_pass(int type, const uint8_t *row, const float *x, int64_t x_stride,
                      int nb, int64_t in, float *y, int64_t y_stride)
{
    switch (type) {
    case T_Q8_0: FUSED_NB(T_Q8_0, 34)
    case T_Q4_0: FUSED_NB(T_Q4_0, 18)
    case T_Q4_1: FUSED_NB(T_Q4_1, 20)
    case T_Q5_0: FUSED_NB(T_Q5_0, 22)
    default: return 0;
    }
}
#undef FUSED_NB
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* A lone stream's pass on AVX2: one token row against 4 widened weight rows (w, `in`
 * apart) at once, 8 independent chains of multiply-adds where dot_rows has 2 (FMA
 * latency, not bandwidth, bound one row), x loaded once for the 4. Each output sums
 * as dot_rows does (lo and hi halves of each 16, then hsum256(lo + hi)): the same bits
 * as the few-row pass. `in` is a multiple of 32 (whole blocks). */
static inline int is_block32(int type)
{
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1;
}

/* dot_4_weight_rows for 4 rows of a 32-value block type (row_bytes apart), each block
 * widened into registers (widen32_avx2) instead of through the fp32 row: the same
 * values multiplied in the same order, so the same bits. type is a constant at each
 * call (fused_4_rows). */
static inline __attribute__((always_inline)) void dot_4_rows_fused32(
    int type, const uint8_t *row, int64_t row_bytes, const float *x, int64_t in, float *y)
{
    const int64_t size = block32_bytes(type);
    __m256 lo[4], hi[4];
    for (int k = 0; k < 4; k++)
        lo[k] = hi[k] = _mm256_setzero_ps();
    /* the next 4 rows fetched while these compute, as dot_fused32_rows does */
    const char *next = (const char *)(row + 4 * row_bytes);
    const int64_t lines = (4 * row_bytes + 63) / 64, blocks = in / QK;
    const int64_t per_block = (lines + blocks - 1) / blocks;
    for (int64_t i = 0, off = 0, pf = 0; i < in; i += QK, off += size) {
        for (int64_t p = 0; p < per_block; p++, pf += 64)
            _mm_prefetch(next + pf, _MM_HINT_T0);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m256 w[4];
            widen32_avx2(type, row + k * row_bytes + off, w);
            lo[k] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x + i), lo[k]);
            hi[k] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + i + 8), hi[k]);
            lo[k] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + i + 16), lo[k]);
            hi[k] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + i + 24), hi[k]);
        }
    }
    for (int k = 0; k < 4; k++)
        y[k] = hsum256(_mm256_add_ps(lo[k], hi[k]));
}

/* 1 if 4 rows of this type took the fused pass, 0 for the widened-row one */
static int fused_4_rows(int type, const uint8_t *row, int64_t row_bytes, const float *x,
                        int64_t in, float *y)
{
    switch (type) {
    case T_Q8_0: dot_4_rows_fused32(T_Q8_0, row, row_bytes, x, in, y); return 1;
    case T_Q4_0: dot_4_rows_fused32(T_Q4_0, row, row_bytes, x, in, y); return 1;
    case T_Q4_1: dot_4_rows_fused32(T_Q4_1, row, row_bytes, x, in, y); return 1;
    case T_Q5_0: dot_4_rows_fused32(T_Q5_0, row, row_bytes, x, in, y); return 1;
    case T_Q5_1: dot_4_rows_fused32(T_Q5_1, row, row_bytes, x, in, y); return 1;
    default: return 0;
    }
}

static void dot_4_weight_rows(const float *x, const float *w, int64_t in, float *y)
{
    __m256 lo[4], hi[4];
    for (int k = 0; k < 4; k++)
        lo[k] = hi[k] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            lo[k] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k * in + i), x0, lo[k]);
            hi[k] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k * in + i + 8), x1, hi[k]);
        }
    }
    for (int k = 0; k < 4; k++)
        y[k] = hsum256(_mm256_add_ps(lo[k], hi[k]));
}
#endif

/* every row of x against one widened weight row, ROWS_PER_PASS rows at a time */
static void all_rows(const float *x, int64_t x_stride, int64_t rows, const float *w,
                     int64_t in, float *y, int64_t out)
{
    int64_t r = 0;
    for (; r + ROWS_PER_PASS <= rows; r += ROWS_PER_PASS)
        dot_rows(x + r * x_stride, x_stride, ROWS_PER_PASS, w, 0, in, y + r * out, out);
    switch (rows - r) {  /* constant row counts: the accumulators stay in registers */
    case 1: dot_rows(x + r * x_stride, x_stride, 1, w, 0, in, y + r * out, out); break;
    case 2: dot_rows(x + r * x_stride, x_stride, 2, w, 0, in, y + r * out, out); break;
    case 3: dot_rows(x + r * x_stride, x_stride, 3, w, 0, in, y + r * out, out); break;
#if ROWS_PER_PASS == 8
    case 4: dot_rows(x + r * x_stride, x_stride, 4, w, 0, in, y + r * out, out); break;
    case 5: dot_rows(x + r * x_stride, x_stride, 5, w, 0, in, y + r * out, out); break;
    case 6: dot_rows(x + r * x_stride, x_stride, 6, w, 0, in, y + r * out, out); break;
    case 7: dot_rows(x + r * x_stride, x_stride, 7, w, 0, in, y + r * out, out); break;
#endif
    default: break;
    }
}

#if defined(__AVX512F__)
/* Wide steps: 4 widened weight rows against 6 token rows at a time, 24 accumulators
 * in registers, so each load feeds 2.4 multiply-adds instead of about one (dot_rows
 * reloads x for every weight row). Each accumulator sums over i in dot_rows' order,
 * so an output has the same bits as on the narrow path. */
#define W_TILE 4
#define X_TILE 6
/* nb (1..X_TILE, a constant at each call) token rows against the W_TILE widened rows */
static inline __attribute__((always_inline)) void tile_4xn(
    const float *x, int64_t x_stride, const float *w, int64_t in, float *y, int64_t out,
    int nb)
{
    __m512 acc[W_TILE][X_TILE];
#pragma GCC unroll 4
    for (int k = 0; k < W_TILE; k++)
#pragma GCC unroll 6
        for (int b = 0; b < nb; b++)
            acc[k][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + in + i),
                     w2 = _mm512_loadu_ps(w + 2 * in + i), w3 = _mm512_loadu_ps(w + 3 * in + i);
#pragma GCC unroll 6
        for (int b = 0; b < nb; b++) {
            const __m512 xv = _mm512_loadu_ps(x + b * x_stride + i);
            acc[0][b] = _mm512_fmadd_ps(w0, xv, acc[0][b]);
            acc[1][b] = _mm512_fmadd_ps(w1, xv, acc[1][b]);
            acc[2][b] = _mm512_fmadd_ps(w2, xv, acc[2][b]);
            acc[3][b] = _mm512_fmadd_ps(w3, xv, acc[3][b]);
        }
    }
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < W_TILE; k++)
            y[b * out + k] = _mm512_reduce_add_ps(acc[k][b]);
}

#define TILE tile_4xn
#elif defined(__AVX2__) && defined(__FMA__)
/* Wide steps on AVX2: 2 widened weight rows against 3 token rows at a time, each
 * output's lo and hi halves in registers (12 accumulators of 16), so a load feeds 1.2
 * multiply-adds where dot_rows' 4-row pass feeds 0.8. Each accumulator sums what
 * dot_rows' does in its order (lo: the first 8 of every 16 values, hi: the second),
 * then hsum256(lo + hi): an output has the same bits as on the narrow path. */
#define W_TILE 2
#define X_TILE 3
static inline __attribute__((always_inline)) void tile_2xn(
    const float *x, int64_t x_stride, const float *w, int64_t in, float *y, int64_t out,
    int nb)
{
    __m256 lo[W_TILE][X_TILE], hi[W_TILE][X_TILE];
#pragma GCC unroll 3
    for (int b = 0; b < nb; b++)
        lo[0][b] = lo[1][b] = hi[0][b] = hi[1][b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + in + i);
#pragma GCC unroll 3
        for (int b = 0; b < nb; b++) {
            const __m256 xv = _mm256_loadu_ps(x + b * x_stride + i);
            lo[0][b] = _mm256_fmadd_ps(w0, xv, lo[0][b]);
            lo[1][b] = _mm256_fmadd_ps(w1, xv, lo[1][b]);
        }
        const __m256 v0 = _mm256_loadu_ps(w + i + 8), v1 = _mm256_loadu_ps(w + in + i + 8);
#pragma GCC unroll 3
        for (int b = 0; b < nb; b++) {
            const __m256 xv = _mm256_loadu_ps(x + b * x_stride + i + 8);
            hi[0][b] = _mm256_fmadd_ps(v0, xv, hi[0][b]);
            hi[1][b] = _mm256_fmadd_ps(v1, xv, hi[1][b]);
        }
    }
    for (int b = 0; b < nb; b++)
        for (int k = 0; k < W_TILE; k++)
            y[b * out + k] = hsum256(_mm256_add_ps(lo[k][b], hi[k][b]));
}

#define TILE tile_2xn
#endif

#ifdef TILE
/* every row of x against W_TILE widened rows: X_TILE at a time, then the rest (64
 * concurrent decodes leave 4 on AVX-512) tiled too rather than one weight row at a
 * time, which reloads x for each; nb is a constant at each TILE call */
static void tile_all_rows(const float *x, int64_t x_stride, int64_t rows, const float *w,
                          int64_t in, float *y, int64_t out)
{
    int64_t r = 0;
    for (; r + X_TILE <= rows; r += X_TILE)
        TILE(x + r * x_stride, x_stride, w, in, y + r * out, out, X_TILE);
    x += r * x_stride;
    y += r * out;
    switch (rows - r) {
    case 1: TILE(x, x_stride, w, in, y, out, 1); break;
    case 2: TILE(x, x_stride, w, in, y, out, 2); break;
#if X_TILE > 3
    case 3: TILE(x, x_stride, w, in, y, out, 3); break;
    case 4: TILE(x, x_stride, w, in, y, out, 4); break;
    case 5: TILE(x, x_stride, w, in, y, out, 5); break;
#endif
    default: break;
    }
}
#endif

typedef struct {
    int type;
    int64_t first, rows, row_bytes;
    const uint8_t *data;
    const uint8_t *packed;  /* quant_pack's copy, or NULL */
} segment;

/* the descriptor's segments; -1 if malformed (a type not handled, rows not summing to
 * out, a row size that is not in's) */
static int read_desc(const int64_t *desc, int64_t out, int64_t in, segment *seg, int *nseg)
{
    const int64_t n = desc[0] & 0xFFFF, packed = desc[0] >> 16;
    if (n < 1 || n > MAX_SEGMENTS || (packed != 0 && packed != 1))
        return -1;
    int64_t first = 0;
    for (int64_t s = 0; s < n; s++) {
        const int64_t *d = desc + 1 + 4 * s;
        seg[s].type = (int)d[0];
        seg[s].rows = d[1];
        seg[s].data = (const uint8_t *)(intptr_t)d[2];
        seg[s].row_bytes = d[3];
        seg[s].first = first;
        /* after the segments, with PACKED_FLAG: each one's repacked copy or 0 */
        seg[s].packed = packed ? (const uint8_t *)(intptr_t)desc[1 + 4 * n + s] : NULL;
        if (seg[s].packed && (!quant_packs(seg[s].type) || in % QK
                              || ((seg[s].type == T_Q4_K || seg[s].type == T_Q5_K
                                   || seg[s].type == T_Q6_K) && in % QK_K)))
            return -1;
        if (quant_row_bytes(seg[s].type, in) != seg[s].row_bytes || seg[s].rows < 0)
            return -1;
        if (seg[s].data == NULL && seg[s].packed == NULL)  /* (blocks dropped: packed only) */
            return -1;
        first += seg[s].rows;
    }
    *nseg = (int)n;
    return first == out ? 0 : -1;
}

/* the index of the segment holding output row o */
static inline int segment_of(const segment *seg, int nseg, int64_t o)
{
    int s = 0;
    while (s + 1 < nseg && o >= seg[s + 1].first)
        s++;
    return s;
}

static inline const uint8_t *row_of(const segment *seg, int nseg, int64_t o, int *type)
{
    const int s = segment_of(seg, nseg, o);
    *type = seg[s].type;
    return seg[s].data + (o - seg[s].first) * seg[s].row_bytes;
}

/* y [rows][ys apart] = x @ w.T on the exact path: each weight row widened to fp32 and
 * dotted with x's fp32 rows, for the `out` rows of segments seg[0..nseg). */
static int exact_linear(const float *x, int64_t x_stride, int64_t rows, const segment *seg,
                        int nseg, int64_t out, int64_t in, float *y, int64_t ys,
                        int num_threads)
{
    int failed = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const int wide = rows > ROWS_PER_PASS && in % 16 == 0;
#else
    const int wide = 0;
#endif
#pragma omp parallel num_threads(num_threads)
    {
        float *w = aligned_alloc(64, (size_t)((4 * in * 4 + 63) / 64 * 64));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        if (!wide) {
#pragma omp for schedule(static)
            for (int64_t og = 0; og < (out + OUT_ROWS - 1) / OUT_ROWS; og++) {
                if (w == NULL)
                    continue;
                const int64_t o0 = og * OUT_ROWS, o1 = o0 + OUT_ROWS < out ? o0 + OUT_ROWS : out;
#if defined(__AVX512F__)
                /* a lone stream: OUT_ROWS weight rows of one segment at once */
                if (rows <= 2 && o1 - o0 == OUT_ROWS) {
                    const int s = segment_of(seg, nseg, o0);
                    if (o1 <= seg[s].first + seg[s].rows
                        && fused_rows_pass(seg[s].type,
                                           seg[s].data + (o0 - seg[s].first) * seg[s].row_bytes,
                                           seg[s].row_bytes, x, x_stride, (int)rows, in,
                                           y + o0, ys))
                        continue;
                }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
                /* a lone stream: 4 weight rows widened into w, then dotted at once */
                if (rows <= 2 && in % 32 == 0) {
                    int64_t o = o0;
                    for (; o + 4 <= o1; o += 4) {
                        /* the segment of row o: all 4 in it, a block type */
                        const int s = segment_of(seg, nseg, o);
                        if (o + 4 <= seg[s].first + seg[s].rows && is_block32(seg[s].type)) {
                            const uint8_t *r0 = seg[s].data + (o - seg[s].first) * seg[s].row_bytes;
                            for (int64_t b = 0; b < rows; b++)
                                fused_4_rows(seg[s].type, r0, seg[s].row_bytes, x + b * x_stride,
                                             in, y + b * ys + o);
                            continue;
                        }
                        {  /* the next 4 rows fetched while these widen */
                            const char *next = (const char *)(seg[s].data
                                + (o + 4 - seg[s].first) * seg[s].row_bytes);
                            for (int64_t pf = 0; pf < 4 * seg[s].row_bytes; pf += 64)
                                _mm_prefetch(next + pf, _MM_HINT_T0);
                        }
                        for (int k = 0; k < 4; k++) {
                            int type;
                            const uint8_t *src = row_of(seg, nseg, o + k, &type);
                            quant_dequant_row(type, src, in, w + k * in);
                        }
                        for (int64_t b = 0; b < rows; b++)
                            dot_4_weight_rows(x + b * x_stride, w, in, y + b * ys + o);
                    }
                    for (; o < o1; o++) {  /* the weight's last rows */
                        int type;
                        const uint8_t *src = row_of(seg, nseg, o, &type);
                        quant_dequant_row(type, src, in, w);
                        all_rows(x, x_stride, rows, w, in, y + o, ys);
                    }
                    continue;
                }
#endif
                for (int64_t o = o0; o < o1; o++) {
                    int type;
                    const uint8_t *src = row_of(seg, nseg, o, &type);
#if defined(__AVX512F__)
                    /* one pass (a few rows): the blocks straight into the sums */
                    if (rows <= ROWS_PER_PASS
                        && fused_pass(type, src, x, x_stride, (int)rows, in, y + o, ys))
                        continue;
#endif
                    quant_dequant_row(type, src, in, w);
                    all_rows(x, x_stride, rows, w, in, y + o, ys);
                }
            }
        }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        else {  /* W_TILE widened weight rows at a time against every token row */
#pragma omp for schedule(static)
            for (int64_t o4 = 0; o4 < (out + W_TILE - 1) / W_TILE; o4++) {
                if (w == NULL)
                    continue;
                const int64_t o = o4 * W_TILE;
                const int nw = (int)(out - o < W_TILE ? out - o : W_TILE);
                for (int k = 0; k < nw; k++) {  /* each weight row widened once */
                    int type;
                    const uint8_t *src = row_of(seg, nseg, o + k, &type);
                    quant_dequant_row(type, src, in, w + k * in);
                }
                if (nw == W_TILE) {
                    tile_all_rows(x, x_stride, rows, w, in, y + o, ys);
                    continue;
                }
                for (int k = 0; k < nw; k++)  /* the last rows of the weight */
                    all_rows(x, x_stride, rows, w + k * in, in, y + o + k, ys);
            }
        }
#endif
        free(w);
    }
    return failed ? -2 : 0;
}


/* y [rows][out] = x [rows][in] (row stride x_stride) @ w.T, w the quantized weight
 * `desc` describes [out][in]. Segments with a repacked copy (PACKED_FLAG) take the
 * int8-activation path (quant_packed.h), the others the exact one. Returns 0; -2 when
 * a buffer cannot be allocated; -3 for a malformed descriptor. */
static int linear(const float *x, int64_t x_stride, int64_t rows, const int64_t *desc,
                  int64_t out, int64_t in, float *y, int num_threads, int force_portable)
{
    segment seg[MAX_SEGMENTS];
    int nseg;
    if (read_desc(desc, out, in, seg, &nseg))
        return -3;
    pk_segment pk[MAX_SEGMENTS];
    int npacked = 0;
    for (int s = 0; s < nseg; s++) {
        pk[s] = (pk_segment){seg[s].type, seg[s].packed, seg[s].first, seg[s].rows};
        npacked += seg[s].packed != NULL;
    }
    if (npacked == 0 || rows == 0)
        return exact_linear(x, x_stride, rows, seg, nseg, out, in, y, out, num_threads);
    const int rc = pk_linear(x, x_stride, rows, pk, nseg, in, y, out, num_threads,
                             force_portable);
    for (int s = 0; s < nseg && rc == 0; s++) {
        if (seg[s].packed != NULL || seg[s].rows == 0)
            continue;
        segment one = seg[s];
        one.first = 0;
        const int e = exact_linear(x, x_stride, rows, &one, 1, one.rows, in, y + seg[s].first,
                                   out, num_threads);
        if (e)
            return e;
    }
    return rc;
}

/* `unused` keeps small_linear_q8's signature, so the C layer loop (decode_layers.c)
 * calls this in its place */
int quant_linear(const float *x, int64_t x_stride, int64_t rows, const int64_t *desc,
                 const float *unused, int64_t out, int64_t in, float *y, int num_threads)
{
    (void)unused;
    return linear(x, x_stride, rows, desc, out, in, y, num_threads, 0);
}

/* quant_linear with the repacked segments on the portable loop (the tests' reference) */
int quant_linear_portable(const float *x, int64_t x_stride, int64_t rows, const int64_t *desc,
                          int64_t out, int64_t in, float *y, int num_threads)
{
    return linear(x, x_stride, rows, desc, out, in, y, num_threads, 1);
}

/* dst [n][in] = rows ids[0..n) of the weight, widened (an embedding lookup). 0, or -3
 * for a malformed descriptor or an id out of range. */
int quant_gather_rows(const int64_t *desc, int64_t out, int64_t in, const int64_t *ids,
                      int64_t n, float *dst, int num_threads)
{
    segment seg[MAX_SEGMENTS];
    int nseg, bad = 0;
    if (read_desc(desc, out, in, seg, &nseg))
        return -3;
    for (int64_t i = 0; i < n; i++)
        bad |= ids[i] < 0 || ids[i] >= out;
    if (bad)
        return -3;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 16)
    for (int64_t i = 0; i < n; i++) {
        const int s = segment_of(seg, nseg, ids[i]);
        if (seg[s].packed)  /* the repacked copy's values: the same floats */
            pk_gather_row(seg[s].type, seg[s].packed, ids[i] - seg[s].first, in, dst + i * in);
        else
            quant_dequant_row(seg[s].type, seg[s].data + (ids[i] - seg[s].first) * seg[s].row_bytes,
                              in, dst + i * in);
    }
    return 0;
}
