/* Decode attention on the CPU: a few query rows per key/value head against slot cache rows.
 *
 * Why not torch's CPU flash attention: at decode there are G = heads / kv_heads query rows
 * (3 for SmolLM2) per key/value head, and its blocked kernel spends most of its time on block
 * set-up, not on reading keys and values (~4-5 GB/s measured on one core). Here each (row, kv
 * head) reads its keys once to score all G queries, takes a softmax in fp32, and reads its
 * values once to sum them; columns past a row's length are never read.
 *
 * Layout (element strides, so the caller passes views of the engine's cache as they are):
 *   q     [B, KV, G, D]  contiguous
 *   cache row b, key head h, column j, dim d at
 *         cache + b * row_stride + h * head_stride + j * D + d
 *   value head h is key head KV + h (keys and values share one buffer, keys first)
 *   lengths[b]: columns row b attends to (a prefix)
 *   out   [B, KV, G, D]  contiguous
 * Scores and sums are fp32; bf16 inputs are widened exactly, the output rounds to nearest even.
 *
 * Built with -march=native on first use; `relayrl_decode_attention_ready` says whether this
 * build has the AVX-512 path (without it the caller keeps torch's attention).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256

#if defined(__AVX512F__)
#include <immintrin.h>

int relayrl_decode_attention_ready(void) { return 1; }

static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline void store16_bf16(uint16_t *p, __m512 x) {
    /* round to nearest even, as torch's float -> bfloat16 cast; NaN kept quiet */
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

static inline void store16_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }

/* exp for x <= 0 (scores minus their max), ~1 ulp over the range that matters; below -87 -> 0 */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(~tiny, p, _mm512_castsi512_ps(e));
}

/* One kernel body per storage type: T the element type, LOAD/STORE its 16-lane accessors. */
#define DEFINE_DECODE_ATTENTION(NAME, T, LOAD, STORE)                                          \
    static inline __attribute__((always_inline)) int NAME##_body(                               \
        const T *q, const T *cache, T *out, const int64_t *lengths, int64_t B, int64_t KV,      \
        const int64_t G, const int64_t V, int64_t row_stride, int64_t head_stride, float scale) { \
        const int64_t D = V * 16;                                                               \
        int64_t longest = 0;                                                                    \
        for (int64_t b = 0; b < B; b++) longest = lengths[b] > longest ? lengths[b] : longest;  \
        const int64_t padded = (longest + 15) / 16 * 16;                                        \
        float *scores = (float *)aligned_alloc(64, (size_t)(G * padded + 16) * sizeof(float));  \
        if (scores == NULL) return -2;                                                          \
        for (int64_t b = 0; b < B; b++) {                                                       \
            const int64_t n = lengths[b];                                                       \
            for (int64_t h = 0; h < KV; h++) {                                                  \
                const T *keys = cache + b * row_stride + h * head_stride;                       \
                const T *values = cache + b * row_stride + (KV + h) * head_stride;              \
                const T *qh = q + ((b * KV + h) * G) * D;                                       \
                T *oh = out + ((b * KV + h) * G) * D;                                           \
                if (n <= 0) {                                                                   \
                    memset(oh, 0, (size_t)(G * D) * sizeof(T));                                \
                    continue;                                                                   \
                }                                                                               \
                __m512 qv[MAX_G][MAX_D / 16];                                                   \
                for (int64_t g = 0; g < G; g++)                                                 \
                    for (int64_t v = 0; v < V; v++)                                             \
                        qv[g][v] = _mm512_mul_ps(LOAD(qh + g * D + v * 16), _mm512_set1_ps(scale)); \
                /* scores[g][j] = q_g . k_j */                                                  \
                for (int64_t j = 0; j < n; j++) {                                               \
                    const T *k = keys + j * D;                                                  \
                    __m512 acc[MAX_G];                                                          \
                    __m512 k0 = LOAD(k);                                                        \
                    for (int64_t g = 0; g < G; g++) acc[g] = _mm512_mul_ps(qv[g][0], k0);       \
                    for (int64_t v = 1; v < V; v++) {                                           \
                        __m512 kv = LOAD(k + v * 16);                                           \
                        for (int64_t g = 0; g < G; g++)                                         \
                            acc[g] = _mm512_fmadd_ps(qv[g][v], kv, acc[g]);                     \
                    }                                                                           \
                    for (int64_t g = 0; g < G; g++) scores[g * padded + j] = _mm512_reduce_add_ps(acc[g]); \
                }                                                                               \
                /* softmax per query row, in fp32 */                                            \
                float inv_sum[MAX_G];                                                           \
                for (int64_t g = 0; g < G; g++) {                                               \
                    float *s = scores + g * padded;                                             \
                    __m512 mx = _mm512_set1_ps(-__builtin_inff());                              \
                    for (int64_t j = 0; j < n; j += 16) {                                       \
                        __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1); \
                        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + j));    \
                    }                                                                           \
                    __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));                      \
                    __m512 sum = _mm512_setzero_ps();                                           \
                    for (int64_t j = 0; j < n; j += 16) {                                       \
                        __mmask16 m = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1); \
                        __m512 e = _mm512_maskz_mov_ps(                                         \
                            m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top)));     \
                        _mm512_mask_storeu_ps(s + j, m, e);                                     \
                        sum = _mm512_add_ps(sum, e);                                            \
                    }                                                                           \
                    inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);                              \
                }                                                                               \
                /* out_g = sum_j p_gj v_j / sum_j p_gj */                                       \
                __m512 o[MAX_G][MAX_D / 16];                                                    \
                for (int64_t g = 0; g < G; g++)                                                 \
                    for (int64_t v = 0; v < V; v++) o[g][v] = _mm512_setzero_ps();              \
                for (int64_t j = 0; j < n; j++) {                                               \
                    const T *val = values + j * D;                                              \
                    for (int64_t v = 0; v < V; v++) {                                           \
                        __m512 x = LOAD(val + v * 16);                                          \
                        for (int64_t g = 0; g < G; g++)                                         \
                            o[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * padded + j]), x, o[g][v]); \
                    }                                                                           \
                }                                                                               \
                for (int64_t g = 0; g < G; g++)                                                 \
                    for (int64_t v = 0; v < V; v++)                                             \
                        STORE(oh + g * D + v * 16, _mm512_mul_ps(o[g][v], _mm512_set1_ps(inv_sum[g]))); \
            }                                                                                   \
        }                                                                                       \
        free(scores);                                                                           \
        return 0;                                                                               \
    }                                                                                           \
    int NAME(const T *q, const T *cache, T *out, const int64_t *lengths, int64_t B, int64_t KV, \
             int64_t G, int64_t D, int64_t row_stride, int64_t head_stride, float scale) {      \
        if (G < 1 || G > MAX_G || D > MAX_D || D % 16 != 0) return -1;                          \
        /* the common shapes get their own copy, loops unrolled and queries held in registers */ \
        if (G == 3 && D == 64)                                                                  \
            return NAME##_body(q, cache, out, lengths, B, KV, 3, 4, row_stride, head_stride, scale); \
        if (G == 4 && D == 64)                                                                  \
            return NAME##_body(q, cache, out, lengths, B, KV, 4, 4, row_stride, head_stride, scale); \
        if (G == 7 && D == 64)                                                                  \
            return NAME##_body(q, cache, out, lengths, B, KV, 7, 4, row_stride, head_stride, scale); \
        if (G == 8 && D == 128)                                                                 \
            return NAME##_body(q, cache, out, lengths, B, KV, 8, 8, row_stride, head_stride, scale); \
        if (G == 4 && D == 128)                                                                 \
            return NAME##_body(q, cache, out, lengths, B, KV, 4, 8, row_stride, head_stride, scale); \
        return NAME##_body(q, cache, out, lengths, B, KV, G, D / 16, row_stride, head_stride, scale); \
    }

DEFINE_DECODE_ATTENTION(relayrl_decode_attention_bf16, uint16_t, load16_bf16, store16_bf16)
DEFINE_DECODE_ATTENTION(relayrl_decode_attention_f32, float, load16_f32, store16_f32)

#else

int relayrl_decode_attention_ready(void) { return 0; }

int relayrl_decode_attention_bf16(const uint16_t *q, const uint16_t *cache, uint16_t *out,
                                  const int64_t *lengths, int64_t B, int64_t KV, int64_t G,
                                  int64_t D, int64_t row_stride, int64_t head_stride, float scale) {
    return -3;
}

int relayrl_decode_attention_f32(const float *q, const float *cache, float *out,
                                 const int64_t *lengths, int64_t B, int64_t KV, int64_t G,
                                 int64_t D, int64_t row_stride, int64_t head_stride, float scale) {
    return -3;
}

#endif
