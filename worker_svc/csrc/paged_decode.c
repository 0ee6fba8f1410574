/* Paged decode attention on CPU, fp32: one query token per request, keys and values
 * read in place from the block-paged cache (no gather copy, no padding).
 * Work items are (request, query head) pairs, split statically across the OpenMP
 * team: a lone request's 9 heads keep both cores busy instead of one, and the heads
 * of one KV group, which read the same keys and values, sit next to each other in
 * the order, so mostly one thread reads a group's run from memory and its other
 * heads find it in cache. Layout: kv_cache [2][num_blocks][block_size][num_kv_heads]
 * [head_dim]. Loops run block by block (no division per position); the softmax's exp
 * is the vectorizable exp_f32.
 *
 * Built with -fopenmp: in a worker the runtime is torch's own libgomp (small_linear.c
 * says why), so the region uses the compute threads' team. */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "exp_f32.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC_HEADS 1
/* the totals of 8 vectors, as one vector: lane j = sum of v[j]'s lanes */
static inline __m256 hsum8(const __m256 *v)
{
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#else
#define VEC_HEADS 0
#endif

/* scores sc[first + t] = q . k_t * scale for the n keys of one block */
static inline void block_scores(const float *qh, const float *k_block, int64_t n,
                                int64_t slot_stride, int64_t head_dim, float scale, float *sc)
{
    int64_t t = 0;
#if VEC_HEADS
    if (head_dim % 8 == 0) {  /* 8 keys at a time: one horizontal sum per 8 dots */
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; t + 8 <= n; t += 8) {
            __m256 acc[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_setzero_ps();
            for (int64_t c = 0; c < head_dim; c += 8) {
                const __m256 qc = _mm256_loadu_ps(qh + c);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(
                        qc, _mm256_loadu_ps(k_block + (t + j) * slot_stride + c), acc[j]);
            }
            _mm256_storeu_ps(sc + t, _mm256_mul_ps(hsum8(acc), vscale));
        }
    }
#endif
    for (; t < n; t++) {
        const float *k = k_block + t * slot_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+:dot)
        for (int64_t i = 0; i < head_dim; i++)
            dot += qh[i] * k[i];
        sc[t] = dot * scale;
    }
}

/* o = sum_t p_t v_t over the sequence's blocks (p = sc * inv) */
static void weighted_values(const float *v_cache, const int64_t *table, int64_t seq_len,
                            int64_t start, int64_t block_size, int64_t slot_stride,
                            int64_t block_stride, int64_t head_dim, const float *sc, float inv,
                            float *o, float *a)
{
    const int64_t num_seq_blocks = (seq_len + block_size - 1) / block_size;
    const int64_t first_block = start / block_size;
#if VEC_HEADS
    if (head_dim % 64 == 0) {  /* 64 dims a pass, their sums held in 8 registers */
        for (int64_t c = 0; c < head_dim; c += 64) {
            __m256 acc[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_setzero_ps();
            for (int64_t b = first_block; b < num_seq_blocks; b++) {
                const int64_t first = b * block_size;
                const int64_t n = seq_len - first < block_size ? seq_len - first : block_size;
                const float *v_block = v_cache + table[b] * block_stride + c;
                for (int64_t t = start > first ? start - first : 0; t < n; t++) {
                    const __m256 p = _mm256_set1_ps(sc[first + t] * inv);
                    const float *v = v_block + t * slot_stride;
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), acc[j]);
                }
            }
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                _mm256_storeu_ps(o + c + 8 * j, acc[j]);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < head_dim; i++)
        a[i] = 0.0f;
    for (int64_t b = first_block; b < num_seq_blocks; b++) {
        const int64_t first = b * block_size;
        const int64_t n = seq_len - first < block_size ? seq_len - first : block_size;
        const float *v_block = v_cache + table[b] * block_stride;
        for (int64_t t = start > first ? start - first : 0; t < n; t++) {
            const float *v = v_block + t * slot_stride;
            const float p = sc[first + t] * inv;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++)
                a[i] += p * v[i];
        }
    }
    for (int64_t i = 0; i < head_dim; i++)
        o[i] = a[i];
}

/* keys [start, seq_len) of one sequence: start is 0, or where a sliding window begins
 * (the keys behind it are never read: their blocks may be another request's now) */
static void one_head(const float *qh, const float *kv_cache, const float *v_cache,
                     int64_t block_size, int64_t slot_stride, int64_t block_stride,
                     int64_t head_dim, const int64_t *table, int64_t seq_len, int64_t start,
                     float scale, float *o, float *sc, float *a)
{
    const int64_t num_seq_blocks = (seq_len + block_size - 1) / block_size;
    for (int64_t b = start / block_size; b < num_seq_blocks; b++) {
        const int64_t first = b * block_size, lo = start > first ? start - first : 0;
        const int64_t n = seq_len - first < block_size ? seq_len - first : block_size;
        block_scores(qh, kv_cache + table[b] * block_stride + lo * slot_stride, n - lo,
                     slot_stride, head_dim, scale, sc + first + lo);
    }
    float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max:max)
    for (int64_t s = start; s < seq_len; s++)
        max = sc[s] > max ? sc[s] : max;
#pragma omp simd reduction(+:sum)
    for (int64_t s = start; s < seq_len; s++) {
        sc[s] = exp_f32(sc[s] - max);
        sum += sc[s];
    }
    weighted_values(v_cache, table, seq_len, start, block_size, slot_stride, block_stride,
                    head_dim, sc, 1.0f / sum, o, a);
}

/* Requests [begin, end) of the step; scratch holds num_threads * (max_seq_len +
 * head_dim) floats (each thread's scores and accumulator). window: each query sees the
 * keys at most window - 1 positions behind it (a sliding-window layer), 0 for all. */
void paged_decode_f32(const float *query, int64_t q_tok_stride, int64_t q_head_stride,
                      const float *kv_cache, int64_t num_blocks, int64_t block_size,
                      int64_t num_kv_heads, int64_t head_dim,
                      const int64_t *block_table, int64_t bt_stride,
                      const int64_t *seq_lens, const int64_t *q_rows, int64_t num_heads,
                      float scale, float *out, int64_t o_tok_stride, int64_t o_head_stride,
                      int64_t begin, int64_t end, float *scratch, int64_t max_seq_len,
                      int64_t window, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * slot_stride;
    const float *v_cache = kv_cache + num_blocks * block_stride;
    const int64_t items = (end - begin) * num_heads;
    const int threads = items < num_threads ? (int)(items > 0 ? items : 1) : num_threads;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num();
#else
        const int tid = 0;
#endif
        float *sc = scratch + tid * (max_seq_len + head_dim);
        float *a = sc + max_seq_len;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const int64_t r = begin + item / num_heads, hq = item % num_heads;
            const int64_t kvh = hq / group;
            one_head(query + q_rows[r] * q_tok_stride + hq * q_head_stride,
                     kv_cache + kvh * head_dim, v_cache + kvh * head_dim, block_size,
                     slot_stride, block_stride, head_dim, block_table + r * bt_stride,
                     seq_lens[r], window > 0 && seq_lens[r] > window ? seq_lens[r] - window : 0,
                     scale, out + q_rows[r] * o_tok_stride + hq * o_head_stride, sc, a);
        }
    }
}
