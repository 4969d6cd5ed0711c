/* The engine's native kernels (fp32, AVX2 + FMA; the GEMM in AVX-512 where the build adds
 * -mavx512f), built by `native.py` with `-O3 -mavx2 -mfma -ffp-contract=off -fopenmp` once per machine class and linked to the OpenMP runtime torch has
 * already loaded (one thread pool; `torch.set_num_threads` applies).
 *
 * decodebench_pack_f32, decodebench_linear_f32: y = x W^T (+ b) for a few rows of x, the case
 *   that matters on a CPU: W streamed once from memory at the machine's bandwidth, and a forward
 *   over 2-16 rows (verification) computed while it streams. W [out, in] is packed once into
 *   panels of PW output rows (16 with AVX-512, 8 with AVX2), P [ceil(out / PW)][in][PW] (zero
 *   padded), so that one vector load holds one input's weight for PW outputs. Each OpenMP thread
 *   takes blocks of 3 panels and computes them for the rows of x, MAXM rows at a time (8 with
 *   AVX-512, 4 with AVX2): 3 x MAXM accumulators, 3 weight loads and MAXM broadcasts of x per
 *   3 x MAXM fused multiply-adds, no horizontal sums. Every output is
 *   one chain of fused multiply-adds over `in` in order, then + b, whatever the number of rows
 *   and their grouping: a row's result does not depend on how many rows share the call (not
 *   MKL's order: same fp32 class, not the same bits).
 * decodebench_pack_bf16, decodebench_linear_bf16: the same panels and the same FMA chains for a
 *   weight whose every value is a bfloat16 (a draft stored in bf16): each panel holds the top 16
 *   bits of the fp32 weights, widened back to fp32 exactly as they are loaded (once per block into
 *   an fp32 copy in L2 where several row groups read it), so the outputs are bit for bit the fp32
 *   kernel's on the same weight, and the weight streams in half the bytes.
 * decodebench_rms_norm_f32, decodebench_rope_store_f32: bit for bit what torch's eager ops compute
 *   (tests/test_native.py), in one call instead of four to ten.
 * decodebench_layer_f32: a whole decoder layer in one call (below). */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The GEMM's vector: 16 floats where the build targets AVX-512 (`-mavx512f`, chosen by native.py
 * on a CPU that has it), else 8 (AVX2). PW outputs share a panel; each output is still one FMA
 * chain over `in` in order, so both builds compute the same bits (tests/test_native.py). */
#ifdef __AVX512F__
#define PW 16
#define MAXM 8 /* rows per group: 8 x 3 accumulators + 3 weights + 1 broadcast of 32 registers */
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(p) _mm512_set1_ps(*(p))
#else
#define PW 8
#define MAXM 4 /* rows per group: 4 x 3 accumulators + 3 weights + 1 broadcast of 16 registers */
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(p) _mm256_broadcast_ss(p)
#endif

long decodebench_panel_width(void) { return PW; }

/* W [out, in] -> panels [ceil(out / PW)][in][PW], zero padded: fp32 values (H = 0), or the top 16
 * bits of each, exact for a weight of bf16 values (H = 1; native.py checks it) */
static inline __attribute__((always_inline)) void pack_panels(const int H, const float *W, void *P, long out, long in) {
    const long panels = (out + PW - 1) / PW;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++)
        for (long k = 0; k < in; k++)
            for (long c = 0; c < PW; c++) {
                const long o = p * PW + c, i = (p * in + k) * PW + c;
                const float w = o < out ? W[o * in + k] : 0.0f;
                if (H) {
                    unsigned int bits;
                    memcpy(&bits, &w, 4);
                    ((unsigned short *)P)[i] = (unsigned short)(bits >> 16);
                } else
                    ((float *)P)[i] = w;
            }
}

void decodebench_pack_f32(const float *W, float *P, long out, long in) { pack_panels(0, W, P, out, in); }

void decodebench_pack_bf16(const float *W, unsigned short *P, long out, long in) { pack_panels(1, W, P, out, in); }

/* PW weights at p: fp32 as stored (H = 0), or bf16 widened exactly to fp32 (H = 1) */
static inline __attribute__((always_inline)) vec wload(const char *p, const int H) {
#ifdef __AVX512F__
    if (H) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    if (H) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#endif
    return VLOAD((const float *)p);
}

/* outputs o0 .. o0+PW-1 of one row: the accumulator + b, the padding left out */
static inline void store_panel(vec acc, const float *b, float *y, long out, long o0) {
    float t[PW];
    VSTORE(t, acc);
    const long n = out - o0 < PW ? out - o0 : PW;
    for (long i = 0; i < n; i++) y[o0 + i] = t[i] + (b ? b[o0 + i] : 0.0f);
}

/* named accumulators a<row><panel> (an array of them would live on the stack: a store per FMA) */
#define ACC(m) vec a##m##0 = VZERO(), a##m##1 = a##m##0, a##m##2 = a##m##0;
#define FMA(m) if (M > m) { const vec xb = VSET1(x##m + k); \
        a##m##0 = VFMA(w0, xb, a##m##0); \
        if (V > 1) a##m##1 = VFMA(w1, xb, a##m##1); \
        if (V > 2) a##m##2 = VFMA(w2, xb, a##m##2); }
#define STORE(m) if (M > m) { float *ym = y + (r0 + m) * out; store_panel(a##m##0, b, ym, out, o0); \
        if (V > 1) store_panel(a##m##1, b, ym, out, o0 + PW); \
        if (V > 2) store_panel(a##m##2, b, ym, out, o0 + 2 * PW); }

/* rows r0 .. r0+M-1 of x (M <= MAXM) against V (<= 3) consecutive panels from P (outputs from o0),
 * fp32 panels (H = 0) or bf16 ones (H = 1); M, V and H are constants where it is inlined, so only
 * the live accumulators exist. pf (or NULL): memory to prefetch into L2 meanwhile, `stride` (<= 128)
 * bytes a step */
static inline __attribute__((always_inline)) void panels_rows(const int M, const int V, const int H, const char *P,
                                                              const float *x, long in, const float *b, float *y, long out,
                                                              long o0, long r0, const char *pf, long stride) {
    ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)
    const float *x0 = x + r0 * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
    const float *x4 = x3 + in, *x5 = x4 + in, *x6 = x5 + in, *x7 = x6 + in;
    const long step = PW * (H ? 2 : 4);  /* bytes of one input's weights in a panel */
    const char *p0 = P, *p1 = P + in * step, *p2 = P + 2 * in * step;
    #pragma GCC unroll 2
    for (long k = 0; k < in; k++) {
        if (pf) {
            _mm_prefetch(pf + k * stride, _MM_HINT_T1);
            if (stride > 64) _mm_prefetch(pf + k * stride + 64, _MM_HINT_T1);
        }
        const vec w0 = wload(p0 + k * step, H);
        const vec w1 = V > 1 ? wload(p1 + k * step, H) : w0, w2 = V > 2 ? wload(p2 + k * step, H) : w0;
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5) FMA(6) FMA(7)
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)
}

#if MAXM == 8
#define ROWS(V) switch (m) { \
        case 8: panels_rows(8, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 7: panels_rows(7, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 6: panels_rows(6, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 5: panels_rows(5, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 4: panels_rows(4, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 3: panels_rows(3, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 2: panels_rows(2, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        default: panels_rows(1, V, H, pp, x, in, b, y, out, o0, r, pf, stride); }
#else
#define ROWS(V) switch (m) { \
        case 4: panels_rows(4, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 3: panels_rows(3, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        case 2: panels_rows(2, V, H, pp, x, in, b, y, out, o0, r, pf, stride); break; \
        default: panels_rows(1, V, H, pp, x, in, b, y, out, o0, r, pf, stride); }
#endif

/* one group of m rows (m <= MAXM) against the block's v panels at pp */
static inline __attribute__((always_inline)) void group_rows(const int H, long v, long m, const char *pp,
                                                             const float *x, long in, const float *b, float *y,
                                                             long out, long o0, long r, const char *pf, long stride) {
    if (v == 3) { ROWS(3) } else if (v == 2) { ROWS(2) } else { ROWS(1) }
}

/* A bf16 block that WIDEN_GROUPS or more row groups read is widened once into this thread's fp32 copy
 * (it stays in L2), and every group reads that: the widening is paid once per block instead of once
 * per group, which made bf16 panels slower than fp32 ones from about 16 rows. From 4 groups on: at 2
 * groups the extra pass over the copy costs about what it saves. The values, and so the bits, are
 * the same. */
#define WIDEN_GROUPS 4
static float *thread_buffer(long floats) {
    static __thread float *buffer = 0;
    static __thread long capacity = 0;
    if (floats > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        capacity = buffer ? floats : 0;
    }
    return buffer;
}

/* Rows go MAXM at a time. One group streams the block's 3 panels from memory. From 2 groups on,
 * each group reads the block from L2 and prefetches a share of the next block into L2, so that
 * memory streams during every group's multiply-adds instead of the first group waiting on memory
 * and the later ones computing with memory idle (docs/performance.md, "The native kernels"). */
static inline __attribute__((always_inline)) void linear_panels(const int H, const char *P, const float *x, const float *b,
                                                                float *y, long out, long in, long rows) {
    const long panels = (out + PW - 1) / PW, blocks = (panels + 2) / 3, bytes = H ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        const long p0 = blk * 3, v = panels - p0 < 3 ? panels - p0 : 3, o0 = p0 * PW;
        const char *pp = P + p0 * in * PW * bytes;
        const long groups = (rows + MAXM - 1) / MAXM, stride = groups >= 2 ? 3 * PW * bytes / groups : 0;
        float *wide = H && groups >= WIDEN_GROUPS ? thread_buffer(v * in * PW) : 0;
        if (wide)
            for (long i = 0; i < v * in * PW; i += PW) VSTORE(wide + i, wload(pp + 2 * i, 1));
        for (long r = 0, g = 0; r < rows; r += MAXM, g++) {
            const char *pf = stride && blk + 1 < blocks ? pp + 3 * in * PW * bytes + g * stride * in : 0;
            const long m = rows - r < MAXM ? rows - r : MAXM;
            if (wide)
                group_rows(0, v, m, (const char *)wide, x, in, b, y, out, o0, r, pf, stride);
            else
                group_rows(H, v, m, pp, x, in, b, y, out, o0, r, pf, stride);
        }
    }
}

void decodebench_linear_f32(const float *P, const float *x, const float *b, float *y, long out, long in, long rows) {
    linear_panels(0, (const char *)P, x, b, y, out, in, rows);
}

void decodebench_linear_bf16(const unsigned short *P, const float *x, const float *b, float *y, long out, long in, long rows) {
    linear_panels(1, (const char *)P, x, b, y, out, in, rows);
}

/* The FMA units' peak: every thread runs `steps` x 12 independent vector FMAs on registers (no
 * memory), so `make perf` can give each verification size the floor its arithmetic sets. Returns
 * the FMAs counted, each PW lanes wide (x 2 flops). */
long decodebench_fma_peak(long steps) {
    long total = 0;
    #pragma omp parallel reduction(+ : total)
    {
        vec a0 = VSET1(&(float){1.0f}), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        vec a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
        const vec m = VSET1(&(float){0.999999f}), c = VSET1(&(float){1e-7f});
        for (long s = 0; s < steps; s++) {
            a0 = VFMA(a0, m, c); a1 = VFMA(a1, m, c); a2 = VFMA(a2, m, c); a3 = VFMA(a3, m, c);
            a4 = VFMA(a4, m, c); a5 = VFMA(a5, m, c); a6 = VFMA(a6, m, c); a7 = VFMA(a7, m, c);
            a8 = VFMA(a8, m, c); a9 = VFMA(a9, m, c); a10 = VFMA(a10, m, c); a11 = VFMA(a11, m, c);
            __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5));
        }
        float t[PW];
        VSTORE(t, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11);
        total += 12 * steps + (t[0] < 0.0f);  /* the result is used: the loop is not optimized away */
    }
    return total;
}

/* A STREAM-like read: every thread sums its share of `n` floats with 8 independent vector
 * accumulators (no FMA chain limits it), so `make perf` reads the bandwidth a streaming GEMV can
 * reach on this machine, not one single-threaded `sum` reaches. The sum is returned so the reads
 * are not optimized away. */
float decodebench_stream_read(const float *x, long n) {
    const long block = 8 * PW, chunk = 256 * block, chunks = n / chunk;
    float total = 0.0f;
    #pragma omp parallel for schedule(static) reduction(+ : total)
    for (long c = 0; c < chunks; c++) {
        vec s0 = VZERO(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
        for (const float *p = x + c * chunk, *end = p + chunk; p < end; p += block) {
            s0 = s0 + VLOAD(p); s1 = s1 + VLOAD(p + PW); s2 = s2 + VLOAD(p + 2 * PW);
            s3 = s3 + VLOAD(p + 3 * PW); s4 = s4 + VLOAD(p + 4 * PW); s5 = s5 + VLOAD(p + 5 * PW);
            s6 = s6 + VLOAD(p + 6 * PW); s7 = s7 + VLOAD(p + 7 * PW);
        }
        float t[PW];
        VSTORE(t, ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)));
        for (int i = 0; i < PW; i++) total += t[i];
    }
    for (long i = chunks * chunk; i < n; i++) total += x[i];
    return total;
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

/* ---------------------------------------------------------------------------------------------
 * decodebench_layer_f32: one whole Llama-family decoder layer for a few rows (a decode step, a
 * verification, a draft head's level), in one call instead of ~30 torch operations and five
 * kernel calls: RMSNorm, the fused qkv projection, RoPE with the KV write, attention over the
 * cache, o_proj + residual, RMSNorm, gate_up, SiLU(gate) * up, down + residual. The projections
 * are `decodebench_linear_f32` on packed weights. Every row is computed on its own, in an order
 * that does not depend on the other rows: attention walks the keys a row may see (the mask's
 * visible ones, else causally) compacted and in position order, so a token verified in a tree
 * gets the bits it gets when decoded alone, whatever the tree and wherever its ancestors sit in
 * the cache before the commit. Same fp32 class as torch's ops, not the same bits (own exp, own
 * summation order).
 * --------------------------------------------------------------------------------------------- */
#include <stdlib.h>

/* e^x for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial;
 * about 1 ulp); below -87.3 exactly 0 (a masked or negligible score), clamped above 88.3 */
static inline __m256 exp8(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* v[0..n) = e^v, through exp8 for every element (a tail through a padded copy: same bits) */
static void exp_inplace(float *v, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
    if (i < n) {
        float t[8] = {0};
        for (long j = i; j < n; j++) t[j - i] = v[j];
        _mm256_storeu_ps(t, exp8(_mm256_loadu_ps(t)));
        for (long j = i; j < n; j++) v[j] = t[j - i];
    }
}

static inline float hsum8(__m256 v) {
    float t[8];
    _mm256_storeu_ps(t, v);
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

/* sum of a[i] * b[i]: 8 lanes in order, then the lanes, then the tail */
static inline float dot(const float *a, const float *b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* RMSNorm of one row with its statistic summed here (`dot`), the rest as decodebench_rms_norm_f32
 * (w NULL: y = x) */
static void rms_row(const float *x, const float *w, float eps, float *y, long dim) {
    if (!w) { for (long i = 0; i < dim; i++) y[i] = x[i]; return; }
    const float variance = dot(x, x, dim) / (float)dim;
    decodebench_rms_norm_f32(x, &variance, w, y, 1, dim, eps);
}

/* dot(q, k_j) for 8 keys at once: one FMA chain over d per key (lanes), the 8 chains reduced
 * together by horizontal adds into ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) per key, as hsum8 and
 * `dot` reduce one: a key's score has the same bits in a block of 8 or alone */
static inline __m256 dot8(const float *q, const float *const k[8], long d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    long i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + i), a0); a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + i), a2); a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + i), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + i), a4); a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + i), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + i), a6); a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + i), a7);
    }
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    if (i < d) {  /* the tail of d, after the lanes, as `dot` adds it */
        float t[8];
        _mm256_storeu_ps(t, s);
        for (int j = 0; j < 8; j++)
            for (long r = i; r < d; r++) t[j] += q[r] * k[j][r];
        s = _mm256_loadu_ps(t);
    }
    return s;
}

/* The keys a row sees (mask row NULL: keys 0 .. last; else those it does not mask), compacted in
 * position order into idx; returns their count. *shifted: whether any of them has a mask value
 * other than 0 (then the scores add it). Computed once per row, shared by its heads. */
static long visible_keys(const float *mrow, long last, long keys, int *idx, int *shifted) {
    long cnt = 0;
    *shifted = 0;
    if (!mrow) { for (long j = 0; j <= last && j < keys; j++) idx[cnt++] = (int)j; return cnt; }
    const __m256 lim = _mm256_set1_ps(-3.0e38f), zero = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= keys; j += 8) {
        const __m256 m = _mm256_loadu_ps(mrow + j);
        const int vis = _mm256_movemask_ps(_mm256_cmp_ps(m, lim, _CMP_GT_OQ));
        if (vis != 0xff || _mm256_movemask_ps(_mm256_cmp_ps(m, zero, _CMP_NEQ_UQ))) {
            for (int c = 0; c < 8; c++) if (vis >> c & 1) { idx[cnt++] = (int)(j + c); *shifted |= mrow[j + c] != 0.0f; }
        } else for (int c = 0; c < 8; c++) idx[cnt++] = (int)(j + c);
    }
    for (; j < keys; j++) if (mrow[j] > -3.0e38f) { idx[cnt++] = (int)j; *shifted |= mrow[j] != 0.0f; }
    return cnt;
}

/* One query head of one row: out[d] = softmax(q . k_j * scaling (+ mask_j)) . v_j over the row's
 * visible keys idx[0..cnt), in position order, so that the sums run the same whichever other rows
 * share the forward. s: >= cnt + 8 floats */
static void attend(const float *q, const float *K, const float *V, const float *mrow, const int *idx, long cnt, int shifted,
                   float scaling, float *out, long d, float *s) {
    long m = 0;
    for (; m + 8 <= cnt; m += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) k[j] = K + (long)idx[m + j] * d;
        _mm256_storeu_ps(s + m, _mm256_mul_ps(dot8(q, k, d), _mm256_set1_ps(scaling)));
    }
    for (; m < cnt; m++) s[m] = dot(q, K + (long)idx[m] * d, d) * scaling;
    if (shifted)
        for (m = 0; m < cnt; m++) s[m] += mrow[idx[m]];
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (m = 0; m + 8 <= cnt; m += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + m));
    float t[8], max;
    _mm256_storeu_ps(t, mx);
    max = t[0];
    for (int j = 1; j < 8; j++) max = t[j] > max ? t[j] : max;
    for (; m < cnt; m++) max = s[m] > max ? s[m] : max;
    const __m256 mv = _mm256_set1_ps(max);
    for (m = 0; m + 8 <= cnt; m += 8) _mm256_storeu_ps(s + m, _mm256_sub_ps(_mm256_loadu_ps(s + m), mv));
    for (; m < cnt; m++) s[m] -= max;
    exp_inplace(s, cnt);
    __m256 acc = _mm256_setzero_ps();
    for (m = 0; m + 8 <= cnt; m += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(s + m));
    float sum = hsum8(acc);
    for (; m < cnt; m++) sum += s[m];
    const __m256 sc = _mm256_set1_ps(1.0f / sum);
    /* out = (sum over the keys, in order, of p_j v_j) * (1 / sum): 8 output vectors at a time
     * (8 independent chains keep both FMA units busy), then 1, then single floats */
    long i = 0;
    for (; i + 64 <= d; i += 64) {
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
        for (long c = 0; c < cnt; c++) {
            const float *v = V + (long)idx[c] * d + i;
            const __m256 p = _mm256_broadcast_ss(s + c);
            o0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), o0); o1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), o1);
            o2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), o2); o3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), o3);
            o4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), o4); o5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), o5);
            o6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), o6); o7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), o7);
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(o0, sc)); _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(o1, sc));
        _mm256_storeu_ps(out + i + 16, _mm256_mul_ps(o2, sc)); _mm256_storeu_ps(out + i + 24, _mm256_mul_ps(o3, sc));
        _mm256_storeu_ps(out + i + 32, _mm256_mul_ps(o4, sc)); _mm256_storeu_ps(out + i + 40, _mm256_mul_ps(o5, sc));
        _mm256_storeu_ps(out + i + 48, _mm256_mul_ps(o6, sc)); _mm256_storeu_ps(out + i + 56, _mm256_mul_ps(o7, sc));
    }
    for (; i + 8 <= d; i += 8) {
        __m256 o0 = _mm256_setzero_ps();
        for (long c = 0; c < cnt; c++)
            o0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + c), _mm256_loadu_ps(V + (long)idx[c] * d + i), o0);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(o0, sc));
    }
    for (; i < d; i++) {
        float o = 0.0f;
        for (long c = 0; c < cnt; c++) o = fmaf(s[c], V[(long)idx[c] * d + i], o);
        out[i] = o * (1.0f / sum);
    }
}

/* x, y [batch, n, hidden] (y written; not x); attn_in NULL (q, k, v read RMSNorm(x)) or the
 * input of q, k, v [batch, n, attn_width] (the input norm then unused); cos, sin [batch, n, d] (sin sign-folded); keys,
 * values: the layer's cache buffers [batch, kv, capacity, d], positions start .. start + n - 1
 * written; mask [mask_batch, n, start + n] additive (0 visible, the dtype's minimum not) or NULL
 * (causal); norms NULL: identity; biases NULL: none; scratch: decodebench_layer_scratch floats;
 * skip_gemms: profiling only, every projection's output zero (wrong outputs, the rest's time);
 * bf16: which packed projections hold bf16 panels (bits 1 qkv, 2 o, 4 gate_up, 8 down), the others fp32 */
/* a projection; with skip_gemms (profiling: `make perf`'s forward without its GEMMs) zeros instead */
#define PROJECT(P, bit, in_, b_, out_, o_, i_, r_) \
    do { if (skip_gemms) { for (long z = 0; z < (r_) * (o_); z++) (out_)[z] = 0.0f; } \
         else if (bf16 & (bit)) decodebench_linear_bf16((const unsigned short *)(P), in_, b_, out_, o_, i_, r_); \
         else decodebench_linear_f32((const float *)(P), in_, b_, out_, o_, i_, r_); } while (0)

long decodebench_layer_scratch(long rows, long hidden, long heads, long kv, long d, long inter) {
    return rows * (2 * hidden + (heads + 2 * kv) * d + 2 * heads * d + 3 * inter);
}

void decodebench_layer_f32(const float *x, const float *attn_in, float *y, float *scratch,
                           const float *in_norm, const float *post_norm, float in_eps, float post_eps,
                           const void *Pqkv, const float *bqkv, const void *Po, const float *bo,
                           const void *Pgu, const float *bgu, const void *Pdown, const float *bdown,
                           const float *cos, const float *sin, float *keys, float *values, const float *mask,
                           long batch, long n, long hidden, long heads, long kv, long d, long inter,
                           long capacity, long start, long mask_batch, float scaling, long skip_gemms, long attn_width,
                           long bf16) {
    const long rows = batch * n, width = (heads + 2 * kv) * d, total = start + n;
    float *h = scratch, *qkv = h + rows * hidden, *q = qkv + rows * width, *att = q + rows * heads * d;
    float *x2 = att + rows * heads * d, *gu = x2 + rows * hidden, *act = gu + rows * 2 * inter;
    if (attn_in)  /* EAGLE-3's layer: q, k, v read their own input [rows, attn_width], the residual stream is x */
        PROJECT(Pqkv, 1, attn_in, bqkv, qkv, width, attn_width, rows);
    else {
        for (long r = 0; r < rows; r++) rms_row(x + r * hidden, in_norm, in_eps, h + r * hidden, hidden);
        PROJECT(Pqkv, 1, h, bqkv, qkv, width, hidden, rows);
    }
    decodebench_rope_store_f32(qkv, cos, sin, q, keys, values, batch, n, heads, kv, d, capacity, start);  /* q [B, heads, n, d] */
    const long group = heads / kv, tasks = rows * heads;
    int *idx = malloc(sizeof(int) * rows * total), *shifted = malloc(sizeof(int) * rows);
    long *count = malloc(sizeof(long) * rows);
    #pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (total + 8));
        #pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            const long b = r / n, t = r % n;
            const float *mrow = mask ? mask + ((mask_batch > 1 ? b : 0) * n + t) * total : 0;
            count[r] = visible_keys(mrow, start + t, total, idx + r * total, shifted + r);
        }
        #pragma omp for schedule(static)
        for (long task = 0; task < tasks; task++) {
            const long r = task / heads, hd = task % heads, b = r / n, t = r % n, g = hd / group;
            const float *mrow = mask ? mask + ((mask_batch > 1 ? b : 0) * n + t) * total : 0;
            const long base = (b * kv + g) * capacity * d;
            attend(q + ((b * heads + hd) * n + t) * d, keys + base, values + base, mrow, idx + r * total, count[r], shifted[r],
                   scaling, att + task * d, d, buf);
        }
        free(buf);
    }
    free(idx); free(shifted); free(count);
    PROJECT(Po, 2, att, bo, x2, hidden, heads * d, rows);
    for (long i = 0; i < rows * hidden; i++) x2[i] = x[i] + x2[i];
    for (long r = 0; r < rows; r++) rms_row(x2 + r * hidden, post_norm, post_eps, h + r * hidden, hidden);
    PROJECT(Pgu, 4, h, bgu, gu, 2 * inter, hidden, rows);
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *a = act + r * inter;
        for (long i = 0; i < inter; i++) a[i] = -g[i];
        exp_inplace(a, inter);
        for (long i = 0; i < inter; i++) a[i] = g[i] / (1.0f + a[i]) * u[i];
    }
    PROJECT(Pdown, 8, act, bdown, y, hidden, inter, rows);
    for (long i = 0; i < rows * hidden; i++) y[i] = x2[i] + y[i];
}
