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
 * One (sequence, KV head) at a time, for the G = H / Hkv query heads sharing it: every score, then a
 * softmax over them, then the weighted sum of V. head_dim / 8 vectors per row is a compile-time
 * constant per variant, so a dot product is a few vector FMAs and one horizontal sum. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 v) {
    float r = 0.f;
    for (int i = 0; i < 8; i++) r += v[i];
    return r;
}

#define DEFINE_HEAD(NV)                                                                                 \
static void head_##NV(const float *restrict qh, const float *restrict kc, const float *restrict vc,       \
                      const int32_t *restrict table, int64_t block_stride, int64_t row_stride, int len,   \
                      int G, int block_size, float scale, float *restrict s, float *restrict o) {         \
    for (int g = 0; g < G; g++) {                                                                       \
        v8 qv[NV], acc[NV];                                                                             \
        for (int i = 0; i < NV; i++) qv[i] = load8(qh + (g * NV + i) * 8) * scale;                      \
        float *sg = s + (int64_t)g * len, m = -FLT_MAX, sum = 0.f;                                      \
        for (int t0 = 0, j = 0; t0 < len; t0 += block_size, j++) { /* scores */                         \
            const float *k = kc + table[j] * block_stride;                                              \
            int end = len - t0 < block_size ? len - t0 : block_size;                                    \
            for (int t = 0; t < end; t++, k += row_stride) {                                            \
                v8 d = qv[0] * load8(k);                                                                \
                for (int i = 1; i < NV; i++) d += qv[i] * load8(k + 8 * i);                             \
                float x = hsum8(d);                                                                     \
                sg[t0 + t] = x;                                                                         \
                m = x > m ? x : m;                                                                      \
            }                                                                                           \
        }                                                                                               \
        for (int t = 0; t < len; t++) { sg[t] = expf(sg[t] - m); sum += sg[t]; }                        \
        for (int i = 0; i < NV; i++) acc[i] = (v8){0};                                                  \
        for (int t0 = 0, j = 0; t0 < len; t0 += block_size, j++) { /* probabilities x V */              \
            const float *v = vc + table[j] * block_stride;                                              \
            int end = len - t0 < block_size ? len - t0 : block_size;                                    \
            for (int t = 0; t < end; t++, v += row_stride) {                                            \
                float p = sg[t0 + t];                                                                   \
                for (int i = 0; i < NV; i++) acc[i] += p * load8(v + 8 * i);                            \
            }                                                                                           \
        }                                                                                               \
        float inv = len ? 1.f / sum : 0.f; /* an empty sequence (a padded row) yields zeros */          \
        for (int i = 0; i < NV; i++) store8(o + (g * NV + i) * 8, acc[i] * inv);                        \
    }                                                                                                   \
}

DEFINE_HEAD(1)   /* head_dim 8 */
DEFINE_HEAD(2)   /* 16 */
DEFINE_HEAD(4)   /* 32 */
DEFINE_HEAD(8)   /* 64 */
DEFINE_HEAD(16)  /* 128 */
DEFINE_HEAD(32)  /* 256 */

typedef void (*head_fn)(const float *, const float *, const float *, const int32_t *, int64_t, int64_t, int, int,
                        int, float, float *, float *);

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
    head_fn fn = head_dim == 8 ? head_1 : head_dim == 16 ? head_2 : head_dim == 32 ? head_4 : head_dim == 64 ? head_8
               : head_dim == 128 ? head_16 : head_dim == 256 ? head_32 : NULL;
    if (!fn) return 2;
    int rc = check_tables(tables, table_stride, kv_lens, n, table_width, block_size, num_blocks, bad);
    if (rc) return rc;
    int G = H / Hkv, max_len = 1;
    for (int b = 0; b < n; b++) max_len = kv_lens[b] > max_len ? kv_lens[b] : max_len;
    float *s = malloc(sizeof(float) * (size_t)max_len * G);  /* scores of one (sequence, KV head) */
    if (!s) return 1;
    for (int b = 0; b < n; b++)
        for (int h = 0; h < Hkv; h++)
            fn(q + b * q_stride + h * G * head_dim, k_cache + h * head_dim, v_cache + h * head_dim,
               tables + b * table_stride, block_stride, row_stride, kv_lens[b], G, block_size, scale, s,
               out + ((int64_t)b * H + h * G) * head_dim);
    free(s);
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
