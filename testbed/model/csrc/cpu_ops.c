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
 * One sequence at a time, all its heads together, so that each K row (all KV heads, contiguous) is
 * read once, in order, for every query head: scores, then a softmax per head, then the weighted sum
 * of V, a few rows at a time for every head. Query heads go GB = 4, 2 or 1 at a time (GB divides
 * G = H / Hkv, the heads sharing a KV head), each K and V vector loaded once for the GB of them.
 * Scores come 8 dot products at a time (GB heads x 8 / GB rows), reduced together by a transposing
 * horizontal sum, so no score waits on a serial sum of its own. Rows are prefetched AHEAD rows
 * ahead, the first V rows during the last scores and the next sequence's first K rows during the
 * last of V, since a sequence's blocks are scattered over the pool. head_dim / 8 vectors per row is
 * a compile-time constant per variant. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));
enum { AHEAD = 16, VROWS = 16 }; /* rows prefetched ahead; V rows per pass over the heads */

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

/* One sequence: q its H query heads of NV * 8; kc, vc the caches at KV head 0; off each token's row
 * offset, padded past len to a multiple of 8, plus AHEAD, with the last row's (so a partial chunk
 * and the prefetches read only rows in bounds; the extra scores are never used); s H rows of lp
 * scores; inv H floats; o the H output rows. len > 0, GB divides G. */
#define DEFINE_SEQ(NV, GB)                                                                              \
static void seq_##NV##_##GB(const float *restrict q, const float *restrict kc, const float *restrict vc,  \
                            const int64_t *restrict off, const int64_t *restrict next, int len, int lp, int H, \
                            int G, float scale, float *restrict s, float *restrict inv, float *restrict o) { \
    enum { D = NV * 8, R = 8 / GB, CV = NV * GB <= 16 ? NV : 16 / GB };                                 \
    for (int t = 0; t < len; t += R) /* scores, R rows x GB heads at a time */                          \
        for (int x = 0, e = 0, hd = -D, first; x < H; x += GB) { /* KV head hd / D */                   \
            if ((first = x == e)) { e += G; hd += D; } /* first of its KV head */                       \
            const float *kh = kc + hd, *vh = vc + hd, *k[R], *qx = q + x * D;                           \
            v8 d[8];                                                                                    \
            for (int r = 0; r < R; r++) k[r] = kh + off[t + r];                                         \
            if (first)                                                                                  \
                for (int r = 0; r < R; r++) { /* then the first V rows */                               \
                    int a = t + AHEAD + r;                                                              \
                    const float *p = a < len ? kh + off[a] : vh + off[a - len];                         \
                    for (int i = 0; i < NV; i += 2) __builtin_prefetch(p + 8 * i);                      \
                }                                                                                       \
            for (int r = 0; r < R; r++) {                                                               \
                v8 kv = load8(k[r]);                                                                    \
                for (int g = 0; g < GB; g++) d[g * R + r] = load8(qx + g * D) * kv;                     \
            }                                                                                           \
            for (int i = 1; i < NV; i++)                                                                \
                for (int r = 0; r < R; r++) {                                                           \
                    v8 kv = load8(k[r] + 8 * i);                                                        \
                    for (int g = 0; g < GB; g++) d[g * R + r] += load8(qx + g * D + 8 * i) * kv;        \
                }                                                                                       \
            float sc[8];                                                                                \
            store8(sc, hsum8x8(d) * scale);                                                             \
            for (int g = 0; g < GB; g++) memcpy(s + (x + g) * lp + t, sc + g * R, sizeof(float) * R);   \
        }                                                                                               \
    for (int x = 0; x < H; x++) { /* softmax */                                                         \
        float *sx = s + x * lp, m = -FLT_MAX, sum = 0.f;                                                \
        for (int t = 0; t < len; t++) m = sx[t] > m ? sx[t] : m;                                        \
        for (int t = 0; t < len; t++) { sx[t] = expf(sx[t] - m); sum += sx[t]; }                        \
        inv[x] = 1.f / sum;                                                                             \
    }                                                                                                   \
    memset(o, 0, sizeof(float) * H * D);                                                                \
    for (int t0 = 0; t0 < len; t0 += VROWS) { /* probabilities x V, VROWS rows for every head */        \
        int t1 = len - t0 < VROWS ? len : t0 + VROWS;                                                   \
        for (int x = 0, e = 0, hd = -D, first; x < H; x += GB) { /* KV head hd / D */                   \
            if ((first = x == e)) { e += G; hd += D; } /* first of its KV head */                       \
            const float *vh = vc + hd, *kh = kc + hd;                                                   \
            for (int c = 0; c < NV; c += CV) { /* CV vectors of each row at a time */                   \
                v8 acc[GB][CV];                                                                         \
                for (int g = 0; g < GB; g++)                                                            \
                    for (int i = 0; i < CV; i++) acc[g][i] = load8(o + (x + g) * D + (c + i) * 8);      \
                for (int t = t0; t < t1; t++) {                                                         \
                    const float *v = vh + off[t] + 8 * c;                                               \
                    if (first) { /* then the next sequence's first K rows */                            \
                        int a = t + VROWS;                                                              \
                        const float *p = a < len ? vh + off[a] : kh + next[a - len];                    \
                        for (int i = 0; i < CV; i += 2) __builtin_prefetch(p + 8 * (c + i));            \
                    }                                                                                   \
                    for (int i = 0; i < CV; i++) {                                                      \
                        v8 vv = load8(v + 8 * i);                                                       \
                        for (int g = 0; g < GB; g++) acc[g][i] += s[(x + g) * lp + t] * vv;             \
                    }                                                                                   \
                }                                                                                       \
                for (int g = 0; g < GB; g++)                                                            \
                    for (int i = 0; i < CV; i++) store8(o + (x + g) * D + (c + i) * 8, acc[g][i]);      \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    for (int x = 0; x < H; x++)                                                                         \
        for (int i = 0; i < NV; i++) store8(o + x * D + i * 8, load8(o + x * D + i * 8) * inv[x]);      \
}

#define DEFINE_SEQS(NV) DEFINE_SEQ(NV, 1) DEFINE_SEQ(NV, 2) DEFINE_SEQ(NV, 4)
DEFINE_SEQS(1)   /* head_dim 8 */
DEFINE_SEQS(2)   /* 16 */
DEFINE_SEQS(4)   /* 32 */
DEFINE_SEQS(8)   /* 64 */
DEFINE_SEQS(16)  /* 128 */
DEFINE_SEQS(32)  /* 256 */

typedef void (*seq_fn)(const float *, const float *, const float *, const int64_t *, const int64_t *, int, int, int,
                       int, float, float *, float *, float *);
#define SEQS(NV) {seq_##NV##_1, seq_##NV##_2, seq_##NV##_4}

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
 * length reaches (bad: the sequence and the value); 5 for a block_size or Hkv below 1. Nothing is read
 * before the tables are checked. */
int paged_decode_f32(const float *restrict q, int64_t q_stride, const float *restrict k_cache,
                     const float *restrict v_cache, int64_t block_stride, int64_t row_stride,
                     const int32_t *restrict tables, int64_t table_stride, const int32_t *restrict kv_lens, int n, int H,
                     int Hkv, int head_dim, int block_size, float scale, float *restrict out, int table_width,
                     int64_t num_blocks, int64_t *bad) {
    static const seq_fn variants[6][3] = {SEQS(1), SEQS(2), SEQS(4), SEQS(8), SEQS(16), SEQS(32)};
    int v = head_dim == 8 ? 0 : head_dim == 16 ? 1 : head_dim == 32 ? 2 : head_dim == 64 ? 3 : head_dim == 128 ? 4
          : head_dim == 256 ? 5 : -1;
    if (v < 0) return 2;
    if (block_size < 1 || Hkv < 1) return 5; /* both divide below: SIGFPE, not an error, otherwise */
    int rc = check_tables(tables, table_stride, kv_lens, n, table_width, block_size, num_blocks, bad);
    if (rc) return rc;
    int G = H / Hkv, max_len = 1;
    seq_fn fn = variants[v][G % 4 == 0 ? 2 : G % 2 == 0 ? 1 : 0];
    for (int b = 0; b < n; b++) max_len = kv_lens[b] > max_len ? kv_lens[b] : max_len;
    int lp_max = (max_len + 7) & ~7;
    /* scores and 1 / sums of every query head; the row offsets of every sequence, each padded to
     * lp_max + AHEAD with its last row's (an empty sequence's are never read) */
    int64_t stride = lp_max + AHEAD;
    float *s = malloc(sizeof(float) * ((size_t)lp_max + 1) * H);
    int64_t *offs = malloc(sizeof(int64_t) * (size_t)stride * (n > 0 ? n : 1));
    if (!s || !offs) {
        free(s); free(offs);
        return 1;
    }
    for (int b = 0; b < n; b++) {
        int len = kv_lens[b];
        const int32_t *table = tables + b * table_stride;
        int64_t *off = offs + b * stride;
        for (int t0 = 0, j = 0, t = 0; t0 < len; t0 += block_size, j++)
            for (int r = 0; r < block_size && t < len; r++, t++) off[t] = table[j] * block_stride + r * row_stride;
        for (int t = len; len && t < stride; t++) off[t] = off[len - 1];
    }
    for (int b = 0, next = 0; b < n; b++) {
        int len = kv_lens[b], lp = (len + 7) & ~7;
        float *ob = out + (int64_t)b * H * head_dim;
        if (!len) { /* an empty sequence (a padded row) yields zeros */
            memset(ob, 0, sizeof(float) * (size_t)H * head_dim);
            continue;
        }
        for (next = next > b ? next : b + 1; next < n && !kv_lens[next]; next++) {}
        fn(q + b * q_stride, k_cache, v_cache, offs + b * stride, offs + (next < n ? next : b) * stride, len, lp, H,
           G, scale, s, s + (size_t)lp * H, ob);
    }
    free(s);
    free(offs);
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
