/* CPU kernels for the engine's hot path in float32, where a step of a small model is a few dozen
 * torch calls of microseconds each: paged decode attention that reads K and V in place through
 * the block table (no gathered, padded copy), RMSNorm, RoPE and SiLU-and-multiply each as one call.
 *
 * Built on first use by testbed/model/cpu_ops.py with the host C compiler and called through
 * ctypes. Each function takes raw pointers and element strides; paged_decode_f32 and rotary_f32
 * return 0 or why they did not run (an index out of bounds is found before any memory is read
 * through it), the others nothing. Math is float32 as in the torch reference; the
 * order of additions differs (vectorised sums), as between any two BLAS libraries.
 *
 * Paged layout, in elements: block b's token row r of one layer starts at
 * cache + b * block_stride + r * row_stride, and KV head h at + h * head_dim (a layer's view of the
 * block-major pool, or a cache of its own). q is (n, H, head_dim) with rows q_stride apart, out the
 * same contiguous.
 * One (sequence, KV head) at a time, for the G = H / Hkv query heads sharing it, GB = 4, 2 or 1 of
 * them per pass so that each K and V row is read once per GB heads instead of once per head: every
 * score, then a softmax over them, then the weighted sum of V. Scores come 8 dot products at a time
 * (GB heads x 8 / GB rows), reduced together by a transposing horizontal sum, so no score waits on
 * a serial sum of its own. head_dim / 8 vectors per row is a compile-time constant per variant. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
#ifndef PF
#define PF 16
#endif

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 v) {
    float r = 0.f;
    for (int i = 0; i < 8; i++) r += v[i];
    return r;
}

/* (sum of d[0], ..., sum of d[7]) as one vector */
static inline v8 hsum8x8(const v8 *d) {
#ifdef __AVX__
    __m256 t0 = _mm256_hadd_ps((__m256)d[0], (__m256)d[1]), t1 = _mm256_hadd_ps((__m256)d[2], (__m256)d[3]);
    __m256 t2 = _mm256_hadd_ps((__m256)d[4], (__m256)d[5]), t3 = _mm256_hadd_ps((__m256)d[6], (__m256)d[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* low and high halves of 0-3, 4-7 */
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    return (v8){hsum8(d[0]), hsum8(d[1]), hsum8(d[2]), hsum8(d[3]), hsum8(d[4]), hsum8(d[5]), hsum8(d[6]),
                hsum8(d[7])};
#endif
}

/* GB query heads (q rows of NV * 8) over one KV head. off: each token's row offset into kc and vc,
 * padded to a multiple of 8 with the last row's (so a partial chunk reads only rows in bounds, its
 * extra scores are never used); s: GB rows of lp scores; o: GB output rows. len > 0. */
#define DEFINE_HEAD(NV, GB)                                                                             \
static void head_##NV##_##GB(const float *restrict qh, const float *restrict kc, const float *restrict vc, \
                             const int64_t *restrict off, int len, int lp, float scale, float *restrict s, \
                             float *restrict o) {                                                       \
    enum { R = 8 / GB, CV = NV * GB <= 16 ? NV : 16 / GB };                                              \
    v8 qv[GB][NV];                                                                                      \
    for (int g = 0; g < GB; g++)                                                                        \
        for (int i = 0; i < NV; i++) qv[g][i] = load8(qh + (g * NV + i) * 8) * scale;                   \
    for (int t = 0; t < len; t += R) { /* scores, R rows x GB heads at a time */                        \
        v8 d[8];                                                                                        \
        const float *k[R];                                                                              \
        for (int r = 0; r < R; r++) k[r] = kc + off[t + r];                                             \
        for (int r = 0; r < R; r++)                                                                     \
            for (int i = 0; i < NV; i += 2) {                                                           \
                __builtin_prefetch(kc + off[t + PF + r] + 8 * i);                                       \
                __builtin_prefetch(vc + off[t + r] + 8 * i);                                            \
            }                                                                                           \
        for (int r = 0; r < R; r++) {                                                                   \
            v8 kv = load8(k[r]);                                                                        \
            for (int g = 0; g < GB; g++) d[g * R + r] = qv[g][0] * kv;                                  \
        }                                                                                               \
        for (int i = 1; i < NV; i++)                                                                    \
            for (int r = 0; r < R; r++) {                                                               \
                v8 kv = load8(k[r] + 8 * i);                                                            \
                for (int g = 0; g < GB; g++) d[g * R + r] += qv[g][i] * kv;                             \
            }                                                                                           \
        float x[8];                                                                                     \
        store8(x, hsum8x8(d));                                                                          \
        for (int g = 0; g < GB; g++) memcpy(s + g * lp + t, x + g * R, sizeof(float) * R);             \
    }                                                                                                   \
    float inv[GB];                                                                                      \
    for (int g = 0; g < GB; g++) { /* softmax */                                                        \
        float *sg = s + g * lp, m = -FLT_MAX, sum = 0.f;                                                \
        for (int t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;                                        \
        for (int t = 0; t < len; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }                        \
        inv[g] = 1.f / sum;                                                                             \
    }                                                                                                   \
    for (int c = 0; c < NV; c += CV) { /* probabilities x V, CV vectors of each row at a time */        \
        v8 acc[GB][CV];                                                                                 \
        for (int g = 0; g < GB; g++)                                                                    \
            for (int i = 0; i < CV; i++) acc[g][i] = (v8){0};                                           \
        for (int t = 0; t < len; t++) {                                                                 \
            const float *v = vc + off[t] + 8 * c;                                                       \
            for (int i = 0; i < CV; i++) {                                                              \
                v8 vv = load8(v + 8 * i);                                                               \
                for (int g = 0; g < GB; g++) acc[g][i] += s[g * lp + t] * vv;                           \
            }                                                                                           \
        }                                                                                               \
        for (int g = 0; g < GB; g++)                                                                    \
            for (int i = 0; i < CV; i++) store8(o + (g * NV + c + i) * 8, acc[g][i] * inv[g]);          \
    }                                                                                                   \
}

#define DEFINE_HEADS(NV) DEFINE_HEAD(NV, 1) DEFINE_HEAD(NV, 2) DEFINE_HEAD(NV, 4)
DEFINE_HEADS(1)   /* head_dim 8 */
DEFINE_HEADS(2)   /* 16 */
DEFINE_HEADS(4)   /* 32 */
DEFINE_HEADS(8)   /* 64 */
DEFINE_HEADS(16)  /* 128 */
DEFINE_HEADS(32)  /* 256 */

typedef void (*head_fn)(const float *, const float *, const float *, const int64_t *, int, int, float, float *,
                        float *);
#define HEADS(NV) {head_##NV##_1, head_##NV##_2, head_##NV##_4}

/* Every block the sequences will read lies in the pool, and every length fits its table row; else
 * the first violation: bad[0] its sequence, bad[1] the offending value (a length or a block id). */
static int check_tables(const int32_t *tables, int64_t table_stride, const int32_t *kv_lens, int n,
                        int table_width, int block_size, int64_t num_blocks, int64_t *bad) {
    for (int b = 0; b < n; b++) {
        int len = kv_lens[b];
        if (len < 0 || (int64_t)len > (int64_t)table_width * block_size) {
            bad[0] = b; bad[1] = len;
            return 3;
        }
        for (int j = 0; j < (len + block_size - 1) / block_size; j++) {
            int32_t id = tables[b * table_stride + j];
            if (id < 0 || id >= num_blocks) {
                bad[0] = b; bad[1] = id;
                return 4;
            }
        }
    }
    return 0;
}

/* Returns 0; 1 when scratch cannot be allocated; 2 for a head_dim without a variant; 3 for a kv_len
 * outside [0, table_width * block_size]; 4 for a block id outside [0, num_blocks) among those a
 * length reaches (bad: the sequence and the value). Nothing is read before the tables are checked. */
int paged_decode_f32(const float *restrict q, int64_t q_stride, const float *restrict k_cache,
                     const float *restrict v_cache, int64_t block_stride, int64_t row_stride,
                     const int32_t *restrict tables, int64_t table_stride, const int32_t *restrict kv_lens, int n, int H,
                     int Hkv, int head_dim, int block_size, float scale, float *restrict out, int table_width,
                     int64_t num_blocks, int64_t *bad) {
    static const head_fn variants[6][3] = {HEADS(1), HEADS(2), HEADS(4), HEADS(8), HEADS(16), HEADS(32)};
    int v = head_dim == 8 ? 0 : head_dim == 16 ? 1 : head_dim == 32 ? 2 : head_dim == 64 ? 3 : head_dim == 128 ? 4
          : head_dim == 256 ? 5 : -1;
    if (v < 0) return 2;
    int rc = check_tables(tables, table_stride, kv_lens, n, table_width, block_size, num_blocks, bad);
    if (rc) return rc;
    int G = H / Hkv, max_len = 1;
    for (int b = 0; b < n; b++) max_len = kv_lens[b] > max_len ? kv_lens[b] : max_len;
    int lp_max = (max_len + 7) & ~7;
    /* scores of up to 4 query heads, and the row offsets of one sequence */
    float *s = malloc(sizeof(float) * (size_t)lp_max * 4);
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(lp_max + PF));
    if (!s || !off) {
        free(s); free(off);
        return 1;
    }
    for (int b = 0; b < n; b++) {
        int len = kv_lens[b], lp = (len + 7) & ~7;
        float *ob = out + (int64_t)b * H * head_dim;
        if (!len) { /* an empty sequence (a padded row) yields zeros */
            memset(ob, 0, sizeof(float) * (size_t)H * head_dim);
            continue;
        }
        const int32_t *table = tables + b * table_stride;
        for (int t0 = 0, j = 0, t = 0; t0 < len; t0 += block_size, j++)
            for (int r = 0; r < block_size && t < len; r++, t++) off[t] = table[j] * block_stride + r * row_stride;
        for (int t = len; t < lp + PF; t++) off[t] = off[len - 1];
        for (int h = 0; h < Hkv; h++)
            for (int g = h * G, end = g + G; g < end;) {
                int w = end - g >= 4 ? 2 : end - g >= 2 ? 1 : 0;
                variants[v][w](q + b * q_stride + g * head_dim, k_cache + h * head_dim, v_cache + h * head_dim, off,
                               len, lp, scale, s, ob + (int64_t)g * head_dim);
                g += 1 << w;
            }
    }
    free(s);
    free(off);
    return 0;
}

/* out[i] = x[i] * rsqrt(mean(x[i]^2) + eps) * w, row by row; x rows `x_stride` apart, out contiguous. */
void rms_norm_f32(const float *restrict x, int64_t x_stride, const float *restrict w, float eps, int64_t rows,
                  int64_t dim, float *restrict out) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * x_stride;
        float *oi = out + i * dim, ss = 0.f;
        for (int64_t d = 0; d < dim; d++) ss += xi[d] * xi[d];
        float r = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) oi[d] = xi[d] * r * w[d];
    }
}

/* RoPE in the Hugging Face layout (the two halves of each head rotated): x (T, heads, D) with rows
 * `x_stride` apart and heads contiguous within a row; table (2, max_len, D) of cos then sin;
 * out (T, heads, D) contiguous. Returns 0, or 1 for a position outside [0, max_len) (bad: the
 * token and the position), found before anything is read. */
int rotary_f32(const float *restrict x, int64_t x_stride, const int64_t *restrict positions,
               const float *restrict table, int64_t max_len, int64_t tokens, int64_t heads, int64_t dim,
               float *restrict out, int64_t *bad) {
    int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_len) {
            bad[0] = t; bad[1] = positions[t];
            return 1;
        }
    for (int64_t t = 0; t < tokens; t++) {
        const float *cos = table + positions[t] * dim, *sin = cos + max_len * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + h * dim;
            float *oh = out + (t * heads + h) * dim;
            for (int64_t d = 0; d < half; d++) {
                oh[d] = xh[d] * cos[d] - xh[d + half] * sin[d];
                oh[d + half] = xh[d + half] * cos[d + half] + xh[d] * sin[d + half];
            }
        }
    }
    return 0;
}

/* out[i] = silu(gate[i]) * up[i] where each row of x is gate (inter) then up (inter). */
void silu_mul_f32(const float *restrict x, int64_t rows, int64_t inter, float *restrict out) {
    for (int64_t i = 0; i < rows; i++) {
        const float *g = x + i * 2 * inter, *u = g + inter;
        float *o = out + i * inter;
        for (int64_t d = 0; d < inter; d++) o[d] = g[d] / (1.f + expf(-g[d])) * u[d];
    }
}
