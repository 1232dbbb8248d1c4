/* One whole decode step of a Llama-family model on the CPU, in fp32, for AVX2 + FMA: every
 * layer in one call.
 *
 * Why: CPUs without AVX512-BF16 (most desktop and many cloud x86 cores: Zen 2/3, Intel client
 * parts) compute bf16 by converting around every product, ~85x slower than fp32 in a large
 * matmul (1.3 vs 108 GFLOP/s on a 2-core AVX2 EPYC), so the engine runs such models in fp32
 * there (`dtype="auto"`). In torch a decode step is then ~35 small ops per layer whose dispatch
 * costs as much as the arithmetic at small batches; decode_step.c removes that cost for bf16 on
 * AVX-512 machines, and this file does the same for fp32 with 8-lane AVX2 vectors, attention
 * included (decode_attention.c is AVX-512 only).
 *
 * Numerics follow `LeanDecoder.step` (engine/decoder.py) in fp32 op for op; what differs is the
 * order of fp32 sums inside a product, a norm or the attention, and the last bits of exp.
 *
 * Packed weight of an [N, K] product (N % 8 == 0): [N/8][K][8], i.e. element (n, k) at
 * ((n / 8) * K + k) * 8 + n % 8: one 32-byte load is eight outputs' weights for one input, so
 * a broadcast input feeds eight products with no horizontal sum.
 *
 * Built with -march=native -fopenmp on first use (kernels/cpu.py); the products split
 * their output blocks over `threads` OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define F32_MAX_G 16
#define F32_MAX_D 256

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int relayrl_decode_step_f32_ready(void) { return 1; }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one vector */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp for x <= 0, ~1 ulp over the range that matters; below -87 (and -inf) -> 0 */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Rows 0 .. MR (<= 4) of y = x @ W.T for three consecutive packed blocks of 8 outputs: twelve
 * accumulators, three weights and one broadcast fill AVX2's sixteen registers. They are named
 * variables, not an array: GCC kept an array of them on the stack, storing every accumulator
 * after each FMA (30 GFLOP/s at 32 rows on a Zen 3 core against 60 this way). With MR a
 * constant the unused rows' code folds away. */
static inline __attribute__((always_inline)) void f32_block3(const float *x, int64_t ldx,
                                                             const float *wb, int64_t K, float *y,
                                                             int64_t ldy, const int MR) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    const float *w0 = wb, *w1 = wb + 8 * K, *w2 = wb + 16 * K;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
    for (int64_t k = 0; k < K; k++) {
        const __m256 v0 = _mm256_loadu_ps(w0 + k * 8), v1 = _mm256_loadu_ps(w1 + k * 8);
        const __m256 v2 = _mm256_loadu_ps(w2 + k * 8);
        __m256 b = _mm256_broadcast_ss(x0 + k);
        a00 = _mm256_fmadd_ps(b, v0, a00), a10 = _mm256_fmadd_ps(b, v1, a10);
        a20 = _mm256_fmadd_ps(b, v2, a20);
        if (MR > 1) {
            b = _mm256_broadcast_ss(x1 + k);
            a01 = _mm256_fmadd_ps(b, v0, a01), a11 = _mm256_fmadd_ps(b, v1, a11);
            a21 = _mm256_fmadd_ps(b, v2, a21);
        }
        if (MR > 2) {
            b = _mm256_broadcast_ss(x2 + k);
            a02 = _mm256_fmadd_ps(b, v0, a02), a12 = _mm256_fmadd_ps(b, v1, a12);
            a22 = _mm256_fmadd_ps(b, v2, a22);
        }
        if (MR > 3) {
            b = _mm256_broadcast_ss(x3 + k);
            a03 = _mm256_fmadd_ps(b, v0, a03), a13 = _mm256_fmadd_ps(b, v1, a13);
            a23 = _mm256_fmadd_ps(b, v2, a23);
        }
    }
    _mm256_storeu_ps(y, a00), _mm256_storeu_ps(y + 8, a10), _mm256_storeu_ps(y + 16, a20);
    if (MR > 1)
        _mm256_storeu_ps(y + ldy, a01), _mm256_storeu_ps(y + ldy + 8, a11),
            _mm256_storeu_ps(y + ldy + 16, a21);
    if (MR > 2)
        _mm256_storeu_ps(y + 2 * ldy, a02), _mm256_storeu_ps(y + 2 * ldy + 8, a12),
            _mm256_storeu_ps(y + 2 * ldy + 16, a22);
    if (MR > 3)
        _mm256_storeu_ps(y + 3 * ldy, a03), _mm256_storeu_ps(y + 3 * ldy + 8, a13),
            _mm256_storeu_ps(y + 3 * ldy + 16, a23);
}

/* The same for one block of 8 outputs (the blocks left after the groups of three). */
static inline __attribute__((always_inline)) void f32_block1(const float *x, int64_t ldx,
                                                             const float *wb, int64_t K, float *y,
                                                             int64_t ldy, const int MR) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; k++) {
        const __m256 v = _mm256_loadu_ps(wb + k * 8);
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), v, a0);
        if (MR > 1) a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + ldx + k), v, a1);
        if (MR > 2) a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 2 * ldx + k), v, a2);
        if (MR > 3) a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + 3 * ldx + k), v, a3);
    }
    _mm256_storeu_ps(y, a0);
    if (MR > 1) _mm256_storeu_ps(y + ldy, a1);
    if (MR > 2) _mm256_storeu_ps(y + 2 * ldy, a2);
    if (MR > 3) _mm256_storeu_ps(y + 3 * ldy, a3);
}

#define F32_PRODUCT_BLOCK(NB, MR)                                                               \
    static void f32_product_##NB##_##MR(const float *x, int64_t ldx, const float *wb,          \
                                        int64_t K, float *y, int64_t ldy) {                     \
        f32_block##NB(x, ldx, wb, K, y, ldy, MR);                                               \
    }
F32_PRODUCT_BLOCK(3, 1)
F32_PRODUCT_BLOCK(3, 2)
F32_PRODUCT_BLOCK(3, 3)
F32_PRODUCT_BLOCK(3, 4)
F32_PRODUCT_BLOCK(1, 1)
F32_PRODUCT_BLOCK(1, 2)
F32_PRODUCT_BLOCK(1, 3)
F32_PRODUCT_BLOCK(1, 4)

typedef void (*f32_product_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t);
static const f32_product_fn F32_PRODUCT_3[5] = {0, f32_product_3_1, f32_product_3_2,
                                                f32_product_3_3, f32_product_3_4};
static const f32_product_fn F32_PRODUCT_1[5] = {0, f32_product_1_1, f32_product_1_2,
                                                f32_product_1_3, f32_product_1_4};
#define F32_ROWS 4

/* y [M, N] = x [M, K] @ W.T with W packed as above: three blocks of outputs at a time (single
 * blocks for the rest), four rows at a time; groups of blocks are split over the threads. */
static void f32_product(const float *x, const float *w, float *y, int64_t M, int64_t N,
                        int64_t K, int threads) {
    const int64_t blocks = N / 8, groups = blocks / 3, units = groups + blocks % 3;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t nb = u < groups ? 3 * u : 3 * groups + (u - groups);
        const f32_product_fn *fns = u < groups ? F32_PRODUCT_3 : F32_PRODUCT_1;
        for (int64_t m0 = 0; m0 < M; m0 += F32_ROWS) {
            const int64_t mr = M - m0 < F32_ROWS ? M - m0 : F32_ROWS;
            fns[mr](x + m0 * K, K, w + nb * 8 * K, K, y + m0 * N + nb * 8, N);
        }
    }
}

/* transformers' LlamaRMSNorm in fp32: out = weight * (x * rsqrt(mean(x^2) + eps)) */
static void f32_rms_norm(const float *x, const float *weight, float *out, int64_t B, int64_t H,
                         float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float *xb = x + b * H;
        __m256 squares = _mm256_setzero_ps();
        for (int64_t i = 0; i < H; i += 8) {
            __m256 v = _mm256_loadu_ps(xb + i);
            squares = _mm256_fmadd_ps(v, v, squares);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(squares) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 8) {
            __m256 h = _mm256_mul_ps(_mm256_loadu_ps(xb + i), r);
            _mm256_storeu_ps(out + b * H + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), h));
        }
    }
}

/* x += y, both [n] with n % 8 == 0 */
static void f32_add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

/* act[b] = silu(gate) * up for gu[b] = [gate (I) | up (I)] */
static void f32_silu_mul(const float *gu, float *act, int64_t B, int64_t I) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < B; b++) {
        const float *g = gu + b * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            /* sigmoid from exp of -|x| (exp8 takes arguments <= 0) */
            __m256 e = exp8(_mm256_or_ps(x, sign));
            __m256 denom = _mm256_add_ps(one, e);
            __m256 positive = _mm256_cmp_ps(x, zero, _CMP_GE_OQ);
            __m256 sig = _mm256_blendv_ps(_mm256_div_ps(e, denom), _mm256_div_ps(one, denom),
                                          positive);
            __m256 s = _mm256_mul_ps(x, sig);
            _mm256_storeu_ps(act + b * I + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
    }
}

/* Rotary on the first `heads` D-wide heads of a row: x*cos + roll(x, D/2)*sin (the sign of
 * rotate_half lives in the sin table, as in decoder.py). */
static void f32_rotary(float *row, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    float rolled[F32_MAX_D];
    for (int64_t h = 0; h < heads; h++) {
        float *x = row + h * D;
        memcpy(rolled, x + half, (size_t)half * sizeof(float));
        memcpy(rolled + half, x, (size_t)half * sizeof(float));
        for (int64_t i = 0; i < D; i += 8) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(cos + i));
            __m256 b = _mm256_mul_ps(_mm256_loadu_ps(rolled + i), _mm256_loadu_ps(sin + i));
            _mm256_storeu_ps(x + i, _mm256_add_ps(a, b));
        }
    }
}

/* Attention of one row's G query heads per key/value head over its first n cache columns:
 * q [KV, G, D] (contiguous), keys of head h at cache + h * head_stride, values at head KV + h;
 * out [KV, G, D]. `scores` holds G * padded floats, padded = n rounded up to 8. */
static inline __attribute__((always_inline)) void f32_attention_body(
    const float *q, const float *cache, float *out, int64_t n, int64_t KV, const int64_t G,
    const int64_t D, int64_t head_stride, float scale, float *scores) {
    const int64_t padded = (n + 7) / 8 * 8;
    for (int64_t h = 0; h < KV; h++) {
        const float *keys = cache + h * head_stride, *values = cache + (KV + h) * head_stride;
        const float *qh = q + h * G * D;
        float *oh = out + h * G * D;
        /* scores[g][j] = scale * q_g . k_j, eight columns at a time: eight independent
         * accumulators per query (one FMA chain each would wait on its own latency), summed
         * across lanes together. A last partial block re-reads column n - 1; the softmax below
         * sets every column past n to -inf, so exp gives them 0. */
        for (int64_t j = 0; j < n; j += 8) {
            const float *k[8];
            for (int jj = 0; jj < 8; jj++) k[jj] = keys + (j + jj < n ? j + jj : n - 1) * D;
            if (j + 16 < n)
                for (int64_t line = 0; line < 8 * D; line += 16)
                    _mm_prefetch((const char *)(keys + (j + 16) * D + line), _MM_HINT_T0);
            for (int64_t g = 0; g < G; g++) {
                __m256 acc[8];
                for (int jj = 0; jj < 8; jj++) acc[jj] = _mm256_setzero_ps();
                for (int64_t v = 0; v < D; v += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + g * D + v);
                    for (int jj = 0; jj < 8; jj++)
                        acc[jj] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[jj] + v), acc[jj]);
                }
                _mm256_storeu_ps(scores + g * padded + j,
                                 _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
            }
        }
        float inv_sum[F32_MAX_G];
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * padded;
            for (int64_t j = n; j < padded; j++) s[j] = -INFINITY;
            __m256 mx = _mm256_set1_ps(-INFINITY);
            for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
            const __m256 top = _mm256_set1_ps(hmax8(mx));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < padded; j += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
                _mm256_storeu_ps(s + j, e);
                sum = _mm256_add_ps(sum, e);
            }
            inv_sum[g] = 1.0f / hsum8(sum);
        }
        /* out_g = sum_j p_gj v_j / sum_j p_gj: one query at a time over 64 dims, so each pass
         * reads the values front to back (the first from memory, the rest from L2); sixteen
         * dims across all queries at a time read them with a stride and ran ~2x slower. */
        for (int64_t g = 0; g < G; g++) {
            const float *p = scores + g * padded;
            const __m256 r = _mm256_set1_ps(inv_sum[g]);
            for (int64_t v0 = 0; v0 < D; v0 += 64) {
                const int64_t width = D - v0 < 64 ? D - v0 : 64;
                __m256 o[8];
                for (int c = 0; c < 8; c++) o[c] = _mm256_setzero_ps();
                for (int64_t j = 0; j < n; j++) {
                    const float *val = values + j * D + v0;
                    const __m256 pj = _mm256_broadcast_ss(p + j);
                    for (int c = 0; c < 8; c++)
                        if (c * 8 < width) o[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(val + 8 * c), o[c]);
                }
                for (int c = 0; c < 8; c++)
                    if (c * 8 < width) _mm256_storeu_ps(oh + g * D + v0 + 8 * c, _mm256_mul_ps(o[c], r));
            }
        }
    }
}

/* The common shapes get their own copy: with G and D constants the loops unroll and the
 * accumulators stay in registers (the generic copy ran ~4x slower at 32 rows x 400 columns). */
static void f32_attention_row(const float *q, const float *cache, float *out, int64_t n,
                              int64_t KV, int64_t G, int64_t D, int64_t head_stride, float scale,
                              float *scores) {
    if (G == 3 && D == 64)
        f32_attention_body(q, cache, out, n, KV, 3, 64, head_stride, scale, scores);
    else if (G == 4 && D == 64)
        f32_attention_body(q, cache, out, n, KV, 4, 64, head_stride, scale, scores);
    else if (G == 7 && D == 64)
        f32_attention_body(q, cache, out, n, KV, 7, 64, head_stride, scale, scores);
    else if (G == 4 && D == 128)
        f32_attention_body(q, cache, out, n, KV, 4, 128, head_stride, scale, scores);
    else if (G == 8 && D == 128)
        f32_attention_body(q, cache, out, n, KV, 8, 128, head_stride, scale, scores);
    else
        f32_attention_body(q, cache, out, n, KV, G, D, head_stride, scale, scores);
}

/* Per layer, the pointers the step reads (the same table as decode_step.c's, fp32 here). */
typedef struct {
    const float *norm_in, *norm_post, *qkv, *o, *gate_up, *down;
    float *cache; /* [rows, 2 * KV, columns, D]: keys in heads 0..KV-1, values after */
} f32_layer_weights;

/* Logits [B, V] of the token after `ids`; row b writes its new key/value to column cols[b] of
 * cache row b and attends to columns 0..cols[b]. Returns 0, or < 0 on bad shapes. */
int relayrl_decode_step_f32(const f32_layer_weights *layers, int64_t n_layers, const int64_t *ids,
                            const int64_t *cols, int64_t B, const float *embed,
                            const float *final_norm, const float *head, int64_t V, float *logits,
                            const float *cos, const float *sin, int64_t H, int64_t heads,
                            int64_t KV, int64_t D, int64_t I, float eps, float scale,
                            int64_t row_stride, int64_t head_stride, int threads) {
    const int64_t G = heads / KV, Q = (heads + 2 * KV) * D;
    if (B < 1 || KV < 1 || heads % KV || G > F32_MAX_G || D > F32_MAX_D || D % 16 || H % 8
        || I % 8 || V % 8 || threads < 1)
        return -1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = cols[b] + 1 > longest ? cols[b] + 1 : longest;
    const int64_t padded = (longest + 7) / 8 * 8;
    float *x = malloc((size_t)(B * (3 * H + Q + heads * D + 3 * I)) * sizeof(float));
    float *scores = malloc((size_t)(B * G * padded) * sizeof(float));
    if (x == NULL || scores == NULL) {
        free(x);
        free(scores);
        return -2;
    }
    float *h = x + B * H, *tmp = h + B * H, *qkv = tmp + B * H, *attn = qkv + B * Q;
    float *gu = attn + B * heads * D, *act = gu + 2 * B * I;
    for (int64_t b = 0; b < B; b++) memcpy(x + b * H, embed + ids[b] * H, (size_t)H * sizeof(float));
    for (int64_t l = 0; l < n_layers; l++) {
        const f32_layer_weights *w = layers + l;
        f32_rms_norm(x, w->norm_in, h, B, H, eps);
        f32_product(h, w->qkv, qkv, B, Q, H, threads);
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * Q;
            f32_rotary(row, heads + KV, D, cos + cols[b] * D, sin + cols[b] * D);
            for (int64_t j = 0; j < 2 * KV; j++)
                memcpy(w->cache + b * row_stride + j * head_stride + cols[b] * D,
                       row + (heads + j) * D, (size_t)D * sizeof(float));
        }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B > 1)
        for (int64_t b = 0; b < B; b++)
            f32_attention_row(qkv + b * Q, w->cache + b * row_stride, attn + b * heads * D,
                              cols[b] + 1, KV, G, D, head_stride, scale,
                              scores + b * G * padded);
        f32_product(attn, w->o, tmp, B, H, heads * D, threads);
        f32_add_into(x, tmp, B * H);
        f32_rms_norm(x, w->norm_post, h, B, H, eps);
        f32_product(h, w->gate_up, gu, B, 2 * I, H, threads);
        f32_silu_mul(gu, act, B, I);
        f32_product(act, w->down, tmp, B, H, I, threads);
        f32_add_into(x, tmp, B * H);
    }
    f32_rms_norm(x, final_norm, h, B, H, eps);
    f32_product(h, head, logits, B, V, H, threads);
    free(x);
    free(scores);
    return 0;
}

#else

int relayrl_decode_step_f32_ready(void) { return 0; }

int relayrl_decode_step_f32(void) { return -3; }

#endif
