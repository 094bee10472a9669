/* The attention side's elementwise ops for the CPU, fused: each replaces a run of small torch ops (a dozen or so
 * per layer and micro-batch, ~2-60 us each at the shipped model's shapes) with one pass over the rows.
 *
 * - add_rms_norm: the residual add and the RMSNorm after it. h += delta (when delta is given), then
 *   out = w * (h * (1 / sqrt(mean(h^2) + eps))), transformers' RMSNorm in fp32.
 * - qkv_rope_write: the fused q/k/v projection's output rows -> per-head RMSNorm of q and k (Qwen3's q_norm and
 *   k_norm, when given), rotary embedding of the first rd channels in rotate-half form (x * cos + rotate_half(x)
 *   * sin), the queries written to q_out [T, h, d] and the keys and values to the paged cache at their slots.
 *
 * Rounding: every product and sum is rounded as torch rounds the same expression (the file is built with
 * -ffp-contract=off, so no multiply-add is fused), so the rotary embedding, the scaling by the norm and the
 * residual add give torch's bits. Only the mean of squares is summed in another order (in double, over 32
 * lanes, then across them), so a normalised row may differ from torch's in the last bit.
 *
 * Layouts (element strides, in floats): rows of h, delta and out at h + r * hs, ...; a qkv row holds
 * [q (h * d) | k (kvh * d) | v (kvh * d)]; cos and sin [T, rd] contiguous; the key of cache slot s and KV head g
 * at k_cache + s * k_tok + g * k_head, the value likewise. Vectors are GCC/clang vector extensions. Built and
 * loaded by kernels/cpu_ops.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

typedef double dvec __attribute__((vector_size(W * sizeof(double))));

/* 1 / sqrt(mean(x^2) + eps) over n floats. Four accumulators: one would wait on its own adds. */
static inline float inv_rms(const float *x, int64_t n, float eps) {
    dvec acc[4] = {{0}, {0}, {0}, {0}};
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W)
        for (int a = 0; a < 4; ++a) {
            dvec xd = __builtin_convertvector(load(x + i + a * W), dvec);
            acc[a] += xd * xd;
        }
    for (; i + W <= n; i += W) {
        dvec xd = __builtin_convertvector(load(x + i), dvec);
        acc[0] += xd * xd;
    }
    dvec all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    double sum = 0;
    for (int l = 0; l < W; ++l) sum += all[l];
    for (; i < n; ++i) sum += (double)x[i] * x[i];
    float var = (float)(sum / n);
    return 1.0f / sqrtf(var + eps);
}

/* y = w * (x * inv) over n floats. */
static inline void scale_row(const float *x, const float *w, float inv, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + W <= n; i += W) store(y + i, load(w + i) * (load(x + i) * splat(inv)));
    for (; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

void afserve_add_rms_norm_f32(float *h, int64_t hs, const float *delta, int64_t ds, const float *w, float *out,
                              int64_t os, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        float *x = h + r * hs;
        if (delta) {
            const float *dx = delta + r * ds;
            int64_t i = 0;
            for (; i + W <= n; i += W) store(x + i, load(x + i) + load(dx + i));
            for (; i < n; ++i) x[i] = x[i] + dx[i];
        }
        scale_row(x, w, inv_rms(x, n, eps), out + r * os, n);
    }
}

/* One head's d channels from src to dst: the optional per-head norm (weight nw), then the rotary embedding of the
 * first rd channels at one position (cos c, sin s); channels past rd pass through. dst must not alias src. */
static inline void norm_rope(const float *src, float *dst, const float *nw, float eps, const float *c,
                             const float *s, int64_t d, int64_t rd) {
    float y[d];
    if (nw)
        scale_row(src, nw, inv_rms(src, d, eps), y, d);
    else
        memcpy(y, src, d * sizeof(float));
    int64_t half = rd / 2;
    for (int64_t i = 0; i < half; ++i) dst[i] = y[i] * c[i] + -y[i + half] * s[i];
    for (int64_t i = half; i < rd; ++i) dst[i] = y[i] * c[i] + y[i - half] * s[i];
    for (int64_t i = rd; i < d; ++i) dst[i] = y[i];
}

void afserve_qkv_rope_write_f32(const float *qkv, int64_t qkv_stride, int64_t T, int64_t h, int64_t kvh,
                                int64_t d, const float *q_norm, const float *k_norm, float eps, const float *cos,
                                const float *sin, int64_t rd, const int64_t *slots, float *k_cache,
                                float *v_cache, int64_t k_tok, int64_t k_head, int64_t v_tok, int64_t v_head,
                                float *q_out) {
    for (int64_t t = 0; t < T; ++t) {
        const float *row = qkv + t * qkv_stride, *c = cos + t * rd, *s = sin + t * rd;
        for (int64_t j = 0; j < h; ++j) norm_rope(row + j * d, q_out + (t * h + j) * d, q_norm, eps, c, s, d, rd);
        const float *k = row + h * d, *v = k + kvh * d;
        int64_t slot = slots[t];
        for (int64_t g = 0; g < kvh; ++g) {
            norm_rope(k + g * d, k_cache + slot * k_tok + g * k_head, k_norm, eps, c, s, d, rd);
            memcpy(v_cache + slot * v_tok + g * v_head, v + g * d, d * sizeof(float));
        }
    }
}
