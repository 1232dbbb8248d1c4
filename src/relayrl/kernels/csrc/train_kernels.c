/* out[b] = scale * a[b] @ w[b].T in fp32 from bf16 a [M, K] and a bf16 or fp32 w [N, K]: the
 * trainer's products whose outputs must not be rounded to bf16.
 *
 * Why: torch's CPU matmul rounds a bf16 product's output to bf16, and an fp32 output needs fp32
 * inputs, whose products run at a quarter of the bf16 rate on AVX512-BF16 (210 against 851
 * GFLOP/s on two Zen 5 cores). The trainer has three such products, where bf16 rounding of the
 * output costs precision: the output head's logits, and attention's scores and their gradient.
 * vdpbf16ps accumulates in fp32, so this kernel keeps its sums as they are.
 *
 * An fp32 `w` (the output head's master weight) goes in as two bf16 terms, its nearest bf16 and
 * the rest, so the logits equal an fp32 product's to ~1e-5 at twice the bf16 work (a bf16 `w`:
 * ~5e-3 nats off in the logprobs).
 *
 * Both operands keep K contiguous (a row of `a`, a row of `w`). A unit of work is one batch entry
 * and 64 columns of the output: it packs those 64 rows of `w` into `pack` as
 * [K/2][terms][4 blocks][16 columns][2] (zeros past N), then runs every row of `a` against them, six
 * rows by four blocks of sixteen columns at a time (24 accumulators; each broadcast pair of `a`
 * feeds four products, each load of `w` six). Units are split over `threads` OpenMP threads,
 * each with its own slice of `pack` (allocated by the caller: no malloc in the parallel loop).
 *
 * Built with -march=native -fopenmp on first use (kernels/cpu.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "decode_attention.c" /* load16_bf16, store16_bf16, exp16 */

#if defined(__AVX512F__) && defined(__AVX512BF16__)

int relayrl_train_kernels_ready(void) { return 1; }

/* Attention's softmax, one pass a row: p[i] = bf16(softmax(s[i] + bias[i])), fp32 inside.
 * s [rows, K] fp32 (overwritten with the exponentials); a row i = ((r * heads) + h) * L + l of
 * the scores [R, heads, L, K] takes bias row (bias_rows > 1 ? r * L + l : l) of bias
 * [bias_rows, L, K] (0 or -inf). Every row must see a key (-inf everywhere is not taken). */
int relayrl_softmax_bf16(float *s, const float *bias, uint16_t *p, int64_t rows, int64_t K,
                         int64_t L, int64_t per_r, int64_t bias_rows, int threads) {
    if (K <= 0 || L <= 0 || per_r <= 0 || rows % per_r || per_r % L) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = i / per_r, l = i % L;
        const float *b = bias + ((bias_rows > 1 ? r * L : 0) + l) * K;
        float *si = s + i * K;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < K; j += 16) {
            const __mmask16 m = K - j >= 16 ? 0xFFFF : (__mmask16)((1u << (K - j)) - 1);
            __m512 x = _mm512_add_ps(_mm512_maskz_loadu_ps(m, si + j), _mm512_maskz_loadu_ps(m, b + j));
            _mm512_mask_storeu_ps(si + j, m, x);
            top = _mm512_mask_max_ps(top, m, top, x);
        }
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < K; j += 16) {
            const __mmask16 m = K - j >= 16 ? 0xFFFF : (__mmask16)((1u << (K - j)) - 1);
            __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, si + j), mx)));
            _mm512_mask_storeu_ps(si + j, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        uint16_t *pi = p + i * K;
        int64_t j = 0;
        for (; j + 16 <= K; j += 16) store16_bf16(pi + j, _mm512_mul_ps(_mm512_loadu_ps(si + j), inv));
        if (j < K) {
            uint16_t tail[16];
            store16_bf16(tail, _mm512_mul_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << (K - j)) - 1), si + j), inv));
            memcpy(pi + j, tail, (size_t)(K - j) * sizeof *tail);
        }
    }
    return 0;
}

/* Its backward, one pass a row: ds[i] = bf16(p[i] * (dp[i] - dot(d_out[i], out[i]))), with p and
 * ds [rows, K] bf16, dp [rows, K] fp32, d_out and out [rows, D] bf16. */
int relayrl_softmax_grad_bf16(const float *dp, const uint16_t *p, const uint16_t *d_out,
                              const uint16_t *out, uint16_t *ds, int64_t rows, int64_t K,
                              int64_t D, int threads) {
    if (K <= 0 || D <= 0 || D % 16) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        __m512 dot = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16)
            dot = _mm512_fmadd_ps(load16_bf16(d_out + i * D + d), load16_bf16(out + i * D + d), dot);
        const __m512 delta = _mm512_set1_ps(_mm512_reduce_add_ps(dot));
        const float *dpi = dp + i * K;
        const uint16_t *pi = p + i * K;
        uint16_t *dsi = ds + i * K;
        int64_t j = 0;
        for (; j + 16 <= K; j += 16)
            store16_bf16(dsi + j, _mm512_mul_ps(load16_bf16(pi + j), _mm512_sub_ps(_mm512_loadu_ps(dpi + j), delta)));
        if (j < K) {
            uint16_t in[16] = {0}, tail[16];
            const __mmask16 m = (__mmask16)((1u << (K - j)) - 1);
            memcpy(in, pi + j, (size_t)(K - j) * sizeof *in);
            store16_bf16(tail, _mm512_mul_ps(load16_bf16(in), _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dpi + j), delta)));
            memcpy(dsi + j, tail, (size_t)(K - j) * sizeof *tail);
        }
    }
    return 0;
}

/* masked loads and stores of n < 16 bf16: the tails of the elementwise kernels below */
static inline __m512 load_bf16_tail(const uint16_t *p, int64_t n) {
    const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16_tail(uint16_t *p, __m512 x, int64_t n) {
    uint16_t tail[16];
    store16_bf16(tail, x);
    memcpy(p, tail, (size_t)n * sizeof *tail);
}

/* bf16 of x as a float: the rounding torch applies to each op's bf16 output */
static inline __m512 round_bf16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
        _mm512_set1_epi32((int)0xFFFF0000u));
    /* NaN stays as it is (its low bits only go when it is stored) */
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(rounded), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

/* RMSNorm as Llama-family models write it, rounding where they round: y = bf16(w * bf16(x * r)),
 * r = 1 / sqrt(mean(x^2) + eps) in fp32, kept per row for the backward. x, y [rows, H], w [H]
 * bf16; H a multiple of 16. */
int relayrl_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, float *r,
                          int64_t rows, int64_t H, float eps, int threads) {
    if (H <= 0 || H % 16 || rows < 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * H;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t j = 0; j < H; j += 16) {
            const __m512 v = load16_bf16(xi + j);
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        const float ri = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)H + eps);
        r[i] = ri;
        const __m512 vr = _mm512_set1_ps(ri);
        for (int64_t j = 0; j < H; j += 16) {
            const __m512 h = round_bf16(_mm512_mul_ps(load16_bf16(xi + j), vr));
            store16_bf16(y + i * H + j, _mm512_mul_ps(h, load16_bf16(w + j)));
        }
    }
    return 0;
}

/* Its backward from g = dL/dy: dx = bf16(r * (d - h * mean(d * h))), d = bf16(g * w) as fp32,
 * h = x * r; dw = sum over rows of g * bf16(h), fp32 sums into `dw` [H]. `partial` holds
 * threads * H floats (each thread's own sums, added up at the end). */
int relayrl_rms_norm_grad_bf16(const uint16_t *g, const uint16_t *x, const uint16_t *w,
                               const float *r, uint16_t *dx, float *dw, float *partial,
                               int64_t rows, int64_t H, int threads) {
    if (H <= 0 || H % 16 || rows < 0 || threads < 1) return 1;
    memset(partial, 0, (size_t)(threads * H) * sizeof *partial);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        float *mine = partial + (int64_t)thread * H;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            const uint16_t *gi = g + i * H, *xi = x + i * H;
            const __m512 vr = _mm512_set1_ps(r[i]);
            __m512 dot = _mm512_setzero_ps();
            for (int64_t j = 0; j < H; j += 16) {
                const __m512 gj = load16_bf16(gi + j), h = _mm512_mul_ps(load16_bf16(xi + j), vr);
                const __m512 d = round_bf16(_mm512_mul_ps(gj, load16_bf16(w + j)));
                dot = _mm512_fmadd_ps(d, h, dot);
                _mm512_storeu_ps(mine + j, _mm512_fmadd_ps(gj, round_bf16(h), _mm512_loadu_ps(mine + j)));
            }
            const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(dot) / (float)H);
            for (int64_t j = 0; j < H; j += 16) {
                const __m512 h = _mm512_mul_ps(load16_bf16(xi + j), vr);
                const __m512 d = round_bf16(_mm512_mul_ps(load16_bf16(gi + j), load16_bf16(w + j)));
                store16_bf16(dx + i * H + j, _mm512_mul_ps(vr, _mm512_fnmadd_ps(h, mean, d)));
            }
        }
    }
    for (int64_t j = 0; j < H; j++) {
        float sum = 0.0f;
        for (int t = 0; t < threads; t++) sum += partial[(int64_t)t * H + j];
        dw[j] = sum;
    }
    return 0;
}

static inline __m512 sigmoid16(__m512 x) {
    /* 1 / (1 + exp(-x)) from exp16 of a non-positive argument, so neither side overflows */
    const __m512 e = exp16(_mm512_min_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), x)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 inv = _mm512_div_ps(one, _mm512_add_ps(one, e));
    /* x >= 0: 1 / (1 + e^-x); x < 0: e^x / (1 + e^x) */
    return _mm512_mask_mul_ps(inv, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), e, inv);
}

/* SwiGLU as Llama-family MLPs write it: out = bf16(bf16(silu(gate)) * up), n elements of bf16 */
int relayrl_swiglu_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n,
                        int threads) {
    if (n < 0) return 1;
    const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 64)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j = b * 16, left = n - j;
        const __m512 g = left >= 16 ? load16_bf16(gate + j) : load_bf16_tail(gate + j, left);
        const __m512 u = left >= 16 ? load16_bf16(up + j) : load_bf16_tail(up + j, left);
        const __m512 y = _mm512_mul_ps(round_bf16(_mm512_mul_ps(g, sigmoid16(g))), u);
        if (left >= 16)
            store16_bf16(out + j, y);
        else
            store_bf16_tail(out + j, y, left);
    }
    return 0;
}

/* Its backward from d = dL/dout: d_up = bf16(d * bf16(silu(gate))), d_gate = bf16(bf16(d * up)
 * * s * (1 + gate * (1 - s))), s = sigmoid(gate), as torch's mul and silu_backward round them */
int relayrl_swiglu_grad_bf16(const uint16_t *d, const uint16_t *gate, const uint16_t *up,
                             uint16_t *d_gate, uint16_t *d_up, int64_t n, int threads) {
    if (n < 0) return 1;
    const int64_t blocks = (n + 15) / 16;
    const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && blocks > 64)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t j = b * 16, left = n - j;
        const __m512 dj = left >= 16 ? load16_bf16(d + j) : load_bf16_tail(d + j, left);
        const __m512 g = left >= 16 ? load16_bf16(gate + j) : load_bf16_tail(gate + j, left);
        const __m512 u = left >= 16 ? load16_bf16(up + j) : load_bf16_tail(up + j, left);
        const __m512 s = sigmoid16(g);
        const __m512 du = _mm512_mul_ps(dj, round_bf16(_mm512_mul_ps(g, s)));
        const __m512 ds = round_bf16(_mm512_mul_ps(dj, u));
        const __m512 dg = _mm512_mul_ps(_mm512_mul_ps(ds, s),
                                        _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
        if (left >= 16) {
            store16_bf16(d_up + j, du);
            store16_bf16(d_gate + j, dg);
        } else {
            store_bf16_tail(d_up + j, du, left);
            store_bf16_tail(d_gate + j, dg, left);
        }
    }
    return 0;
}

/* Rotary embedding as transformers' apply_rotary_pos_emb writes it, rounding where its bf16 ops
 * round: y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1].
 * With `backward`, x is the output's gradient g and y = bf16(bf16(g * cos) + bf16(g * sin)
 * rotated back: [u2, -u1]), which is what autograd sums (one non-zero term from each path).
 * x and y are [B, H, S, D] with the given strides in elements (D contiguous), cos and sin
 * [B or 1, S, D] (batch stride cb, 0 for one row of positions; row stride cs); D a multiple
 * of 32. */
int relayrl_rotary_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *y,
                        int64_t B, int64_t H, int64_t S, int64_t D, int64_t xb, int64_t xh,
                        int64_t xs, int64_t yb, int64_t yh, int64_t ys, int64_t cb, int64_t cs,
                        int backward, int threads) {
    if (B < 0 || H < 0 || S < 0 || D <= 0 || D % 32) return 1;
    const int64_t half = D / 2, rows = B * H * S;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 64)
    for (int64_t n = 0; n < rows; n++) {
        const int64_t b = n / (H * S), h = n / S % H, t = n % S;
        const uint16_t *xi = x + b * xb + h * xh + t * xs;
        const uint16_t *ci = cos + b * cb + t * cs, *si = sin + b * cb + t * cs;
        uint16_t *yi = y + b * yb + h * yh + t * ys;
        for (int64_t j = 0; j < half; j += 16) {
            const __m512 x1 = load16_bf16(xi + j), x2 = load16_bf16(xi + half + j);
            const __m512 c1 = load16_bf16(ci + j), c2 = load16_bf16(ci + half + j);
            const __m512 s1 = load16_bf16(si + j), s2 = load16_bf16(si + half + j);
            const __m512 a1 = round_bf16(_mm512_mul_ps(x1, c1)), a2 = round_bf16(_mm512_mul_ps(x2, c2));
            __m512 y1, y2;
            if (backward) { /* u = bf16(g * sin); dx = [bf16(g1 c1) + u2, bf16(g2 c2) - u1] */
                y1 = _mm512_add_ps(a1, round_bf16(_mm512_mul_ps(x2, s2)));
                y2 = _mm512_sub_ps(a2, round_bf16(_mm512_mul_ps(x1, s1)));
            } else { /* [bf16(x1 c1) + bf16(-x2 s1), bf16(x2 c2) + bf16(x1 s2)] */
                y1 = _mm512_sub_ps(a1, round_bf16(_mm512_mul_ps(x2, s1)));
                y2 = _mm512_add_ps(a2, round_bf16(_mm512_mul_ps(x1, s2)));
            }
            store16_bf16(yi + j, y1);
            store16_bf16(yi + half + j, y2);
        }
    }
    return 0;
}

#define COLS 64
#define ROWS 6

/* rows 0 .. MR of one unit: NB blocks of 16 columns, the last `tail` columns wide (mask); T
 * terms of w per pair of inputs (T = 2: its bf16 part and the bf16 rest of an fp32 weight) */
#define NT_BLOCK(T, NB, MR)                                                                     \
    static void nt_##T##_##NB##_##MR(const uint16_t *a, int64_t lda, const uint16_t *pack,      \
                                     int64_t K, float *out, int64_t ldo, __m512 scale,          \
                                     __mmask16 last) {                                          \
        __m512 acc[NB][MR];                                                                     \
        for (int j = 0; j < NB; j++)                                                            \
            for (int m = 0; m < MR; m++) acc[j][m] = _mm512_setzero_ps();                       \
        for (int64_t kp = 0; kp < K / 2; kp++) {                                                \
            __m512bh w[T][NB];                                                                  \
            for (int t = 0; t < T; t++)                                                         \
                for (int j = 0; j < NB; j++)                                                    \
                    w[t][j] = (__m512bh)_mm512_loadu_si512(                                     \
                        (const void *)(pack + ((kp * T + t) * 4 + j) * 32));                    \
            for (int m = 0; m < MR; m++) {                                                      \
                int32_t pair;                                                                   \
                memcpy(&pair, a + m * lda + 2 * kp, sizeof pair);                               \
                __m512bh av = (__m512bh)_mm512_set1_epi32(pair);                                \
                for (int t = 0; t < T; t++)                                                     \
                    for (int j = 0; j < NB; j++)                                                \
                        acc[j][m] = _mm512_dpbf16_ps(acc[j][m], av, w[t][j]);                   \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < MR; m++) {                                                          \
            for (int j = 0; j < NB - 1; j++)                                                    \
                _mm512_storeu_ps(out + m * ldo + 16 * j, _mm512_mul_ps(acc[j][m], scale));      \
            _mm512_mask_storeu_ps(out + m * ldo + 16 * (NB - 1), last,                          \
                                  _mm512_mul_ps(acc[NB - 1][m], scale));                        \
        }                                                                                       \
    }
#define NT_ROWS(T, NB) NT_BLOCK(T, NB, 1) NT_BLOCK(T, NB, 2) NT_BLOCK(T, NB, 3) \
                       NT_BLOCK(T, NB, 4) NT_BLOCK(T, NB, 5) NT_BLOCK(T, NB, 6)
NT_ROWS(1, 1)
NT_ROWS(1, 2)
NT_ROWS(1, 3)
NT_ROWS(1, 4)
NT_ROWS(2, 1)
NT_ROWS(2, 2)
NT_ROWS(2, 3)
NT_ROWS(2, 4)

typedef void (*nt_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t,
                      __m512, __mmask16);
#define NT_TABLE(T, NB)                                                                     \
    {0, nt_##T##_##NB##_1, nt_##T##_##NB##_2, nt_##T##_##NB##_3, nt_##T##_##NB##_4,         \
     nt_##T##_##NB##_5, nt_##T##_##NB##_6}
static const nt_fn NT[3][5][ROWS + 1] = {
    {{0}},
    {{0}, NT_TABLE(1, 1), NT_TABLE(1, 2), NT_TABLE(1, 3), NT_TABLE(1, 4)},
    {{0}, NT_TABLE(2, 1), NT_TABLE(2, 2), NT_TABLE(2, 3), NT_TABLE(2, 4)}};

/* fp32 bits -> the nearest bf16 (ties to even), as torch casts; NaN stays NaN */
static inline uint16_t bf16_of(uint32_t bits) {
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* `cols` (<= 64) rows of w, K wide, as [K/2][T][4][16][2]: a bf16 w as it is (T = 1), an fp32 w
 * as its nearest bf16 and the bf16 of what that leaves (T = 2: 16 bits of w's 24, against 8);
 * columns past `cols` are zero */
static void pack_unit(const void *w, int64_t ldw, int64_t cols, int64_t K, int T,
                      uint16_t *pack) {
    memset(pack, 0, (size_t)K * COLS * T * sizeof *pack);
    for (int64_t c = 0; c < cols; c++) {
        uint16_t *dst = pack + (c / 16) * 32 + (c % 16) * 2;
        if (T == 1) {
            const uint16_t *row = (const uint16_t *)w + c * ldw;
            for (int64_t kp = 0; kp < K / 2; kp++) {
                dst[kp * 4 * 32] = row[2 * kp];
                dst[kp * 4 * 32 + 1] = row[2 * kp + 1];
            }
            continue;
        }
        const float *row = (const float *)w + c * ldw;
        for (int64_t k = 0; k < K; k++) {
            uint32_t bits, hi_bits;
            memcpy(&bits, row + k, sizeof bits);
            const uint16_t hi = bf16_of(bits);
            hi_bits = (uint32_t)hi << 16;
            float hi_value, rest;
            memcpy(&hi_value, &hi_bits, sizeof hi_value);
            rest = row[k] - hi_value;
            memcpy(&bits, &rest, sizeof bits);
            uint16_t *at = dst + (k / 2) * 2 * 4 * 32 + k % 2;
            at[0] = hi;
            at[4 * 32] = bf16_of(bits);
        }
    }
}

/* Returns 0, or 1 where the shapes are not taken (K odd or not positive, T not 1 or 2). `w` is
 * bf16 for T = 1, fp32 for T = 2; `pack` holds threads * K * 64 * T bf16. */
int relayrl_nt_product_bf16(const uint16_t *a, int64_t a_batch, int64_t lda, const void *w,
                            int64_t w_batch, int64_t ldw, int T, float *out, int64_t out_batch,
                            int64_t ldo, int64_t batch, int64_t M, int64_t N, int64_t K,
                            float scale, uint16_t *pack, int threads) {
    if (K <= 0 || K % 2 || M < 0 || N < 0 || batch < 0 || T < 1 || T > 2) return 1;
    const int64_t per_entry = (N + COLS - 1) / COLS, units = batch * per_entry;
    const int64_t w_item = T == 1 ? 2 : 4;
    const __m512 vscale = _mm512_set1_ps(scale);
#pragma omp parallel num_threads(threads) if (threads > 1 && units > 1)
    {
        int thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        uint16_t *mine = pack + (int64_t)thread * K * COLS * T;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            const int64_t b = u / per_entry, n0 = (u % per_entry) * COLS;
            const int64_t cols = N - n0 < COLS ? N - n0 : COLS;
            const int nb = (int)((cols + 15) / 16);
            const int tail = (int)(cols - 16 * (nb - 1));
            const __mmask16 last = (__mmask16)(tail == 16 ? 0xFFFF : (1u << tail) - 1);
            pack_unit((const char *)w + (b * w_batch + n0 * ldw) * w_item, ldw, cols, K, T, mine);
            const uint16_t *ab = a + b * a_batch;
            float *ob = out + b * out_batch + n0;
            for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
                const int mr = (int)(M - m0 < ROWS ? M - m0 : ROWS);
                NT[T][nb][mr](ab + m0 * lda, lda, mine, K, ob + m0 * ldo, ldo, vscale, last);
            }
        }
    }
    return 0;
}

#else

int relayrl_train_kernels_ready(void) { return 0; }

int relayrl_nt_product_bf16(void) { return 2; }
int relayrl_softmax_bf16(void) { return 2; }
int relayrl_softmax_grad_bf16(void) { return 2; }
int relayrl_rms_norm_bf16(void) { return 2; }
int relayrl_rms_norm_grad_bf16(void) { return 2; }
int relayrl_swiglu_bf16(void) { return 2; }
int relayrl_swiglu_grad_bf16(void) { return 2; }
int relayrl_rotary_bf16(void) { return 2; }

#endif
