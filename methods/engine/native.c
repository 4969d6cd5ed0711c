/* The engine's native kernels (fp32, AVX2 + FMA), built by `native.py` with `-O3 -mavx2 -mfma
 * -ffp-contract=off -fopenmp` once per machine class and linked to the OpenMP runtime torch has
 * already loaded (one thread pool; `torch.set_num_threads` applies).
 *
 * decodebench_linear_f32: y = x W^T (+ b) for a few rows of x, for the case that matters on a
 *   CPU: W streamed once from memory at the machine's bandwidth. W [out, in] and x [rows, in]
 *   row-major and contiguous, y [rows, out]. Each OpenMP thread takes blocks of 8 consecutive rows
 *   of W and computes them against every row of x: one row against all 8 at once (a decode step),
 *   several rows three at a time against 4 (12 accumulators), then two. Summation is the same
 *   for every row count, so a row's result does not depend on how many rows share the call: 8
 *   lanes of fused multiply-adds in one chain per output, then the lanes pairwise, then the tail
 *   of `in` % 8 in order (not MKL's order: same fp32 class, not the same bits).
 * decodebench_rms_norm_f32, decodebench_rope_store_f32: bit for bit what torch's eager ops compute
 *   (tests/test_native.py), in one call instead of four to ten. */
#include <immintrin.h>
#include <math.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r, o0 .. o0+nb-1] for rows r0 .. r0+2 of x against 4 weight rows w[0..3] (12 accumulators) */
static inline void rows3x4(const float *const w[4], const float *x, const float *b, float *y, long out, long in,
                           long body, long o0, long nb, long r) {
    const float *x0 = x + r * in, *x1 = x0 + in, *x2 = x1 + in;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (long i = 0; i < body; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(w[0] + i), w1 = _mm256_loadu_ps(w[1] + i);
        const __m256 w2 = _mm256_loadu_ps(w[2] + i), w3 = _mm256_loadu_ps(w[3] + i);
        __m256 v = _mm256_loadu_ps(x0 + i);
        a00 = _mm256_fmadd_ps(w0, v, a00); a01 = _mm256_fmadd_ps(w1, v, a01);
        a02 = _mm256_fmadd_ps(w2, v, a02); a03 = _mm256_fmadd_ps(w3, v, a03);
        v = _mm256_loadu_ps(x1 + i);
        a10 = _mm256_fmadd_ps(w0, v, a10); a11 = _mm256_fmadd_ps(w1, v, a11);
        a12 = _mm256_fmadd_ps(w2, v, a12); a13 = _mm256_fmadd_ps(w3, v, a13);
        v = _mm256_loadu_ps(x2 + i);
        a20 = _mm256_fmadd_ps(w0, v, a20); a21 = _mm256_fmadd_ps(w1, v, a21);
        a22 = _mm256_fmadd_ps(w2, v, a22); a23 = _mm256_fmadd_ps(w3, v, a23);
    }
    float s[3][4] = {{hsum(a00), hsum(a01), hsum(a02), hsum(a03)},
                     {hsum(a10), hsum(a11), hsum(a12), hsum(a13)},
                     {hsum(a20), hsum(a21), hsum(a22), hsum(a23)}};
    for (int k = 0; k < 3; k++) {
        const float *xk = x0 + k * in;
        for (int j = 0; j < nb; j++) {
            for (long i = body; i < in; i++) s[k][j] += w[j][i] * xk[i];
            y[(r + k) * out + o0 + j] = s[k][j] + (b ? b[o0 + j] : 0.0f);
        }
    }
}

/* the same for rows r0, r0+1 (8 accumulators) */
static inline void rows2x4(const float *const w[4], const float *x, const float *b, float *y, long out, long in,
                           long body, long o0, long nb, long r) {
    const float *x0 = x + r * in, *x1 = x0 + in;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    for (long i = 0; i < body; i += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i);
        const __m256 w0 = _mm256_loadu_ps(w[0] + i), w1 = _mm256_loadu_ps(w[1] + i);
        const __m256 w2 = _mm256_loadu_ps(w[2] + i), w3 = _mm256_loadu_ps(w[3] + i);
        a00 = _mm256_fmadd_ps(w0, v0, a00); a01 = _mm256_fmadd_ps(w1, v0, a01);
        a02 = _mm256_fmadd_ps(w2, v0, a02); a03 = _mm256_fmadd_ps(w3, v0, a03);
        a10 = _mm256_fmadd_ps(w0, v1, a10); a11 = _mm256_fmadd_ps(w1, v1, a11);
        a12 = _mm256_fmadd_ps(w2, v1, a12); a13 = _mm256_fmadd_ps(w3, v1, a13);
    }
    float s0[4] = {hsum(a00), hsum(a01), hsum(a02), hsum(a03)};
    float s1[4] = {hsum(a10), hsum(a11), hsum(a12), hsum(a13)};
    for (int j = 0; j < nb; j++) {
        for (long i = body; i < in; i++) {
            s0[j] += w[j][i] * x0[i];
            s1[j] += w[j][i] * x1[i];
        }
        const float bj = b ? b[o0 + j] : 0.0f;
        y[r * out + o0 + j] = s0[j] + bj;
        y[(r + 1) * out + o0 + j] = s1[j] + bj;
    }
}

/* one row of x against nb (<= 8) weight rows w[0..7] (8 accumulators: a decode step's GEMV
 * keeps 8 weight rows streaming at once) */
static inline void row1x8(const float *const w[8], const float *x, const float *b, float *y, long out, long in,
                          long body, long o0, long nb, long r) {
    const float *x0 = x + r * in;
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (long i = 0; i < body; i += 8) {
        const __m256 v = _mm256_loadu_ps(x0 + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w[j] + i), v, a[j]);
    }
    for (int j = 0; j < nb; j++) {
        float s = hsum(a[j]);
        for (long i = body; i < in; i++) s += w[j][i] * x0[i];
        y[r * out + o0 + j] = s + (b ? b[o0 + j] : 0.0f);
    }
}

void decodebench_linear_f32(const float *W, const float *x, const float *b, float *y,
                            long out, long in, long rows) {
    const long blocks = (out + 7) / 8, body = in - in % 8;
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        const long o8 = blk * 8, n8 = out - o8 < 8 ? out - o8 : 8;
        const float *w[8];
        for (int j = 0; j < 8; j++) w[j] = W + (o8 + (j < n8 ? j : 0)) * in;  /* past the end: a stand-in, unused */
        long r = 0;
        for (long o0 = o8; o0 < o8 + n8 && rows > 1; o0 += 4) {  /* several rows: two halves of 4 */
            const long nb = o8 + n8 - o0 < 4 ? o8 + n8 - o0 : 4;
            const float *w4[4];
            for (int j = 0; j < 4; j++) w4[j] = w[o0 - o8 + (j < nb ? j : 0)];
            for (r = 0; r + 3 <= rows; r += 3) rows3x4(w4, x, b, y, out, in, body, o0, nb, r);
            for (; r + 2 <= rows; r += 2) rows2x4(w4, x, b, y, out, in, body, o0, nb, r);
        }
        for (; r < rows; r++) row1x8(w, x, b, y, out, in, body, o8, n8, r);  /* the rows left: 0 or 1 */
    }
}

/* RMSNorm as `transformers`' LlamaRMSNorm computes it in fp32, given its statistic (variance =
 * mean(x^2) over the row, computed by torch so that its summation order is torch's own):
 * y = w * (x * (1 / sqrt(variance + eps))), each product rounded on its own (-ffp-contract=off). */
void decodebench_rms_norm_f32(const float *x, const float *variance, const float *w, float *y,
                              long rows, long dim, float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        const float s = 1.0f / sqrtf(variance[r] + eps);
        const __m256 scale = _mm256_set1_ps(s);
        long i = 0;
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), scale)));
        for (; i < dim; i++) yr[i] = w[i] * (xr[i] * s);
    }
}

/* RoPE as `x * cos + rotate_half(x) * sin` with the sign folded into `sin` (`fused.RopeTable`):
 * y[i] = x[i] * cos[i] + x[(i + d/2) % d] * sin[i], each product rounded on its own. */
static inline void rope_row(const float *x, const float *c, const float *s, float *y, long d) {
    const long half = d / 2;
    for (long i = 0; i < d; i++) {
        const float a = x[i] * c[i];
        const float b = x[i < half ? i + half : i - half] * s[i];
        y[i] = a + b;
    }
}

/* One decoder layer's new q, k, v from its fused projection: qkv [batch, n, heads + 2 kv, d]
 * (contiguous), cos and sin [batch, n, d]. Writes q rotated as [batch, heads, n, d] (the layout
 * attention reads), and k rotated and v copied into the KV cache's buffers [batch, kv, capacity, d]
 * at positions start .. start + n - 1. */
void decodebench_rope_store_f32(const float *qkv, const float *cos, const float *sin, float *q, float *keys,
                                float *values, long batch, long n, long heads, long kv, long d,
                                long capacity, long start) {
    const long width = (heads + 2 * kv) * d;
    for (long b = 0; b < batch; b++) {
        for (long t = 0; t < n; t++) {
            const float *row = qkv + (b * n + t) * width, *c = cos + (b * n + t) * d, *s = sin + (b * n + t) * d;
            for (long h = 0; h < heads; h++)
                rope_row(row + h * d, c, s, q + ((b * heads + h) * n + t) * d, d);
            for (long h = 0; h < kv; h++) {
                const long slot = ((b * kv + h) * capacity + start + t) * d;
                rope_row(row + (heads + h) * d, c, s, keys + slot, d);
                const float *v = row + (heads + kv + h) * d;
                for (long i = 0; i < d; i++) values[slot + i] = v[i];
            }
        }
    }
}
