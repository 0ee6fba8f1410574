/* Paged decode attention on CPU, fp32: one query token per request, keys and values
 * read in place from the block-paged cache (no gather copy, no padding).
 * Work items are requests, all heads of one together: a slot's keys (and values) of
 * every KV head sit side by side, so each is read once, as one run. A caller may split
 * the requests [begin, end) across threads. Layout: kv_cache
 * [2][num_blocks][block_size][num_kv_heads][head_dim]. Loops run block by block (no
 * division per position); the softmax's exp is the vectorizable exp_f32. */
#include <math.h>
#include <stdint.h>

#include "exp_f32.h"

void paged_decode_f32(const float *query, int64_t q_tok_stride, int64_t q_head_stride,
                      const float *kv_cache, int64_t num_blocks, int64_t block_size,
                      int64_t num_kv_heads, int64_t head_dim,
                      const int64_t *block_table, int64_t bt_stride,
                      const int64_t *seq_lens, const int64_t *q_rows, int64_t num_heads,
                      float scale, float *out, int64_t o_tok_stride, int64_t o_head_stride,
                      int64_t begin, int64_t end, float *scores /* num_heads * max_seq_len */,
                      float *acc /* num_heads * head_dim */)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * slot_stride;
    const float *v_cache = kv_cache + num_blocks * block_stride;
    for (int64_t r = begin; r < end; r++) {
        const int64_t seq_len = seq_lens[r];
        const int64_t num_seq_blocks = (seq_len + block_size - 1) / block_size;
        const int64_t *table = block_table + r * bt_stride;
        const float *q = query + q_rows[r] * q_tok_stride;

        for (int64_t b = 0; b < num_seq_blocks; b++) {
            const int64_t first = b * block_size;
            const int64_t n = seq_len - first < block_size ? seq_len - first : block_size;
            const float *k_block = kv_cache + table[b] * block_stride;
            for (int64_t o = 0; o < n; o++) {
                const float *k_slot = k_block + o * slot_stride;
                for (int64_t h = 0, hq = 0; h < num_kv_heads; h++) {
                    const float *k = k_slot + h * head_dim;
                    for (int64_t g = 0; g < group; g++, hq++) {
                        const float *qh = q + hq * q_head_stride;
                        float dot = 0.0f;
#pragma omp simd reduction(+:dot)
                        for (int64_t i = 0; i < head_dim; i++)
                            dot += qh[i] * k[i];
                        scores[hq * seq_len + first + o] = dot * scale;
                    }
                }
            }
        }

        for (int64_t hq = 0; hq < num_heads; hq++) {
            float *sc = scores + hq * seq_len;
            float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max:max)
            for (int64_t s = 0; s < seq_len; s++)
                max = sc[s] > max ? sc[s] : max;
#pragma omp simd reduction(+:sum)
            for (int64_t s = 0; s < seq_len; s++) {
                sc[s] = exp_f32(sc[s] - max);
                sum += sc[s];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t s = 0; s < seq_len; s++)
                sc[s] *= inv;
            float *a = acc + hq * head_dim;
            for (int64_t i = 0; i < head_dim; i++)
                a[i] = 0.0f;
        }

        for (int64_t b = 0; b < num_seq_blocks; b++) {
            const int64_t first = b * block_size;
            const int64_t n = seq_len - first < block_size ? seq_len - first : block_size;
            const float *v_block = v_cache + table[b] * block_stride;
            for (int64_t o = 0; o < n; o++) {
                const float *v_slot = v_block + o * slot_stride;
                for (int64_t h = 0, hq = 0; h < num_kv_heads; h++) {
                    const float *v = v_slot + h * head_dim;
                    for (int64_t g = 0; g < group; g++, hq++) {
                        const float p = scores[hq * seq_len + first + o];
                        float *a = acc + hq * head_dim;
#pragma omp simd
                        for (int64_t i = 0; i < head_dim; i++)
                            a[i] += p * v[i];
                    }
                }
            }
        }

        for (int64_t hq = 0; hq < num_heads; hq++) {
            float *o = out + q_rows[r] * o_tok_stride + hq * o_head_stride;
            const float *a = acc + hq * head_dim;
            for (int64_t i = 0; i < head_dim; i++)
                o[i] = a[i];
        }
    }
}
