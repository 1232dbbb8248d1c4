/* One whole decode step of a Llama-family model on the CPU, in bf16: every layer in one call.
 *
 * Why: at decode batch sizes a step of SmolLM2-135M in torch is ~35 small ops per layer (norms,
 * rotary, residual adds, the SwiGLU product), each a few microseconds of dispatch on a few
 * kilobytes of data; at 1 row they took more of the step than the matrix products. Here the
 * products are the only real work, and they read weights packed for AVX512-BF16's `vdpbf16ps`:
 * sixteen outputs by two inputs per 64-byte load, so one load of a weight block serves every row
 * of the batch and no horizontal sum is needed.
 *
 * Numerics follow `LeanDecoder.step` (engine/decoder.py) op for op: every value torch would
 * round to bf16 is rounded here too (nearest even), sums run in fp32. What differs is only the
 * order of fp32 sums inside a product or a norm, and the last bits of exp in SiLU.
 *
 * Packed weight of an [N, K] product (N % 16 == 0, K % 2 == 0): [N/16][K/2][16][2], i.e.
 * element (n, k) at ((n / 16) * (K / 2) + k / 2) * 32 + (n % 16) * 2 + k % 2.
 *
 * Built with -march=native -fopenmp on first use (kernels/cpu.py); the products split
 * their output blocks over `threads` OpenMP threads (torch's own runtime, already loaded).
 */
#include <math.h>

#include "decode_attention.c"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

int relayrl_decode_step_ready(void) { return 1; }

/* fp32 -> the nearest bf16, kept as fp32 (low 16 bits zero): torch's cast, so values chain */
static inline __m512 round_bf16(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Rows 0 .. MR of y = x @ W.T for NB blocks of 16 outputs (NB consecutive packed blocks). Each
 * broadcast of an input pair feeds NB products and each weight load MR: with 4 x 6 the loads
 * per product fall to 0.42 (one block of 8 rows: 1.1), which measured 1.3x faster at 8 rows
 * and no slower at 1 (SmolLM2-135M's products, 2-core EPYC, one thread). */
#define PRODUCT_BLOCK(NB, MR)                                                                   \
    static void product_##NB##_##MR(const uint16_t *x, int64_t ldx, const uint16_t *wb,        \
                                    int64_t K, uint16_t *y, int64_t ldy) {                     \
        __m512 acc[NB][MR];                                                                     \
        for (int j = 0; j < NB; j++)                                                            \
            for (int m = 0; m < MR; m++) acc[j][m] = _mm512_setzero_ps();                       \
        for (int64_t kp = 0; kp < K / 2; kp++) {                                                \
            __m512bh w[NB];                                                                     \
            for (int j = 0; j < NB; j++)                                                        \
                w[j] = (__m512bh)_mm512_loadu_si512((const void *)(wb + j * 16 * K + kp * 32)); \
            for (int m = 0; m < MR; m++) {                                                      \
                int32_t pair;                                                                   \
                memcpy(&pair, x + m * ldx + 2 * kp, sizeof pair);                               \
                __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                                \
                for (int j = 0; j < NB; j++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, w[j]); \
            }                                                                                   \
        }                                                                                       \
        for (int j = 0; j < NB; j++)                                                            \
            for (int m = 0; m < MR; m++) store16_bf16(y + m * ldy + 16 * j, acc[j][m]);         \
    }
PRODUCT_BLOCK(4, 1)
PRODUCT_BLOCK(4, 2)
PRODUCT_BLOCK(4, 3)
PRODUCT_BLOCK(4, 4)
PRODUCT_BLOCK(4, 5)
PRODUCT_BLOCK(4, 6)
PRODUCT_BLOCK(1, 1)
PRODUCT_BLOCK(1, 2)
PRODUCT_BLOCK(1, 3)
PRODUCT_BLOCK(1, 4)
PRODUCT_BLOCK(1, 5)
PRODUCT_BLOCK(1, 6)

typedef void (*product_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, uint16_t *,
                           int64_t);
static const product_fn PRODUCT_4[7] = {0, product_4_1, product_4_2, product_4_3,
                                        product_4_4, product_4_5, product_4_6};
static const product_fn PRODUCT_1[7] = {0, product_1_1, product_1_2, product_1_3,
                                        product_1_4, product_1_5, product_1_6};
#define ROWS 6

/* y [M, N] = bf16(x [M, K] @ W.T) with W packed as above: four blocks of outputs at a time
 * (single blocks for the rest), six rows at a time, the row groups reading each weight block
 * from cache after the first; groups of blocks are split over the threads. */
static void product(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N,
                    int64_t K, int threads) {
    const int64_t blocks = N / 16, groups = blocks / 4, units = groups + blocks % 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t u = 0; u < units; u++) {
        const int64_t nb = u < groups ? 4 * u : 4 * groups + (u - groups);
        const product_fn *fns = u < groups ? PRODUCT_4 : PRODUCT_1;
        for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
            const int64_t mr = M - m0 < ROWS ? M - m0 : ROWS;
            fns[mr](x + m0 * K, K, w + nb * 16 * K, K, y + m0 * N + nb * 16, N);
        }
    }
}

/* transformers' LlamaRMSNorm: h = bf16(x * rsqrt(mean(x^2) + eps)); out = bf16(weight * h) */
static void rms_norm(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t B,
                     int64_t H, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *xb = x + b * H;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < H; i += 16) {
            __m512 v = load16_bf16(xb + i);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16) {
            __m512 h = round_bf16(_mm512_mul_ps(load16_bf16(xb + i), r));
            store16_bf16(out + b * H + i, _mm512_mul_ps(load16_bf16(weight + i), h));
        }
    }
}

/* x = bf16(x + y), both [n] with n % 16 == 0 */
static void add_into(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        store16_bf16(x + i, _mm512_add_ps(load16_bf16(x + i), load16_bf16(y + i)));
}

/* act[b] = bf16(bf16(silu(gate)) * up) for gu[b] = [gate (I) | up (I)] */
static void silu_mul(const uint16_t *gu, uint16_t *act, int64_t B, int64_t I) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *g = gu + b * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            __m512 x = load16_bf16(g + i);
            /* sigmoid from exp of -|x| (exp16 takes arguments <= 0) */
            __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));
            __m512 e = exp16(neg);
            __m512 denom = _mm512_add_ps(one, e);
            __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
            __m512 sig = _mm512_mask_div_ps(_mm512_div_ps(e, denom), positive, one, denom);
            __m512 s = round_bf16(_mm512_mul_ps(x, sig));
            store16_bf16(act + b * I + i, _mm512_mul_ps(s, load16_bf16(u + i)));
        }
    }
}

/* Rotary on the first `heads` D-wide heads of a row: out = bf16(bf16(x*cos) + bf16(roll(x)*sin)),
 * roll by D/2 (the sign of rotate_half lives in the table, as in decoder.py). */
static void rotary(uint16_t *row, int64_t heads, int64_t D, const uint16_t *cos,
                   const uint16_t *sin) {
    const int64_t half = D / 2;
    uint16_t rolled[MAX_D];
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *x = row + h * D;
        memcpy(rolled, x + half, (size_t)half * sizeof(uint16_t));
        memcpy(rolled + half, x, (size_t)half * sizeof(uint16_t));
        for (int64_t i = 0; i < D; i += 16) {
            __m512 a = round_bf16(_mm512_mul_ps(load16_bf16(x + i), load16_bf16(cos + i)));
            __m512 b = round_bf16(_mm512_mul_ps(load16_bf16(rolled + i), load16_bf16(sin + i)));
            store16_bf16(x + i, _mm512_add_ps(a, b));
        }
    }
}

/* Per layer, the pointers the step reads: norms (bf16 [H]), packed products, the cache. */
typedef struct {
    const uint16_t *norm_in, *norm_post, *qkv, *o, *gate_up, *down;
    uint16_t *cache; /* [rows, 2 * KV, columns, D]: keys in heads 0..KV-1, values after */
} layer_weights;

/* Logits [B, V] (bf16) of the token after `ids`; row b writes its new key/value to column
 * cols[b] of cache row b and attends to columns 0..cols[b]. Returns 0, or < 0 on bad shapes. */
int relayrl_decode_step_bf16(const layer_weights *layers, int64_t n_layers, const int64_t *ids,
                             const int64_t *cols, int64_t B, const uint16_t *embed,
                             const uint16_t *final_norm, const uint16_t *head, int64_t V,
                             uint16_t *logits, const uint16_t *cos, const uint16_t *sin,
                             int64_t H, int64_t heads, int64_t KV, int64_t D, int64_t I,
                             float eps, float scale, int64_t row_stride, int64_t head_stride,
                             int threads) {
    const int64_t G = heads / KV, Q = (heads + 2 * KV) * D;
    if (B < 1 || KV < 1 || heads % KV || G > MAX_G || D > MAX_D || D % 32 || H % 32 || I % 32
        || V % 16 || threads < 1)
        return -1;
    uint16_t *x = malloc((size_t)(B * (3 * H + Q + heads * D + 3 * I)) * sizeof(uint16_t));
    int64_t *lengths = malloc((size_t)B * sizeof(int64_t));
    if (x == NULL || lengths == NULL) {
        free(x);
        free(lengths);
        return -2;
    }
    uint16_t *h = x + B * H, *tmp = h + B * H, *qkv = tmp + B * H, *attn = qkv + B * Q;
    uint16_t *gu = attn + B * heads * D, *act = gu + 2 * B * I;
    for (int64_t b = 0; b < B; b++) {
        memcpy(x + b * H, embed + ids[b] * H, (size_t)H * sizeof(uint16_t));
        lengths[b] = cols[b] + 1;
    }
    int status = 0;
    for (int64_t l = 0; l < n_layers && status == 0; l++) {
        const layer_weights *w = layers + l;
        rms_norm(x, w->norm_in, h, B, H, eps);
        product(h, w->qkv, qkv, B, Q, H, threads);
        for (int64_t b = 0; b < B; b++) {
            uint16_t *row = qkv + b * Q;
            rotary(row, heads + KV, D, cos + cols[b] * D, sin + cols[b] * D);
            for (int64_t j = 0; j < 2 * KV; j++)
                memcpy(w->cache + b * row_stride + j * head_stride + cols[b] * D,
                       row + (heads + j) * D, (size_t)D * sizeof(uint16_t));
        }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B > 1) \
    reduction(min : status)
        for (int64_t b = 0; b < B; b++) {
            int code = relayrl_decode_attention_bf16(qkv + b * Q, w->cache + b * row_stride,
                                                     attn + b * heads * D, lengths + b, 1, KV,
                                                     G, D, row_stride, head_stride, scale);
            if (code < status) status = code;
        }
        product(attn, w->o, tmp, B, H, heads * D, threads);
        add_into(x, tmp, B * H);
        rms_norm(x, w->norm_post, h, B, H, eps);
        product(h, w->gate_up, gu, B, 2 * I, H, threads);
        silu_mul(gu, act, B, I);
        product(act, w->down, tmp, B, H, I, threads);
        add_into(x, tmp, B * H);
    }
    if (status == 0) {
        rms_norm(x, final_norm, h, B, H, eps);
        product(h, head, logits, B, V, H, threads);
    }
    free(x);
    free(lengths);
    return status;
}

/* The step's pieces between its products, for a step whose products run elsewhere (oneDNN's
 * AMX GEMMs at larger batches, engine/decoder.py): the same code in the same order, so only
 * the products' order of sums differs from `relayrl_decode_step_bf16`. */

/* out = rms_norm(x) with `weight`; with y: x = bf16(x + y) first (the residual add) */
int relayrl_step_add_norm_bf16(uint16_t *x, const uint16_t *y, const uint16_t *weight,
                               uint16_t *out, int64_t B, int64_t H, float eps) {
    if (B < 1 || H % 32) return -1;
    if (y != NULL) add_into(x, y, B * H);
    rms_norm(x, weight, out, B, H, eps);
    return 0;
}

/* Rotary on the queries and keys of qkv [B, heads + 2 KV, D], each row's key and value to
 * column cols[b] of cache row b, then attention of row b over columns 0..cols[b] into
 * attn [B, heads, D]. */
int relayrl_step_attend_bf16(uint16_t *qkv, uint16_t *cache, const int64_t *cols, int64_t B,
                             const uint16_t *cos, const uint16_t *sin, int64_t heads,
                             int64_t KV, int64_t D, int64_t row_stride, int64_t head_stride,
                             float scale, uint16_t *attn, int threads) {
    const int64_t G = heads / KV, Q = (heads + 2 * KV) * D;
    if (B < 1 || KV < 1 || heads % KV || G > MAX_G || D > MAX_D || D % 32 || threads < 1)
        return -1;
    int status = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && B > 1) \
    reduction(min : status)
    for (int64_t b = 0; b < B; b++) {
        uint16_t *row = qkv + b * Q;
        rotary(row, heads + KV, D, cos + cols[b] * D, sin + cols[b] * D);
        for (int64_t j = 0; j < 2 * KV; j++)
            memcpy(cache + b * row_stride + j * head_stride + cols[b] * D,
                   row + (heads + j) * D, (size_t)D * sizeof(uint16_t));
        const int64_t length = cols[b] + 1;
        int code = relayrl_decode_attention_bf16(row, cache + b * row_stride,
                                                 attn + b * heads * D, &length, 1, KV, G, D,
                                                 row_stride, head_stride, scale);
        if (code < status) status = code;
    }
    return status;
}

/* act [B, I] = bf16(bf16(silu(gate)) * up) for gu [B, 2 I] = [gate | up] */
int relayrl_step_silu_mul_bf16(const uint16_t *gu, uint16_t *act, int64_t B, int64_t I) {
    if (B < 1 || I % 16) return -1;
    silu_mul(gu, act, B, I);
    return 0;
}

#else

int relayrl_decode_step_ready(void) { return 0; }

int relayrl_step_add_norm_bf16(void) { return -3; }

int relayrl_step_attend_bf16(void) { return -3; }

int relayrl_step_silu_mul_bf16(void) { return -3; }

int relayrl_decode_step_bf16(void) { return -3; }

#endif
