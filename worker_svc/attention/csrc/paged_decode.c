/* Paged decode attention on CPU, fp32: one query token per request, keys and values
 * read in place from the block-paged cache (no gather copy, no padding).
 * Work items are (request, kv head) pairs; a caller may split [begin, end) across
 * threads. Layout: kv_cache [2][num_blocks][block_size][num_kv_heads][head_dim]. */
#include <math.h>
#include <stdint.h>

void paged_decode_f32(const float *query, int64_t q_tok_stride, int64_t q_head_stride,
                      const float *kv_cache, int64_t num_blocks, int64_t block_size,
                      int64_t num_kv_heads, int64_t head_dim,
                      const int64_t *block_table, int64_t bt_stride,
                      const int64_t *seq_lens, const int64_t *q_rows, int64_t num_heads,
                      float scale, float *out, int64_t o_tok_stride, int64_t o_head_stride,
                      int64_t begin, int64_t end, float *scores /* group * max_seq_len */,
                      float *acc /* group * head_dim */)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const float *v_cache = kv_cache + num_blocks * block_size * slot_stride;
    for (int64_t item = begin; item < end; item++) {
        const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t seq_len = seq_lens[r];
        const int64_t *table = block_table + r * bt_stride;
        const float *q = query + q_rows[r] * q_tok_stride + h * group * q_head_stride;
        for (int64_t s = 0; s < seq_len; s++) {
            const int64_t slot = table[s / block_size] * block_size + s % block_size;
            const float *k = kv_cache + slot * slot_stride + h * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * q_head_stride;
                float dot = 0.0f;
#pragma omp simd reduction(+:dot)
                for (int64_t i = 0; i < head_dim; i++)
                    dot += qg[i] * k[i];
                scores[g * seq_len + s] = dot * scale;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *sc = scores + g * seq_len;
            float max = -INFINITY, sum = 0.0f;
            for (int64_t s = 0; s < seq_len; s++)
                max = sc[s] > max ? sc[s] : max;
            for (int64_t s = 0; s < seq_len; s++) {
                sc[s] = expf(sc[s] - max);
                sum += sc[s];
            }
            const float inv = 1.0f / sum;
            for (int64_t s = 0; s < seq_len; s++)
                sc[s] *= inv;
            for (int64_t i = 0; i < head_dim; i++)
                acc[g * head_dim + i] = 0.0f;
        }
        for (int64_t s = 0; s < seq_len; s++) {
            const int64_t slot = table[s / block_size] * block_size + s % block_size;
            const float *v = v_cache + slot * slot_stride + h * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * seq_len + s];
                float *a = acc + g * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++)
                    a[i] += p * v[i];
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *o = out + q_rows[r] * o_tok_stride + (h * group + g) * o_head_stride;
            for (int64_t i = 0; i < head_dim; i++)
                o[i] = acc[g * head_dim + i];
        }
    }
}
