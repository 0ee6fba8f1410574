/* Fused element-wise parts of a decoder layer on CPU, fp32, row-major [rows][dim].
 *
 * Each function replaces several small torch ops (one dispatch, allocation and pass
 * over memory each); at batch 1 those dominate everything but the matrix multiplies.
 * Built with -ffp-contract=off: every product and sum is rounded exactly where the
 * transformers reference rounds it (no fused multiply-adds), so RoPE and the residual
 * adds are bit-identical to it; the RMSNorm mean of squares is summed in double, and
 * SiLU's exponential (exp_f32.h) is within a few ulp of torch's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_f32.h"

static float inv_rms(const float *x, int64_t dim, float eps)
{
    double sum = 0.0;
#pragma omp simd reduction(+:sum)
    for (int64_t i = 0; i < dim; i++)
        sum += (double)x[i] * (double)x[i];
    const float mean = (float)(sum / (double)dim);
    return 1.0f / sqrtf(mean + eps);
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)), per row. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                  int64_t rows, int64_t dim, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        const float inv = inv_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = weight[i] * (xr[i] * inv);
    }
}

/* residual += delta (in place), then out = rms_norm(residual): the residual stream's
 * add and the next norm in one pass. */
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out,
                      int64_t rows, int64_t dim, float eps)
{
    for (int64_t r = 0; r < rows; r++) {
        float *xr = residual + r * dim;
        const float *d = delta + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            xr[i] = xr[i] + d[i];
        const float inv = inv_rms(xr, dim, eps);
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = weight[i] * (xr[i] * inv);
    }
}

/* RoPE on the q and k heads of each row of qkv [rows][qkv_stride] (q heads, then k
 * heads, then v heads), in place, then the row's k and v into its cache slot.
 * cos/sin are [max_positions][head_dim] tables, sin with rotate_half's sign folded in:
 * x * cos + roll(x, half) * sin equals the reference's x * cos + rotate_half(x) * sin.
 * kv_cache is one layer's [2][num_slots][num_kv_heads][head_dim]; slot < 0 skips.
 * Returns 0, or -1 with nothing written if a position or slot is out of range. */
int rope_write_kv_f32(float *qkv, int64_t qkv_stride, int64_t rows, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, const float *cos_table,
                      const float *sin_table, const int64_t *positions,
                      int64_t num_positions, float *kv_cache, int64_t num_slots,
                      const int64_t *slot_mapping)
{
    const int64_t half = head_dim / 2, kv_width = num_kv_heads * head_dim;
    float rotated[512];  /* head_dim <= 512, checked by the caller */
    float *v_cache = kv_cache + num_slots * kv_width;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= num_positions || slot_mapping[r] >= num_slots)
            return -1;
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * qkv_stride;
        const float *c = cos_table + positions[r] * head_dim;
        const float *s = sin_table + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            float *x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                rotated[i] = x[i + half];
                rotated[i + half] = x[i];
            }
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++)
                x[i] = x[i] * c[i] + rotated[i] * s[i];
        }
        const int64_t slot = slot_mapping[r];
        if (slot < 0)
            continue;
        memcpy(kv_cache + slot * kv_width, row + num_heads * head_dim,
               sizeof(float) * kv_width);
        memcpy(v_cache + slot * kv_width, row + (num_heads + num_kv_heads) * head_dim,
               sizeof(float) * kv_width);
    }
    return 0;
}

/* out = silu(gate) * up for gate_up rows [gate (inter) | up (inter)]. */
void silu_mul_f32(const float *restrict gate_up, float *restrict out, int64_t rows,
                  int64_t inter)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gate_up + r * 2 * inter;
        const float *restrict u = g + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++)
            o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* out = gelu_tanh(gate) * up for gate_up rows [gate (inter) | up (inter)]: GeGLU with
 * torch's tanh approximation, 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3),
 * computed as g / (1 + e^(-2u)) (the same function: 0.5 (1 + tanh(u)) is the logistic
 * of 2u), so the exponential is exp_f32's and the loop vectorizes; within a few ulp of
 * torch's F.gelu(approximate="tanh"). */
void gelu_tanh_mul_f32(const float *restrict gate_up, float *restrict out, int64_t rows,
                       int64_t inter)
{
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gate_up + r * 2 * inter;
        const float *restrict u = g + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = g[i], inner = k0 * (x + k1 * x * x * x);
            o[i] = x / (1.0f + exp_f32(-2.0f * inner)) * u[i];
        }
    }
}
