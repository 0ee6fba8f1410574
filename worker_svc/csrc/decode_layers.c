/* Every decoder layer of a CPU decode step of a few tokens, in one call.
 *
 * A step of one to a few tokens runs about ten kernels a layer (norms, the four
 * matmuls, RoPE and the KV write, attention, SiLU), each a few tens of microseconds on
 * the default model; called one by one from Python, each also pays a ctypes call, a
 * tensor allocation and the interpreter between them (an int8 step of one token on the
 * default model: 15.7 ms that way, 11.7 ms in one call; docs/worker.md).
 * This loop calls the very same kernels (their own libraries, passed in as function
 * pointers, so each keeps its compiler flags and its bits) in the same order as
 * DecoderModel._forward_fused, into buffers the caller allocated once for the step.
 * It has no arithmetic of its own: its output is the Python loop's, bit for bit.
 *
 * Layout of the arrays (int64, pointers as integers):
 *   fns     small_linear_f32, small_linear_q8, rms_norm_f32, add_rms_norm_f32,
 *           rope_write_kv_f32, silu_mul_f32, paged_decode_f32
 *   dims    layers, hidden, num_heads, num_kv_heads, head_dim, inter, num_positions,
 *           num_blocks, block_size, weights_int8, weights_bf16, threads
 *   weights per layer qkv, o_proj, gate_up, down (int8: their q), [layers][4]
 *   scales  int8 scales of the same, [layers][4] (unused for fp32/bf16)
 *   norms   per layer input_norm, post_norm, [layers][2]
 *   kv      per layer its KV cache [2][num_blocks][block_size][num_kv_heads][head_dim]
 *   attn    the step's decode plan: block_table, bt_stride, seq_lens, q_rows, scratch,
 *           max_seq_len, num_decodes
 * Buffers (fp32, rows each): h [hidden], qkv [(heads + 2 kv_heads) head_dim],
 * att [heads head_dim], o [hidden], gate_up [2 inter], act [inter], delta [hidden].
 * residual [rows][hidden] is updated in place; on return delta holds the last layer's
 * MLP output, which the caller adds (as the Python loop does).
 * Returns 0; -1 for a position or KV slot out of range (rope_write_kv_f32's check,
 * before the first layer writes anything of it); -2 if an int8 matmul found no memory
 * for its int16 copy of x. */
#include <stdint.h>

typedef void (*linear_f32_fn)(const float *, int64_t, int64_t, const void *, int, int64_t,
                              int64_t, float *, int);
typedef int (*linear_q8_fn)(const float *, int64_t, int64_t, const int8_t *, const float *,
                            int64_t, int64_t, float *, int);
typedef void (*rms_norm_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t,
                            float);
typedef void (*add_rms_norm_fn)(float *, const float *, const float *, float *, int64_t,
                                int64_t, float);
typedef int (*rope_fn)(float *, int64_t, int64_t, int64_t, int64_t, int64_t, const float *,
                       const float *, const int64_t *, int64_t, float *, int64_t,
                       const int64_t *);
typedef void (*silu_fn)(const float *, float *, int64_t, int64_t);
typedef void (*decode_fn)(const float *, int64_t, int64_t, const float *, int64_t, int64_t,
                          int64_t, int64_t, const int64_t *, int64_t, const int64_t *,
                          const int64_t *, int64_t, float, float *, int64_t, int64_t, int64_t,
                          int64_t, float *, int64_t, int64_t, int);

#define PTR(T, v) ((T)(intptr_t)(v))

int decode_layers_f32(const int64_t *fns, const int64_t *dims, const int64_t *weights,
                      const int64_t *scales, const int64_t *norms, const int64_t *kv,
                      const int64_t *attn, float scale, float eps, int64_t rows,
                      const int64_t *positions, const int64_t *slot_mapping,
                      const float *cos_table, const float *sin_table, float *residual,
                      float *h, float *qkv, float *att, float *o, float *gate_up, float *act,
                      float *delta)
{
    const linear_f32_fn linear_f32 = PTR(linear_f32_fn, fns[0]);
    const linear_q8_fn linear_q8 = PTR(linear_q8_fn, fns[1]);
    const rms_norm_fn rms_norm = PTR(rms_norm_fn, fns[2]);
    const add_rms_norm_fn add_rms_norm = PTR(add_rms_norm_fn, fns[3]);
    const rope_fn rope_write_kv = PTR(rope_fn, fns[4]);
    const silu_fn silu_mul = PTR(silu_fn, fns[5]);
    const decode_fn paged_decode = PTR(decode_fn, fns[6]);
    const int64_t layers = dims[0], hidden = dims[1], num_heads = dims[2];
    const int64_t num_kv_heads = dims[3], head_dim = dims[4], inter = dims[5];
    const int64_t num_positions = dims[6], num_blocks = dims[7], block_size = dims[8];
    const int int8 = (int)dims[9], bf16 = (int)dims[10], threads = (int)dims[11];
    const int64_t nq = num_heads * head_dim;
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
    /* (x, its width, weight j of layer i, out features, y) -> 0 or -2 */
#define LINEAR(x, in, i, j, out, y)                                                        \
    do {                                                                                   \
        const int64_t w_ = weights[(i) * 4 + (j)];                                         \
        if (int8) {                                                                        \
            if (linear_q8((x), (in), rows, PTR(const int8_t *, w_),                        \
                          PTR(const float *, scales[(i) * 4 + (j)]), (out), (in), (y),      \
                          threads))                                                        \
                return -2;                                                                 \
        } else {                                                                           \
            linear_f32((x), (in), rows, PTR(const void *, w_), bf16, (out), (in), (y),     \
                       threads);                                                           \
        }                                                                                  \
    } while (0)

    for (int64_t i = 0; i < layers; i++) {
        const float *input_norm = PTR(const float *, norms[2 * i]);
        const float *post_norm = PTR(const float *, norms[2 * i + 1]);
        float *cache = PTR(float *, kv[i]);
        if (i == 0)
            rms_norm(residual, hidden, input_norm, h, rows, hidden, eps);
        else
            add_rms_norm(residual, delta, input_norm, h, rows, hidden, eps);
        LINEAR(h, hidden, i, 0, qkv_width, qkv);
        if (rope_write_kv(qkv, qkv_width, rows, num_heads, num_kv_heads, head_dim, cos_table,
                          sin_table, positions, num_positions, cache, num_blocks * block_size,
                          slot_mapping))
            return -1;
        paged_decode(qkv, qkv_width, head_dim, cache, num_blocks, block_size, num_kv_heads,
                     head_dim, PTR(const int64_t *, attn[0]), attn[1],
                     PTR(const int64_t *, attn[2]), PTR(const int64_t *, attn[3]), num_heads,
                     scale, att, nq, head_dim, 0, attn[6], PTR(float *, attn[4]), attn[5], 0,
                     threads);
        LINEAR(att, nq, i, 1, hidden, o);
        add_rms_norm(residual, o, post_norm, h, rows, hidden, eps);
        LINEAR(h, hidden, i, 2, 2 * inter, gate_up);
        silu_mul(gate_up, act, rows, inter);
        LINEAR(act, inter, i, 3, hidden, delta);
    }
#undef LINEAR
    return 0;
}

/* Gemma 3's layers (gemma.py's Model.layer), the same way: each norm scales by its
 * weight, which the caller passes as (1 + w) in fp32 (the reference adds the 1 in fp32
 * too); q and k heads normed before RoPE; the attention's output normed before the
 * residual add, the MLP's input and output normed; GeGLU; each layer its own RoPE
 * tables (sliding layers rotate with their own base) and sliding window (0: none).
 *   fns     unused, quant_linear, rms_norm_f32, add_rms_norm_f32, rope_write_kv_f32,
 *           gelu_tanh_mul_f32, paged_decode_f32
 *   dims    layers, hidden, num_heads, num_kv_heads, head_dim, inter, num_positions,
 *           num_blocks, block_size, threads
 *   weights per layer qkv, o_proj, gate_up, down descriptors, [layers][4]
 *   norms   per layer input, post-attention, pre-feed-forward, post-feed-forward, q, k
 *           norms (1 + w), [layers][6]
 *   ropes   per layer its cos and sin tables [num_positions][head_dim], [layers][2]
 *   windows per layer its sliding window, 0 for a global layer
 * kv, attn and the buffers as decode_layers_f32's; on return delta holds the last
 * layer's normed MLP output, which the caller adds. Returns 0, -1 or -2 as it does. */
int decode_layers_gemma_f32(const int64_t *fns, const int64_t *dims, const int64_t *weights,
                            const int64_t *norms, const int64_t *ropes,
                            const int64_t *windows, const int64_t *kv, const int64_t *attn,
                            float scale, float eps, int64_t rows, const int64_t *positions,
                            const int64_t *slot_mapping, float *residual, float *h,
                            float *qkv, float *att, float *o, float *gate_up, float *act,
                            float *delta)
{
    const linear_q8_fn linear = PTR(linear_q8_fn, fns[1]);
    const rms_norm_fn rms_norm = PTR(rms_norm_fn, fns[2]);
    const add_rms_norm_fn add_rms_norm = PTR(add_rms_norm_fn, fns[3]);
    const rope_fn rope_write_kv = PTR(rope_fn, fns[4]);
    const silu_fn gelu_mul = PTR(silu_fn, fns[5]);
    const decode_fn paged_decode = PTR(decode_fn, fns[6]);
    const int64_t layers = dims[0], hidden = dims[1], num_heads = dims[2];
    const int64_t num_kv_heads = dims[3], head_dim = dims[4], inter = dims[5];
    const int64_t num_positions = dims[6], num_blocks = dims[7], block_size = dims[8];
    const int threads = (int)dims[9];
    const int64_t nq = num_heads * head_dim;
    const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
#define LINEAR(x, in, i, j, out, y)                                                        \
    do {                                                                                   \
        if (linear((x), (in), rows, PTR(const int8_t *, weights[(i) * 4 + (j)]), 0,        \
                   (out), (in), (y), threads))                                             \
            return -2;                                                                     \
    } while (0)

    for (int64_t i = 0; i < layers; i++) {
        const int64_t *nw = norms + 6 * i;
        float *cache = PTR(float *, kv[i]);
        if (i == 0)
            rms_norm(residual, hidden, PTR(const float *, nw[0]), h, rows, hidden, eps);
        else
            add_rms_norm(residual, delta, PTR(const float *, nw[0]), h, rows, hidden, eps);
        LINEAR(h, hidden, i, 0, qkv_width, qkv);
        for (int64_t r = 0; r < rows; r++) {  /* per-head norms, in place */
            float *row = qkv + r * qkv_width;
            rms_norm(row, head_dim, PTR(const float *, nw[4]), row, num_heads, head_dim, eps);
            rms_norm(row + nq, head_dim, PTR(const float *, nw[5]), row + nq, num_kv_heads,
                     head_dim, eps);
        }
        if (rope_write_kv(qkv, qkv_width, rows, num_heads, num_kv_heads, head_dim,
                          PTR(const float *, ropes[2 * i]), PTR(const float *, ropes[2 * i + 1]),
                          positions, num_positions, cache, num_blocks * block_size,
                          slot_mapping))
            return -1;
        paged_decode(qkv, qkv_width, head_dim, cache, num_blocks, block_size, num_kv_heads,
                     head_dim, PTR(const int64_t *, attn[0]), attn[1],
                     PTR(const int64_t *, attn[2]), PTR(const int64_t *, attn[3]), num_heads,
                     scale, att, nq, head_dim, 0, attn[6], PTR(float *, attn[4]), attn[5],
                     windows[i], threads);
        LINEAR(att, nq, i, 1, hidden, o);
        rms_norm(o, hidden, PTR(const float *, nw[1]), o, rows, hidden, eps);
        add_rms_norm(residual, o, PTR(const float *, nw[2]), h, rows, hidden, eps);
        LINEAR(h, hidden, i, 2, 2 * inter, gate_up);
        gelu_mul(gate_up, act, rows, inter);
        LINEAR(act, inter, i, 3, hidden, delta);
        rms_norm(delta, hidden, PTR(const float *, nw[3]), delta, rows, hidden, eps);
    }
#undef LINEAR
    return 0;
}
