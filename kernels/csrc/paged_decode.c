/* Paged decode attention for the CPU, reading K/V blocks where they lie in the cache (no gathered copy).
 *
 * One query per sequence. For sequence b, query head j (KV head j / (h / kvh)) and the context positions t
 * its window keeps, score_t = scale * q . k_t; out = sum_t softmax(score)_t v_t, with an optional sink logit
 * per head that joins the normalisation and attends to nothing (GPT-OSS). The softmax is exact (two passes:
 * scores, then max, exponentials and the weighted sum), in fp32.
 *
 * Layouts (element strides, in floats): q [B, h, dk] and out [B, h, dv] contiguous; the key of cache slot
 * s = block * bs + offset and KV head g is at k + s * k_tok + g * k_head (dk contiguous floats), the value at
 * v + s * v_tok + g * v_head (dv floats); block_tables [B, M] int32 (-1 padded), context_lens [B] int32.
 * dk and dv must be multiples of W (the caller checks). Vectors are GCC/clang vector extensions, so the
 * compiler picks the instructions (-march=native). Built and loaded by kernels/cpu_attention.py, once per cache
 * element type: KV_FMT 0 (fp32, the default), 1 (float8 e4m3fn) or 2 (float8 e5m2); strides count elements.
 * A float8 cache is read a vector of bytes at a time and widened to fp32 in registers, exactly for every finite
 * value (the writes saturate, so no infinity is stored; a NaN from a broken forward reads as a finite number in
 * e4m3, and in the integer form below in e5m2 too).
 * Returns 0, or -1 when scratch memory cannot be had.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

typedef int32_t ivec __attribute__((vector_size(W * sizeof(int32_t))));

#ifndef KV_FMT
#define KV_FMT 0
#endif
#if KV_FMT == 0
typedef float kv_t;
static inline vec load_kv(const kv_t *p) { return load(p); }
#else
typedef uint8_t kv_t;
typedef uint8_t bvec __attribute__((vector_size(W)));
#if KV_FMT == 1   /* e4m3fn: exponent bias 7, 3 mantissa bits */
#define MANT 3
#define BIAS 7
#else             /* e5m2: exponent bias 15, 2 mantissa bits */
#define MANT 2
#define BIAS 15
#endif

#if defined(__F16C__) && W == 8
typedef uint16_t svec __attribute__((vector_size(W * sizeof(uint16_t))));

/* W float8 values -> fp32 through fp16 and F16C's one-instruction widening (measured 1.5x faster than the integer
 * form below on this project's x86 VM): e5m2 is the top byte of an fp16; an e4m3fn byte's exponent and mantissa
 * bits moved into fp16's places read as 2^-8 of its value (subnormals too, which fp16 holds as subnormals), so
 * the result is scaled by 2^8. */
static inline vec load_kv(const kv_t *p) {
    bvec b;
    memcpy(&b, p, sizeof b);
    svec x = __builtin_convertvector(b, svec);
    x = BIAS == 7 ? ((x & 0x7F) << 7) | ((x & 0x80) << 8) : x << 8;
    __m128i half;
    memcpy(&half, &x, sizeof half);
    const __m256 f = _mm256_cvtph_ps(half);
    vec out;
    memcpy(&out, &f, sizeof out);
    return BIAS == 7 ? out * splat(256.0f) : out;
}
#else
/* W float8 values -> fp32 in integer lanes: a normal number's exponent and mantissa bits move into fp32's places
 * and the exponent is rebased; a subnormal (exponent bits 0) is its mantissa times 2^(1 - BIAS - MANT), made from
 * an integer conversion, so no fp32 denormal is ever an operand. */
static inline vec load_kv(const kv_t *p) {
    bvec b;
    memcpy(&b, p, sizeof b);
    const ivec x = __builtin_convertvector(b, ivec);
    const ivec mag = x & 0x7F, sign = (x & 0x80) << 24;
    const ivec normal = (mag << (23 - MANT)) + ((127 - BIAS) << 23);
    const vec sub = __builtin_convertvector(mag, vec) * splat(1.0f / (float)(1 << (BIAS + MANT - 1)));
    ivec subbits, bits;
    memcpy(&subbits, &sub, sizeof sub);
    const ivec is_sub = (mag >> MANT) == 0;             /* all ones where the exponent bits are 0 */
    bits = ((normal & ~is_sub) | (subbits & is_sub)) | sign;
    vec out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#endif
#endif

static inline vec vmax(vec a, vec b) {
    ivec keep = a > b, ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (ai & keep) | (bi & ~keep);
    memcpy(&a, &ai, sizeof a);
    return a;
}

static inline float hsum(vec v) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    return v[0];
}

/* exp(x) for x <= 0 (the softmax's shifted scores), Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-7
 * polynomial for exp(r), then 2^n from the exponent bits. About 1 ulp; inputs below -87 give exp(-87). */
static inline vec exp_nonpositive(vec x) {
    x = vmax(x, splat(-87.0f));
    vec t = x * splat(1.44269504088896341f) - splat(0.5f);
    ivec n = __builtin_convertvector(t, ivec);          /* truncation toward zero = round to nearest, x <= 0 */
    vec nf = __builtin_convertvector(n, vec);
    vec r = x - nf * splat(0.693359375f) + nf * splat(2.12194440e-4f);
    vec p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    ivec bits = (n + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float dot(const float *a, const kv_t *b, int64_t nv) {
    vec acc = load(a) * load_kv(b);
    for (int64_t c = 1; c < nv; ++c) acc += load(a + c * W) * load_kv(b + c * W);
    return hsum(acc);
}

/* Ask for a cache block's `floats` floats (whole 64-byte lines) ahead of use, into L2 and beyond (prefetcht2):
 * blocks lie anywhere in the cache, so the hardware prefetchers lose the stream at every block. One block ahead
 * measured 1.2-1.3x faster on DRAM-resident K/V (bench/cpu_decode.py; 84-91 -> 70-73 ns per context token timed
 * in the engine at 1+1); prefetcht0/prefetcht1, or two blocks ahead, gained less. */
static inline void prefetch_block(const kv_t *p, int64_t elements) {
    for (int64_t o = 0; o < elements; o += 64 / sizeof(kv_t)) __builtin_prefetch(p + o, 0, 1);
}

/* One call's arguments, shared by the threads that split its sequences. */
struct job {
    const float *q;
    const kv_t *k, *v;
    const float *sinks;
    const int32_t *block_tables, *context_lens;
    float *out;
    int64_t h, kvh, dk, dv, bs, M, k_tok, k_head, v_tok, v_head, window, stride;
    float scale;
};

/* The sums of 8 vectors' lanes, as one vector: lane i is hsum(a[i]). */
static inline vec reduce8(const vec a[8]) {
    vec p[4], r[2];
    for (int i = 0; i < 4; ++i)      /* pairwise: [a0+a1 b0+b1 a2+a3 b2+b3 a4+a5 b4+b5 a6+a7 b6+b7] */
        p[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        r[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
             + __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(r[0], r[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(r[0], r[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* score_t = scale * q_j . k_t for the tokens [0, n_tok) of one block run (consecutive slots from kt) and the query
 * heads [j0, j0 + group) of one KV head. Eight dots at a time (8 / group tokens x the group's heads) keep eight
 * independent FMA chains going and reduce together; the rest one at a time. */
static inline __attribute__((always_inline)) void run_scores(const float *qb, const kv_t *kt, float *scores,
                                                             int64_t n_tok, int64_t k_tok, int64_t j0, int64_t group,
                                                             int64_t dk, int64_t stride, float scale, int64_t nk) {
    const float *qg = qb + j0 * dk;
    int64_t i = 0;
    if (8 % group == 0) {
        const int64_t tile = 8 / group;
        for (; i + tile <= n_tok; i += tile) {
            vec acc[8];
            for (int d = 0; d < 8; ++d) acc[d] = splat(0.0f);
            for (int64_t c = 0; c < nk; ++c)
                for (int d = 0; d < 8; ++d)
                    acc[d] += load(qg + (d % group) * dk + c * W) * load_kv(kt + (i + d / group) * k_tok + c * W);
            const vec r = reduce8(acc) * splat(scale);
            for (int d = 0; d < 8; ++d) scores[(j0 + d % group) * stride + i + d / group] = r[d];
        }
    }
    for (; i < n_tok; ++i)
        for (int64_t jj = 0; jj < group; ++jj)
            scores[(j0 + jj) * stride + i] = scale * dot(qg + jj * dk, kt + i * k_tok, nk);
}

/* o_j += sum_t p_jt v_t over the tokens of one block run, for the query heads [j0, j0 + group) of one KV head,
 * with each head's output row held in registers over the run. nvv is a constant where the caller specialises. */
static inline __attribute__((always_inline)) void run_values(const kv_t *vt, const float *scores, float *ob,
                                                             int64_t n_tok, int64_t v_tok, int64_t j0, int64_t group,
                                                             int64_t dv, int64_t stride, int64_t nvv) {
    for (int64_t jj = 0; jj < group; ++jj) {
        float *o = ob + (j0 + jj) * dv;
        const float *p = scores + (j0 + jj) * stride;
        vec acc[nvv];
        for (int64_t c = 0; c < nvv; ++c) acc[c] = load(o + c * W);
        const kv_t *vr = vt;
        for (int64_t i = 0; i < n_tok; ++i, vr += v_tok) {
            const vec w = splat(p[i]);
            for (int64_t c = 0; c < nvv; ++c) acc[c] += w * load_kv(vr + c * W);
        }
        for (int64_t c = 0; c < nvv; ++c) store(o + c * W, acc[c]);
    }
}

/* Sequence b of the job, with scratch `scores` of h * stride floats. */
static void decode_one(const struct job *jb, int64_t b, float *scores) {
    const float *q = jb->q, *sinks = jb->sinks;
    const kv_t *k = jb->k, *v = jb->v;
    const int32_t *block_tables = jb->block_tables, *context_lens = jb->context_lens;
    float *out = jb->out;
    const int64_t h = jb->h, kvh = jb->kvh, dk = jb->dk, dv = jb->dv, bs = jb->bs, M = jb->M, k_tok = jb->k_tok;
    const int64_t k_head = jb->k_head, v_tok = jb->v_tok, v_head = jb->v_head, window = jb->window;
    const int64_t stride = jb->stride, group = h / kvh, nk = dk / W, nvv = dv / W;
    const float scale = jb->scale;
    const int64_t len = context_lens[b];
    const int64_t first = (window > 0 && len > window) ? len - window : 0;
    const int64_t n = len - first, blocks = (len + bs - 1) / bs;
    const int32_t *table = block_tables + b * M;
    const float *qb = q + b * h * dk;
    float *ob = out + b * h * dv;
    /* Scores, a block's run of tokens at a time (their slots are consecutive), a KV head's group at a time. */
    for (int64_t t = first; t < len;) {
        const int64_t end = (t / bs + 1) * bs < len ? (t / bs + 1) * bs : len;
        const kv_t *kt = k + ((int64_t)table[t / bs] * bs + t % bs) * k_tok;
        if (t / bs + 1 < blocks) prefetch_block(k + (int64_t)table[t / bs + 1] * bs * k_tok, bs * k_tok);
        else prefetch_block(v + (int64_t)table[first / bs] * bs * v_tok, bs * v_tok);   /* the values' first */
        for (int64_t g = 0; g < kvh; ++g) {
            float *s = scores + (t - first);
            if (nk == 8 && group == 2)
                run_scores(qb, kt + g * k_head, s, end - t, k_tok, g * group, 2, dk, stride, scale, 8);
            else if (nk == 8)
                run_scores(qb, kt + g * k_head, s, end - t, k_tok, g * group, group, dk, stride, scale, 8);
            else
                run_scores(qb, kt + g * k_head, s, end - t, k_tok, g * group, group, dk, stride, scale, nk);
        }
        t = end;
    }
    /* Softmax numerators in place, and each head's 1 / denominator. */
    float inv[h];
    for (int64_t j = 0; j < h; ++j) {
        float *s = scores + j * stride;
        float top = sinks ? sinks[j] : -INFINITY;
        for (int64_t i = 0; i < n; ++i) top = s[i] > top ? s[i] : top;
        /* Padding to a whole vector: exp gives exp(-87) ~ 1e-38, which cannot change a sum of at least 1 (the top). */
        for (int64_t i = n; i < (n + W - 1) / W * W; ++i) s[i] = -INFINITY;
        vec sum = splat(0.0f);
        for (int64_t i = 0; i < n; i += W) {
            vec e = exp_nonpositive(load(s + i) - splat(top));
            store(s + i, e);
            sum += e;
        }
        float total = hsum(sum) + (sinks ? expf(sinks[j] - top) : 0.0f);
        inv[j] = total > 0.0f ? 1.0f / total : 0.0f;   /* an empty context attends to nothing */
        memset(ob + j * dv, 0, sizeof(float) * (size_t)dv);
    }
    /* The weighted sum of values, again a block's run at a time. */
    for (int64_t t = first; t < len;) {
        const int64_t end = (t / bs + 1) * bs < len ? (t / bs + 1) * bs : len;
        const kv_t *vt = v + ((int64_t)table[t / bs] * bs + t % bs) * v_tok;
        if (t / bs + 1 < blocks) prefetch_block(v + (int64_t)table[t / bs + 1] * bs * v_tok, bs * v_tok);
        for (int64_t g = 0; g < kvh; ++g) {
            const float *s = scores + (t - first);
            if (nvv == 8)
                run_values(vt + g * v_head, s, ob, end - t, v_tok, g * group, group, dv, stride, 8);
            else if (nvv == 16)
                run_values(vt + g * v_head, s, ob, end - t, v_tok, g * group, group, dv, stride, 16);
            else
                run_values(vt + g * v_head, s, ob, end - t, v_tok, g * group, group, dv, stride, nvv);
        }
        t = end;
    }
    for (int64_t j = 0; j < h; ++j)
        for (int64_t c = 0; c < nvv; ++c) store(ob + j * dv + c * W, load(ob + j * dv + c * W) * splat(inv[j]));
}

/* The sequences that *cursor hands out, one at a time, until none is left (the threads of a call share the
 * cursor, so a thread that gets less of its core, e.g. on a core an expert rank is computing on, takes fewer)
 * -> 0, or -1 without scratch memory (then this thread takes none). */
static int decode_shared(const struct job *jb, int64_t B, int64_t *cursor) {
    float *scores = malloc(sizeof(float) * (size_t)(jb->h * jb->stride));
    if (scores == NULL) return -1;
    for (int64_t b; (b = __atomic_fetch_add(cursor, 1, __ATOMIC_RELAXED)) < B;) decode_one(jb, b, scores);
    free(scores);
    return 0;
}

/* A pool of worker threads, started on first need and kept. A call opens a round: its threads (the caller and
 * the workers that wake while the round is open) take sequences from one shared cursor, and the call returns
 * once the cursor is spent and every worker that joined has finished its sequence. The caller never waits for
 * a worker to wake: one that wakes after the round closed skips it. One caller at a time (a rank's main
 * thread). */
#define MAX_THREADS 64
#define SPIN_POLLS 200
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_go = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int pool_threads = 1, pool_started = 1, pool_open = 0, pool_active = 0, pool_rc = 0;
static int64_t pool_round = 0, pool_cursor = 0, pool_size = 0;
static const struct job *pool_job;

static void *pool_worker(void *arg) {
    (void)arg;
    int64_t seen = 0;
    for (;;) {
        /* Poll a while before sleeping: calls come once per layer, and a wake-up through the kernel costs
         * about as much as a small call's work. Yielding lets another ready process have the core. */
        for (int i = 0; i < SPIN_POLLS && __atomic_load_n(&pool_round, __ATOMIC_ACQUIRE) == seen; ++i) sched_yield();
        pthread_mutex_lock(&pool_lock);
        while (pool_round == seen) pthread_cond_wait(&pool_go, &pool_lock);
        seen = pool_round;
        if (!pool_open) {          /* woke after its round closed: nothing to do */
            pthread_mutex_unlock(&pool_lock);
            continue;
        }
        ++pool_active;
        const struct job *jb = pool_job;
        const int64_t B = pool_size;
        pthread_mutex_unlock(&pool_lock);
        const int rc = decode_shared(jb, B, &pool_cursor);
        pthread_mutex_lock(&pool_lock);
        if (rc) pool_rc = rc;
        if (--pool_active == 0 && !pool_open) pthread_cond_signal(&pool_done);
        pthread_mutex_unlock(&pool_lock);
    }
    return NULL;
}

/* A forked child has none of the workers (only the forking thread survives a fork): start over. */
static void pool_reset_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_go, NULL);
    pthread_cond_init(&pool_done, NULL);
    pool_started = 1;
    pool_open = pool_active = 0;
}

/* How this build widens the cache: 0 fp32 (nothing to widen), 1 float8 through F16C, 2 float8 in integer lanes. */
int afserve_kv_widen(void) {
#if KV_FMT == 0
    return 0;
#elif defined(__F16C__) && W == 8
    return 1;
#else
    return 2;
#endif
}

/* Threads for later calls (1: the caller alone) -> the number in use (at most MAX_THREADS). */
int afserve_set_threads(int n) {
    pool_threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : n;
    return pool_threads;
}

int afserve_paged_decode(const float *q, const kv_t *k, const kv_t *v, const int32_t *block_tables,
                             const int32_t *context_lens, const float *sinks, float *out, int64_t B, int64_t h,
                             int64_t kvh, int64_t dk, int64_t dv, int64_t bs, int64_t M, int64_t k_tok,
                             int64_t k_head, int64_t v_tok, int64_t v_head, float scale, int64_t window) {
    int64_t longest = 1, total = 0;
    for (int64_t b = 0; b < B; ++b) {
        if (context_lens[b] > longest) longest = context_lens[b];
        total += context_lens[b];
    }
    const struct job jb = {q, k, v, sinks, block_tables, context_lens, out, h, kvh, dk, dv, bs, M, k_tok, k_head,
                           v_tok, v_head, window, (longest + W - 1) / W * W, scale};
    /* A call too small to pay for waking threads runs on the caller alone. */
    if (total < 2048 || B < 2 || pool_threads < 2) {
        int64_t cursor = 0;
        return decode_shared(&jb, B, &cursor);
    }
    pthread_mutex_lock(&pool_lock);
    if (pool_started == 1) {
        static int registered = 0;
        if (!registered) registered = pthread_atfork(NULL, NULL, pool_reset_in_child) == 0;
    }
    while (pool_started < pool_threads) {
        pthread_t t;
        if (pthread_create(&t, NULL, pool_worker, NULL) != 0) break;
        pthread_detach(t);
        ++pool_started;
    }
    pool_job = &jb;
    pool_size = B;
    pool_rc = 0;
    pool_open = 1;
    /* Atomic stores: the spinning workers read the round and all threads the cursor outside the lock. */
    __atomic_store_n(&pool_cursor, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&pool_round, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool_go);
    pthread_mutex_unlock(&pool_lock);
    int rc = decode_shared(&jb, B, &pool_cursor);
    pthread_mutex_lock(&pool_lock);
    pool_open = 0;             /* from here no worker joins; wait for those inside (each on its last sequence) */
    while (pool_active > 0) pthread_cond_wait(&pool_done, &pool_lock);
    if (pool_rc) rc = pool_rc;
    pthread_mutex_unlock(&pool_lock);
    return rc;
}
