/* The engine's native kernels (fp32, AVX2 + FMA), built by `native.py` with `-O3 -mavx2 -mfma
 * -ffp-contract=off -fopenmp` once per machine class and linked to the OpenMP runtime torch has
 * already loaded (one thread pool; `torch.set_num_threads` applies).
 *
 * decodebench_pack_f32, decodebench_linear_f32: y = x W^T (+ b) for a few rows of x, the case
 *   that matters on a CPU: W streamed once from memory at the machine's bandwidth, and a forward
 *   over 2-16 rows (verification) computed while it streams. W [out, in] is packed once into
 *   panels of 8 output rows, P [ceil(out / 8)][in][8] (zero padded), so that one 32-byte load
 *   holds one input's weight for 8 outputs. Each OpenMP thread takes blocks of 3 panels (24
 *   outputs) and computes them for the rows of x, 4 rows at a time: 12 accumulators, 3 weight
 *   loads and 4 broadcasts of x per 12 fused multiply-adds, no horizontal sums. Every output is
 *   one chain of fused multiply-adds over `in` in order, then + b, whatever the number of rows
 *   and their grouping: a row's result does not depend on how many rows share the call (not
 *   MKL's order: same fp32 class, not the same bits).
 * decodebench_rms_norm_f32, decodebench_rope_store_f32: bit for bit what torch's eager ops compute
 *   (tests/test_native.py), in one call instead of four to ten. */
#include <immintrin.h>
#include <math.h>

void decodebench_pack_f32(const float *W, float *P, long out, long in) {
    const long panels = (out + 7) / 8;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long k = 0; k < in; k++)
            for (long c = 0; c < 8; c++) {
                const long o = p * 8 + c;
                P[(p * in + k) * 8 + c] = o < out ? W[o * in + k] : 0.0f;
            }
}

/* outputs o0 .. o0+7 of one row: the accumulator + b, the padding left out */
static inline void store8(__m256 acc, const float *b, float *y, long out, long o0) {
    float t[8];
    _mm256_storeu_ps(t, acc);
    const long n = out - o0 < 8 ? out - o0 : 8;
    for (long i = 0; i < n; i++) y[o0 + i] = t[i] + (b ? b[o0 + i] : 0.0f);
}

/* named accumulators a<row><panel> (an array of them would live on the stack: a store per FMA) */
#define ACC(m) __m256 a##m##0 = _mm256_setzero_ps(), a##m##1 = a##m##0, a##m##2 = a##m##0;
#define FMA(m) if (M > m) { const __m256 xb = _mm256_broadcast_ss(x##m + k); \
        a##m##0 = _mm256_fmadd_ps(w0, xb, a##m##0); \
        if (V > 1) a##m##1 = _mm256_fmadd_ps(w1, xb, a##m##1); \
        if (V > 2) a##m##2 = _mm256_fmadd_ps(w2, xb, a##m##2); }
#define STORE(m) if (M > m) { float *ym = y + (r0 + m) * out; store8(a##m##0, b, ym, out, o0); \
        if (V > 1) store8(a##m##1, b, ym, out, o0 + 8); \
        if (V > 2) store8(a##m##2, b, ym, out, o0 + 16); }

/* rows r0 .. r0+M-1 of x (M <= 4) against V (<= 3) consecutive panels from P (outputs from o0);
 * M and V are constants where it is inlined, so only the live accumulators exist. pf (or NULL):
 * memory to prefetch meanwhile, `stride` bytes a step */
static inline __attribute__((always_inline)) void panels_rows(const int M, const int V, const float *P, const float *x,
                                                              long in, const float *b, float *y, long out, long o0, long r0,
                                                              const char *pf, long stride) {
    ACC(0) ACC(1) ACC(2) ACC(3)
    const float *x0 = x + r0 * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
    const float *p0 = P, *p1 = P + in * 8, *p2 = P + 2 * in * 8;
    for (long k = 0; k < in; k++) {
        if (pf) { _mm_prefetch(pf + k * stride, _MM_HINT_T0); _mm_prefetch(pf + k * stride + 64, _MM_HINT_T0); }
        const __m256 w0 = _mm256_loadu_ps(p0 + k * 8);
        const __m256 w1 = V > 1 ? _mm256_loadu_ps(p1 + k * 8) : w0, w2 = V > 2 ? _mm256_loadu_ps(p2 + k * 8) : w0;
        FMA(0) FMA(1) FMA(2) FMA(3)
    }
    STORE(0) STORE(1) STORE(2) STORE(3)
}

#define ROWS(V) switch (m) { \
        case 4: panels_rows(4, V, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 3: panels_rows(3, V, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 2: panels_rows(2, V, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        default: panels_rows(1, V, pp, x, in, b, y, out, o0, r, pf, stride); }

/* Rows go 4 at a time; the first group streams the block's 3 panels from memory, the later ones
 * read them from cache. From 3 groups on (9+ rows) the later groups also prefetch the next
 * block, a share each, so that memory streams while they compute (measured: 20% off 16 rows;
 * with 2 groups it costs more than it saves). */
void decodebench_linear_f32(const float *P, const float *x, const float *b, float *y, long out, long in, long rows) {
    const long panels = (out + 7) / 8, blocks = (panels + 2) / 3;
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        const long p0 = blk * 3, v = panels - p0 < 3 ? panels - p0 : 3, o0 = p0 * 8;
        const float *pp = P + p0 * in * 8;
        const long groups = (rows + 3) / 4, stride = groups >= 3 ? 96 / (groups - 1) : 0;  /* 3 panels: 96 B a step */
        for (long r = 0, g = 0; r < rows; r += 4, g++) {
            const char *pf = stride && g > 0 && blk + 1 < blocks ? (const char *)(pp + 3 * in * 8) + (g - 1) * stride * in : 0;
            const long m = rows - r < 4 ? rows - r : 4;
            if (v == 3) { ROWS(3) } else if (v == 2) { ROWS(2) } else { ROWS(1) }
        }
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
