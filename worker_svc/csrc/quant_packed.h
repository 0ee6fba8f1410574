/* quant_linear's int8-activation path on repacked weights (--quant-activations int8):
 * llama.cpp's trade, faster where the CPU multiplies bytes (AVX512-VNNI's vpdpbusd:
 * 64 multiply-adds an instruction against an fp32 FMA's 16).
 *
 * The weight is repacked once at load (quant_pack): every 32-value block's values as
 * unsigned integers u (a value is sc * u + mn, the file's own scale and min: Q8_0 is
 * u = q + 128 with mn = -128 d, Q4_0 mn = -8 d, Q5_0 mn = -16 d, the K-quants d * sc6
 * and -dmin * m6), 16 output rows interleaved a block:
 *
 *   block (group g of 16 rows, block b) = u8 [8 chunks][16 rows][4 values] (512 bytes),
 *                                         then the 16 rows' scales and mins
 *
 * The scales and mins take the file's own precision, so a lone stream reads no more
 * bytes than the file's: Q8_0, Q4_0 and Q5_0 keep their fp16 scale alone (mn = -z sc,
 * z = 128, 8, 16: exact), Q4_1 and Q5_1 their fp16 scale and min, the K-quants fp32
 * (d * sc6 is not an fp16 value): 544, 576 or 640 bytes a block (pk_format).
 *
 * so one 64-byte load is 4 values of each of 16 rows: one vpdpbusd against 4 values
 * of x broadcast sums them into 16 lanes, one lane an output row. There is no
 * transposition and no horizontal sum; x is read as broadcasts.
 *
 * x is quantized per 32 values to int8 (scale amax / 127, as llama.cpp's q8_0), and a
 * block's dot is an exact integer sum. The float arithmetic after it is one fixed
 * sequence per (output row, x row), which the portable loop and the SIMD loop both run:
 *
 *   I_b = sum(u * q, the block's 32 values)          (exact int32)
 *   acc = fma((float)I_b * sc_b, dx_b, acc);  acc = fma(mn_b, dx_b * (float)S_b, acc)
 *
 * (dx_b, S_b: x's scale and the sum of its int8 values in the block.) So a row's output
 * does not depend on which other rows share the step, how they are tiled or which
 * build ran it (tests/worker/test_quant_packed.py). Q6_K's two scales a block keep
 * its sum in integers to the end (PK_Q6K); the float types are not repacked: their
 * rows keep the exact path.
 *
 * Included by quant_linear.c after its block helpers (f16, u16, scale_min_k4, T_*). */
#ifndef GAPSERVE_QUANT_PACKED_H
#define GAPSERVE_QUANT_PACKED_H

#include <math.h>

#define PK_ROWS 16

/* how a type's scales and mins are held after the values (the low two bits), and
 * PK_NIB where its values are 4 bits: two to a byte, chunk c in the low nibbles of
 * the 64 bytes at 64 c and chunk c + 4 in their high nibbles (256 bytes a block).
 * PK_Q6K: Q6_K's two int8 scales a block (one per 16 values: sc_a [16], sc_b [16])
 * and its fp16 d [16]; a value is d * sc * (u - 32), and a block's sum stays an
 * integer to the end: J = sc_a (I_a - 32 S_a) + sc_b (I_b - 32 S_b), the halves' sums
 * of u * q and of q; then acc = fma((float)J * d, dx, acc). */
enum { PK_SYM16 = 0, PK_ASYM16 = 1, PK_ASYM32 = 2, PK_Q6K = 3, PK_NIB = 4 };

static inline int pk_format(int type)
{
    const int nib = type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K ? PK_NIB : 0;
    return nib | (type == T_Q4_1 || type == T_Q5_1 ? PK_ASYM16
                  : type == T_Q4_K || type == T_Q5_K ? PK_ASYM32
                  : type == T_Q6_K ? PK_Q6K : PK_SYM16);
}

/* bytes of a block's values: 16 rows of 32 */
static inline int64_t pk_value_bytes(int fmt)
{
    return fmt & PK_NIB ? QK * PK_ROWS / 2 : QK * PK_ROWS;
}

/* bytes of a block of each format */
static inline int64_t pk_block_bytes(int fmt)
{
    const int scales = fmt & 3;
    return pk_value_bytes(fmt) + (scales == PK_SYM16 ? 32 : scales == PK_ASYM32 ? 128 : 64);
}

/* -z of a PK_SYM16 type: its min is -z times its scale */
static inline float pk_neg_zero(int type)
{
    return type == T_Q8_0 ? -128.0f : type == T_Q4_0 ? -8.0f : -16.0f;
}

/* 1 if quant_pack repacks this type */
int quant_packs(int type)
{
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q4_K: case T_Q5_K:
    case T_Q6_K:
        return 1;
    default:
        return 0;
    }
}

/* bytes of a repacked `type` weight of `rows` rows (padded to 16) and `in` values */
int64_t quant_pack_bytes(int type, int64_t rows, int64_t in)
{
    return (rows + PK_ROWS - 1) / PK_ROWS * (in / QK) * pk_block_bytes(pk_format(type));
}

/* One row's values as unsigned integers u [in] with sc and mn per 32 values (h: the
 * file's fp16 words of them where it has them, sc then mn; Q6_K: d in h, its two int8
 * scales a block in s6). 0, or -1 for a type not repacked. */
static int pk_unpack_row(int type, const uint8_t *src, int64_t in, uint8_t *u, float *sc,
                         float *mn, uint16_t *h, int8_t *s6)
{
    switch (type) {
    case T_Q6_K:
        for (int64_t sb = 0; sb < in / QK_K; sb++, src += 210) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *scales = (const int8_t *)(src + 192);
            for (int n = 0; n < 2; n++, ql += 64, qh += 32, scales += 8) {
                const int64_t b0 = sb * 8 + n * 4;  /* the half's first 32-value block */
                for (int j = 0; j < 4; j++) {
                    h[2 * (b0 + j)] = u16(src + 208);
                    s6[2 * (b0 + j)] = scales[2 * j];
                    s6[2 * (b0 + j) + 1] = scales[2 * j + 1];
                }
                for (int l = 0; l < 32; l++) {
                    u[(b0 + 0) * QK + l] = (uint8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
                    u[(b0 + 1) * QK + l] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                    u[(b0 + 2) * QK + l] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    u[(b0 + 3) * QK + l] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
        }
        return 0;
    case T_Q8_0:
        for (int64_t b = 0; b < in / QK; b++, src += 34, u += QK) {
            const float d = f16(u16(src));
            h[2 * b] = u16(src);
            sc[b] = d;
            mn[b] = -128.0f * d;
            for (int l = 0; l < QK; l++)
                u[l] = (uint8_t)((int)(int8_t)src[2 + l] + 128);
        }
        return 0;
    case T_Q4_0:
    case T_Q4_1: {
        const int with_min = type == T_Q4_1;
        const int64_t size = with_min ? 20 : 18;
        for (int64_t b = 0; b < in / QK; b++, src += size, u += QK) {
            const float d = f16(u16(src));
            h[2 * b] = u16(src);
            h[2 * b + 1] = u16(src + 2);
            sc[b] = d;
            mn[b] = with_min ? f16(u16(src + 2)) : -8.0f * d;
            const uint8_t *q = src + (with_min ? 4 : 2);
            for (int l = 0; l < 16; l++) {
                u[l] = q[l] & 0xF;
                u[l + 16] = q[l] >> 4;
            }
        }
        return 0;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const int with_min = type == T_Q5_1;
        const int64_t size = with_min ? 24 : 22;
        for (int64_t b = 0; b < in / QK; b++, src += size, u += QK) {
            const float d = f16(u16(src));
            h[2 * b] = u16(src);
            h[2 * b + 1] = u16(src + 2);
            sc[b] = d;
            mn[b] = with_min ? f16(u16(src + 2)) : -16.0f * d;
            uint32_t qh;
            memcpy(&qh, src + (with_min ? 4 : 2), 4);
            const uint8_t *q = src + (with_min ? 8 : 6);
            for (int l = 0; l < 16; l++) {
                u[l] = (uint8_t)((q[l] & 0xF) | (((qh >> l) & 1u) << 4));
                u[l + 16] = (uint8_t)((q[l] >> 4) | (((qh >> (l + 16)) & 1u) << 4));
            }
        }
        return 0;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t b = 0; b < in / QK_K; b++, src += size) {
            const float d = f16(u16(src)), dmin = f16(u16(src + 2));
            const uint8_t *scales = src + 4, *qh = src + 16;
            const uint8_t *q = src + (five ? 48 : 16);
            for (int j = 0; j < 4; j++, q += 32, u += 64, sc += 2, mn += 2) {
                uint8_t s6, m6;
                scale_min_k4(2 * j, scales, &s6, &m6);
                sc[0] = d * (float)s6;
                mn[0] = -(dmin * (float)m6);
                scale_min_k4(2 * j + 1, scales, &s6, &m6);
                sc[1] = d * (float)s6;
                mn[1] = -(dmin * (float)m6);
                for (int l = 0; l < 32; l++) {
                    int lo = q[l] & 0xF, hi = q[l] >> 4;
                    if (five) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    u[l] = (uint8_t)lo;
                    u[l + 32] = (uint8_t)hi;
                }
            }
        }
        return 0;
    }
    default:
        return -1;
    }
}

/* dst (quant_pack_bytes) = `rows` rows of a `type` weight (row_bytes apart) repacked;
 * the rows padding the last group are zero (sc = mn = 0). 0; -1 for a type not
 * repacked or `in` not whole blocks; -2 without memory. */
int quant_pack(int type, const uint8_t *data, int64_t rows, int64_t row_bytes, int64_t in,
               uint8_t *dst, int num_threads)
{
    if (!quant_packs(type) || in % QK || quant_row_bytes(type, in) != row_bytes
        || ((type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) && in % QK_K))
        return -1;
    const int64_t nb = in / QK, groups = (rows + PK_ROWS - 1) / PK_ROWS;
    const int fmt = pk_format(type);
    const int64_t bb = pk_block_bytes(fmt), vb = pk_value_bytes(fmt);
    int failed = 0;
    memset(dst, 0, (size_t)quant_pack_bytes(type, rows, in));
#pragma omp parallel num_threads(num_threads)
    {
        uint8_t *u = malloc((size_t)in);
        float *sc = malloc((size_t)nb * 4), *mn = malloc((size_t)nb * 4);
        uint16_t *h = malloc((size_t)nb * 4);
        int8_t *s6 = malloc((size_t)nb * 2);
        if (!u || !sc || !mn || !h || !s6) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (!u || !sc || !mn || !h || !s6)
                continue;
            for (int r = 0; r < PK_ROWS && g * PK_ROWS + r < rows; r++) {
                pk_unpack_row(type, data + (g * PK_ROWS + r) * row_bytes, in, u, sc, mn, h, s6);
                for (int64_t b = 0; b < nb; b++) {
                    uint8_t *blk = dst + (g * nb + b) * bb;
                    if (fmt & PK_NIB) {
                        for (int c = 0; c < QK / 8; c++)
                            for (int i = 0; i < 4; i++)
                                blk[(c * PK_ROWS + r) * 4 + i] = (uint8_t)(
                                    u[b * QK + 4 * c + i] | u[b * QK + 4 * (c + 4) + i] << 4);
                    } else {
                        for (int c = 0; c < QK / 4; c++)
                            memcpy(blk + (c * PK_ROWS + r) * 4, u + b * QK + 4 * c, 4);
                    }
                    if ((fmt & 3) == PK_Q6K) {
                        blk[vb + r] = (uint8_t)s6[2 * b];
                        blk[vb + PK_ROWS + r] = (uint8_t)s6[2 * b + 1];
                        memcpy(blk + vb + 2 * PK_ROWS + 2 * r, h + 2 * b, 2);
                    } else if ((fmt & 3) == PK_ASYM32) {
                        memcpy(blk + vb + 4 * r, sc + b, 4);
                        memcpy(blk + vb + 4 * PK_ROWS + 4 * r, mn + b, 4);
                    } else {
                        memcpy(blk + vb + 2 * r, h + 2 * b, 2);
                        if ((fmt & 3) == PK_ASYM16)
                            memcpy(blk + vb + 2 * PK_ROWS + 2 * r, h + 2 * b + 1, 2);
                    }
                }
            }
        }
        free(s6);
        free(h);
        free(u);
        free(sc);
        free(mn);
    }
    return failed ? -2 : 0;
}

/* One value as gguf.quants.dequantize computes it from its integer u: d * (u - z) for
 * Q8_0, Q4_0 and Q5_0 (a zero keeps the sign of d), sc * u + mn with the same two
 * roundings as its d * q + m (or d1 * q - m1, the K-quants) for the others, and
 * (d * sc) * (u - 32) for Q6_K (ds: that product, per 16 values). */
static inline float pk_value(int type, int fmt, int u, float sc, float mn)
{
    switch (fmt & 3) {
    case PK_SYM16: return sc * (float)(u + (int)pk_neg_zero(type));
    case PK_Q6K: return sc * (float)(u - 32);
    default: return sc * (float)u + mn;
    }
}

/* A row of a type quant_pack reads widened to fp32 from the file's blocks, through
 * the one decoder of their layouts (pk_unpack_row) and pk_value: the exact path's
 * portable widening (quant_dequant_row). 0, or -1 for a type not read here. */
static int pk_widen_blocks(int type, const uint8_t *src, int64_t in, float *dst)
{
    if (!quant_packs(type))
        return -1;
    const int fmt = pk_format(type);
    const int64_t chunk = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K ? QK_K : QK;
    const int64_t bytes = quant_row_bytes(type, chunk);
    uint8_t u[QK_K];
    float sc[QK_K / QK], mn[QK_K / QK];
    uint16_t h[2 * QK_K / QK];
    int8_t s6[2 * QK_K / QK];
    for (int64_t at = 0; at < in; at += chunk, src += bytes) {
        pk_unpack_row(type, src, chunk, u, sc, mn, h, s6);
        for (int64_t b = 0; b < chunk / QK; b++)
            for (int i = 0; i < QK; i++) {
                const float scale = (fmt & 3) == PK_Q6K
                    ? f16(h[2 * b]) * (float)s6[2 * b + i / 16] : sc[b];
                dst[at + b * QK + i] = pk_value(type, fmt, u[b * QK + i], scale, mn[b]);
            }
    }
    return 0;
}

/* Row r of a repacked weight widened to fp32: pk_value of its values, so the file's
 * dequantized values bit for bit, and a repacked weight needs no blocks beside it
 * (the embedding lookup of a tied head reads it). */
static void pk_gather_row(int type, const uint8_t *packed, int64_t r, int64_t in, float *dst)
{
    const int fmt = pk_format(type);
    const int64_t bb = pk_block_bytes(fmt), vb = pk_value_bytes(fmt), nb = in / QK;
    const int rr = (int)(r % PK_ROWS);
    const uint8_t *w = packed + (r / PK_ROWS) * nb * bb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        float sc[2] = {0.0f, 0.0f}, mn = 0.0f;  /* Q6_K: a scale per 16 values */
        if ((fmt & 3) == PK_Q6K) {
            const float d = f16(u16(blk + vb + 2 * PK_ROWS + 2 * rr));
            sc[0] = d * (float)(int8_t)blk[vb + rr];
            sc[1] = d * (float)(int8_t)blk[vb + PK_ROWS + rr];
        } else if ((fmt & 3) == PK_ASYM32) {
            memcpy(&sc[0], blk + vb + 4 * rr, 4);
            memcpy(&mn, blk + vb + 4 * PK_ROWS + 4 * rr, 4);
        } else {
            sc[0] = f16(u16(blk + vb + 2 * rr));
            mn = (fmt & 3) == PK_ASYM16 ? f16(u16(blk + vb + 2 * PK_ROWS + 2 * rr)) : 0.0f;
        }
        if ((fmt & 3) != PK_Q6K)
            sc[1] = sc[0];
        for (int c = 0; c < QK / 4; c++)
            for (int i = 0; i < 4; i++) {
                const int cc = fmt & PK_NIB ? c % 4 : c;
                const uint8_t v = blk[(cc * PK_ROWS + rr) * 4 + i];
                const int u = fmt & PK_NIB ? (c < 4 ? v & 0xF : v >> 4) : v;
                dst[b * QK + 4 * c + i] = pk_value(type, fmt, u, sc[c / 4], mn);
            }
    }
}

/* x's rows quantized per 32 values: q [rows][in], dx and dx * S [rows][nb] */
typedef struct {
    int8_t *q;
    float *dx, *dxs;
    int32_t *s;  /* the sum of the block's q (the AVX2 loop's Q8_0 sums signed values) */
    int32_t *s16;  /* [rows][nb][2]: the sums of its two halves' q (Q6_K) */
    int64_t in, nb;
} pk_x;

/* One block of x: scale amax / 127, values rint(x * (127 / amax)). A block holding a
 * NaN or an infinity gets a NaN scale and zero values, so its outputs are NaN as the
 * exact path's would be, never a finite number made of saturated bytes. A block whose
 * amax is below PK_TINY (where 127 / amax would overflow) is zero. The SIMD builds
 * compute the same: amax and the integer sum in any order, each value's product and
 * rounding as here. */
#define PK_TINY 1e-30f

static void pk_block_scales(float amax, int bad, int32_t sum, float *dx, float *dxs,
                            int32_t *s)
{
    *dx = bad ? NAN : amax / 127.0f;
    *dxs = bad ? NAN : *dx * (float)sum;
    *s = sum;
}

static void pk_quantize_block(const float *v, int8_t *q, float *dx, float *dxs, int32_t *s,
                              int32_t *s16)
{
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const __m512 za = _mm512_mul_ps(a, _mm512_setzero_ps()),
                 zb = _mm512_mul_ps(b, _mm512_setzero_ps());  /* NaN: a NaN or infinity */
    const int bad = (_mm512_cmp_ps_mask(za, za, _CMP_UNORD_Q)
                     | _mm512_cmp_ps_mask(zb, zb, _CMP_UNORD_Q)) != 0;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    if (bad || !(amax >= PK_TINY)) {
        memset(q, 0, QK);
        s16[0] = s16[1] = 0;
        pk_block_scales(amax, bad, 0, dx, dxs, s);
        return;
    }
    const __m512 id = _mm512_set1_ps(127.0f / amax);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(
        _mm512_mul_ps(a, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(
        _mm512_mul_ps(b, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    s16[0] = _mm512_reduce_add_epi32(qa);
    s16[1] = _mm512_reduce_add_epi32(qb);
    pk_block_scales(amax, 0, s16[0] + s16[1], dx, dxs, s);
#elif defined(__AVX2__)
    __m256 a[4], m = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int bad = 0;
    for (int k = 0; k < 4; k++) {
        a[k] = _mm256_loadu_ps(v + 8 * k);
        const __m256 z = _mm256_mul_ps(a[k], _mm256_setzero_ps());  /* NaN: NaN or inf */
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(z, z, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, _mm256_and_ps(a[k], abs_mask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    if (bad || !(amax >= PK_TINY)) {
        memset(q, 0, QK);
        s16[0] = s16[1] = 0;
        pk_block_scales(amax, bad != 0, 0, dx, dxs, s);
        return;
    }
    const __m256 id = _mm256_set1_ps(127.0f / amax);
    __m256i qi[4];
    for (int k = 0; k < 4; k++)
        qi[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a[k], id),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* packs work within 128-bit lanes: the permute puts the 4-byte groups in order */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
    for (int half = 0; half < 2; half++) {
        const __m256i sum = _mm256_add_epi32(qi[2 * half], qi[2 * half + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        s16[half] = _mm_cvtsi128_si32(s4);
    }
    pk_block_scales(amax, 0, s16[0] + s16[1], dx, dxs, s);
#else
    float amax = 0.0f, probe = 0.0f;
    for (int i = 0; i < QK; i++) {
        amax = fmaxf(amax, fabsf(v[i]));
        probe += v[i] * 0.0f;  /* NaN iff some value is NaN or infinite */
    }
    const int bad = probe != 0.0f;
    if (bad || !(amax >= PK_TINY)) {
        memset(q, 0, QK);
        s16[0] = s16[1] = 0;
        pk_block_scales(amax, bad, 0, dx, dxs, s);
        return;
    }
    const float id = 127.0f / amax;
    s16[0] = s16[1] = 0;
    for (int i = 0; i < QK; i++) {
        const int32_t v8 = (int32_t)rintf(v[i] * id);  /* |v8| <= 127 */
        q[i] = (int8_t)v8;
        s16[i / 16] += v8;
    }
    pk_block_scales(amax, 0, s16[0] + s16[1], dx, dxs, s);
#endif
}

/* ---- the portable loop: the reference every SIMD loop equals bit for bit ---- */

/* rows o0..o0+n (n <= 16) of group block row `w` (group g's first block) against
 * every row of x: y [t][o] for o in 0..n */
static void pk_group_portable(int type, const uint8_t *w, int n, const pk_x *x,
                              int64_t rows, float *y, int64_t y_stride)
{
    const int fmt = pk_format(type);
    const int64_t bb = pk_block_bytes(fmt), vb = pk_value_bytes(fmt);
    for (int64_t t = 0; t < rows; t++) {
        const int8_t *xq = x->q + t * x->in;
        for (int r = 0; r < n; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < x->nb; b++) {
                const uint8_t *blk = w + b * bb;
                int32_t I = 0, half[2] = {0, 0};
                for (int c = 0; c < QK / 4; c++)
                    for (int i = 0; i < 4; i++) {
                        const int cc = fmt & PK_NIB ? c % 4 : c;
                        const uint8_t v = blk[(cc * PK_ROWS + r) * 4 + i];
                        const int u = fmt & PK_NIB ? (c < 4 ? v & 0xF : v >> 4) : v;
                        I += u * xq[b * QK + 4 * c + i];
                        half[c / 4] += u * xq[b * QK + 4 * c + i];
                    }
                if ((fmt & 3) == PK_Q6K) {
                    const int32_t *S = x->s16 + 2 * (t * x->nb + b);
                    const int32_t J = (int8_t)blk[vb + r] * (half[0] - 32 * S[0])
                                    + (int8_t)blk[vb + PK_ROWS + r] * (half[1] - 32 * S[1]);
                    const float d = f16(u16(blk + vb + 2 * PK_ROWS + 2 * r));
                    acc = fmaf((float)J * d, x->dx[t * x->nb + b], acc);
                    continue;
                }
                float sc, mn;
                if ((fmt & 3) == PK_ASYM32) {
                    memcpy(&sc, blk + vb + 4 * r, 4);
                    memcpy(&mn, blk + vb + 4 * PK_ROWS + 4 * r, 4);
                } else {
                    sc = f16(u16(blk + vb + 2 * r));
                    mn = (fmt & 3) == PK_ASYM16 ? f16(u16(blk + vb + 2 * PK_ROWS + 2 * r))
                                                : pk_neg_zero(type) * sc;
                }
                const float f = (float)I * sc;
                acc = fmaf(f, x->dx[t * x->nb + b], acc);
                acc = fmaf(mn, x->dxs[t * x->nb + b], acc);
            }
            y[t * y_stride + r] = acc;
        }
    }
}

#if defined(__AVX512F__)
/* ---- AVX512-VNNI: G groups x T rows of x a tile, the int32 sums in registers ---- */
#define PK_VNNI __attribute__((target("avx512f,avx512vnni"), always_inline)) inline

/* chunk c of a block's values (64 bytes: 4 values of 16 rows), as bytes */
static PK_VNNI __m512i pk_chunk512(const uint8_t *blk, int c, int fmt)
{
    if (!(fmt & PK_NIB))
        return _mm512_loadu_si512((const void *)(blk + c * 64));
    const __m512i v = _mm512_loadu_si512((const void *)(blk + (c % 4) * 64));
    return _mm512_and_si512(c < 4 ? v : _mm512_srli_epi32(v, 4), _mm512_set1_epi8(0x0F));
}

static PK_VNNI void pk_tile_vnni(int fmt, float neg_zero, const uint8_t *w,
                                 int64_t g_stride, int G, int T, const pk_x *x, int64_t t0,
                                 int64_t nb, float *y, int64_t y_stride, int n_last)
{
    const int64_t bb = pk_block_bytes(fmt), vb = pk_value_bytes(fmt);
    __m512 acc[4][8];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++)
            acc[g][t] = _mm512_setzero_ps();
    const int8_t *xq = x->q + t0 * x->in;
    const float *dx = x->dx + t0 * nb, *dxs = x->dxs + t0 * nb;
    const int q6k = (fmt & 3) == PK_Q6K;
    for (int64_t b = 0; b < nb; b++) {
        __m512i I[4][8], I2[4][8];  /* I2: Q6_K's second half (chunks 4..7) */
#pragma GCC unroll 4
        for (int g = 0; g < G; g++)
#pragma GCC unroll 8
            for (int t = 0; t < T; t++)
                I[g][t] = I2[g][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < QK / 4; c++) {
#pragma GCC unroll 4
            for (int g = 0; g < G; g++) {
                const __m512i wv = pk_chunk512(w + g * g_stride + b * bb, c, fmt);
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    int32_t xv;
                    memcpy(&xv, xq + t * x->in + b * QK + 4 * c, 4);
                    if (q6k && c >= 4)
                        I2[g][t] = _mm512_dpbusd_epi32(I2[g][t], wv, _mm512_set1_epi32(xv));
                    else
                        I[g][t] = _mm512_dpbusd_epi32(I[g][t], wv, _mm512_set1_epi32(xv));
                }
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = w + g * g_stride + b * bb;
            if (q6k) {
                const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + vb)));
                const __m512i sb = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(blk + vb + PK_ROWS)));
                const __m512 d = _mm512_cvtph_ps(
                    _mm256_loadu_si256((const __m256i *)(blk + vb + 2 * PK_ROWS)));
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const int32_t *S = x->s16 + 2 * ((t0 + t) * nb + b);
                    const __m512i J = _mm512_add_epi32(
                        _mm512_mullo_epi32(_mm512_sub_epi32(I[g][t], _mm512_set1_epi32(32 * S[0])), sa),
                        _mm512_mullo_epi32(_mm512_sub_epi32(I2[g][t], _mm512_set1_epi32(32 * S[1])), sb));
                    const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(J), d);
                    acc[g][t] = _mm512_fmadd_ps(f, _mm512_set1_ps(dx[t * nb + b]), acc[g][t]);
                }
                continue;
            }
            __m512 sc, mn;
            if ((fmt & 3) == PK_ASYM32) {
                sc = _mm512_loadu_ps((const float *)(blk + vb));
                mn = _mm512_loadu_ps((const float *)(blk + vb + 64));
            } else {
                sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + vb)));
                mn = (fmt & 3) == PK_ASYM16
                    ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + vb + 32)))
                    : _mm512_mul_ps(sc, _mm512_set1_ps(neg_zero));
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(I[g][t]), sc);
                acc[g][t] = _mm512_fmadd_ps(f, _mm512_set1_ps(dx[t * nb + b]), acc[g][t]);
                acc[g][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dxs[t * nb + b]), acc[g][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        const __mmask16 m = g == G - 1 ? (__mmask16)((1u << n_last) - 1u) : (__mmask16)0xFFFF;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++)
            _mm512_mask_storeu_ps(y + (t0 + t) * y_stride + g * PK_ROWS, m, acc[g][t]);
    }
}

/* groups g0..g0+G of one segment (w: group g0's first block) against every row of x:
 * two groups by 4 rows a tile, or one group (a few rows of x, or a segment's odd last
 * group) by up to 8; fmt a constant at each call */
#define PK_TILE(G, T) pk_tile_vnni(fmt, neg_zero, w, g_stride, G, T, x, t, nb, y, y_stride, n_last)
static PK_VNNI void pk_groups_vnni(int fmt, float neg_zero, const uint8_t *w,
                                   int64_t g_stride, int G, int n_last, const pk_x *x,
                                   int64_t rows, float *y, int64_t y_stride)
{
    const int64_t nb = x->nb;
    int64_t t = 0;
    if (G == 2) {
        for (; t + 4 <= rows; t += 4)
            PK_TILE(2, 4);
        switch (rows - t) {
        case 1: PK_TILE(2, 1); break;
        case 2: PK_TILE(2, 2); break;
        case 3: PK_TILE(2, 3); break;
        default: break;
        }
    } else {
        for (; t + 8 <= rows; t += 8)
            PK_TILE(1, 8);
        switch (rows - t) {
        case 1: PK_TILE(1, 1); break;
        case 2: PK_TILE(1, 2); break;
        case 3: PK_TILE(1, 3); break;
        case 4: PK_TILE(1, 4); break;
        case 5: PK_TILE(1, 5); break;
        case 6: PK_TILE(1, 6); break;
        case 7: PK_TILE(1, 7); break;
        default: break;
        }
    }
}
#undef PK_TILE

static __attribute__((target("avx512f,avx512vnni"))) void pk_run_vnni(
    int type, const uint8_t *w, int64_t g_stride, int G, int n_last, const pk_x *x,
    int64_t rows, float *y, int64_t y_stride)
{
#define PK_RUN(FMT, NZ) pk_groups_vnni(FMT, NZ, w, g_stride, G, n_last, x, rows, y, y_stride)
    switch (type) {
    case T_Q8_0: PK_RUN(PK_SYM16, -128.0f); break;
    case T_Q5_0: PK_RUN(PK_SYM16, -16.0f); break;
    case T_Q4_0: PK_RUN(PK_SYM16 | PK_NIB, -8.0f); break;
    case T_Q5_1: PK_RUN(PK_ASYM16, 0.0f); break;
    case T_Q4_1: PK_RUN(PK_ASYM16 | PK_NIB, 0.0f); break;
    case T_Q5_K: PK_RUN(PK_ASYM32, 0.0f); break;
    case T_Q6_K: PK_RUN(PK_Q6K, 0.0f); break;
    default: PK_RUN(PK_ASYM32 | PK_NIB, 0.0f); break;  /* T_Q4_K */
    }
#undef PK_RUN
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* ---- AVX2: 8 rows a register (half a group), maddubs + madd for the block sums ----
 * maddubs multiplies unsigned bytes by signed ones into int16 pairs, saturating: safe
 * for u <= 31 (2 * 31 * 127 < 2^15). Q8_0's u = q + 128 is not, so its loop takes the
 * signed q (u ^ 0x80) by the sign trick, |q| times x with q's sign, and adds 128 S
 * back: the same integer as the unsigned sum. */
static inline __attribute__((always_inline)) __m256i pk_dot8_avx2(__m256i w, __m256i xb,
                                                                  int q8)
{
    const __m256i ones = _mm256_set1_epi16(1);
    if (q8) {
        const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
        return _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xb, q)), ones);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xb), ones);
}

/* H halves (8 rows each, consecutive in the group order) by T rows of x */
static inline __attribute__((always_inline)) void pk_tile_avx2(
    int fmt, float neg_zero, int q8, const uint8_t *w, int64_t g_stride, int H, int T,
    const pk_x *x, int64_t t0, int64_t nb, float *y, int64_t y_stride, int n_valid)
{
    const int64_t bb = pk_block_bytes(fmt), vb = pk_value_bytes(fmt);
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int h = 0; h < H; h++)
#pragma GCC unroll 3
        for (int t = 0; t < T; t++)
            acc[h][t] = _mm256_setzero_ps();
    const int8_t *xq = x->q + t0 * x->in;
    const float *dx = x->dx + t0 * nb, *dxs = x->dxs + t0 * nb;
    const int32_t *xs = x->s + t0 * nb;
    const int q6k = (fmt & 3) == PK_Q6K;
    for (int64_t b = 0; b < nb; b++) {
        __m256i I[4][3], I2[4][3];  /* I2: Q6_K's second half (chunks 4..7) */
#pragma GCC unroll 4
        for (int h = 0; h < H; h++)
#pragma GCC unroll 3
            for (int t = 0; t < T; t++)
                I[h][t] = I2[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < QK / 4; c++) {
            __m256i xb[3];
#pragma GCC unroll 3
            for (int t = 0; t < T; t++) {
                int32_t xv;
                memcpy(&xv, xq + t * x->in + b * QK + 4 * c, 4);
                xb[t] = _mm256_set1_epi32(xv);
            }
#pragma GCC unroll 4
            for (int h = 0; h < H; h++) {
                const uint8_t *at = w + (h / 2) * g_stride + b * bb + (h % 2) * 32;
                __m256i wv;
                if (fmt & PK_NIB) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(at + (c % 4) * 64));
                    wv = _mm256_and_si256(c < 4 ? v : _mm256_srli_epi32(v, 4),
                                          _mm256_set1_epi8(0x0F));
                } else {
                    wv = _mm256_loadu_si256((const __m256i *)(at + c * 64));
                }
#pragma GCC unroll 3
                for (int t = 0; t < T; t++) {
                    if (q6k && c >= 4)
                        I2[h][t] = _mm256_add_epi32(I2[h][t], pk_dot8_avx2(wv, xb[t], 0));
                    else
                        I[h][t] = _mm256_add_epi32(I[h][t], pk_dot8_avx2(wv, xb[t], q8));
                }
            }
        }
#pragma GCC unroll 4
        for (int h = 0; h < H; h++) {
            const uint8_t *blk = w + (h / 2) * g_stride + b * bb;
            const int r0 = (h % 2) * 8;
            if (q6k) {
                const __m256i sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + vb + r0)));
                const __m256i sb = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(blk + vb + PK_ROWS + r0)));
                const __m256 d = _mm256_cvtph_ps(
                    _mm_loadu_si128((const __m128i *)(blk + vb + 2 * PK_ROWS + 2 * r0)));
#pragma GCC unroll 3
                for (int t = 0; t < T; t++) {
                    const int32_t *S = x->s16 + 2 * ((t0 + t) * nb + b);
                    const __m256i J = _mm256_add_epi32(
                        _mm256_mullo_epi32(_mm256_sub_epi32(I[h][t], _mm256_set1_epi32(32 * S[0])), sa),
                        _mm256_mullo_epi32(_mm256_sub_epi32(I2[h][t], _mm256_set1_epi32(32 * S[1])), sb));
                    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(J), d);
                    acc[h][t] = _mm256_fmadd_ps(f, _mm256_set1_ps(dx[t * nb + b]), acc[h][t]);
                }
                continue;
            }
            __m256 sc, mn;
            if ((fmt & 3) == PK_ASYM32) {
                sc = _mm256_loadu_ps((const float *)(blk + vb) + r0);
                mn = _mm256_loadu_ps((const float *)(blk + vb + 64) + r0);
            } else {
                sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + vb + 2 * r0)));
                mn = (fmt & 3) == PK_ASYM16
                    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + vb + 32 + 2 * r0)))
                    : _mm256_mul_ps(sc, _mm256_set1_ps(neg_zero));
            }
#pragma GCC unroll 3
            for (int t = 0; t < T; t++) {
                __m256i Iu = I[h][t];
                if (q8)  /* signed sums back to the unsigned ones: + 128 S */
                    Iu = _mm256_add_epi32(Iu, _mm256_set1_epi32(128 * xs[t * nb + b]));
                const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(Iu), sc);
                acc[h][t] = _mm256_fmadd_ps(f, _mm256_set1_ps(dx[t * nb + b]), acc[h][t]);
                acc[h][t] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dxs[t * nb + b]), acc[h][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < H; h++) {
        const int r0 = (h / 2) * PK_ROWS + (h % 2) * 8;  /* y's first row of this half */
        const int n = n_valid - r0 < 8 ? n_valid - r0 : 8;
#pragma GCC unroll 3
        for (int t = 0; t < T; t++) {
            float *dst = y + (t0 + t) * y_stride + r0;
            if (n == 8) {
                _mm256_storeu_ps(dst, acc[h][t]);
            } else if (n > 0) {
                float tmp[8];
                _mm256_storeu_ps(tmp, acc[h][t]);
                memcpy(dst, tmp, (size_t)n * 4);
            }
        }
    }
}

#define PK_TILE2(H, T) pk_tile_avx2(fmt, neg_zero, q8, w, g_stride, H, T, x, t, nb, y, \
                                    y_stride, n_valid)
/* groups g0..g0+G (n_valid rows in all) against every row of x: a lone stream's rows
 * as 4 halves (two groups) at once, wider steps one group by 3 rows */
static inline __attribute__((always_inline)) void pk_groups_avx2(
    int fmt, float neg_zero, int q8, const uint8_t *w, int64_t g_stride, int G,
    int n_valid, const pk_x *x, int64_t rows, float *y, int64_t y_stride)
{
    const int64_t nb = x->nb;
    int64_t t = 0;
    if (G == 2 && rows <= 2) {
        for (; t < rows; t++)
            PK_TILE2(4, 1);
        return;
    }
    for (int g = 0; g < G; g++, w += g_stride, y += PK_ROWS, n_valid -= PK_ROWS) {
        for (t = 0; t + 3 <= rows; t += 3)
            PK_TILE2(2, 3);
        switch (rows - t) {
        case 1: PK_TILE2(2, 1); break;
        case 2: PK_TILE2(2, 2); break;
        default: break;
        }
    }
}
#undef PK_TILE2

static void pk_run_avx2(int type, const uint8_t *w, int64_t g_stride, int G, int n_valid,
                        const pk_x *x, int64_t rows, float *y, int64_t y_stride)
{
#define PK_RUN(FMT, NZ, Q8) pk_groups_avx2(FMT, NZ, Q8, w, g_stride, G, n_valid, x, rows, y, \
                                           y_stride)
    switch (type) {
    case T_Q8_0: PK_RUN(PK_SYM16, -128.0f, 1); break;
    case T_Q5_0: PK_RUN(PK_SYM16, -16.0f, 0); break;
    case T_Q4_0: PK_RUN(PK_SYM16 | PK_NIB, -8.0f, 0); break;
    case T_Q5_1: PK_RUN(PK_ASYM16, 0.0f, 0); break;
    case T_Q4_1: PK_RUN(PK_ASYM16 | PK_NIB, 0.0f, 0); break;
    case T_Q5_K: PK_RUN(PK_ASYM32, 0.0f, 0); break;
    case T_Q6_K: PK_RUN(PK_Q6K, 0.0f, 0); break;
    default: PK_RUN(PK_ASYM32 | PK_NIB, 0.0f, 0); break;  /* T_Q4_K */
    }
#undef PK_RUN
}
#endif

/* the loop this build runs on this CPU: PK_VNNI_LOOP, PK_AVX2_LOOP or the portable one
 * (force_portable: the tests' reference) */
enum { PK_PORTABLE_LOOP = 0, PK_AVX2_LOOP = 1, PK_VNNI_LOOP = 2 };

static int pk_loop(int force_portable)
{
    if (force_portable)
        return PK_PORTABLE_LOOP;
#if defined(__AVX512F__)
    if (__builtin_cpu_supports("avx512vnni"))
        return PK_VNNI_LOOP;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return PK_AVX2_LOOP;
#else
    return PK_PORTABLE_LOOP;
#endif
}

/* which loop the repacked path runs here: 2 AVX512-VNNI, 1 AVX2, 0 the portable one */
int quant_packed_loop(void)
{
    return pk_loop(0);
}

/* the repacked segments' rows of y [rows][out]: x quantized once, then pairs of row
 * groups across the threads. seg[s].packed is the repacked weight or NULL. 0, or -2
 * without memory. */
typedef struct {
    int type;
    const uint8_t *packed;
    int64_t first, rows;
} pk_segment;

/* buffers for `rows` rows of x quantized; 0, or -1 without memory (all freed) */
static int pk_x_alloc(pk_x *xs, int64_t rows, int64_t in)
{
    const int64_t nb = in / QK;
    *xs = (pk_x){malloc((size_t)(rows * in)), malloc((size_t)(rows * nb) * 4),
                 malloc((size_t)(rows * nb) * 4), malloc((size_t)(rows * nb) * 4),
                 malloc((size_t)(rows * nb) * 8), in, nb};
    if (xs->q && xs->dx && xs->dxs && xs->s && xs->s16)
        return 0;
    free(xs->q); free(xs->dx); free(xs->dxs); free(xs->s); free(xs->s16);
    xs->q = NULL;
    return -1;
}

static void pk_x_free(pk_x *xs)
{
    if (xs->q == NULL)
        return;
    free(xs->q); free(xs->dx); free(xs->dxs); free(xs->s); free(xs->s16);
}

static void pk_quantize_rows(const float *x, int64_t x_stride, const pk_x *xs, int64_t i0,
                             int64_t i1)
{
    for (int64_t i = i0; i < i1; i++) {  /* i: row * nb + block */
        const int64_t t = i / xs->nb, b = i % xs->nb;
        pk_quantize_block(x + t * x_stride + b * QK, xs->q + t * xs->in + b * QK, xs->dx + i,
                          xs->dxs + i, xs->s + i, xs->s16 + 2 * i);
    }
}

/* x of at most this many values is quantized by every thread for itself: no barrier
 * between quantizing and the matmul, which on a lone stream's 121 small calls a token
 * is the cost (a thread descheduled at a barrier stalls the other) */
#define PK_PRIVATE_X 16384
#define PK_FEW_ROWS 8

static int pk_linear(const float *x, int64_t x_stride, int64_t rows, const pk_segment *seg,
                     int nseg, int64_t in, float *y, int64_t y_stride, int num_threads,
                     int force_portable)
{
    const int64_t nb = in / QK;
    const int private_x = rows * in <= PK_PRIVATE_X;
    pk_x shared = {0};
    if (!private_x && pk_x_alloc(&shared, rows, in))
        return -2;
    const int loop = pk_loop(force_portable);
    /* work items: row groups, per segment. Up to PK_FEW_ROWS rows of x, one group an
     * item: each thread then reads its share of the weight as one sequential stream,
     * which the hardware prefetcher follows best (a lone stream's pass over SmolLM2 Q8_0
     * 7.2 -> 4.8 ms against pairs of groups with software prefetch). Wider, pairs:
     * two groups by four rows a tile measured faster than one by eight (64 rows ~7%). */
    const int per = rows <= PK_FEW_ROWS ? 1 : 2;
    int64_t start[MAX_SEGMENTS + 1];
    start[0] = 0;
    for (int s = 0; s < nseg; s++) {
        const int64_t groups = seg[s].packed ? (seg[s].rows + PK_ROWS - 1) / PK_ROWS : 0;
        start[s + 1] = start[s] + (groups + per - 1) / per;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        pk_x own = {0};
        const pk_x *xs = &shared;
        if (private_x) {
            if (pk_x_alloc(&own, rows, in) == 0) {
                pk_quantize_rows(x, x_stride, &own, 0, rows * nb);
                xs = &own;
            } else {
#pragma omp atomic write
                failed = 1;
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < rows * nb; i++)
                pk_quantize_rows(x, x_stride, &shared, i, i + 1);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < start[nseg]; item++) {
            if (xs->q == NULL)
                continue;
            int s = 0;
            while (item >= start[s + 1])
                s++;
            const int64_t g0 = per * (item - start[s]);
            const int64_t groups = (seg[s].rows + PK_ROWS - 1) / PK_ROWS;
            const int G = g0 + per <= groups ? per : 1;
            const int64_t last_first = (g0 + G - 1) * PK_ROWS;
            const int n_last = (int)(seg[s].rows - last_first < PK_ROWS
                                     ? seg[s].rows - last_first : PK_ROWS);
            const int64_t g_stride = nb * pk_block_bytes(pk_format(seg[s].type));
            const uint8_t *w = seg[s].packed + g0 * g_stride;
            float *yo = y + seg[s].first + g0 * PK_ROWS;
#if defined(__AVX512F__)
            if (loop == PK_VNNI_LOOP) {
                pk_run_vnni(seg[s].type, w, g_stride, G, n_last, xs, rows, yo, y_stride);
                continue;
            }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            if (loop == PK_AVX2_LOOP) {
                pk_run_avx2(seg[s].type, w, g_stride, G, (G - 1) * PK_ROWS + n_last, xs,
                            rows, yo, y_stride);
                continue;
            }
#endif
            (void)loop;
            for (int g = 0; g < G; g++)
                pk_group_portable(seg[s].type, w + g * g_stride, g == G - 1 ? n_last : PK_ROWS,
                                  xs, rows, yo + g * PK_ROWS, y_stride);
        }
        pk_x_free(&own);
    }
    pk_x_free(&shared);
    return failed ? -2 : 0;
}

#endif
