/*
 * plinth CPU backend: native kernels for x86-64 with AVX2, FMA and F16C.
 *
 * Plain C with a C ABI, called through ctypes with raw pointers: no Python or torch headers, so it
 * builds in about a second with the system compiler and is cached on disk (see native.py).
 *
 * Threads: a small pool of its own (see "Thread pool"), not OpenMP. An OpenMP loop ends in a
 * barrier that waits for every thread, so on a shared machine one descheduled thread stalls each
 * of the hundreds of parallel regions of a decode step for a scheduler time slice (measured here
 * under co-tenant load: 2 OpenMP threads decoded at 3-4 tok/s, 1 thread at 20-34). In this pool
 * the calling thread claims work items too and waits only for items another thread has actually
 * started: a worker that wakes late finds nothing left and the call has already returned.
 *
 * Conventions: every matrix is row-major and contiguous; a weight is [N, K] (out, in) like
 * F.linear; "x @ W^T" is computed for M activation rows. Quantized weights keep ggml's block
 * layouts bit for bit (a GGUF tensor's bytes, row after row):
 *   Q8_0: { fp16 d; int8 q[32]; }              value = d * q              (34 bytes / 32)
 *   Q4_1: { fp16 d; fp16 m; uint8 qs[16]; }    value = d * q + m, q in 0..15; element j < 16 is
 *                                              the low nibble of qs[j], element j + 16 its high one
 * Quantized GEMMs multiply fp32 activations as given, or round them per 32-block to int16 (scale
 * amax / 32767) or int8 (amax / 127, like llama.cpp's Q8_1, also keeping d * sum(q)) and
 * accumulate integer dot products per block.
 */
#ifdef PLINTH_EMULATE
#include "emulate.h" /* the AVX-512 and AMX instructions in portable code: a test build (see there) */
#else
#include <immintrin.h>
#endif
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h" /* the exported prototypes and the step-graph ops, generated from abi.py */

#define QK 32

typedef struct {
    uint16_t d;
    int8_t q[QK];
} block_q8_0;

typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t qs[QK / 2];
} block_q4_1;

/* An activation block: int8 values, their scale, and scale * sum of the values. */
typedef struct {
    float d;
    float s;
    int8_t q[QK];
} block_q8_x;

/* An activation block in int16: values, their scale (amax / 32767), and the exact fp32 sum of the
 * block's activations (for q4_1's minimum term). */
typedef struct {
    float d;
    float s;
    int16_t q[QK];
} block_q16_x;

_Static_assert(sizeof(block_q8_0) == 34, "Q8_0 block is 34 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "Q4_1 block is 20 bytes");

static inline float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^r by a
 * degree-6 polynomial, 2^n into the exponent bits. Relative error about 2 ulp; x < -87.3 gives
 * 0 (including -inf), x > 88.3 gives +inf, NaN stays NaN. */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447505531f);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n: n in [-126, 127] after the clamp; build it in two halves so n = 128 cannot overflow */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i half = _mm256_srai_epi32(ni, 1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    y = _mm256_andnot_ps(under, y);
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
    return _mm256_blendv_ps(y, x, nan);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

int plinth_abi_version(void) { return PLINTH_ABI_VERSION; }

/* Which ISA this build targets (native.py builds one library per variant and loads the one the CPU
 * runs): 3 with AVX-512 F/BW/VL/DQ and VNNI (its int16 dot products run on 512-bit registers), 2 for
 * AVX2/FMA/F16C only, 103 for the AVX-512 build emulated (-DPLINTH_EMULATE: emulate.h). Everything else
 * is the same code in every build. */
#if defined(PLINTH_EMULATE) || (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
                                defined(__AVX512DQ__) && defined(__AVX512VNNI__))
#define PLINTH_AVX512 1
#else
#define PLINTH_AVX512 0
#endif
#ifdef PLINTH_EMULATE
int plinth_isa(void) { return 103; } /* the AVX-512 build, emulated: never mistaken for the real one */
#else
int plinth_isa(void) { return PLINTH_AVX512 ? 3 : 2; }
#endif

#if PLINTH_AVX512
/* [x[0] x 8 | x[1] x 8]: an 8-byte load (memcpy: no float read through a double pointer) and a permute */
static inline __m512 pair_halves(const float *x) {
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    double pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(_mm_set_sd(pair))));
}
/* the low plus the high 8 lanes */
static inline __m256 fold_halves(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Thread pool. parallel_for(fn, ctx, n, grain) runs fn(ctx, begin, end) over [0, n) in items of
 * `grain`. Items are claimed by compare-and-swap on one 64-bit word holding (generation, next
 * item); a worker holding a stale generation can never claim an item of a newer call. The caller
 * returns once every item is done; it never waits for a worker that claimed nothing.
 */
typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);

#define MAX_THREADS 256
#define SPIN_ITERS 4000 /* ~50-100 us of pause before a worker sleeps */

static struct {
    int nthreads; /* workers + the caller */
    int started;
    _Atomic uint64_t next; /* generation << 32 | next item */
    _Atomic int64_t done;
    _Atomic uint32_t gen;
    _Atomic int sleeping;
    uint32_t cur_gen;
    range_fn fn;
    void *ctx;
    int64_t n, grain, items;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} pool = {.nthreads = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void run_items(uint32_t g) {
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool.next, memory_order_acquire);
        if ((uint32_t)(v >> 32) != g || (int64_t)(v & 0xFFFFFFFFu) >= pool.items) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.next, &v, v + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        int64_t i = (int64_t)(v & 0xFFFFFFFFu); /* claimed: the call cannot finish, so fn/ctx are stable */
        int64_t begin = i * pool.grain, end = begin + pool.grain < pool.n ? begin + pool.grain : pool.n;
        pool.fn(pool.ctx, begin, end);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        int spins = 0;
        while (atomic_load(&pool.gen) == seen) {
            if (++spins < SPIN_ITERS) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleeping, 1);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.gen);
        run_items(seen);
    }
    return NULL;
}

/* Use n threads in all (the caller included); workers are started on first use, never stopped. */
void plinth_set_num_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pool.nthreads = n;
}

int plinth_get_num_threads(void) { return pool.nthreads; }

/* A forked child has none of the parent's workers (and maybe a mutex a worker held): start afresh. */
static void pool_after_fork_in_child(void) {
    pool.started = 0;
    atomic_store(&pool.sleeping, 0);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
}

static void parallel_for(range_fn fn, void *ctx, int64_t n, int64_t grain) {
    static int atfork_registered = 0;
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, pool_after_fork_in_child);
        atfork_registered = 1;
    }
    if (grain < 1) grain = 1;
    int64_t items = (n + grain - 1) / grain;
    if (items <= 1 || pool.nthreads <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    while (pool.started < pool.nthreads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker_main, NULL) != 0) break;
        pthread_detach(t);
        pool.started++;
    }
    /* Close the word first: a worker still holding the previous generation's exhausted index must
     * not win a CAS against it once items has grown for this call (it would run an item twice and
     * count it, and the call could return while an item still runs: a use after free). */
    uint32_t g = ++pool.cur_gen;
    atomic_store(&pool.next, ((uint64_t)g << 32) | 0xFFFFFFFFu);
    atomic_thread_fence(memory_order_seq_cst); /* the fields below are written after the close */
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.grain = grain;
    pool.items = items;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.next, (uint64_t)g << 32);
    atomic_store(&pool.gen, g);
    if (atomic_load(&pool.sleeping) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    run_items(g);
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < items; spins++) {
        if (spins < SPIN_ITERS) _mm_pause();
        else sched_yield(); /* a worker was descheduled mid-item: let it run */
    }
}

/* Split n items for the pool: about 4 grains per thread, at least min_grain items each. */
static int64_t grain_for(int64_t n, int64_t min_grain) {
    int64_t g = n / (4 * (int64_t)pool.nthreads);
    return g < min_grain ? min_grain : g;
}

/* ---------------------------------------------------------------------------------------------
 * Read bandwidth probe: sums n floats (n a multiple of 4096) with the loads a weight-streaming
 * GEMV does, four sequential streams per thread (one stream leaves bandwidth unused: measured
 * 1.4x more per thread with three or four); partial sums per 4096-float chunk go to out[n / 4096].
 */
typedef struct {
    const float *x;
    float *out;
} probe_ctx;

static float probe_chunk(const float *x) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int i = 0; i < 4096; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(x + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(x + i + 24));
    }
    return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

static void probe_range(void *p, int64_t begin, int64_t end) {
    probe_ctx *c = (probe_ctx *)p;
    int64_t S = (end - begin) / 4;
    for (int64_t ch = begin; ch < begin + S; ch++) { /* chunks ch, ch + S, ch + 2S, ch + 3S in lockstep */
        const float *x0 = c->x + ch * 4096, *x1 = x0 + S * 4096, *x2 = x1 + S * 4096, *x3 = x2 + S * 4096;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < 4096; i += 16) {
            a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_loadu_ps(x0 + i), _mm256_loadu_ps(x0 + i + 8)));
            a1 = _mm256_add_ps(a1, _mm256_add_ps(_mm256_loadu_ps(x1 + i), _mm256_loadu_ps(x1 + i + 8)));
            a2 = _mm256_add_ps(a2, _mm256_add_ps(_mm256_loadu_ps(x2 + i), _mm256_loadu_ps(x2 + i + 8)));
            a3 = _mm256_add_ps(a3, _mm256_add_ps(_mm256_loadu_ps(x3 + i), _mm256_loadu_ps(x3 + i + 8)));
        }
        c->out[ch] = hsum256(a0), c->out[ch + S] = hsum256(a1);
        c->out[ch + 2 * S] = hsum256(a2), c->out[ch + 3 * S] = hsum256(a3);
    }
    for (int64_t ch = begin + 4 * S; ch < end; ch++) c->out[ch] = probe_chunk(c->x + ch * 4096);
}

void plinth_read_probe(const float *x, float *out, int64_t n) {
    probe_ctx c = {x, out};
    parallel_for(probe_range, &c, n / 4096, grain_for(n / 4096, 16));
}

/* Panels hold fp32 weights (W_F32), or a checkpoint's 16-bit weights kept as they were stored
 * (W_BF16, W_F16: half the bytes to stream). Those are widened to fp32 as they are loaded (bf16: the
 * bits shifted up; fp16: F16C's vcvtph2ps), exactly, since every bf16 and fp16 value is an fp32
 * value; the FMA chains are the fp32 panels', so a 16-bit panel and the fp32 panel of the same values
 * give the same sums bit for bit. `wt` is a constant wherever these are inlined. */
enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_F8 = 3 };
/* W_F8 is a KV cache's only (torch.float8_e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits,
 * no infinity, NaN S.1111.111), widened exactly through fp16 (f8_widen8). */
/* Bytes ahead a tile of a single row group prefetches each panel stream it reads (once per line):
 * with no row group after it to reuse a block, the weights stream straight from memory and the
 * hardware prefetcher alone kept too few lines in flight. SmolLM2-shaped stack of 30 layers, 2
 * threads, Zen 5, AVX-512 build, against none: bf16 panels 1 row +3-29%, 4 rows +25-40%; fp32
 * 4 rows +8-55%, 1 row within noise (1024 and 4096 bytes measured no better). The weight streams'
 * prefetches (these, the bf16 pairs' and the quantized panels') go into L2 (prefetcht1), as the
 * attention's pages do: AMD EPYC Zen 4, 2 threads, against
 * prefetcht0, benchmarks/w16.py (2 runs): fp32 panels 4 rows 1.09-1.16x, 16 rows 1.17-1.20x, 1 row
 * 1.02-1.10x, 16-bit panels 0.95-1.12x (the row groups' next-block prefetch kept in L1: with it in L2
 * the 16-bit panels at 16 rows measured 0.94-0.95x); onednn_packed.py --calls pairs: bf16 pairs
 * 1.02-1.10x (8-16 rows 1.07-1.10x); q4_1_layouts.py, alternating builds: q4_1 panels 1 row 69-73 ->
 * 77-81 GFLOP/s (1.1x), 2 rows 1.1x, 4-16 rows even. */
#define PANEL_PF_DIST 2048
static inline size_t wsize(int wt) { return wt == W_F32 ? sizeof(float) : wt == W_F8 ? 1 : sizeof(uint16_t); }
/* the element i of a panel buffer of kind wt */
static inline const void *wat(const void *P, int64_t i, int wt) { return (const char *)P + i * (int64_t)wsize(wt); }
/* 8 fp8 (e4m3fn) values, the low 8 bytes of b, as fp32. A byte S.EEEE.MMM moved to the top of a
 * 16-bit lane and shifted right by one (arithmetically: S lands in bits 15 and 14), bit 14 cleared,
 * is the fp16 S.0EEEE.MMM0000000: the value / 2^8. NaN where the byte is one (S.1111.111 widens to
 * +-480, which no fp8 value is). */
static inline __attribute__((always_inline)) __m256 f8_widen8(__m128i b) {
    __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1), _mm_set1_epi16((short)0xBFFF));
    __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    return _mm256_or_ps(f, _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), f), _mm256_set1_ps(480.0f), _CMP_EQ_OQ));
}
/* 8 weights from element i */
static inline __attribute__((always_inline)) __m256 load8w(const void *P, int64_t i, int wt) {
    if (wt == W_F8) return f8_widen8(_mm_loadl_epi64((const __m128i *)((const uint8_t *)P + i)));
    if (wt == W_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)P + i))), 16));
    if (wt == W_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)P + i)));
    return _mm256_loadu_ps((const float *)P + i);
}
#if PLINTH_AVX512
/* 16 weights from element i */
static inline __attribute__((always_inline)) __m512 load16w(const void *P, int64_t i, int wt) {
    if (wt == W_F8) {
        __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)P + i))), 8);
        __m256i h = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xBFFF)); /* as f8_widen8 */
        __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
        __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(f), _mm512_set1_ps(480.0f), _CMP_EQ_OQ);
        return _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(NAN));
    }
    if (wt == W_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)P + i))), 16));
    if (wt == W_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)P + i)));
    return _mm512_loadu_ps((const float *)P + i);
}
#endif

#if PLINTH_AVX512
/* e^x for 16 lanes: exp256's operations on 16 lanes, so the same value per lane as exp256 (the
 * AVX2 build's SwiGLU and softmax compute what the AVX-512 build's do) */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365447505531f);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i ni = _mm512_cvtps_epi32(n);
    __m512i half = _mm512_srai_epi32(ni, 1);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, _mm512_set1_epi32(127)), 23));
    __m512 s2 =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), _mm512_set1_epi32(127)), 23));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    y = _mm512_maskz_mov_ps((__mmask16)~under, y);
    y = _mm512_mask_blend_ps(over, y, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(nan, y, x);
}
#endif

/* Rounding to 16 bits, as torch rounds (so a native op's bf16/fp16 output equals torch's cast of the
 * same fp32 values): round to nearest, ties to even, overflow to infinity; a NaN stays a NaN (bf16:
 * the canonical quiet 0x7FC0, torch's scalar cast's; its vectorised cast may write another NaN
 * pattern; fp16: F16C's vcvtps2ph). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline __attribute__((always_inline)) __m128i f32_to_bf16_8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(
        u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF)));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16); /* 0..0xFFFF: unsigned saturation packs it as is */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
/* Rounding to fp8 (e4m3fn), as torch casts: to nearest, ties to even, beyond the largest finite
 * value (448) and infinities saturated to +-448, a NaN to S.1111.111 (its sign kept). 8 values into
 * the low 8 bytes. */
static inline __attribute__((always_inline)) __m128i f32_to_f8_8(__m256 v) {
    __m256i sign = _mm256_srli_epi32(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32((int)0x80000000u)), 24);
    __m256 a = _mm256_min_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), _mm256_set1_ps(448.0f)); /* NaN -> 448 */
    __m256i u = _mm256_castps_si256(a);
    /* normal (|v| >= 2^-6): the mantissa rounded to 3 bits, the exponent rebiased from 127 to 7 */
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1)),
                                                     _mm256_set1_epi32(0x7FFFF)));
    __m256i code = _mm256_sub_epi32(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(120 << 3));
    /* subnormal: |v| in steps of 2^-9 (8 of them make the smallest normal, code 8) */
    __m256i sub = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    code = _mm256_blendv_epi8(code, sub, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ)));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    code = _mm256_or_si256(code, sign);
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    return _mm_packus_epi16(w, w);
}
/* 8 fp32 values into element i of a buffer of kind wt (W_F32, W_BF16, W_F16 or W_F8) */
static inline __attribute__((always_inline)) void store8w(void *P, int64_t i, __m256 v, int wt) {
    if (wt == W_F8)
        _mm_storel_epi64((__m128i *)((uint8_t *)P + i), f32_to_f8_8(v));
    else if (wt == W_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)P + i), f32_to_bf16_8(v));
    else if (wt == W_F16)
        _mm_storeu_si128((__m128i *)((uint16_t *)P + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm256_storeu_ps((float *)P + i, v);
}
#if PLINTH_AVX512
/* 16 fp32 values into element i of a buffer of kind wt, rounded as store8w rounds */
static inline __attribute__((always_inline)) void store16w(void *P, int64_t i, __m512 v, int wt) {
    if (wt == W_BF16) {
        __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                                         _mm512_set1_epi32(0x7FFF)));
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
        _mm256_storeu_si256((__m256i *)((uint16_t *)P + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    } else if (wt == W_F16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)P + i),
                            _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    else
        _mm512_storeu_ps((float *)P + i, v);
}
#endif
/* one value of kind wt, as fp32 / stored */
static inline float load1w(const void *P, int64_t i, int wt) {
    if (wt == W_F8) {
        float r[8];
        _mm256_storeu_ps(r, f8_widen8(_mm_cvtsi32_si128(((const uint8_t *)P)[i])));
        return r[0];
    }
    if (wt == W_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)P)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    if (wt == W_F16) return fp16_to_f32(((const uint16_t *)P)[i]);
    return ((const float *)P)[i];
}
static inline void store1w(void *P, int64_t i, float v, int wt) {
    if (wt == W_F8)
        ((uint8_t *)P)[i] = (uint8_t)_mm_cvtsi128_si32(f32_to_f8_8(_mm256_set1_ps(v)));
    else if (wt == W_BF16)
        ((uint16_t *)P)[i] = f32_to_bf16(v);
    else if (wt == W_F16)
        ((uint16_t *)P)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else
        ((float *)P)[i] = v;
}

/* ---------------------------------------------------------------------------------------------
 * fp32 GEMM over a row-major weight: y[M, N] = x[M, K] @ w[N, K]^T + b, K a multiple of 8. The
 * backend lays its fp32 weights out in panels at load (below); these row tiles serve a weight as
 * given and the quantized many-row path, which dequantizes 3 rows at a time.
 * Work items are groups of 3 weight rows; a thread's range is walked as
 * three far-apart segments (rows n, n + S, n + 2S together): three sequential streams from memory
 * where adjacent rows would make one (one stream per thread read 7-9 GB/s here, three 13.7-15.4).
 * A 4x3 register tile (12 accumulators along K, 4 activation rows by 3 weight rows) keeps the FMA
 * units busy, 7 loads per 12 FMAs; leftover activation rows take the 1x3 tile, which is load-bound
 * and streams its weights once.
 */
static inline __attribute__((always_inline)) float dot1_w(const float *x, const void *w, int64_t K, int wt) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) a = _mm256_fmadd_ps(load8w(w, k, wt), _mm256_loadu_ps(x + k), a);
    return hsum256(a);
}
static inline float dot1(const float *x, const float *w, int64_t K) { return dot1_w(x, w, K, W_F32); }

/* [sum(a), sum(b), sum(c), 0] */
static inline __m128 hsum3(__m256 a, __m256 b, __m256 c) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, _mm256_setzero_ps()));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* y[col[j]] = v[j] + bias[col[j]] for the three columns */
static inline void store3(float *y, __m128 v, const int64_t col[3], const float *bias) {
    float r[4];
    _mm_storeu_ps(r, v);
    for (int j = 0; j < 3; j++) y[col[j]] = r[j] + (bias ? bias[col[j]] : 0.0f);
}

/* A 16-bit weight's three row streams, PANEL_PF_DIST bytes ahead of element k (once per 64 bytes: 32
 * elements): the hardware prefetcher alone kept too few lines in flight, as for the 16-bit panels. */
static inline __attribute__((always_inline)) void rows16_prefetch(const void *w0, const void *w1, const void *w2,
                                                                  int64_t k, int wt) {
    _mm_prefetch((const char *)wat(w0, k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
    _mm_prefetch((const char *)wat(w1, k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
    _mm_prefetch((const char *)wat(w2, k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
}

/* 4 activation rows (K apart) against weight rows w[0..2] (elements of kind wt, widened as read); row
 * i's outputs go to y + i * N at col[] */
static inline __attribute__((always_inline)) void tile_4x3_w(const float *x, const void *const w[3], int64_t K,
                                                             float *y, int64_t N, const int64_t col[3],
                                                             const float *bias, int wt) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const void *w0 = w[0], *w1 = w[1], *w2 = w[2];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    int64_t k = 0;
#if PLINTH_AVX512
    { /* 16 k per register, folded into the 8-wide sums before an odd 8 k (K is a multiple of 8) */
        __m512 z00 = _mm512_setzero_ps(), z01 = z00, z02 = z00, z10 = z00, z11 = z00, z12 = z00;
        __m512 z20 = z00, z21 = z00, z22 = z00, z30 = z00, z31 = z00, z32 = z00;
        for (; k + 16 <= K; k += 16) {
            if (wt != W_F32 && !(k & 31)) rows16_prefetch(w0, w1, w2, k, wt);
            __m512 a = load16w(w0, k, wt), b = load16w(w1, k, wt), c = load16w(w2, k, wt);
            __m512 v = _mm512_loadu_ps(x0 + k);
            z00 = _mm512_fmadd_ps(v, a, z00), z01 = _mm512_fmadd_ps(v, b, z01), z02 = _mm512_fmadd_ps(v, c, z02);
            v = _mm512_loadu_ps(x1 + k);
            z10 = _mm512_fmadd_ps(v, a, z10), z11 = _mm512_fmadd_ps(v, b, z11), z12 = _mm512_fmadd_ps(v, c, z12);
            v = _mm512_loadu_ps(x2 + k);
            z20 = _mm512_fmadd_ps(v, a, z20), z21 = _mm512_fmadd_ps(v, b, z21), z22 = _mm512_fmadd_ps(v, c, z22);
            v = _mm512_loadu_ps(x3 + k);
            z30 = _mm512_fmadd_ps(v, a, z30), z31 = _mm512_fmadd_ps(v, b, z31), z32 = _mm512_fmadd_ps(v, c, z32);
        }
        c00 = fold_halves(z00), c01 = fold_halves(z01), c02 = fold_halves(z02);
        c10 = fold_halves(z10), c11 = fold_halves(z11), c12 = fold_halves(z12);
        c20 = fold_halves(z20), c21 = fold_halves(z21), c22 = fold_halves(z22);
        c30 = fold_halves(z30), c31 = fold_halves(z31), c32 = fold_halves(z32);
    }
#endif
    for (; k < K; k += 8) {
        if (wt != W_F32 && !(k & 31)) rows16_prefetch(w0, w1, w2, k, wt);
        __m256 a = load8w(w0, k, wt), b = load8w(w1, k, wt), c = load8w(w2, k, wt);
        __m256 v = _mm256_loadu_ps(x0 + k);
        c00 = _mm256_fmadd_ps(v, a, c00), c01 = _mm256_fmadd_ps(v, b, c01), c02 = _mm256_fmadd_ps(v, c, c02);
        v = _mm256_loadu_ps(x1 + k);
        c10 = _mm256_fmadd_ps(v, a, c10), c11 = _mm256_fmadd_ps(v, b, c11), c12 = _mm256_fmadd_ps(v, c, c12);
        v = _mm256_loadu_ps(x2 + k);
        c20 = _mm256_fmadd_ps(v, a, c20), c21 = _mm256_fmadd_ps(v, b, c21), c22 = _mm256_fmadd_ps(v, c, c22);
        v = _mm256_loadu_ps(x3 + k);
        c30 = _mm256_fmadd_ps(v, a, c30), c31 = _mm256_fmadd_ps(v, b, c31), c32 = _mm256_fmadd_ps(v, c, c32);
    }
    store3(y, hsum3(c00, c01, c02), col, bias);
    store3(y + N, hsum3(c10, c11, c12), col, bias);
    store3(y + 2 * N, hsum3(c20, c21, c22), col, bias);
    store3(y + 3 * N, hsum3(c30, c31, c32), col, bias);
}

/* One activation row against weight rows w[0..2] (kind wt); outputs to y at col[] */
static inline __attribute__((always_inline)) void tile_1x3_w(const float *x, const void *const w[3], int64_t K,
                                                             float *y, const int64_t col[3], const float *bias,
                                                             int wt) {
    const void *w0 = w[0], *w1 = w[1], *w2 = w[2];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0;
    int64_t k = 0;
#if PLINTH_AVX512
    { /* 32 k a step in two 16-wide chains per row, folded into the 8-wide chains for the tail */
        __m512 za0 = _mm512_setzero_ps(), za1 = za0, zb0 = za0, zb1 = za0, zc0 = za0, zc1 = za0;
        for (; k + 32 <= K; k += 32) {
            if (wt != W_F32) rows16_prefetch(w0, w1, w2, k, wt);
            __m512 xa = _mm512_loadu_ps(x + k), xb = _mm512_loadu_ps(x + k + 16);
            za0 = _mm512_fmadd_ps(load16w(w0, k, wt), xa, za0), za1 = _mm512_fmadd_ps(load16w(w0, k + 16, wt), xb, za1);
            zb0 = _mm512_fmadd_ps(load16w(w1, k, wt), xa, zb0), zb1 = _mm512_fmadd_ps(load16w(w1, k + 16, wt), xb, zb1);
            zc0 = _mm512_fmadd_ps(load16w(w2, k, wt), xa, zc0), zc1 = _mm512_fmadd_ps(load16w(w2, k + 16, wt), xb, zc1);
        }
        a0 = fold_halves(za0), a1 = fold_halves(za1), b0 = fold_halves(zb0), b1 = fold_halves(zb1);
        c0 = fold_halves(zc0), c1 = fold_halves(zc1);
    }
#endif
    for (; k + 16 <= K; k += 16) { /* two chains per row: the loop is bound by FMA latency otherwise */
        if (wt != W_F32 && !(k & 31)) rows16_prefetch(w0, w1, w2, k, wt);
        __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + k + 8);
        a0 = _mm256_fmadd_ps(load8w(w0, k, wt), xa, a0), a1 = _mm256_fmadd_ps(load8w(w0, k + 8, wt), xb, a1);
        b0 = _mm256_fmadd_ps(load8w(w1, k, wt), xa, b0), b1 = _mm256_fmadd_ps(load8w(w1, k + 8, wt), xb, b1);
        c0 = _mm256_fmadd_ps(load8w(w2, k, wt), xa, c0), c1 = _mm256_fmadd_ps(load8w(w2, k + 8, wt), xb, c1);
    }
    for (; k < K; k += 8) {
        __m256 xa = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(load8w(w0, k, wt), xa, a0);
        b0 = _mm256_fmadd_ps(load8w(w1, k, wt), xa, b0);
        c0 = _mm256_fmadd_ps(load8w(w2, k, wt), xa, c0);
    }
    store3(y, hsum3(_mm256_add_ps(a0, a1), _mm256_add_ps(b0, b1), _mm256_add_ps(c0, c1)), col, bias);
}

static void tile_4x3(const float *x, const float *const w[3], int64_t K, float *y, int64_t N, const int64_t col[3],
                     const float *bias) {
    tile_4x3_w(x, (const void *const *)w, K, y, N, col, bias, W_F32);
}

static void tile_1x3(const float *x, const float *const w[3], int64_t K, float *y, const int64_t col[3],
                     const float *bias) {
    tile_1x3_w(x, (const void *const *)w, K, y, col, bias, W_F32);
}

/* n (a multiple of 8) weights of kind wt from src as fp32 into dst */
static inline __attribute__((always_inline)) void widen_w(const void *src, float *dst, int64_t n, int wt, int pf) {
    int64_t i = 0;
#if PLINTH_AVX512
    for (; i + 16 <= n; i += 16) {
        if (pf && !(i & 31)) _mm_prefetch((const char *)wat(src, i, wt) + PANEL_PF_DIST, _MM_HINT_T1);
        _mm512_storeu_ps(dst + i, load16w(src, i, wt));
    }
#endif
    for (; i < n; i += 8) {
        if (pf && !(i & 31)) _mm_prefetch((const char *)wat(src, i, wt) + PANEL_PF_DIST, _MM_HINT_T1);
        _mm256_storeu_ps(dst + i, load8w(src, i, wt));
    }
}

/* pf: prefetch PANEL_PF_DIST ahead of the reads (where nothing else prefetches the stream) */
static void widen(const void *src, float *dst, int64_t n, int wt, int pf) {
    if (wt == W_BF16)
        pf ? widen_w(src, dst, n, W_BF16, 1) : widen_w(src, dst, n, W_BF16, 0);
    else
        pf ? widen_w(src, dst, n, W_F16, 1) : widen_w(src, dst, n, W_F16, 0);
}

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t M, N, K;
    const void *P; /* panels (gemm_panels_range): elements of kind wt */
    int wt;
} gemm_ctx;

/* Activation rows per pass over a thread's weight rows: 64 rows of K floats stay in L2 while the
 * weights stream past them, so a decode batch of up to 64 reads each weight once. */
#define GEMM_M_BLOCK 64

/* items are groups of 3 weight rows; measured against adjacent rows with a prefetch of the next
 * item (2 threads, SmolLM2's four shapes, weights not in cache): 24.5-25 to 30-35 GFLOP/s at 4
 * rows, 38-39 to 49-52 at 8, 58-61 to 79-80 at 16, 81-83 to 93-97 at 32 */
static inline __attribute__((always_inline)) void gemm_rows_w(const gemm_ctx *c, int64_t begin, int64_t end,
                                                              int wt) {
    int64_t M = c->M, N = c->N, K = c->K;
    int64_t r0 = begin * 3, r1 = end * 3 < N ? end * 3 : N, S = (r1 - r0) / 3;
    const void *W = wt == W_F32 ? (const void *)c->w : c->P;
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_M_BLOCK) {
        int64_t m1 = m0 + GEMM_M_BLOCK < M ? m0 + GEMM_M_BLOCK : M;
        for (int64_t n = r0; n < r0 + S; n++) {
            const void *w[3] = {wat(W, n * K, wt), wat(W, (n + S) * K, wt), wat(W, (n + 2 * S) * K, wt)};
            const int64_t col[3] = {n, n + S, n + 2 * S};
            int64_t m = m0;
            for (; m + 4 <= m1; m += 4) tile_4x3_w(c->x + m * K, w, K, c->y + m * N, N, col, c->bias, wt);
            for (; m < m1; m++) tile_1x3_w(c->x + m * K, w, K, c->y + m * N, col, c->bias, wt);
        }
        for (int64_t n = r0 + 3 * S; n < r1; n++)
            for (int64_t m = m0; m < m1; m++)
                c->y[m * N + n] = dot1_w(c->x + m * K, wat(W, n * K, wt), K, wt) + (c->bias ? c->bias[n] : 0.0f);
    }
}

static void gemm_f32_range(void *p, int64_t begin, int64_t end) { gemm_rows_w((gemm_ctx *)p, begin, end, W_F32); }

static void gemm_rows16_range(void *p, int64_t begin, int64_t end) {
    gemm_ctx *c = (gemm_ctx *)p;
    if (c->wt == W_BF16)
        gemm_rows_w(c, begin, end, W_BF16);
    else
        gemm_rows_w(c, begin, end, W_F16);
}

void plinth_gemm_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    gemm_ctx c = {x, w, bias, y, M, N, K, NULL, W_F32};
    int64_t groups = (N + 2) / 3;
    parallel_for(gemm_f32_range, &c, groups, grain_for(groups, 8));
}

/* The row tiles over a bf16/fp16 weight [N, K] as stored (wt: W_BF16 or W_F16; a 16-bit model's
 * dense weights, which its batched products hand to oneDNN as they are): the weights widened exactly
 * as they are read, so the sums are those of plinth_gemm_f32 over the same values, bit for bit.
 * Returns -1 for another wt. */
int plinth_gemm_rows16(int wt, const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K) {
    if (wt != W_BF16 && wt != W_F16) return -1;
    gemm_ctx c = {x, NULL, bias, y, M, N, K, w, wt};
    int64_t groups = (N + 2) / 3;
    parallel_for(gemm_rows16_range, &c, groups, grain_for(groups, 8));
    return 0;
}

/* a thread's scratch for the rows of one panel, grown on demand */
static _Thread_local float *pack_buf;
static _Thread_local size_t pack_cap;

static float *pack_buffer(size_t floats) {
    if (pack_cap < floats) {
        free(pack_buf);
        pack_buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        pack_cap = pack_buf ? floats : 0;
    }
    return pack_buf;
}

/* 8 rows of w (K apart; rows past `rows` read as zeros) by 8 columns into P, column j at P + j * ldp
 * (8 floats each, stored in order: with ldp < 8 each store's tail is overwritten by the next) */
static inline __attribute__((always_inline)) void transpose8(const float *w, int64_t K, float *P, int64_t ldp, int rows) {
    __m256 r0, r1, r2, r3, r4, r5, r6, r7, z = _mm256_setzero_ps();
    r0 = rows > 0 ? _mm256_loadu_ps(w) : z;
    r1 = rows > 1 ? _mm256_loadu_ps(w + K) : z;
    r2 = rows > 2 ? _mm256_loadu_ps(w + 2 * K) : z;
    r3 = rows > 3 ? _mm256_loadu_ps(w + 3 * K) : z;
    r4 = rows > 4 ? _mm256_loadu_ps(w + 4 * K) : z;
    r5 = rows > 5 ? _mm256_loadu_ps(w + 5 * K) : z;
    r6 = rows > 6 ? _mm256_loadu_ps(w + 6 * K) : z;
    r7 = rows > 7 ? _mm256_loadu_ps(w + 7 * K) : z;
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(P + 0 * ldp, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(P + 1 * ldp, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(P + 2 * ldp, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(P + 3 * ldp, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(P + 4 * ldp, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(P + 5 * ldp, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(P + 6 * ldp, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(P + 7 * ldp, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* ---------------------------------------------------------------------------------------------
 * fp32 weights in 8-column panels, laid out once at load: P[ceil(N/8)][K][8], panel p holding
 * weight rows 8p..8p+7 k-major (the last panel's missing rows are zeros), so one k of a panel is
 * one aligned vector of 8 outputs' weights. A 4x24 register tile (4 activation rows by 3 panels,
 * 12 accumulators) takes 3 vector loads and 4 broadcasts per 12 FMAs and ends with plain stores,
 * no horizontal sums. The three panels of a tile come from three far-apart segments of a thread's
 * range, three sequential weight streams as in the row-major tiles (the AVX-512 build's tiles are up
 * to 8 rows tall for calls of few rows: see PANEL_MR). With more rows than one tile, K goes
 * in blocks of PANEL_KC: the 3 x PANEL_KC x 8 weights of a tile stay in L1 while every 4-row
 * group of a 64-row block of activations passes them, where the row-major tiles re-read both
 * operands from L2. A panel of one block is contiguous, so the weight streams stay sequential.
 * Measured here against the row-major tiles (2 threads, SmolLM2's four layer shapes, weights not in
 * cache, quiet machine, GFLOP/s): 4 rows 54 -> 57, 8 rows 73 -> 82, 16 rows 90 -> 103, 32 rows
 * 131 -> 154, 64 rows 140 -> 166; 1 row the same (bandwidth-bound). From 96 rows the BLIS blocking
 * below takes over.
 */
#define PANEL_KC 128
/* Row groups (of 4) from which a tile prefetches the panels' next block in software: measured +4-8%
 * at 32-64 rows, +10-20% at 20-28 rows, even at 13-16 (4 groups); at 12 rows (3 groups) it cost
 * 11-13%, at 8 rows (2 groups, so bursts of 90 prefetches) 23-29% (the hardware prefetcher follows
 * the panels' streams there). */
#define PANEL_PREFETCH_GROUPS 4

static void pack_panels_range(void *p, int64_t begin, int64_t end) {
    gemm_ctx *c = (gemm_ctx *)p; /* w: the [N, K] weight; y: the panels */
    int64_t N = c->N, K = c->K;
    for (int64_t q = begin; q < end; q++) {
        int rows = N - q * 8 < 8 ? (int)(N - q * 8) : 8;
        for (int64_t k = 0; k < K; k += 8) transpose8(c->w + q * 8 * K + k, K, c->y + q * 8 * K + k * 8, 8, rows);
    }
}

/* Lays out a weight [N, K] (K a multiple of 8) as panels P [ceil(N/8) * 8 * K]. */
void plinth_pack_f32_panels(const float *w, float *P, int64_t N, int64_t K) {
    gemm_ctx c = {NULL, w, NULL, P, 0, N, K, NULL, W_F32};
    int64_t panels = (N + 7) / 8;
    parallel_for(pack_panels_range, &c, panels, grain_for(panels, 4));
}

/* y[0..8) (+ bias) at output columns n0.. of a row, added to what y holds when acc; the last
 * panel of an N that is not a multiple of 8 stores only its real columns */
static inline void store8(float *y, __m256 v, int acc, const float *bias, int64_t n0, int64_t N) {
    if (n0 + 8 <= N) {
        if (acc) v = _mm256_add_ps(v, _mm256_loadu_ps(y));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0));
        _mm256_storeu_ps(y, v);
        return;
    }
    float r[8];
    _mm256_storeu_ps(r, v);
    for (int64_t j = 0; j < N - n0; j++) y[j] = r[j] + (acc ? y[j] : 0.0f) + (bias ? bias[n0 + j] : 0.0f);
}

#if PLINTH_AVX512
/* The AVX-512 build: one register holds two k of a panel (16 consecutive floats), multiplied by
 * [x[k] x 8 | x[k + 1] x 8] (an 8-byte load and a permute); a tile's registers then sum even k in
 * their low and odd k in their high halves, added when stored: half the FMAs and loads of the AVX2
 * tile per k. With 32 registers a tile holds up to 8 rows (24 accumulators): a call of 5-16 rows
 * (fp32; 5-8 of 16-bit panels) takes 8-row tiles, so up to 8 rows stream the weights once, computing
 * as they go, where the 4-row tiles stream them with the first 4 rows and re-read them from L1 for
 * the rest. Measured (AMD EPYC Zen 4, 2 threads, benchmarks/onednn_packed.py --dtype float32
 * --against the 4-row tiles, 30 SmolLM2-shaped layers from memory, alternating, 3 processes): 6 rows
 * 1.25-1.42x, 8 rows 1.37-1.54x, 12 rows 1.19-1.21x, 16 rows 1.13-1.14x; 8-row tiles for every row
 * count were 0.93-0.98x from 24 rows (4 processes), so more rows keep the 4-row tiles and their
 * prefetching; 16-bit panels (benchmarks/w16.py) 1.9-2.0x at 6-8 rows, 0.8-0.9x at 16. */
#define PANEL_MR 8
#define PANEL_TALL_ROWS 16   /* the most rows of a call that takes 8-row tiles of fp32 panels */
#define PANEL_TALL_ROWS16 8  /* ... of 16-bit panels */
#define PROW(i)                                                                                                \
    if (r > i) {                                                                                               \
        __m512 a = pair_halves(x##i + k);                                                                      \
        c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0), c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);                  \
        c##i##2 = _mm512_fmadd_ps(a, b2, c##i##2);                                                             \
    }
#define POUT(i)                                                                                                \
    if (r > i) {                                                                                               \
        store8(y + i * N + col[0], fold_halves(c##i##0), acc, bias, col[0], N);                                \
        store8(y + i * N + col[1], fold_halves(c##i##1), acc, bias, col[1], N);                                \
        store8(y + i * N + col[2], fold_halves(c##i##2), acc, bias, col[2], N);                                \
    }
static inline __attribute__((always_inline)) void panel_tile(int r, const float *x, int64_t K, const void *const P[3],
                                                             int64_t kc, float *y, int64_t N, const int64_t col[3],
                                                             int acc, const float *bias, int wt, int pf) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const float *x4 = x + 4 * K, *x5 = x + 5 * K, *x6 = x + 6 * K, *x7 = x + 7 * K;
    const void *p0 = P[0], *p1 = P[1], *p2 = P[2];
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m512 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    __m512 c40 = c00, c41 = c00, c42 = c00, c50 = c00, c51 = c00, c52 = c00;
    __m512 c60 = c00, c61 = c00, c62 = c00, c70 = c00, c71 = c00, c72 = c00;
    (void)x1, (void)x2, (void)x3, (void)x4, (void)x5, (void)x6, (void)x7;
    for (int64_t k = 0; k < kc; k += 2) { /* kc is a multiple of 8 */
        if (pf && (wt == W_F32 || !(k & 3))) { /* a line every 64 bytes: 2 k of fp32, 4 of 16-bit */
            _mm_prefetch((const char *)wat(p0, 8 * k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
            _mm_prefetch((const char *)wat(p1, 8 * k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
            _mm_prefetch((const char *)wat(p2, 8 * k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
        }
        __m512 b0 = load16w(p0, 8 * k, wt), b1 = load16w(p1, 8 * k, wt), b2 = load16w(p2, 8 * k, wt);
        PROW(0) PROW(1) PROW(2) PROW(3) PROW(4) PROW(5) PROW(6) PROW(7)
    }
    POUT(0) POUT(1) POUT(2) POUT(3) POUT(4) POUT(5) POUT(6) POUT(7)
}
#undef PROW
#undef POUT
#else
#define PANEL_MR 4 /* 16 registers: 4-row tiles at every row count */
#define PANEL_TALL_ROWS 0
#define PANEL_TALL_ROWS16 0
#define PROW(i)                                                                                                \
    if (r > i) {                                                                                               \
        __m256 a = _mm256_broadcast_ss(x##i + k);                                                              \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0), c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                  \
        c##i##2 = _mm256_fmadd_ps(a, b2, c##i##2);                                                             \
    }
#define POUT(i)                                                                                                \
    if (r > i) {                                                                                               \
        store8(y + i * N + col[0], c##i##0, acc, bias, col[0], N);                                             \
        store8(y + i * N + col[1], c##i##1, acc, bias, col[1], N);                                             \
        store8(y + i * N + col[2], c##i##2, acc, bias, col[2], N);                                             \
    }
/* r (a constant where inlined, 1..4) activation rows (K apart) by the panels' first kc k; outputs
 * at columns col[0..2] of rows N apart */
static inline __attribute__((always_inline)) void panel_tile(int r, const float *x, int64_t K, const void *const P[3],
                                                             int64_t kc, float *y, int64_t N, const int64_t col[3],
                                                             int acc, const float *bias, int wt, int pf) {
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const void *p0 = P[0], *p1 = P[1], *p2 = P[2];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
    __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    (void)x1, (void)x2, (void)x3;
    for (int64_t k = 0; k < kc; k++) {
        if (pf && !(k & (wt == W_F32 ? 1 : 3))) { /* a line every 64 bytes: 2 k of fp32, 4 of 16-bit */
            _mm_prefetch((const char *)wat(p0, 8 * k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
            _mm_prefetch((const char *)wat(p1, 8 * k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
            _mm_prefetch((const char *)wat(p2, 8 * k, wt) + PANEL_PF_DIST, _MM_HINT_T1);
        }
        __m256 b0 = load8w(p0, 8 * k, wt), b1 = load8w(p1, 8 * k, wt), b2 = load8w(p2, 8 * k, wt);
        PROW(0) PROW(1) PROW(2) PROW(3)
    }
    POUT(0) POUT(1) POUT(2) POUT(3)
}
#undef PROW
#undef POUT
#endif

static inline __attribute__((always_inline)) void panel_tile_rows_w(int64_t r, const float *x, int64_t K,
                                                                    const void *const P[3], int64_t kc, float *y,
                                                                    int64_t N, const int64_t col[3], int acc,
                                                                    const float *bias, int wt, int pf) {
    switch (r) {
#if PANEL_MR == 8
    case 8: panel_tile(8, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    case 7: panel_tile(7, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    case 6: panel_tile(6, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    case 5: panel_tile(5, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
#endif
    case 4: panel_tile(4, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    case 3: panel_tile(3, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    case 2: panel_tile(2, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    default: panel_tile(1, x, K, P, kc, y, N, col, acc, bias, wt, pf); break;
    }
}

static void panel_tile_rows(int64_t r, const float *x, int64_t K, const void *const P[3], int64_t kc, float *y,
                            int64_t N, const int64_t col[3], int acc, const float *bias, int wt) {
    switch (wt) {
    case W_BF16: panel_tile_rows_w(r, x, K, P, kc, y, N, col, acc, bias, W_BF16, 0); break;
    case W_F16: panel_tile_rows_w(r, x, K, P, kc, y, N, col, acc, bias, W_F16, 0); break;
    default: panel_tile_rows_w(r, x, K, P, kc, y, N, col, acc, bias, W_F32, 0); break;
    }
}

/* the same for a tile that is its row block's only reader from memory: it prefetches its streams
 * PANEL_PF_DIST ahead. A function of its own: a pf test in the shared copies, or one switch over
 * both, cost the other tiles 5-12% at 16-64 rows. */
static void panel_tile_rows_pf(int64_t r, const float *x, int64_t K, const void *const P[3], int64_t kc, float *y,
                               int64_t N, const int64_t col[3], int acc, const float *bias, int wt) {
    switch (wt) {
    case W_BF16: panel_tile_rows_w(r, x, K, P, kc, y, N, col, acc, bias, W_BF16, 1); break;
    case W_F16: panel_tile_rows_w(r, x, K, P, kc, y, N, col, acc, bias, W_F16, 1); break;
    default: panel_tile_rows_w(r, x, K, P, kc, y, N, col, acc, bias, W_F32, 1); break;
    }
}

/* one activation row by one whole panel (a thread's 1-2 panels left over from its triples) */
static inline __attribute__((always_inline)) void panel_row_w(const float *x, const void *P, int64_t K, float *y,
                                                              int64_t n0, int64_t N, const float *bias, int wt) {
#if PLINTH_AVX512
    __m512 a = _mm512_setzero_ps(), b = a;
    for (int64_t k = 0; k < K; k += 4) { /* two chains of k pairs: K is a multiple of 8 */
        a = _mm512_fmadd_ps(pair_halves(x + k), load16w(P, 8 * k, wt), a);
        b = _mm512_fmadd_ps(pair_halves(x + k + 2), load16w(P, 8 * k + 16, wt), b);
    }
    store8(y + n0, fold_halves(_mm512_add_ps(a, b)), 0, bias, n0, N);
#else
    __m256 a = _mm256_setzero_ps(), b = a;
    for (int64_t k = 0; k < K; k += 2) { /* two chains: K is a multiple of 8 */
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), load8w(P, 8 * k, wt), a);
        b = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 1), load8w(P, 8 * k + 8, wt), b);
    }
    store8(y + n0, _mm256_add_ps(a, b), 0, bias, n0, N);
#endif
}

static void panel_row(const float *x, const void *P, int64_t K, float *y, int64_t n0, int64_t N, const float *bias,
                      int wt) {
    switch (wt) {
    case W_BF16: panel_row_w(x, P, K, y, n0, N, bias, W_BF16); break;
    case W_F16: panel_row_w(x, P, K, y, n0, N, bias, W_F16); break;
    default: panel_row_w(x, P, K, y, n0, N, bias, W_F32); break;
    }
}

/* items are panels; a thread's range is walked as three segments of S panels side by side */
static void gemm_panels_range(void *p, int64_t begin, int64_t end) {
    gemm_ctx *c = (gemm_ctx *)p;
    int64_t M = c->M, N = c->N, K = c->K, S = (end - begin) / 3;
    int wt = c->wt;
    int64_t mr = M <= (wt == W_F32 ? PANEL_TALL_ROWS : PANEL_TALL_ROWS16) ? PANEL_MR : 4; /* rows per tile */
    int64_t chunks = M <= mr ? 1 : (K + PANEL_KC - 1) / PANEL_KC, kcs = (K / chunks + 7) / 8 * 8;
    int64_t per_line = 64 / (int64_t)wsize(wt); /* elements in a cache line */
    float wide[3 * PANEL_KC * 8] __attribute__((aligned(64))); /* a 16-bit tile's 3 panels of one K block */
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_M_BLOCK) {
        int64_t m1 = m0 + GEMM_M_BLOCK < M ? m0 + GEMM_M_BLOCK : M, groups = (m1 - m0 + mr - 1) / mr;
        int prefetch = mr == 4 && groups >= PANEL_PREFETCH_GROUPS;
        for (int64_t q = begin; q < begin + S; q++) {
            const int64_t col[3] = {q * 8, (q + S) * 8, (q + 2 * S) * 8};
            for (int64_t k0 = 0; k0 < K; k0 += kcs) {
                int64_t kc = K - k0 < kcs ? K - k0 : kcs, lines = 0;
                const void *P[3] = {wat(c->P, col[0] * K + k0 * 8, wt), wat(c->P, col[1] * K + k0 * 8, wt),
                                    wat(c->P, col[2] * K + k0 * 8, wt)};
                const float *bias = k0 + kc >= K ? c->bias : NULL; /* added once, with the last block */
                /* with enough row groups, each also prefetches a share of the lines of the panels'
                 * next block (or the next triple's first), so that block does not start on misses */
                const void *next[3] = {P[0], P[1], P[2]};
                if (prefetch && k0 + kc < K) {
                    for (int j = 0; j < 3; j++) next[j] = wat(P[j], kc * 8, wt);
                    lines = (K - k0 - kc < kcs ? K - k0 - kc : kcs) * 8 / per_line;
                } else if (prefetch && q + 1 < begin + S) {
                    for (int j = 0; j < 3; j++) next[j] = wat(c->P, (col[j] + 8) * K, wt);
                    lines = kcs * 8 / per_line;
                }
                int64_t share = (lines + groups - 1) / groups, l0 = 0;
                int tile_wt = wt; /* 16-bit panels: widened in registers for one row group, else once here */
                if (wt != W_F32 && groups > 1) {
                    for (int j = 0; j < 3; j++) widen(P[j], wide + j * kc * 8, kc * 8, wt, !prefetch), P[j] = wide + j * kc * 8;
                    tile_wt = W_F32;
                }
                for (int64_t m = m0; m < m1; m += mr, l0 += share) {
                    for (int64_t l = l0; l < l0 + share && l < lines; l++)
                        for (int j = 0; j < 3; j++) _mm_prefetch((const char *)next[j] + l * 64, _MM_HINT_T0);
                    /* a single row group streams the block from memory; with 2-3 groups the first does */
                    int64_t r = m1 - m < mr ? m1 - m : mr;
                    if (groups == 1 || (m == m0 && !prefetch && tile_wt == W_F32)) /* direct calls: inlined */
                        panel_tile_rows_pf(r, c->x + m * K + k0, K, P, kc, c->y + m * N, N, col, k0 > 0, bias, tile_wt);
                    else
                        panel_tile_rows(r, c->x + m * K + k0, K, P, kc, c->y + m * N, N, col, k0 > 0, bias, tile_wt);
                }
            }
        }
        for (int64_t q = begin + 3 * S; q < end; q++)
            for (int64_t m = m0; m < m1; m++)
                panel_row(c->x + m * K, wat(c->P, q * 8 * K, wt), K, c->y + m * N, q * 8, N, c->bias, wt);
    }
}

/* ---- many rows (prefill): blocked as in BLIS (Goto's algorithm) ----
 * x is packed once per call into 6-row micro-panels [ceil(M/6)][K][6] with 8x8 register
 * transposes, so a k step reads 6 consecutive floats; a 6x16 register tile over two adjacent
 * weight panels (12 accumulators) takes 2 loads and 6 broadcasts per 12 FMAs (the AVX-512 build: 12
 * rows, two micro-panels, by 4 panels, 24 accumulators of 16). Items are (group of
 * 4 panels, 48-row block) pairs, row block inner: a thread's consecutive items share their weights
 * in L1/L2, and o_proj's and down_proj's 576 outputs still split evenly over two threads. The 4x24
 * tiles matched it at 1024 rows with two threads but not with one (83 against 92 GFLOP/s): they
 * re-read 64 rows of x from L2 for every 24 columns. Against packing the weight panels per item
 * (what this did before the panels were made at load): 1024 rows 158 -> 161 GFLOP/s, 256 rows
 * 152 -> 161 (2 threads). */
#define BLOCKED_MIN_ROWS 96
/* ... and from 48 rows for outputs this wide (an lm_head: SmolLM2's 49152 x 576 at 48-80 rows ran 2-16%
 * faster blocked than in 4x24 tiles, 80 rows 25%; the layers' 576-3072 outputs the same either way) */
#define BLOCKED_WIDE_MIN_ROWS 48
#define BLOCKED_WIDE_N 16384
/* The AVX-512 build also takes fp32 calls of 17-32 rows (past its 8-row tiles) blocked: its 12-row
 * tiles outran the 4-row panel tiles there (AMD EPYC Zen 4, 2 threads, benchmarks/onednn_packed.py
 * --dtype float32 --calls native, 30 SmolLM2-shaped layers, 4 processes): 17 rows 1.16-1.32x, 20
 * 1.11-1.27x, 24 1.05-1.23x, 28-32 1.00-1.16x; from 40 rows the panel tiles were even or ahead
 * (40-64 rows 0.94-1.13x, 64 rows 0.94-1.05x). 16-bit panels stay: blocked, a call first widens the
 * whole weight to fp32, twice the bytes a decode step reads. */
#if PLINTH_AVX512
#define BLOCKED_SHORT_ROWS 32
#else
#define BLOCKED_SHORT_ROWS 0
#endif
#define PACK_MC 48 /* activation rows per item: a 48 x K block of micro-panels stays in L2 */
#define PACK_KC 768 /* K per pass: one pass up to 768, so the output tile is stored once */
#define PACK_GP 4  /* 8-row panels per item */

/* y[mr][16] (rows ldy apart) = A[kc][6] @ [P0 | P1][kc][16] for the first mr of A's 6 rows, added
 * to y when acc; mr is a constant where this is inlined, so only mr rows of registers are live */
#define KROW(i)                                                                                                \
    if (mr > i) {                                                                                              \
        __m256 a = _mm256_broadcast_ss(A + i);                                                                 \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0), c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                  \
    }
#define KOUT(i)                                                                                                \
    if (mr > i) {                                                                                              \
        if (acc) {                                                                                             \
            c##i##0 = _mm256_add_ps(c##i##0, _mm256_loadu_ps(y + i * ldy));                                    \
            c##i##1 = _mm256_add_ps(c##i##1, _mm256_loadu_ps(y + i * ldy + 8));                                \
        }                                                                                                      \
        _mm256_storeu_ps(y + i * ldy, c##i##0), _mm256_storeu_ps(y + i * ldy + 8, c##i##1);                    \
    }
static inline __attribute__((always_inline)) void kern_rows(int mr, const float *A, int64_t kc, const float *P0,
                                                            const float *P1, float *y, int64_t ldy, int acc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++, A += 6) {
        __m256 b0 = _mm256_loadu_ps(P0 + 8 * k), b1 = _mm256_loadu_ps(P1 + 8 * k);
        KROW(0) KROW(1) KROW(2) KROW(3) KROW(4) KROW(5)
    }
    KOUT(0) KOUT(1) KOUT(2) KOUT(3) KOUT(4) KOUT(5)
}
#undef KROW
#undef KOUT

/* kern_rows for any mr in 1..6 (the last rows of x need no zero rows multiplied); the AVX2 build's tile */
static __attribute__((unused)) void kern6x16(int64_t mr, const float *A, int64_t kc, const float *P0, const float *P1, float *y, int64_t ldy,
                     int acc) {
    switch (mr) {
    case 6: kern_rows(6, A, kc, P0, P1, y, ldy, acc); break;
    case 5: kern_rows(5, A, kc, P0, P1, y, ldy, acc); break;
    case 4: kern_rows(4, A, kc, P0, P1, y, ldy, acc); break;
    case 3: kern_rows(3, A, kc, P0, P1, y, ldy, acc); break;
    case 2: kern_rows(2, A, kc, P0, P1, y, ldy, acc); break;
    default: kern_rows(1, A, kc, P0, P1, y, ldy, acc); break;
    }
}

#if PLINTH_AVX512
/* The AVX-512 build's tile: up to two 6-row micro-panels (mr rows of A, then mr2 of A2: 0 for a lone
 * micro-panel) by 4 adjacent weight panels (32 columns), each register one k of two panels ([P0 | P1]
 * and [P2 | P3]: a load and an insert from the other panel), each A value broadcast from memory into
 * the FMA: up to 24 accumulators of 16, so each pair of weight vectors loaded and inserted serves 12
 * rows (on Intel the inserts share a port with the FMAs). Same panels, same packed A, same sums per
 * output as kern6x16 (one k after another), so both builds' results agree bit for bit. Measured (AMD
 * EPYC Zen 4, 2 threads, benchmarks/onednn_packed.py --dtype float32 --calls native --against 6-row
 * tiles, 30 SmolLM2-shaped layers): 96-512 rows 1.04-1.08x (~186-192 -> ~195-200 GFLOP/s of a 232
 * GFLOP/s FMA peak; oneDNN on its pre-packed weights 206-213). K blocks of 256 or 384 (a block of
 * weights in L1 for every tile of an item) or 96-row items measured the same. */
#define KROW(c, A, m, i)                                                                                       \
    if (m > i) {                                                                                               \
        __m512 a = _mm512_set1_ps(A[i]);                                                                       \
        c##i##0 = _mm512_fmadd_ps(a, b0, c##i##0), c##i##1 = _mm512_fmadd_ps(a, b1, c##i##1);                  \
    }
#define KOUT(c, y, m, i)                                                                                       \
    if (m > i) {                                                                                               \
        if (acc) {                                                                                             \
            c##i##0 = _mm512_add_ps(c##i##0, _mm512_loadu_ps(y + i * ldy));                                    \
            c##i##1 = _mm512_add_ps(c##i##1, _mm512_loadu_ps(y + i * ldy + 16));                               \
        }                                                                                                      \
        _mm512_storeu_ps(y + i * ldy, c##i##0), _mm512_storeu_ps(y + i * ldy + 16, c##i##1);                   \
    }
#define KROWS(c, A, m) KROW(c, A, m, 0) KROW(c, A, m, 1) KROW(c, A, m, 2) KROW(c, A, m, 3) KROW(c, A, m, 4) KROW(c, A, m, 5)
#define KOUTS(c, y, m) KOUT(c, y, m, 0) KOUT(c, y, m, 1) KOUT(c, y, m, 2) KOUT(c, y, m, 3) KOUT(c, y, m, 4) KOUT(c, y, m, 5)
static inline __attribute__((always_inline)) void kern_rows32(int mr, int mr2, const float *A, const float *A2,
                                                              int64_t kc, const float *const P[4], float *y,
                                                              int64_t ldy, int acc) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    __m512 d00 = c00, d01 = c00, d10 = c00, d11 = c00, d20 = c00, d21 = c00;
    __m512 d30 = c00, d31 = c00, d40 = c00, d41 = c00, d50 = c00, d51 = c00;
    const float *P0 = P[0], *P1 = P[1], *P2 = P[2], *P3 = P[3];
    for (int64_t k = 0; k < kc; k++, A += 6, A2 += 6) {
        __m512 b0 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(P0 + 8 * k)), _mm256_loadu_ps(P1 + 8 * k), 1);
        __m512 b1 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(P2 + 8 * k)), _mm256_loadu_ps(P3 + 8 * k), 1);
        KROWS(c, A, mr) KROWS(d, A2, mr2)
    }
    float *y2 = y + 6 * ldy;
    KOUTS(c, y, mr) KOUTS(d, y2, mr2)
}
#undef KROWS
#undef KOUTS
#undef KROW
#undef KOUT

/* mr (1..6) rows of A alone (mr2 0), or 6 of A and mr2 (1..6) of A2 */
static void kern12x32(int64_t mr, int64_t mr2, const float *A, const float *A2, int64_t kc, const float *const P[4],
                      float *y, int64_t ldy, int acc) {
#define K32(m, m2) kern_rows32(m, m2, A, A2, kc, P, y, ldy, acc)
    switch (mr2 ? mr2 + 6 : mr) {
    case 12: K32(6, 6); break;
    case 11: K32(6, 5); break;
    case 10: K32(6, 4); break;
    case 9: K32(6, 3); break;
    case 8: K32(6, 2); break;
    case 7: K32(6, 1); break;
    case 6: K32(6, 0); break;
    case 5: K32(5, 0); break;
    case 4: K32(4, 0); break;
    case 3: K32(3, 0); break;
    case 2: K32(2, 0); break;
    default: K32(1, 0); break;
    }
#undef K32
}
#define KERN_PANELS 4
#define KERN_TILES 2 /* 6-row micro-panels per tile */
#else
#define KERN_PANELS 2
#define KERN_TILES 1
#endif
#define KERN_COLS (8 * KERN_PANELS)

typedef struct {
    const float *x;
    float *A;
    int64_t M, K;
} pack_x_ctx;

/* Floats per packed micro-panel: 6 x K, and 2 more that the last 8-float store of its transposes
 * spills into (K is a multiple of 8). */
#define PANEL_X(K) ((K) * 6 + 8)

/* items are 6-row micro-panels; rows past M are zeros (8x8 register transposes of 6 rows) */
static void pack_x_range(void *p, int64_t begin, int64_t end) {
    pack_x_ctx *c = (pack_x_ctx *)p;
    int64_t M = c->M, K = c->K;
    for (int64_t t = begin; t < end; t++) {
        float *At = c->A + t * PANEL_X(K);
        int64_t m = t * 6, mr = M - m < 6 ? M - m : 6;
        for (int64_t k = 0; k < K; k += 8) transpose8(c->x + m * K + k, K, At + k * 6, 6, (int)mr);
    }
}

typedef struct {
    const float *A;
    const void *w; /* panels of kind wt */
    const float *bias;
    float *y;
    int64_t M, N, K, blocks; /* blocks: PACK_MC-row blocks of M */
    int wt;
} blocked_ctx;

/* items are (panel group, row block) pairs, row block inner */
static void gemm_blocked_range(void *p, int64_t begin, int64_t end) {
    blocked_ctx *c = (blocked_ctx *)p;
    int64_t M = c->M, N = c->N, K = c->K, tiles = (M + 5) / 6, panels = (N + 7) / 8;
    int64_t chunks = (K + PACK_KC - 1) / PACK_KC, kcs = (K / chunks + 7) / 8 * 8;
    float tile[6 * KERN_TILES * KERN_COLS];
    /* 16-bit panels: the fp32 values of the KERN_PANELS panels' current K block (kcs <= PACK_KC),
     * widened once for the item's row tiles: 4 x 768 x 8 floats (96 KiB) at most, read from L2 */
    float wide[KERN_PANELS * PACK_KC * 8] __attribute__((aligned(64)));
    for (int64_t item = begin; item < end; item++) {
        int64_t group = item / c->blocks, block = item % c->blocks;
        int64_t q0 = group * PACK_GP, q1 = q0 + PACK_GP < panels ? q0 + PACK_GP : panels;
        int64_t t0 = block * (PACK_MC / 6), t1 = t0 + PACK_MC / 6 < tiles ? t0 + PACK_MC / 6 : tiles;
        for (int64_t k0 = 0; k0 < K; k0 += kcs) {
            int64_t kc = K - k0 < kcs ? K - k0 : kcs;
            for (int64_t q = q0; q < q1; q += KERN_PANELS) {
                int64_t nj = q * 8, cols = N - nj < KERN_COLS ? N - nj : KERN_COLS;
                const float *P[KERN_PANELS];
                for (int j = 0; j < KERN_PANELS; j++) { /* a panel past the last: its columns are dropped */
                    const void *src = wat(c->w, (q + j < q1 ? nj + 8 * j : nj) * K + k0 * 8, c->wt);
                    if (c->wt == W_F32) {
                        P[j] = (const float *)src;
                    } else { /* 16-bit panels: this block widened once for the item's row tiles */
                        P[j] = wide + j * kc * 8;
                        widen(src, wide + j * kc * 8, kc * 8, c->wt, 0);
                    }
                }
                for (int64_t t = t0; t < t1; t += KERN_TILES) {
                    int two = KERN_TILES == 2 && t + 1 < t1; /* a 12-row tile: this micro-panel and the next */
                    int64_t m = t * 6, rows = two ? 12 : 6, mr = M - m < rows ? M - m : rows;
                    const float *At = c->A + t * PANEL_X(K) + k0 * 6;
                    float *out = cols == KERN_COLS ? c->y + m * N + nj : tile;
                    int64_t ldy = cols == KERN_COLS ? N : KERN_COLS;
                    /* the last columns: through a scratch tile, only the real ones */
                    if (cols < KERN_COLS && k0 > 0)
                        for (int64_t i = 0; i < mr; i++)
                            memcpy(tile + i * KERN_COLS, c->y + (m + i) * N + nj, sizeof(float) * (size_t)cols);
#if PLINTH_AVX512
                    kern12x32(two ? 6 : mr, two ? mr - 6 : 0, At, two ? At + PANEL_X(K) : At, kc, P, out, ldy, k0 > 0);
#else
                    kern6x16(mr, At, kc, P[0], P[1], out, ldy, k0 > 0);
#endif
                    if (cols < KERN_COLS)
                        for (int64_t i = 0; i < mr; i++)
                            memcpy(c->y + (m + i) * N + nj, tile + i * KERN_COLS, sizeof(float) * (size_t)cols);
                }
            }
        }
        if (c->bias) {
            int64_t n1 = q1 * 8 < N ? q1 * 8 : N, m1 = t1 * 6 < M ? t1 * 6 : M;
            for (int64_t m = t0 * 6; m < m1; m++)
                for (int64_t n = q0 * 8; n < n1; n++) c->y[m * N + n] += c->bias[n];
        }
    }
}

/* the packed activations, grown on demand (kernel calls come from one thread at a time) */
static float *packed_x;
static size_t packed_x_cap;

/* Returns 0, or -1 when there was no memory for the packed activations (nothing written). */
/* 16-bit panels up to this many fp32 bytes are widened whole once per prefill-sized call (a layer's
 * weight: ~0.2% of the product's work at 512 rows) and multiplied as fp32 panels; wider ones (an
 * lm_head) block by block in each item, which re-widens a block for every 48-row block of x. */
#define WIDEN_WHOLE_MAX_BYTES (16 << 20)

typedef struct {
    const void *src;
    float *dst;
    int wt;
} widen_ctx;

/* items are runs of 8 * 64 elements */
static void widen_range(void *p, int64_t begin, int64_t end) {
    widen_ctx *c = (widen_ctx *)p;
    widen(wat(c->src, begin * 512, c->wt), c->dst + begin * 512, (end - begin) * 512, c->wt, 0);
}

/* the fp32 copy of whole 16-bit panels, grown on demand (kernel calls come from one thread at a time) */
static float *widened;
static size_t widened_cap;

static int gemm_blocked(const float *x, const void *P, int wt, const float *bias, float *y, int64_t M, int64_t N,
                        int64_t K) {
    int64_t tiles = (M + 5) / 6;
    size_t elements = (size_t)((N + 7) / 8) * 8 * (size_t)K; /* a multiple of 64: K is of 8 */
    if (wt != W_F32 && elements * sizeof(float) <= WIDEN_WHOLE_MAX_BYTES) {
        if (widened_cap < elements) {
            free(widened);
            widened = (float *)aligned_alloc(64, elements * sizeof(float));
            widened_cap = widened ? elements : 0;
        }
        if (widened) { /* else: widened block by block in the items */
            int64_t runs = (int64_t)((elements + 511) / 512), last = (int64_t)(elements % 512);
            widen_ctx wc = {P, widened, wt};
            parallel_for(widen_range, &wc, last ? runs - 1 : runs, grain_for(runs, 16));
            if (last) widen(wat(P, (runs - 1) * 512, wt), widened + (runs - 1) * 512, last, wt, 0);
            P = widened, wt = W_F32;
        }
    }
    size_t need = (size_t)tiles * (size_t)PANEL_X(K);
    if (packed_x_cap < need) {
        free(packed_x);
        packed_x = (float *)aligned_alloc(64, need * sizeof(float));
        packed_x_cap = packed_x ? need : 0;
        if (!packed_x) return -1;
    }
    pack_x_ctx px = {x, packed_x, M, K};
    parallel_for(pack_x_range, &px, tiles, grain_for(tiles, 4));
    int64_t groups = ((N + 7) / 8 + PACK_GP - 1) / PACK_GP, blocks = (tiles + PACK_MC / 6 - 1) / (PACK_MC / 6);
    blocked_ctx c = {packed_x, P, bias, y, M, N, K, blocks, wt};
    parallel_for(gemm_blocked_range, &c, groups * blocks, 1); /* items are ~10-100 us: claim one at a time, so threads finish together */
    return 0;
}

static void gemm_panels(const float *x, const void *P, int wt, const float *bias, float *y, int64_t M, int64_t N,
                        int64_t K) {
    int blocked = M >= BLOCKED_MIN_ROWS || (M >= BLOCKED_WIDE_MIN_ROWS && N >= BLOCKED_WIDE_N) ||
                  (wt == W_F32 && M > PANEL_TALL_ROWS && M <= BLOCKED_SHORT_ROWS);
    if (blocked && gemm_blocked(x, P, wt, bias, y, M, N, K) == 0) return;
    gemm_ctx c = {x, NULL, bias, y, M, N, K, P, wt}; /* few rows, or no memory to pack: the 4x24 tiles need none */
    int64_t panels = (N + 7) / 8;
    parallel_for(gemm_panels_range, &c, panels, grain_for(panels, 6));
}

/* y[M, N] = x[M, K] @ w^T + b for a weight laid out by plinth_pack_f32_panels (K a multiple of 8) */
void plinth_gemm_f32_panels(const float *x, const float *P, const float *bias, float *y, int64_t M, int64_t N,
                            int64_t K) {
    gemm_panels(x, P, W_F32, bias, y, M, N, K);
}

/* The same for 16-bit panels (wt: 1 bf16, 2 fp16; the layout of plinth_pack_f32_panels, 2-byte
 * elements): the sums of the fp32 panels of the same values, bit for bit. -1 for an unknown wt. */
int plinth_gemm_panels16(int wt, const float *x, const void *P, const float *bias, float *y, int64_t M, int64_t N,
                         int64_t K) {
    if (wt != W_BF16 && wt != W_F16) return -1;
    gemm_panels(x, P, wt, bias, y, M, N, K);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * bf16 x bf16 products with AVX512-BF16 dot products (a bf16 model's few-row products). A weight
 * [N, K] (bf16, K even) is laid out once at load in 16-column pair panels P[ceil(N/16)][K/2][16][2]:
 * one 64-byte vector of a panel holds 16 outputs' weights at k and k + 1, which vdpbf16ps
 * multiplies by a broadcast pair (x[k], x[k + 1]) and adds to 16 fp32 sums, so a tile needs no
 * horizontal sums and reads the weights as one sequential stream per panel. The products of two
 * bf16 values are exact in fp32, so the sums differ from fp32 FMAs over the widened values only in
 * the order of their additions (and in that the instruction flushes denormals). A tile is
 * PAIRS_MR activation rows by PAIRS_NP panels (24 accumulators) from three far-apart segments of a
 * thread's range, as the fp32 panels take theirs: three sequential weight streams (against adjacent
 * panels, side by side in one process, Zen 4, 2 threads, 30 SmolLM2-shaped layers from memory: 1 row
 * +9-12%, 4 rows +7-9%, 16 rows +3-5%, 64 rows +1%); the rows are walked in blocks of PAIRS_MR over
 * the tile's panels, which stay in L2 between them. The build compiles this with the avx512bf16
 * target whatever its flags, and a call runs it only where CPUID reports AVX512-BF16 (plinth_bf16_dot).
 */
#define PAIRS_MR 8
#define PAIRS_NP 3

#if PLINTH_AVX512
#include <cpuid.h>
#ifdef PLINTH_EMULATE
#define BF16_TARGET /* emulated: no instruction of the target may be emitted */
#else
#define BF16_TARGET __attribute__((target("avx512bf16")))
#endif

static int bf16_dot_probe(void) {
#ifdef PLINTH_EMULATE
    return 1;
#endif
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (a >> 5) & 1; /* CPUID.(7,1):EAX bit 5: AVX512_BF16 */
}

typedef struct {
    const uint16_t *x, *P;
    int64_t sx;
    const float *bias;
    void *y;
    int yt; /* W_F32 or W_BF16 */
    int64_t M, N, K;
} pairs_ctx;

/* the 16 sums at column n0 (+ bias) stored as fp32 or rounded to bf16 (nearest even), only the real
 * columns of a last panel */
static inline __attribute__((always_inline)) BF16_TARGET void pairs_store(__m512 v, const pairs_ctx *c, int64_t m,
                                                                          int64_t n0) {
    int64_t N = c->N;
    __mmask16 mask = n0 + 16 <= N ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    if (c->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, c->bias + n0));
    if (c->yt == W_BF16)
        _mm256_mask_storeu_epi16((uint16_t *)c->y + m * N + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_mask_storeu_ps((float *)c->y + m * N + n0, mask, v);
}

/* mr activation rows (from m) by np panels q, q + S, q + 2S (mr, np constants where inlined) */
static inline __attribute__((always_inline)) BF16_TARGET void pairs_tile(int mr, int np, const pairs_ctx *c,
                                                                         int64_t m, int64_t q, int64_t S, int pf) {
    int64_t K = c->K, half = K / 2, pstride = K * 16 * S;
    const uint16_t *x = c->x + m * c->sx, *p = c->P + q * K * 16;
    __m512 acc[PAIRS_MR][PAIRS_NP];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < half; kp++) {
        __m512bh b[PAIRS_NP];
        for (int j = 0; j < np; j++) {
            if (pf) _mm_prefetch((const char *)(p + j * pstride + kp * 32) + PANEL_PF_DIST, _MM_HINT_T1);
            b[j] = (__m512bh)_mm512_loadu_si512(p + j * pstride + kp * 32);
        }
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, x + i * c->sx + 2 * kp, sizeof pair);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < np; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < np; j++) pairs_store(acc[i][j], c, m + i, (q + j * S) * 16);
}

#define PAIRS_ROWS(np, pf)                                                                                   \
    switch (mr) {                                                                                              \
    case 8: pairs_tile(8, np, c, m, q, S, pf); break;                                                         \
    case 7: pairs_tile(7, np, c, m, q, S, pf); break;                                                         \
    case 6: pairs_tile(6, np, c, m, q, S, pf); break;                                                         \
    case 5: pairs_tile(5, np, c, m, q, S, pf); break;                                                         \
    case 4: pairs_tile(4, np, c, m, q, S, pf); break;                                                         \
    case 3: pairs_tile(3, np, c, m, q, S, pf); break;                                                         \
    case 2: pairs_tile(2, np, c, m, q, S, pf); break;                                                         \
    default: pairs_tile(1, np, c, m, q, S, pf); break;                                                        \
    }

/* items are panels; a thread's range is walked as three segments of S panels side by side (three
 * far-apart weight streams, as the fp32 panels), the 0-2 panels left over one at a time */
static BF16_TARGET void gemm_pairs_range(void *p, int64_t begin, int64_t end) {
    const pairs_ctx *c = (const pairs_ctx *)p;
    int64_t M = c->M, S = (end - begin) / 3;
    for (int64_t q = begin; q < begin + S; q++)
        for (int64_t m = 0; m < M; m += PAIRS_MR) {
            int64_t mr = M - m < PAIRS_MR ? M - m : PAIRS_MR;
            /* the first row block reads the panels from memory: it prefetches ahead of its streams */
            if (m == 0) { PAIRS_ROWS(3, 1) }
            else { PAIRS_ROWS(3, 0) }
        }
    for (int64_t q = begin + 3 * S; q < end; q++)
        for (int64_t m = 0; m < M; m += PAIRS_MR) {
            int64_t mr = M - m < PAIRS_MR ? M - m : PAIRS_MR;
            PAIRS_ROWS(1, 0)
        }
}
#undef PAIRS_ROWS

/*
 * The same product on AMX tiles (Intel Sapphire Rapids and later: AMX-TILE and AMX-BF16). A pair
 * panel's K/2 rows of 16 column pairs are, 16 rows at a time, exactly a B tile (16 rows of 64 bytes,
 * stride 64); an A tile is up to 16 activation rows by 32 k (row stride sx); TDPBF16PS adds their
 * products into a 16 x 16 fp32 C tile. 32 rows (two A tiles) against two panels (two B tiles) a
 * step, four C tiles (16 rows or fewer: one A tile, two C tiles), so four tile loads feed four
 * products; row blocks inner within chunks of AMX_ROW_CHUNK rows, so a panel pair stays in L1/L2
 * across the row blocks and a chunk's activations in L2 across the pairs. Measured (Xeon family 6
 * model 207, 2 threads, 30 SmolLM2-shaped layers of bf16 weights, GFLOP/s before (one A tile a step,
 * no chunks) -> after, oneDNN pre-packed in the same run): 64 rows 1,008 -> 1,013 (845), 256 rows
 * 1,708 -> 1,826 (1,705), 1024 rows 1,847 -> 2,069 (1,806). Each thread loads the tile
 * configuration at the start of its range (tiles are per thread) and releases it at the end. Runs
 * where plinth_amx_bf16 says so (the CPU has both and Linux granted the tile data: arch_prctl
 * ARCH_REQ_XCOMP_PERM), for K a multiple of 32 and at least AMX_MIN_ROWS rows.
 */
#if defined(PLINTH_EMULATE) || (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define PLINTH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#ifdef PLINTH_EMULATE
#define AMX_TARGET
#else
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#endif
#define AMX_MIN_ROWS 2

#define AMX_BF16_BIT 22
#define AMX_INT8_BIT 25

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* tiles 0, 1: C of rows m.. for two panels, 2, 3: C of rows m + 16.. (mrb rows, 0: unused); 4, 5:
 * their A tiles; 6, 7: the panels' B tiles */
static AMX_TARGET void amx_configure2(int mra, int mrb) {
    amx_tilecfg t;
    memset(&t, 0, sizeof t);
    t.palette = 1;
    static const int a_side[3] = {0, 1, 4}, b_side[3] = {2, 3, 5};
    for (int i = 0; i < 3; i++) {
        t.rows[a_side[i]] = (uint8_t)mra, t.colsb[a_side[i]] = 64;
        t.rows[b_side[i]] = (uint8_t)(mrb > 0 ? mrb : 1), t.colsb[b_side[i]] = 64;
    }
    for (int i = 6; i < 8; i++) t.rows[i] = 16, t.colsb[i] = 64;
    __asm__ volatile("" : : "r"(&t) : "memory"); /* the stores must precede LDTILECFG (see amx_attn_configure) */
    _tile_loadconfig(&t);
}

/* The B tiles AMX_PF_STEPS k steps ahead of step k in both panels (16 lines each), where the first
 * row block of a pass reads the panels from memory: tile loads left the weight streams to the
 * hardware prefetcher alone. Measured (Xeon family 6 model 207, 2 threads, 30 SmolLM2-shaped layers
 * of bf16 weights, GFLOP/s without -> with, 8 steps ahead): 16 rows 274 -> 430-434, 64 rows 1,052 ->
 * 1,055-1,162, 4 rows 112 -> 113-116 (4 steps ahead: 16 rows 419-423); the bf16 64-request workload
 * within its noise (798.0, 785.0 -> 814.5, 824.3 output tok/s, alternating). */
#define AMX_PF_STEPS 8
static inline __attribute__((always_inline)) void amx_prefetch_panels(const uint16_t *p0, const uint16_t *p1,
                                                                      int64_t k, int64_t K) {
    if (k + 32 * AMX_PF_STEPS >= K) return;
    const char *a = (const char *)(p0 + (k + 32 * AMX_PF_STEPS) * 16), *b = (const char *)(p1 + (k + 32 * AMX_PF_STEPS) * 16);
    for (int l = 0; l < 1024; l += 64) _mm_prefetch(a + l, _MM_HINT_T0), _mm_prefetch(b + l, _MM_HINT_T0);
}

/* Rows per pass over a thread's panel pairs: a pass's activations (AMX_ROW_CHUNK x K bf16, 384 KiB
 * at K = 1536) stay in L2 while the pairs stream past them */
#define AMX_ROW_CHUNK 128

/* items are panel pairs (the last one may hold a single panel); a thread's pairs are walked once per
 * AMX_ROW_CHUNK rows, 32 rows (two A tiles) against a pair (two B tiles) a step: four C tiles, four
 * tile loads per four products */
static AMX_TARGET void gemm_pairs_amx_range(void *p, int64_t begin, int64_t end) {
    const pairs_ctx *c = (const pairs_ctx *)p;
    int64_t M = c->M, K = c->K, sx = c->sx, panels = (c->N + 15) / 16;
    float out[4][16][16] __attribute__((aligned(64)));
    int configured = -1;
    for (int64_t mc = 0; mc < M; mc += AMX_ROW_CHUNK) {
        int64_t me = mc + AMX_ROW_CHUNK < M ? mc + AMX_ROW_CHUNK : M;
        for (int64_t pp = begin; pp < end; pp++) {
            int64_t q = 2 * pp;
            int two = q + 1 < panels; /* a last lone panel is multiplied twice, its second copy not stored */
            const uint16_t *p0 = c->P + q * K * 16, *p1 = two ? p0 + K * 16 : p0;
            for (int64_t m = mc; m < me; m += 32) {
                int mra = me - m < 16 ? (int)(me - m) : 16, mrb = me - m - 16 > 16 ? 16 : (int)(me - m - 16);
                if (mrb < 0) mrb = 0;
                if (mra * 32 + mrb != configured) amx_configure2(mra, mrb), configured = mra * 32 + mrb;
                const uint16_t *xa = c->x + m * sx;
                _tile_zero(0);
                _tile_zero(1);
                if (mrb) {
                    const uint16_t *xb = xa + 16 * sx;
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t k = 0; k < K; k += 32) {
                        if (m == mc) amx_prefetch_panels(p0, p1, k, K);
                        _tile_loadd(6, p0 + k * 16, 64);
                        _tile_loadd(7, p1 + k * 16, 64);
                        _tile_loadd(4, xa + k, sx * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(5, xb + k, sx * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(2, out[2], 64);
                    _tile_stored(3, out[3], 64);
                } else {
                    for (int64_t k = 0; k < K; k += 32) {
                        if (m == mc) amx_prefetch_panels(p0, p1, k, K);
                        _tile_loadd(4, xa + k, sx * 2);
                        _tile_loadd(6, p0 + k * 16, 64);
                        _tile_loadd(7, p1 + k * 16, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                }
                _tile_stored(0, out[0], 64);
                _tile_stored(1, out[1], 64);
                for (int i = 0; i < mra + mrb; i++) {
                    int t = i < 16 ? 0 : 2, r = i & 15;
                    pairs_store(_mm512_load_ps(out[t][r]), c, m + i, q * 16);
                    if (two) pairs_store(_mm512_load_ps(out[t + 1][r]), c, m + i, (q + 1) * 16);
                }
            }
        }
    }
    if (configured >= 0) _tile_release();
}

/* 1 where the CPU has AMX-TILE and the AMX feature of CPUID.(7,0):EDX bit `bit` (22: AMX-BF16, 25:
 * AMX-INT8; AMX-TILE is bit 24) and Linux lets this process use the tile data (XFEATURE_XTILEDATA,
 * 18); each caller asks once */
static int amx_probe(int bit) {
#ifdef PLINTH_EMULATE
    (void)bit;
    return 1;
#endif
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> bit) & 1)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
}

/* An AMX path's switch (plinth_amx_bf16, plinth_amx_int8): whether the CPU has the feature of `bit`
 * (AMX-BF16 also needs AVX512-BF16) is asked once into *available; mode 1 or 0 sets *on, -1 only asks.
 * Returns 1 where the path is on after the call. */
static int amx_switch(int *available, int *on, int mode, int bit) {
    if (*available < 0) *available = (bit != AMX_BF16_BIT || plinth_bf16_dot()) && amx_probe(bit);
    if (mode >= 0) *on = mode;
    return *available && *on;
}
#else
#define PLINTH_AMX 0
#endif
#endif

/* Whether plinth_gemm_bf16_pairs runs on AMX tiles: mode 1 turns them on where the CPU has them (the
 * default), 0 off, -1 asks. Returns 1 where they are on after the call. */
int plinth_amx_bf16(int mode) {
#if PLINTH_AVX512 && PLINTH_AMX
    static int available = -1, on = 1;
    return amx_switch(&available, &on, mode, AMX_BF16_BIT);
#else
    (void)mode;
    return 0;
#endif
}

/* 1 where plinth_gemm_bf16_pairs runs: the AVX-512 build on a CPU with AVX512-BF16; else 0 */
int plinth_bf16_dot(void) {
#if PLINTH_AVX512
    static int known = -1;
    if (known < 0) known = bf16_dot_probe();
    return known;
#else
    return 0;
#endif
}

typedef struct {
    const uint32_t *w; /* the weight's k pairs: [N][K / 2] */
    uint32_t *P;
    int64_t N, half;
} pack_pairs_ctx;

static void pack_pairs_range(void *p, int64_t begin, int64_t end) {
    const pack_pairs_ctx *c = (const pack_pairs_ctx *)p;
    for (int64_t q = begin; q < end; q++)
        for (int j = 0; j < 16; j++) {
            int64_t n = q * 16 + j;
            uint32_t *dst = c->P + q * c->half * 16 + j;
            if (n < c->N)
                for (int64_t kp = 0; kp < c->half; kp++) dst[kp * 16] = c->w[n * c->half + kp];
            else
                for (int64_t kp = 0; kp < c->half; kp++) dst[kp * 16] = 0;
        }
}

/* Lays out a bf16 weight [N, K] (K even) as pair panels P [ceil(N/16) * 16 * K] (missing columns zero). */
void plinth_pack_bf16_pairs(const void *w, void *P, int64_t N, int64_t K) {
    pack_pairs_ctx c = {(const uint32_t *)w, (uint32_t *)P, N, K / 2};
    int64_t panels = (N + 15) / 16;
    parallel_for(pack_pairs_range, &c, panels, grain_for(panels, 4));
}

/* y[M, N] = x[M, K] @ w^T + bias for a bf16 x (rows sx elements apart) and a weight laid out by
 * plinth_pack_bf16_pairs, y fp32 (yt 0) or bf16 (yt 1, each fp32 sum rounded once), bias fp32 or
 * NULL. -1 where this build or CPU has no AVX512-BF16, or for another yt. */
int plinth_gemm_bf16_pairs(const void *x, int64_t sx, const void *P, const float *bias, int yt, void *y, int64_t M,
                           int64_t N, int64_t K) {
    if (!plinth_bf16_dot() || (yt != W_F32 && yt != W_BF16)) return -1;
#if PLINTH_AVX512
    pairs_ctx c = {(const uint16_t *)x, (const uint16_t *)P, sx, bias, y, yt, M, N, K};
    int64_t panels = (N + 15) / 16, grain = (grain_for(panels, 3) + 2) / 3 * 3; /* whole triples */
#if PLINTH_AMX
    if (M >= AMX_MIN_ROWS && K % 32 == 0 && plinth_amx_bf16(-1)) {
        int64_t pairs = (panels + 1) / 2;
        parallel_for(gemm_pairs_amx_range, &c, pairs, grain_for(pairs, 1));
        return 0;
    }
#endif
    parallel_for(gemm_pairs_range, &c, panels, grain);
    return 0;
#else
    (void)x, (void)sx, (void)P, (void)bias, (void)y, (void)M, (void)N, (void)K;
    return -1;
#endif
}


/* ---------------------------------------------------------------------------------------------
 * Quantized GEMM. Activations are quantized to int8 per 32-block first (K a multiple of 32).
 */
static void quantize_block_q8x(const float *v, block_q8_x *out) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
    for (int j = 8; j < QK; j += 8) a = _mm256_max_ps(a, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float d = _mm_cvtss_f32(m4) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        int q = (int)lrintf(v[j] * id);
        out->q[j] = (int8_t)q;
        sum += q;
    }
    out->d = d;
    out->s = d * (float)sum;
}

/* Integer dot products of one weight block with one activation block, as 8 int32 lanes in fp32. */
static inline __m256 dot_q4_1_block(const block_q4_1 *w, const block_q8_x *x) {
    __m128i packed = _mm_loadu_si128((const __m128i *)w->qs);
    __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    __m256i p16 = _mm256_maddubs_epi16(nib, _mm256_loadu_si256((const __m256i *)x->q));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

static inline __m256 dot_q8_0_block(const block_q8_0 *w, const block_q8_x *x) {
    __m256i qw = _mm256_loadu_si256((const __m256i *)w->q);
    __m256i qx = _mm256_loadu_si256((const __m256i *)x->q);
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

static float row_dot_q4_1(const block_q4_1 *w, const block_q8_x *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float summs = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(w[b].d) * x[b].d), dot_q4_1_block(w + b, x + b), acc);
        summs += fp16_to_f32(w[b].m) * x[b].s;
    }
    return hsum256(acc) + summs;
}

static float row_dot_q8_0(const block_q8_0 *w, const block_q8_x *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(w[b].d) * x[b].d), dot_q8_0_block(w + b, x + b), acc);
    return hsum256(acc);
}

/* fp32 activations: the exact product with the dequantized weight (up to fp32 rounding).
 * q4_1: sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j, with sum_j x_j per block given. */
static inline __m256 q4_dot_f32(__m128i packed, const float *xb) {
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xb));
    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xb + 8), t);
    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xb + 16), t);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xb + 24), t);
}

static float row_dot_q4_1_f32(const block_q4_1 *w, const float *x, const float *xsum, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float summs = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256 t = q4_dot_f32(_mm_loadu_si128((const __m128i *)w[b].qs), x + b * QK);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(w[b].d)), t, acc);
        summs += fp16_to_f32(w[b].m) * xsum[b];
    }
    return hsum256(acc) + summs;
}

static float row_dot_q8_0_f32(const block_q8_0 *w, const float *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = w[b].q;
        const float *xb = x + b * QK;
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))),
                                 _mm256_loadu_ps(xb));
        for (int j = 8; j < QK; j += 8)
            t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)))),
                                _mm256_loadu_ps(xb + j), t);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16_to_f32(w[b].d)), t, acc);
    }
    return hsum256(acc);
}

/* int16 activations: the rounding error of each activation is at most 2^-16 of its block's largest
 * magnitude (int8: 2^-8), and the products are exact in int32; on AVX2 it runs about as fast as
 * int8, because the fp32 path is bound by converting each weight to float. */
static void quantize_block_q16x(const float *v, block_q16_x *out) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
    __m256 sum = _mm256_loadu_ps(v);
    for (int j = 8; j < QK; j += 8) {
        __m256 t = _mm256_loadu_ps(v + j);
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, t));
        sum = _mm256_add_ps(sum, t);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float d = _mm_cvtss_f32(m4) / 32767.0f;
    __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    for (int j = 0; j < QK; j += 16) {
        __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j), id));
        __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + j + 8), id));
        /* packs works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] -> reorder the 64-bit quarters */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256((__m256i *)(out->q + j), packed);
    }
    out->d = d;
    out->s = hsum256(sum);
}

/* Four weight rows against one int16 activation row, the rows taken from four segments of the
 * item's range (far apart in memory): four sequential streams keep more reads in flight than one
 * (measured 1.25x on one thread reading from DRAM; adjacent rows are no faster than one row), and
 * the four rows' scales convert in one instruction. Each block's (d, m) pair is one 32-bit word;
 * times the activation block's (d, s) pair it gives d_w * d_x (the integer dot's scale) and m * s
 * (q4_1's minimum term). q8_0 ignores the odd lanes (its first two quants, not a minimum). */
static void rows4_i16(int fmt, const char *const w[4], const block_q16_x *x, int64_t nb, float out[4]) {
    const __m256i mask16 = _mm256_set1_epi16(0x0F); /* one cvtepu8_epi16 per block: bytes to 16 bits, then nibbles */
    const size_t bsz = fmt == 0 ? sizeof(block_q4_1) : sizeof(block_q8_0);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0, macc = acc0;
    float sc[8] __attribute__((aligned(32)));
    int64_t b = 0;
#if PLINTH_AVX512
    /* Two blocks per step on 512-bit registers: a row's two blocks fill one register of 32 int16
     * (block b in the low half, b + 1 in the high), VNNI's dpwssd multiplies and adds pairs into
     * int32 lanes 0-7 (block b) and 8-15 (b + 1), and each lane is scaled by its own block's
     * d_w * d_x (a permute of both blocks' scale products). Same integers, same fp32 order of
     * the scale products as the AVX2 loop below, which finishes an odd block. */
    {
        const __m512i mask = _mm512_set1_epi16(0x0F);
        const __m512i idx0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
        const __m512i step = _mm512_set1_epi32(2);
        const __m512i idx1 = _mm512_add_epi32(idx0, step), idx2 = _mm512_add_epi32(idx1, step),
                      idx3 = _mm512_add_epi32(idx2, step);
        __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
        for (; b + 2 <= nb; b += 2) {
            const char *w0 = w[0] + b * bsz, *w1 = w[1] + b * bsz, *w2 = w[2] + b * bsz, *w3 = w[3] + b * bsz;
            int32_t s0, s1, s2, s3, t0, t1, t2, t3; /* in registers: a vector load of words just stored stalls */
            memcpy(&s0, w0, 4), memcpy(&s1, w1, 4), memcpy(&s2, w2, 4), memcpy(&s3, w3, 4);
            memcpy(&t0, w0 + bsz, 4), memcpy(&t1, w1 + bsz, 4), memcpy(&t2, w2 + bsz, 4), memcpy(&t3, w3 + bsz, 4);
            __m256 pair0 = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b].d));
            __m256 pair1 = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b + 1].d));
            __m256 prod0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_setr_epi32(s0, s1, s2, s3)), pair0);
            __m256 prod1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm_setr_epi32(t0, t1, t2, t3)), pair1);
            macc = _mm256_add_ps(_mm256_add_ps(macc, prod0), prod1);
            __m512 P = _mm512_insertf32x8(_mm512_castps256_ps512(prod0), prod1, 1);
            __m512i x0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x[b].q)),
                                            _mm256_loadu_si256((const __m256i *)x[b + 1].q), 1);
            __m512i x1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x[b].q + 16))),
                                            _mm256_loadu_si256((const __m256i *)(x[b + 1].q + 16)), 1);
#define HALVES(wr, o) \
    _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)((wr) + (o)))), \
                            _mm_loadu_si128((const __m128i *)((wr) + bsz + (o))), 1)
            if (fmt == 0) {
#define ROW(wr, idx, z)                                                                                       \
    {                                                                                                         \
        __m512i p = _mm512_cvtepu8_epi16(HALVES(wr, 4));                                                      \
        __m512i d = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(p, mask), x0), \
                                        _mm512_srli_epi16(p, 4), x1);                                          \
        z = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, P), _mm512_cvtepi32_ps(d), z);                         \
    }
                ROW(w0, idx0, z0) ROW(w1, idx1, z1) ROW(w2, idx2, z2) ROW(w3, idx3, z3)
#undef ROW
            } else {
#define ROW(wr, idx, z)                                                                                       \
    {                                                                                                         \
        __m512i d = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(),                           \
                                                            _mm512_cvtepi8_epi16(HALVES(wr, 2)), x0),          \
                                        _mm512_cvtepi8_epi16(HALVES(wr, 18)), x1);                            \
        z = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, P), _mm512_cvtepi32_ps(d), z);                         \
    }
                ROW(w0, idx0, z0) ROW(w1, idx1, z1) ROW(w2, idx2, z2) ROW(w3, idx3, z3)
#undef ROW
            }
#undef HALVES
        }
        acc0 = _mm256_add_ps(_mm512_castps512_ps256(z0), _mm512_extractf32x8_ps(z0, 1));
        acc1 = _mm256_add_ps(_mm512_castps512_ps256(z1), _mm512_extractf32x8_ps(z1, 1));
        acc2 = _mm256_add_ps(_mm512_castps512_ps256(z2), _mm512_extractf32x8_ps(z2, 1));
        acc3 = _mm256_add_ps(_mm512_castps512_ps256(z3), _mm512_extractf32x8_ps(z3, 1));
    }
#endif
    for (; b < nb; b++) {
        const char *w0 = w[0] + b * bsz, *w1 = w[1] + b * bsz, *w2 = w[2] + b * bsz, *w3 = w[3] + b * bsz;
        int32_t s0, s1, s2, s3;
        memcpy(&s0, w0, 4), memcpy(&s1, w1, 4), memcpy(&s2, w2, 4), memcpy(&s3, w3, 4);
        __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b].d)); /* (d, s) x 4 */
        __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(_mm_setr_epi32(s0, s1, s2, s3)), pair);
        macc = _mm256_add_ps(macc, prod);
        _mm256_store_ps(sc, prod);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)x[b].q), x1 = _mm256_loadu_si256((const __m256i *)(x[b].q + 16));
        if (fmt == 0) {
#define ROW(wr, r, acc)                                                                                        \
    {                                                                                                          \
        __m256i p = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wr + 4)));                         \
        __m256i d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(p, mask16), x0),                       \
                                     _mm256_madd_epi16(_mm256_srli_epi16(p, 4), x1));                          \
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 2 * r), _mm256_cvtepi32_ps(d), acc);                    \
    }
            ROW(w0, 0, acc0) ROW(w1, 1, acc1) ROW(w2, 2, acc2) ROW(w3, 3, acc3)
#undef ROW
        } else {
#define ROW(wr, r, acc)                                                                                        \
    {                                                                                                          \
        __m256i d = _mm256_add_epi32(                                                                          \
            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + 2))), x0),          \
            _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr + 18))), x1));         \
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 2 * r), _mm256_cvtepi32_ps(d), acc);                    \
    }
            ROW(w0, 0, acc0) ROW(w1, 1, acc1) ROW(w2, 2, acc2) ROW(w3, 3, acc3)
#undef ROW
        }
    }
    float m[8];
    _mm256_storeu_ps(m, macc);
    int q41 = fmt == 0;
    out[0] = hsum256(acc0) + (q41 ? m[1] : 0.0f), out[1] = hsum256(acc1) + (q41 ? m[3] : 0.0f);
    out[2] = hsum256(acc2) + (q41 ? m[5] : 0.0f), out[3] = hsum256(acc3) + (q41 ? m[7] : 0.0f);
}

/* ---------------------------------------------------------------------------------------------
 * Q4_1 in 4-row groups (format code 2, "q4_1x4"): plinth's own layout of a q4_1 weight, made once
 * at load by plinth_pack_q4_1x4, for int16 activations. Rows 4g..4g+3 form group g, GROUP bytes
 * apart (x4_stride: nb * 80 rounded up to a cache line; missing rows of a last group are zeros):
 *   nb x 64 bytes of quants: block b's 32 uint16 lanes, lane 8r + i of row r holding its values
 *       i, 8 + i, 16 + i and 24 + i in nibbles 0-3 (the same 4-bit values as the GGUF block);
 *   nb x 16 bytes of scales: block b's (d, m) fp16 pairs of rows 0-3, one 32-bit word each.
 * One 512-bit load is a block of four rows; nibble p of every lane (a shift and a mask) is four
 * rows' values 8p..8p+7 as int16, against the activation block's values 8p..8p+7 repeated in each
 * 128-bit lane (a broadcast load). Four VNNI dot products leave int32 lane 4r + j holding row r's
 * sum over 8 of its values, scaled per lane by d_r * d_x: no widening of bytes, one scale load for
 * four rows, a single stream per group. The AVX2 build runs the same lanes in two halves and
 * gives the same sums bit for bit.
 */
enum { FMT_Q4_1 = 0, FMT_Q8_0 = 1, FMT_Q4_1X4 = 2, FMT_Q4_1P16 = 3, FMT_Q8_0P16 = 4 };

#ifndef X4_PF_DIST
#define X4_PF_DIST 4096
#endif
#ifndef X4_STREAMS
#define X4_STREAMS 4
#endif
static inline size_t x4_stride(int64_t nb) { return ((size_t)nb * 80 + 63) / 64 * 64; }

/* Bytes of a q4_1x4 weight of N rows and K columns (K a multiple of 32). */
int64_t plinth_q4_1x4_bytes(int64_t N, int64_t K) { return (N + 3) / 4 * (int64_t)x4_stride(K / QK); }

typedef struct {
    const block_q4_1 *w;
    uint8_t *out;
    int64_t N, nb;
} pack_x4_ctx;

static void pack_x4_range(void *p, int64_t begin, int64_t end) {
    pack_x4_ctx *c = (pack_x4_ctx *)p;
    int64_t nb = c->nb;
    size_t S = x4_stride(nb);
    for (int64_t g = begin; g < end; g++) {
        uint8_t *base = c->out + (size_t)g * S;
        memset(base, 0, S);
        for (int r = 0; r < 4 && g * 4 + r < c->N; r++) {
            const block_q4_1 *row = c->w + (g * 4 + r) * nb;
            for (int64_t b = 0; b < nb; b++) {
                uint8_t q[QK];
                for (int j = 0; j < QK / 2; j++) q[j] = row[b].qs[j] & 0x0F, q[j + QK / 2] = row[b].qs[j] >> 4;
                uint16_t lanes[8];
                for (int i = 0; i < 8; i++)
                    lanes[i] = (uint16_t)(q[i] | q[8 + i] << 4 | q[16 + i] << 8 | q[24 + i] << 12);
                memcpy(base + b * 64 + r * 16, lanes, sizeof lanes);
                uint32_t dm = row[b].d | (uint32_t)row[b].m << 16;
                memcpy(base + nb * 64 + b * 16 + r * 4, &dm, sizeof dm);
            }
        }
    }
}

/* Lay out the q4_1 weight w [N, K] (GGUF blocks, row after row) in out (plinth_q4_1x4_bytes(N, K)
 * bytes, 64-byte aligned) as q4_1x4. */
void plinth_pack_q4_1x4(const void *w, void *out, int64_t N, int64_t K) {
    pack_x4_ctx c = {(const block_q4_1 *)w, (uint8_t *)out, N, K / QK};
    int64_t groups = (N + 3) / 4;
    parallel_for(pack_x4_range, &c, groups, grain_for(groups, 16));
}

/* Groups G[0..ng) (ng 1 to X4_STREAMS: they share the activation loads) against one int16 row. */
static inline void groups_x4(const uint8_t *const G[X4_STREAMS], int ng, const block_q16_x *x, int64_t nb,
                             float out[X4_STREAMS][4]) {
    float lanes[X4_STREAMS][16] __attribute__((aligned(64))), m[X4_STREAMS][8] __attribute__((aligned(32)));
#if PLINTH_AVX512
    const __m512i m15 = _mm512_set1_epi16(0x0F);
    const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    __m512 acc[X4_STREAMS];
    __m256 macc[X4_STREAMS];
    for (int g = 0; g < X4_STREAMS; g++) acc[g] = _mm512_setzero_ps(), macc[g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int16_t *xq = x[b].q;
        __m512i x0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)xq));
        __m512i x1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq + 8)));
        __m512i x2 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq + 16)));
        __m512i x3 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xq + 24)));
        __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b].d)); /* (d, s) x 4 */
        for (int g = 0; g < ng; g++) {
            if (X4_PF_DIST) _mm_prefetch((const char *)G[g] + b * 64 + X4_PF_DIST, _MM_HINT_T1);
            __m512i v = _mm512_load_si512((const void *)(G[g] + b * 64));
            /* two chains of two: the four products of a block do not wait on each other */
            __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, m15), x0);
            __m512i e = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(v, 4), m15), x1);
            d = _mm512_dpwssd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(v, 8), m15), x2);
            e = _mm512_dpwssd_epi32(e, _mm512_srli_epi16(v, 12), x3);
            __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128((const __m128i *)(G[g] + nb * 64 + b * 16))), pair);
            macc[g] = _mm256_add_ps(macc[g], prod);
            acc[g] = _mm512_fmadd_ps(_mm512_permutexvar_ps(expand, _mm512_castps256_ps512(prod)),
                                     _mm512_cvtepi32_ps(_mm512_add_epi32(d, e)), acc[g]);
        }
    }
    for (int g = 0; g < ng; g++) _mm512_store_ps(lanes[g], acc[g]), _mm256_store_ps(m[g], macc[g]);
#else
    const __m256i m15 = _mm256_set1_epi16(0x0F);
    const __m256i lo_rows = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2), hi_rows = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
    __m256 acc[X4_STREAMS][2], macc[X4_STREAMS];
    for (int g = 0; g < X4_STREAMS; g++) acc[g][0] = acc[g][1] = macc[g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int16_t *xq = x[b].q;
        __m256i x0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xq));
        __m256i x1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + 8)));
        __m256i x2 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + 16)));
        __m256i x3 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + 24)));
        __m256 pair = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b].d));
        for (int g = 0; g < ng; g++) {
            __m256 prod = _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128((const __m128i *)(G[g] + nb * 64 + b * 16))), pair);
            macc[g] = _mm256_add_ps(macc[g], prod);
            for (int h = 0; h < 2; h++) { /* rows 0-1, then rows 2-3 */
                __m256i v = _mm256_load_si256((const __m256i *)(G[g] + b * 64 + 32 * h));
                __m256i d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, m15), x0),
                                             _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m15), x1));
                __m256i e = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 8), m15), x2),
                                             _mm256_madd_epi16(_mm256_srli_epi16(v, 12), x3));
                __m256 scale = _mm256_permutevar8x32_ps(prod, h ? hi_rows : lo_rows);
                acc[g][h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_add_epi32(d, e)), acc[g][h]);
            }
        }
    }
    for (int g = 0; g < ng; g++) {
        _mm256_store_ps(lanes[g], acc[g][0]), _mm256_store_ps(lanes[g] + 8, acc[g][1]);
        _mm256_store_ps(m[g], macc[g]);
    }
#endif
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < 4; r++) {
            const float *a = lanes[g] + 4 * r;
            out[g][r] = (a[0] + a[1]) + (a[2] + a[3]) + m[g][2 * r + 1];
        }
}

/* Activation handling of plinth_gemm_quant. */
enum { ACT_F32 = 0, ACT_INT8 = 1, ACT_INT16 = 2 };

typedef struct {
    int fmt; /* 0: q4_1, 1: q8_0 */
    int act; /* ACT_* */
    const float *x;
    float *xsum; /* fp32 path: [M, nb] block sums of x */
    block_q8_x *xq;
    block_q16_x *xq16;
    const char *w;
    const float *bias;
    float *y;
    int64_t M, N, K, nb;
    size_t row_bytes;
} qgemm_ctx;

static void quantize_range(void *p, int64_t begin, int64_t end) {
    qgemm_ctx *c = (qgemm_ctx *)p;
    for (int64_t i = begin; i < end; i++) {
        if (c->act == ACT_INT8) {
            quantize_block_q8x(c->x + i * QK, c->xq + i);
        } else if (c->act == ACT_INT16) {
            quantize_block_q16x(c->x + i * QK, c->xq16 + i);
        } else {
            __m256 s = _mm256_loadu_ps(c->x + i * QK);
            for (int j = 8; j < QK; j += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(c->x + i * QK + j));
            c->xsum[i] = hsum256(s);
        }
    }
}

/* items are weight rows */
static void qgemm_range(void *p, int64_t begin, int64_t end) {
    qgemm_ctx *c = (qgemm_ctx *)p;
    for (int64_t m = 0; m < c->M; m++) {
        int64_t n = begin;
        if (c->act == ACT_INT16) { /* rows n, n + S, n + 2S, n + 3S together (see rows4_i16) */
            int64_t S = (end - begin) / 4;
            const block_q16_x *xr = c->xq16 + m * c->nb;
            float *y = c->y + m * c->N;
            for (; n < begin + S; n++) {
                const char *w[4];
                float v[4];
                for (int r = 0; r < 4; r++) w[r] = c->w + (size_t)(n + r * S) * c->row_bytes;
                rows4_i16(c->fmt, w, xr, c->nb, v);
                for (int r = 0; r < 4; r++) y[n + r * S] = v[r] + (c->bias ? c->bias[n + r * S] : 0.0f);
            }
            for (n = begin + 4 * S; n < end; n++) { /* the remainder (< 4 rows): one row in all four lanes */
                const char *row = c->w + (size_t)n * c->row_bytes, *w[4] = {row, row, row, row};
                float v[4];
                rows4_i16(c->fmt, w, xr, c->nb, v);
                y[n] = v[0] + (c->bias ? c->bias[n] : 0.0f);
            }
            continue;
        }
        for (; n < end; n++) {
            const void *wr = c->w + (size_t)n * c->row_bytes;
            float v;
            if (c->act == ACT_INT8) {
                const block_q8_x *xr = c->xq + m * c->nb;
                v = c->fmt == 0 ? row_dot_q4_1((const block_q4_1 *)wr, xr, c->nb)
                                : row_dot_q8_0((const block_q8_0 *)wr, xr, c->nb);
            } else {
                const float *xr = c->x + m * c->K;
                v = c->fmt == 0 ? row_dot_q4_1_f32((const block_q4_1 *)wr, xr, c->xsum + m * c->nb, c->nb)
                                : row_dot_q8_0_f32((const block_q8_0 *)wr, xr, c->nb);
            }
            c->y[m * c->N + n] = v + (c->bias ? c->bias[n] : 0.0f);
        }
    }
}

/* q4_1x4: items are groups of 4 weight rows, taken two at a time; each pair meets every activation
 * row while its blocks are in L1 */
/* Groups gs[0..ng) against every activation row, into y (with the bias). */
static void x4_groups_all_rows(const qgemm_ctx *c, const int64_t gs[X4_STREAMS], int ng) {
    size_t S = x4_stride(c->nb);
    const uint8_t *G[X4_STREAMS];
    for (int k = 0; k < ng; k++) G[k] = (const uint8_t *)c->w + (size_t)gs[k] * S;
    for (int64_t m = 0; m < c->M; m++) {
        float v[X4_STREAMS][4];
        groups_x4(G, ng, c->xq16 + m * c->nb, c->nb, v);
        float *y = c->y + m * c->N;
        for (int k = 0; k < ng; k++)
            for (int r = 0; r < 4; r++) {
                int64_t n = gs[k] * 4 + r;
                if (n < c->N) y[n] = v[k][r] + (c->bias ? c->bias[n] : 0.0f);
            }
    }
}

static void qgemm_x4_range(void *p, int64_t begin, int64_t end) {
    const qgemm_ctx *c = (const qgemm_ctx *)p;
    /* X4_STREAMS groups at a time from as many segments of the range (far apart in memory), then
     * the remainder one group at a time */
    int64_t seg = (end - begin) / X4_STREAMS, gs[X4_STREAMS];
    for (int64_t i = 0; i < seg; i++) {
        for (int k = 0; k < X4_STREAMS; k++) gs[k] = begin + i + k * seg;
        x4_groups_all_rows(c, gs, X4_STREAMS);
    }
    for (gs[0] = begin + X4_STREAMS * seg; gs[0] < end; gs[0]++) x4_groups_all_rows(c, gs, 1);
}

/* ---------------------------------------------------------------------------------------------
 * q4_1 in 16-row panels ("q4_1p16"): a q4_1 weight laid out at load so that one 512-bit vector of
 * int16 lanes holds a pair of columns (k, k + 1) of 16 rows, as VNNI's dpwssd wants it: each int32
 * lane is one row's dot product, and the activation pair is a 32-bit broadcast. Per 16-row panel
 * and 32-column block, 320 bytes: 256 of quants (four 64-byte vectors; word 2r + h of vector t holds
 * in nibble s the quant of row r, column 2(4t + s) + h), then the 16 rows' d (fp16), then their m.
 * Panels follow each other, blocks within a panel in order; missing rows of a last panel are zeros.
 * The same 20 bytes per 32 values as GGUF q4_1.
 */
#define P16_BYTES 320
/* q8_0 in the same 16-row panels ("q8_0p16"): per panel and block 544 bytes, 16 pairs of columns of
 * 32 bytes (byte 2r + h of pair j: the quant of row r, column 2j + h; sign-extended to int16 lanes as
 * read), then the 16 rows' d (fp16). The same 34 bytes per 32 values as GGUF q8_0. */
#define Q8P16_BYTES 544

int64_t plinth_q4_1p16_bytes(int64_t N, int64_t K) { return (N + 15) / 16 * (K / QK) * P16_BYTES; }
int64_t plinth_q8_0p16_bytes(int64_t N, int64_t K) { return (N + 15) / 16 * (K / QK) * Q8P16_BYTES; }
static inline int64_t p16_block_bytes(int fmt) { return fmt == FMT_Q8_0P16 ? Q8P16_BYTES : P16_BYTES; }

static inline int q4_1_quant(const block_q4_1 *blk, int k) { return k < 16 ? blk->qs[k] & 0x0F : blk->qs[k - 16] >> 4; }

static void pack_p16_range(void *p, int64_t begin, int64_t end) {
    pack_x4_ctx *c = (pack_x4_ctx *)p;
    int64_t nb = c->nb;
    for (int64_t pn = begin; pn < end; pn++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *base = c->out + ((size_t)pn * nb + b) * P16_BYTES;
            uint16_t words[4][32] = {{0}}, d[16] = {0}, m[16] = {0};
            for (int r = 0; r < 16 && pn * 16 + r < c->N; r++) {
                const block_q4_1 *blk = c->w + (pn * 16 + r) * nb + b;
                for (int t = 0; t < 4; t++)
                    for (int s = 0; s < 4; s++)
                        for (int h = 0; h < 2; h++)
                            words[t][2 * r + h] |= (uint16_t)(q4_1_quant(blk, 2 * (4 * t + s) + h) << (4 * s));
                d[r] = blk->d, m[r] = blk->m;
            }
            memcpy(base, words, sizeof words);
            memcpy(base + 256, d, sizeof d);
            memcpy(base + 288, m, sizeof m);
        }
}

static void pack_q8p16_range(void *p, int64_t begin, int64_t end) {
    pack_x4_ctx *c = (pack_x4_ctx *)p;
    const block_q8_0 *w = (const block_q8_0 *)c->w;
    int64_t nb = c->nb;
    for (int64_t pn = begin; pn < end; pn++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *base = c->out + ((size_t)pn * nb + b) * Q8P16_BYTES;
            memset(base, 0, Q8P16_BYTES);
            for (int r = 0; r < 16 && pn * 16 + r < c->N; r++) {
                const block_q8_0 *blk = w + (pn * 16 + r) * nb + b;
                for (int k = 0; k < QK; k++) base[32 * (k / 2) + 2 * r + k % 2] = (uint8_t)blk->q[k];
                memcpy(base + 512 + 2 * r, &blk->d, sizeof blk->d);
            }
        }
}

/* Lay out the q8_0 weight w [N, K] (GGUF blocks, row after row) in out (plinth_q8_0p16_bytes(N, K)
 * bytes, 64-byte aligned) as q8_0p16. */
void plinth_pack_q8_0p16(const void *w, void *out, int64_t N, int64_t K) {
    pack_x4_ctx c = {(const block_q4_1 *)w, (uint8_t *)out, N, K / QK};
    int64_t panels = (N + 15) / 16;
    parallel_for(pack_q8p16_range, &c, panels, grain_for(panels, 4));
}

/* Lay out the q4_1 weight w [N, K] (GGUF blocks, row after row) in out (plinth_q4_1p16_bytes(N, K)
 * bytes, 64-byte aligned) as q4_1p16. */
void plinth_pack_q4_1p16(const void *w, void *out, int64_t N, int64_t K) {
    pack_x4_ctx c = {(const block_q4_1 *)w, (uint8_t *)out, N, K / QK};
    int64_t panels = (N + 15) / 16;
    parallel_for(pack_p16_range, &c, panels, grain_for(panels, 4));
}

#ifndef P16_ROWS
#define P16_ROWS 4
#endif
/* Rows per chunk: a chunk's int16 activations (72 bytes a block) stay in L2 while the range's
 * panels pass them. */
#ifndef P16_CHUNK
#define P16_CHUNK 128
#endif
#ifndef P16_PF_DIST
#define P16_PF_DIST 1280
#endif
#if PLINTH_AVX512
/* acc[r][p]: row r's sums of panel p's 16 rows. */
typedef __m512 p16_acc[P16_ROWS][2];
/* np (1 or 2) panels against nr (1 to P16_ROWS) int16 activation rows: each block's quants are
 * unpacked once (a shift and a mask per pair of columns) for all nr rows; per row and panel a block
 * costs one vpmaddwd and 15 dpwssd, a conversion, the scale's product and two FMAs. */
static inline __attribute__((always_inline)) void p16_tile(int q8, const uint8_t *const P[2], int np,
                                                            const block_q16_x *x, int64_t nb, int nr,
                                                            p16_acc acc) {
    const int64_t bytes = q8 ? Q8P16_BYTES : P16_BYTES;
    const __m512i m15 = _mm512_set1_epi16(0x0F);
    for (int r = 0; r < nr; r++)
        for (int p = 0; p < np; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* at one or two rows, two chains of dot products per row and panel (even and odd s), so
         * the dpwssd latency does not bound a weight-streaming product */
        const int chains = nr <= 2 ? 2 : 1;
        __m512i di[P16_ROWS][2][2];
        for (int t = 0; t < 4; t++) {
            __m512i v[2];
            for (int p = 0; p < np; p++) {
                const uint8_t *B = P[p] + b * bytes;
                if (q8) { /* four pairs of columns: 128 bytes */
                    if (P16_PF_DIST) _mm_prefetch((const char *)B + 128 * t + P16_PF_DIST, _MM_HINT_T1);
                    if (P16_PF_DIST) _mm_prefetch((const char *)B + 128 * t + 64 + P16_PF_DIST, _MM_HINT_T1);
                    continue;
                }
                if (P16_PF_DIST) _mm_prefetch((const char *)B + 64 * t + P16_PF_DIST, _MM_HINT_T1);
                v[p] = _mm512_load_si512((const void *)(B + 64 * t));
            }
            for (int s = 0; s < 4; s++) {
                __m512i w[2];
                for (int p = 0; p < np; p++)
                    w[p] = q8       ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(P[p] + b * bytes + 32 * (4 * t + s))))
                         : s == 0 ? _mm512_and_si512(v[p], m15)
                         : s == 3 ? _mm512_srli_epi16(v[p], 12)
                                  : _mm512_and_si512(_mm512_srli_epi16(v[p], 4 * s), m15);
                for (int r = 0; r < nr; r++) {
                    int32_t pair;
                    memcpy(&pair, x[r * nb + b].q + 2 * (4 * t + s), sizeof pair);
                    __m512i xp = _mm512_set1_epi32(pair);
                    int ch = chains == 2 ? s & 1 : 0;
                    for (int p = 0; p < np; p++)
                        di[r][p][ch] = t == 0 && s == ch ? _mm512_madd_epi16(w[p], xp)
                                                         : _mm512_dpwssd_epi32(di[r][p][ch], w[p], xp);
                }
            }
        }
        for (int p = 0; p < np; p++) {
            const uint8_t *B = P[p] + b * bytes;
            __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(B + (q8 ? 512 : 256))));
            __m512 mw = q8 ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(B + 288)));
            for (int r = 0; r < nr; r++) {
                const block_q16_x *xb = x + r * nb + b;
                __m512i dots = chains == 2 ? _mm512_add_epi32(di[r][p][0], di[r][p][1]) : di[r][p][0];
                acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(dots), acc[r][p]);
                if (!q8) acc[r][p] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb->s), acc[r][p]);  /* q4_1's minimum */
            }
        }
    }
}

#else
/* The AVX2 build reads the same panels as two 256-bit halves (rows 0-7 and 8-15): without dpwssd a
 * pair of columns costs a vpmaddwd and a vpaddd per row and half. */
/* acc[r][p][h]: row r's sums of panel p's rows 8h..8h+7. */
typedef __m256 p16_acc[P16_ROWS][2][2];
/* One int16 column pair of 8 rows (half h of a panel's pair j = 4t + s of block B), as 8 int32
 * lanes of two int16 each: q4_1 from nibble s of vector t, q8_0 sign-extended from its bytes. */
static inline __attribute__((always_inline)) __m256i p16_pair_avx2(int q8, const uint8_t *B, int t, int s, int h) {
    if (q8) return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(B + 32 * (4 * t + s) + 16 * h)));
    __m256i v = _mm256_load_si256((const __m256i *)(B + 64 * t + 32 * h));
    const __m256i m15 = _mm256_set1_epi16(0x0F);
    return s == 0 ? _mm256_and_si256(v, m15)
         : s == 3 ? _mm256_srli_epi16(v, 12)
                  : _mm256_and_si256(_mm256_srli_epi16(v, 4 * s), m15);
}

/* np (1 or 2) panels against nr (1 to P16_ROWS) int16 activation rows: per row, panel and half a
 * block costs 16 vpmaddwd and 16 vpaddd, a conversion, the scale's product and two FMAs. */
static inline __attribute__((always_inline)) void p16_tile(int q8, const uint8_t *const P[2], int np,
                                                            const block_q16_x *x, int64_t nb, int nr,
                                                            p16_acc acc) {
    const int64_t bytes = q8 ? Q8P16_BYTES : P16_BYTES;
    for (int r = 0; r < nr; r++)
        for (int p = 0; p < np; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i di[P16_ROWS][2][2];
        for (int r = 0; r < nr; r++)
            for (int p = 0; p < np; p++) di[r][p][0] = di[r][p][1] = _mm256_setzero_si256();
        for (int p = 0; p < np; p++) {
            const uint8_t *B = P[p] + b * bytes;
            if (P16_PF_DIST)
                for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)B + o + P16_PF_DIST, _MM_HINT_T1);
        }
        for (int t = 0; t < 4; t++)
            for (int s = 0; s < 4; s++) {
                __m256i xp[P16_ROWS];
                for (int r = 0; r < nr; r++) {
                    int32_t pair;
                    memcpy(&pair, x[r * nb + b].q + 2 * (4 * t + s), sizeof pair);
                    xp[r] = _mm256_set1_epi32(pair);
                }
                for (int p = 0; p < np; p++)
                    for (int h = 0; h < 2; h++) {
                        __m256i w = p16_pair_avx2(q8, P[p] + b * bytes, t, s, h);
                        for (int r = 0; r < nr; r++) {
                            di[r][p][h] = _mm256_add_epi32(di[r][p][h], _mm256_madd_epi16(w, xp[r]));
                        }
                    }
            }
        for (int p = 0; p < np; p++) {
            const uint8_t *B = P[p] + b * bytes;
            for (int h = 0; h < 2; h++) {
                __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(B + (q8 ? 512 : 256) + 16 * h)));
                __m256 mw = q8 ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(B + 288 + 16 * h)));
                for (int r = 0; r < nr; r++) {
                    const block_q16_x *xb = x + r * nb + b;
                    __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(xb->d));
                    acc[r][p][h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(di[r][p][h]), acc[r][p][h]);
                    if (!q8) acc[r][p][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb->s), acc[r][p][h]);
                }
            }
        }
    }
}
#endif

/* p16_tile with nr and np as constants. */
static void p16_tile_n(int q8, const uint8_t *const P[2], int np, const block_q16_x *x, int64_t nb, int nr,
                       p16_acc acc) {
#define P16_CASE(R)                                                                                    \
    case R:                                                                                            \
        if (q8) np == 2 ? p16_tile(1, P, 2, x, nb, R, acc) : p16_tile(1, P, 1, x, nb, R, acc);         \
        else np == 2 ? p16_tile(0, P, 2, x, nb, R, acc) : p16_tile(0, P, 1, x, nb, R, acc);            \
        return;
    switch (nr) {
        P16_CASE(1)
#if P16_ROWS >= 2
        P16_CASE(2)
#endif
#if P16_ROWS >= 3
        P16_CASE(3)
#endif
#if P16_ROWS >= 4
        P16_CASE(4)
#endif
    }
#undef P16_CASE
}

/* Rows m..m+nr-1 of panel k's sums (acc), plus the bias, into y from column n0. */
#if PLINTH_AVX512
static inline void p16_store(const qgemm_ctx *c, p16_acc acc, int nr, int k, int64_t m, int64_t n0) {
    int64_t left = c->N - n0;
    __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    __m512 bias = c->bias ? _mm512_maskz_loadu_ps(mask, c->bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < nr; r++)
        _mm512_mask_storeu_ps(c->y + (m + r) * c->N + n0, mask, _mm512_add_ps(acc[r][k], bias));
}
#else
/* ... in two halves, a last partial panel through a buffer */
static inline void p16_store(const qgemm_ctx *c, p16_acc acc, int nr, int k, int64_t m, int64_t n0) {
    int64_t left = c->N - n0 < 16 ? c->N - n0 : 16;
    float bias[16] = {0}, out[16];
    if (c->bias) memcpy(bias, c->bias + n0, (size_t)left * sizeof(float));
    for (int r = 0; r < nr; r++) {
        float *dst = c->y + (m + r) * c->N + n0;
        __m256 lo = _mm256_add_ps(acc[r][k][0], _mm256_loadu_ps(bias));
        __m256 hi = _mm256_add_ps(acc[r][k][1], _mm256_loadu_ps(bias + 8));
        if (left == 16) {
            _mm256_storeu_ps(dst, lo), _mm256_storeu_ps(dst + 8, hi);
        } else {
            _mm256_storeu_ps(out, lo), _mm256_storeu_ps(out + 8, hi);
            memcpy(dst, out, (size_t)left * sizeof(float));
        }
    }
}
#endif

/* Panels ps[0..np) against rows [m0, m1), P16_ROWS at a time, into y (with the bias). */
static void p16_panels_rows(const qgemm_ctx *c, const int64_t ps[2], int np, int64_t m0, int64_t m1) {
    const uint8_t *P[2];
    for (int k = 0; k < np; k++) P[k] = (const uint8_t *)c->w + (size_t)ps[k] * c->nb * p16_block_bytes(c->fmt);
    for (int64_t m = m0; m < m1; m += P16_ROWS) {
        int nr = (int)(m1 - m < P16_ROWS ? m1 - m : P16_ROWS);
        p16_acc acc;
        p16_tile_n(c->fmt == FMT_Q8_0P16, P, np, c->xq16 + m * c->nb, c->nb, nr, acc);
        for (int k = 0; k < np; k++) p16_store(c, acc, nr, k, m, ps[k] * 16);
    }
}

static void qgemm_p16_range(void *p, int64_t begin, int64_t end) {
    const qgemm_ctx *c = (const qgemm_ctx *)p;
    /* two panels at a time from two halves of the range (two weight streams), then the odd one */
    int64_t seg = (end - begin) / 2, ps[2];
    for (int64_t m0 = 0; m0 < c->M; m0 += P16_CHUNK) {
        int64_t m1 = m0 + P16_CHUNK < c->M ? m0 + P16_CHUNK : c->M;
        for (int64_t i = 0; i < seg; i++) {
            ps[0] = begin + i, ps[1] = begin + i + seg;
            p16_panels_rows(c, ps, 2, m0, m1);
        }
        if ((end - begin) % 2) ps[0] = end - 1, p16_panels_rows(c, ps, 1, m0, m1);
    }
}

#if PLINTH_AVX512 && PLINTH_AMX
/*
 * The 16-row panels (q4_1p16, q8_0p16) on AMX-INT8 tiles, for batched products. The int16
 * activations are split into bytes, x = 256 hi + lo (hi signed, lo unsigned), so two int8 tile
 * products per block give exactly the integer dot the dpwssd kernel forms, 256 (hi . q) + (lo . q):
 * TDPBSUD and TDPBUUD for q4_1's unsigned quants, TDPBSSD and TDPBUSD for q8_0's signed ones. Each
 * 32-block is its own tile product (K = 32: the blocks' scales differ), its C tiles stored and
 * scaled by AVX-512 with p16_tile's operations in p16_tile's order, so the outputs are the dpwssd
 * kernel's bit for bit. Per call each panel pair's quants are unpacked once into B tiles (8 rows of
 * 64 bytes a block: row i holds each column's quants 4i..4i+3) and pass every row of activations.
 * Tiles 0-3: C (hi and lo of two panels), 4-5: A (hi, lo bytes of 16 rows), 6-7: B of two panels.
 */
#ifdef PLINTH_EMULATE
#define AMX_I8_TARGET
#else
#define AMX_I8_TARGET __attribute__((target("amx-tile,amx-int8")))
#endif
/* the fewest rows a product takes the tiles with (a tile holds 16: fewer pad it with zero rows) */
#define AMX_I8_MIN_ROWS 16

typedef struct {
    const qgemm_ctx *c;
    int8_t *xh;  /* [Mp][K]: each int16 activation's high byte (signed) ... */
    uint8_t *xl; /* ... and its low byte; rows M..Mp (M rounded up to 16) zero */
    _Atomic int failed;
} amx_q_ctx;

static void amx_q_split_range(void *p, int64_t begin, int64_t end) {
    amx_q_ctx *a = (amx_q_ctx *)p;
    const qgemm_ctx *c = a->c;
    int64_t K = c->K, nb = c->nb;
    for (int64_t m = begin; m < end; m++) {
        int8_t *h = a->xh + m * K;
        uint8_t *l = a->xl + m * K;
        if (m >= c->M) {
            memset(h, 0, (size_t)K), memset(l, 0, (size_t)K);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            __m512i v = _mm512_loadu_si512((const void *)c->xq16[m * nb + b].q);
            _mm256_storeu_si256((__m256i *)(h + b * QK), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
            _mm256_storeu_si256((__m256i *)(l + b * QK), _mm512_cvtepi16_epi8(v)); /* truncated: the low byte */
        }
    }
}

/* per 32-bit lane: its bytes b0 and b1 moved to bytes 0, 1 (hi = 0) or 2, 3 (hi = 1), the others zero */
static inline __m512i dword_pick(int b0, int b1, int hi) {
    uint8_t ctl[64];
    memset(ctl, 0x80, sizeof ctl);
    for (int d = 0; d < 16; d++) {
        int base = d % 4 * 4, at = d * 4 + 2 * hi;
        ctl[at] = (uint8_t)(base + b0), ctl[at + 1] = (uint8_t)(base + b1);
    }
    return _mm512_loadu_si512((const void *)ctl);
}

/* A panel's nb blocks (at P, q4_1p16 or q8_0p16) as B tiles at T: 512 bytes a block, row i the 16
 * columns' quants 4i..4i+3. q4_1p16's 32-bit lane n of vector t holds column n's nibbles of k =
 * 8t + 2s + h at bit 16h + 4s: rows 2t and 2t + 1 take its nibbles s = 0, 1 and s = 2, 3. */
static void amx_q_unpack(int q8, const uint8_t *P, int64_t nb, uint8_t *T) {
    const int64_t bytes = q8 ? Q8P16_BYTES : P16_BYTES;
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i e0 = dword_pick(0, 2, 0), e1 = dword_pick(0, 2, 1), o0 = dword_pick(1, 3, 0), o1 = dword_pick(1, 3, 1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *B = P + b * bytes;
        uint8_t *t8 = T + b * 512;
        if (q8) { /* row i: pair 2i's word of each column, pair 2i + 1's above it */
            for (int i = 0; i < 8; i++) {
                __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(B + 64 * i)));
                __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(B + 64 * i + 32)));
                _mm512_store_si512((void *)(t8 + 64 * i), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
            continue;
        }
        for (int t = 0; t < 4; t++) {
            __m512i v = _mm512_load_si512((const void *)(B + 64 * t));
            /* bytes of each lane: lo [s0h0 s2h0 s0h1 s2h1], hi [s1h0 s3h0 s1h1 s3h1] */
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            _mm512_store_si512((void *)(t8 + 128 * t), _mm512_or_si512(_mm512_shuffle_epi8(lo, e0), _mm512_shuffle_epi8(hi, e1)));
            _mm512_store_si512((void *)(t8 + 128 * t + 64), _mm512_or_si512(_mm512_shuffle_epi8(lo, o0), _mm512_shuffle_epi8(hi, o1)));
        }
    }
}

static AMX_I8_TARGET void amx_q_configure(void) {
    amx_tilecfg t;
    memset(&t, 0, sizeof t);
    t.palette = 1;
    for (int i = 0; i < 4; i++) t.rows[i] = 16, t.colsb[i] = 64;
    t.rows[4] = t.rows[5] = 16, t.colsb[4] = t.colsb[5] = 32;
    t.rows[6] = t.rows[7] = 8, t.colsb[6] = t.colsb[7] = 64;
    __asm__ volatile("" : : "r"(&t) : "memory"); /* the stores must precede LDTILECFG (see amx_attn_configure) */
    _tile_loadconfig(&t);
}

/* items are panel pairs (the last may hold one panel, multiplied twice, its copy not stored) */
static AMX_I8_TARGET void qgemm_amx_range(void *p, int64_t begin, int64_t end) {
    amx_q_ctx *a = (amx_q_ctx *)p;
    const qgemm_ctx *c = a->c;
    const int q8 = c->fmt == FMT_Q8_0P16;
    const int64_t nb = c->nb, K = c->K, panels = (c->N + 15) / 16, bytes = p16_block_bytes(c->fmt);
    uint8_t *T = (uint8_t *)aligned_alloc(64, (size_t)(2 * nb * 512));
    if (!T) {
        atomic_store(&a->failed, 1);
        return;
    }
    int32_t cb[4][16][16] __attribute__((aligned(64)));
    float acc[2][16][16] __attribute__((aligned(64)));
    amx_q_configure();
    for (int64_t pp = begin; pp < end; pp++) {
        int64_t q = 2 * pp;
        int two = q + 1 < panels;
        const uint8_t *P[2] = {(const uint8_t *)c->w + q * nb * bytes, NULL};
        P[1] = two ? P[0] + nb * bytes : P[0];
        amx_q_unpack(q8, P[0], nb, T);
        if (two) amx_q_unpack(q8, P[1], nb, T + nb * 512);
        const uint8_t *T1 = two ? T + nb * 512 : T;
        for (int64_t m0 = 0; m0 < c->M; m0 += 16) {
            int nr = c->M - m0 < 16 ? (int)(c->M - m0) : 16;
            memset(acc, 0, sizeof acc);
            for (int64_t b = 0; b < nb; b++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(4, a->xh + m0 * K + b * QK, K);
                _tile_loadd(5, a->xl + m0 * K + b * QK, K);
                _tile_loadd(6, T + b * 512, 64);
                _tile_loadd(7, T1 + b * 512, 64);
                if (q8) {
                    _tile_dpbssd(0, 4, 6);
                    _tile_dpbusd(1, 5, 6);
                    _tile_dpbssd(2, 4, 7);
                    _tile_dpbusd(3, 5, 7);
                } else {
                    _tile_dpbsud(0, 4, 6);
                    _tile_dpbuud(1, 5, 6);
                    _tile_dpbsud(2, 4, 7);
                    _tile_dpbuud(3, 5, 7);
                }
                _tile_stored(0, cb[0], 64);
                _tile_stored(1, cb[1], 64);
                _tile_stored(2, cb[2], 64);
                _tile_stored(3, cb[3], 64);
                for (int k = 0; k <= two; k++) { /* p16_tile's scaling, in its order */
                    const uint8_t *B = P[k] + b * bytes;
                    __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(B + (q8 ? 512 : 256))));
                    __m512 mw = q8 ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(B + 288)));
                    for (int r = 0; r < nr; r++) {
                        const block_q16_x *xb = c->xq16 + (m0 + r) * nb + b;
                        __m512i dots = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)cb[2 * k][r]), 8),
                                                        _mm512_load_si512((const void *)cb[2 * k + 1][r]));
                        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), _mm512_cvtepi32_ps(dots),
                                                   _mm512_load_ps(acc[k][r]));
                        if (!q8) v = _mm512_fmadd_ps(mw, _mm512_set1_ps(xb->s), v); /* q4_1's minimum */
                        _mm512_store_ps(acc[k][r], v);
                    }
                }
            }
            for (int k = 0; k <= two; k++) {
                int64_t n0 = (q + k) * 16, left = c->N - n0;
                __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
                __m512 bias = c->bias ? _mm512_maskz_loadu_ps(mask, c->bias + n0) : _mm512_setzero_ps();
                for (int r = 0; r < nr; r++)
                    _mm512_mask_storeu_ps(c->y + (m0 + r) * c->N + n0, mask, _mm512_add_ps(_mm512_load_ps(acc[k][r]), bias));
            }
        }
    }
    _tile_release();
    free(T);
}

/* plinth_gemm_quant's 16-row panels on AMX-INT8 tiles (c's activations already in int16): 0, or -1
 * when out of memory */
static int qgemm_amx(qgemm_ctx *c) {
    int64_t Mp = (c->M + 15) / 16 * 16, panels = (c->N + 15) / 16, pairs = (panels + 1) / 2;
    amx_q_ctx a = {c, (int8_t *)malloc((size_t)(Mp * c->K)), (uint8_t *)malloc((size_t)(Mp * c->K)), 0};
    int rc = -1;
    if (a.xh && a.xl) {
        parallel_for(amx_q_split_range, &a, Mp, grain_for(Mp, 16));
        parallel_for(qgemm_amx_range, &a, pairs, grain_for(pairs, 1));
        rc = atomic_load(&a.failed) ? -1 : 0;
    }
    free(a.xh), free(a.xl);
    return rc;
}
#endif

/* Whether plinth_gemm_quant multiplies the 16-row panels on AMX-INT8 tiles from AMX_I8_MIN_ROWS rows:
 * mode 1 on where the CPU has them, 0 off (the default), -1 asks. Returns 1 where they are on. */
int plinth_amx_int8(int mode) {
#if PLINTH_AVX512 && PLINTH_AMX
    static int available = -1, on = 0;
    return amx_switch(&available, &on, mode, AMX_INT8_BIT);
#else
    (void)mode;
    return 0;
#endif
}

/* y[M, N] = x[M, K] @ dequant(w)[N, K]^T + b with activations (act) in fp32 as given, or rounded
 * per 32-block to int8 or int16 first (q4_1x4 and q4_1p16: int16 only; -2 for another act). The
 * GGUF layouts and q4_1x4 serve few rows; the 16-row panels (q4_1p16, q8_0p16) any number.
 * Returns 0, or -1 when out of memory. */
int plinth_gemm_quant(int fmt, int act, const float *x, const void *w, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K) {
    int64_t nb = K / QK;
    int panels16 = fmt == FMT_Q4_1P16 || fmt == FMT_Q8_0P16;
    if ((fmt == FMT_Q4_1X4 || panels16) && act != ACT_INT16) return -2;
    size_t per_block = act == ACT_INT8 ? sizeof(block_q8_x) : act == ACT_INT16 ? sizeof(block_q16_x) : sizeof(float);
    void *scratch = malloc(per_block * (size_t)(M * nb));
    if (!scratch) return -1;
    size_t row_bytes = (size_t)nb * (fmt == 0 ? sizeof(block_q4_1) : sizeof(block_q8_0));
    qgemm_ctx c = {fmt,
                   act,
                   x,
                   act == ACT_F32 ? (float *)scratch : NULL,
                   act == ACT_INT8 ? (block_q8_x *)scratch : NULL,
                   act == ACT_INT16 ? (block_q16_x *)scratch : NULL,
                   (const char *)w,
                   bias,
                   y,
                   M,
                   N,
                   K,
                   nb,
                   row_bytes};
    if (act != ACT_F32 || fmt == 0) parallel_for(quantize_range, &c, M * nb, grain_for(M * nb, 256));
    if (panels16) {
        int64_t panels = (N + 15) / 16;
#if PLINTH_AVX512 && PLINTH_AMX
        if (M >= AMX_I8_MIN_ROWS && plinth_amx_int8(-1)) {
            int rc = qgemm_amx(&c);
            free(scratch);
            return rc;
        }
#endif
        parallel_for(qgemm_p16_range, &c, panels, grain_for(panels, 2));
        free(scratch);
        return 0;
    }
    if (fmt == FMT_Q4_1X4) {
        int64_t groups = (N + 3) / 4;
        parallel_for(qgemm_x4_range, &c, groups, grain_for(groups, 4 * X4_STREAMS));
    } else {
        parallel_for(qgemm_range, &c, N, grain_for(N, 16));
    }
    free(scratch);
    return 0;
}

typedef struct {
    const float *x;
    float *out;
} rt_ctx;

static void round_trip_range(void *p, int64_t begin, int64_t end) {
    rt_ctx *c = (rt_ctx *)p;
    block_q8_x b;
    for (int64_t i = begin; i < end; i++) {
        quantize_block_q8x(c->x + i * QK, &b);
        for (int j = 0; j < QK; j++) c->out[i * QK + j] = (float)b.q[j] * b.d;
    }
}

/* out = the values the quantized GEMMs multiply for activations x [M, K]: int8 per 32-block times
 * its scale. Many-row products run on these in fp32 and so agree with the few-row integer path up
 * to fp32 rounding: a sequence's result does not depend on how many others share its step. */
void plinth_round_trip_q8(const float *x, float *out, int64_t M, int64_t K) {
    rt_ctx c = {x, out};
    parallel_for(round_trip_range, &c, M * (K / QK), grain_for(M * (K / QK), 256));
}

typedef struct {
    int fmt;
    const char *w;
    float *out;
    int64_t K, nb;
    size_t bsz;
} dequant_ctx;

/* 32 q8_0 values q times their fp16 scale dh into o: 8 per vector, widened, converted, scaled. */
static inline void dequant32_q8(float *o, const int8_t *q, uint16_t dh) {
    __m256 d = _mm256_set1_ps(fp16_to_f32(dh));
    for (int i = 0; i < 4; i++) {
        __m128i v = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
        _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
    }
}

static void dequant_range(void *p, int64_t begin, int64_t end) {
    dequant_ctx *c = (dequant_ctx *)p;
    for (int64_t n = begin; n < end; n++) {
        float *o = c->out + n * c->K;
        if (c->fmt == FMT_Q8_0P16) { /* row r of its panel: its byte pair of each column pair, then d */
            int r = (int)(n % 16);
            for (int64_t b = 0; b < c->nb; b++) {
                const uint8_t *base = (const uint8_t *)c->w + ((size_t)(n / 16) * c->nb + b) * Q8P16_BYTES;
                int8_t q[QK];
                uint16_t dh;
                for (int j = 0; j < QK / 2; j++) memcpy(q + 2 * j, base + 32 * j + 2 * r, 2);
                memcpy(&dh, base + 512 + 2 * r, sizeof dh);
                dequant32_q8(o + b * QK, q, dh);
            }
            continue;
        }
        if (c->fmt == FMT_Q4_1P16) { /* row r of its panel: columns 8t..8t+7 are the 8 nibbles of its
                                       * two words in vector t (column 8t + 2s + h: nibble s of word h) */
            int r = (int)(n % 16);
            const __m256i shifts = _mm256_setr_epi32(0, 16, 4, 20, 8, 24, 12, 28), m15 = _mm256_set1_epi32(0x0F);
            for (int64_t b = 0; b < c->nb; b++) {
                const uint8_t *base = (const uint8_t *)c->w + ((size_t)(n / 16) * c->nb + b) * P16_BYTES;
                uint16_t dh, mh;
                memcpy(&dh, base + 256 + 2 * r, sizeof dh);
                memcpy(&mh, base + 288 + 2 * r, sizeof mh);
                __m256 d = _mm256_set1_ps(fp16_to_f32(dh)), m = _mm256_set1_ps(fp16_to_f32(mh));
                for (int t = 0; t < 4; t++) {
                    int32_t words;
                    memcpy(&words, base + 64 * t + 4 * r, sizeof words);
                    __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(words), shifts), m15);
                    _mm256_storeu_ps(o + b * QK + 8 * t, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(v), m));
                }
            }
            continue;
        }
        if (c->fmt == FMT_Q4_1X4) { /* row r of its group: 16 bytes of each block, nibble p is values 8p..8p+7 */
            const char *base = c->w + (size_t)(n / 4) * x4_stride(c->nb);
            int r = (int)(n % 4);
            for (int64_t b = 0; b < c->nb; b++) {
                uint32_t dm;
                memcpy(&dm, base + c->nb * 64 + b * 16 + r * 4, sizeof dm);
                __m256 d = _mm256_set1_ps(fp16_to_f32((uint16_t)dm)), m = _mm256_set1_ps(fp16_to_f32((uint16_t)(dm >> 16)));
                __m128i v = _mm_loadu_si128((const __m128i *)(base + b * 64 + r * 16)), m15 = _mm_set1_epi16(0x0F);
                for (int q = 0; q < 4; q++) {
                    __m256i vals = _mm256_cvtepu16_epi32(_mm_and_si128(_mm_srli_epi16(v, 4 * q), m15));
                    _mm256_storeu_ps(o + b * QK + 8 * q, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(vals), m));
                }
            }
            continue;
        }
        const char *row = c->w + (size_t)n * c->nb * c->bsz;
        for (int64_t b = 0; b < c->nb; b++) { /* 8 values per vector: widen, convert, scale */
            float *ob = o + b * QK;
            if (c->fmt == 0) { /* value j is d * nibble + m: low nibbles are values 0-15, high ones 16-31 */
                const block_q4_1 *blk = (const block_q4_1 *)(row + b * c->bsz);
                __m256 d = _mm256_set1_ps(fp16_to_f32(blk->d)), m = _mm256_set1_ps(fp16_to_f32(blk->m));
                __m128i q = _mm_loadu_si128((const __m128i *)blk->qs), low4 = _mm_set1_epi8(0x0F);
                __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
                __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                for (int i = 0; i < 4; i++)
                    _mm256_storeu_ps(ob + 8 * i, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), m));
            } else {
                const block_q8_0 *blk = (const block_q8_0 *)(row + b * c->bsz);
                dequant32_q8(ob, blk->q, blk->d);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Quantized GEMM for many rows: x [M, K] (activations already rounded by plinth_round_trip_q8)
 * times a q4_1/q8_0 weight. Each item dequantizes its 3 weight rows into a small per-thread buffer
 * (cache-resident) and runs the fp32 register tiles over every activation row: the dequantization
 * is paid once per 3 rows and M-block, the products run at fp32 GEMM speed.
 */
typedef struct {
    int fmt;
    const float *x;
    const char *w;
    const float *bias;
    float *y;
    int64_t M, N, K;
    size_t row_bytes;
    _Atomic int failed;
} qdgemm_ctx;

static void qdgemm_range(void *p, int64_t begin, int64_t end) {
    qdgemm_ctx *c = (qdgemm_ctx *)p;
    int64_t M = c->M, N = c->N, K = c->K;
    float *buf = (float *)malloc(sizeof(float) * (size_t)(3 * K));
    if (!buf) {
        atomic_store(&c->failed, 1);
        return;
    }
    dequant_ctx d = {c->fmt, c->w, NULL, K, K / QK, c->fmt == 0 ? sizeof(block_q4_1) : sizeof(block_q8_0)};
    /* each item's rows are dequantized once, then meet every activation row (a decode batch of
     * at most a few dozen rows of K floats stays in L2 meanwhile) */
    for (int64_t item = begin; item < end; item++) {
        int64_t n = item * 3, rows = n + 3 <= N ? 3 : N - n;
        d.out = buf - n * K; /* dequant_range writes row r at out + r * K */
        dequant_range(&d, n, n + rows);
        const float *bias = c->bias ? c->bias + n : NULL;
        if (rows == 3) {
            int64_t m = 0;
            const float *w[3] = {buf, buf + K, buf + 2 * K};
            const int64_t col[3] = {n, n + 1, n + 2};
            for (; m + 4 <= M; m += 4) tile_4x3(c->x + m * K, w, K, c->y + m * N, N, col, c->bias);
            for (; m < M; m++) tile_1x3(c->x + m * K, w, K, c->y + m * N, col, c->bias);
        } else {
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < rows; j++)
                    c->y[m * N + n + j] = dot1(c->x + m * K, buf + j * K, K) + (bias ? bias[j] : 0.0f);
        }
    }
    free(buf);
}

/* y[M, N] = x[M, K] @ dequant(w)^T + b; returns 0, or -1 when out of memory. */
int plinth_gemm_dequant(int fmt, const float *x, const void *w, const float *bias, float *y, int64_t M, int64_t N,
                        int64_t K) {
    size_t bsz = fmt == 0 ? sizeof(block_q4_1) : sizeof(block_q8_0);
    qdgemm_ctx c = {fmt, x, (const char *)w, bias, y, M, N, K, (size_t)(K / QK) * bsz, 0};
    int64_t groups = (N + 2) / 3;
    parallel_for(qdgemm_range, &c, groups, grain_for(groups, 8));
    return atomic_load(&c.failed) ? -1 : 0;
}

typedef struct {
    dequant_ctx d;
    void *out; /* [N, K] of kind dt */
    int dt;
    _Atomic int failed;
} dequant16_ctx;

/* rows dequantized one at a time into a thread's fp32 scratch, then rounded to 16 bits (as torch
 * rounds: the fp32 values' cast) */
static void dequant16_range(void *p, int64_t begin, int64_t end) {
    dequant16_ctx *c = (dequant16_ctx *)p;
    int64_t K = c->d.K;
    float *buf = pack_buffer((size_t)K);
    if (!buf) {
        atomic_store(&c->failed, 1);
        return;
    }
    dequant_ctx d = c->d;
    for (int64_t n = begin; n < end; n++) {
        d.out = buf - n * K; /* dequant_range writes row n at out + n * K */
        dequant_range(&d, n, n + 1);
        void *row = (char *)c->out + (size_t)(n * K) * wsize(c->dt);
        for (int64_t k = 0; k < K; k += 8) store8w(row, k, _mm256_loadu_ps(buf + k), c->dt);
    }
}

/* Dequantize an [N, K] weight into out [N, K] of element kind dt: fp32 (W_F32), or the fp32 values
 * rounded to bf16/fp16 (W_BF16/W_F16). Returns 0, or -1 for another kind or when out of memory. */
int plinth_dequant(int fmt, const void *w, void *out, int dt, int64_t N, int64_t K) {
    dequant_ctx c = {fmt, (const char *)w, (float *)out, K, K / QK, fmt == 0 ? sizeof(block_q4_1) : sizeof(block_q8_0)};
    if (dt == W_F32) {
        parallel_for(dequant_range, &c, N, grain_for(N, 16));
        return 0;
    }
    if (dt != W_BF16 && dt != W_F16) return -1;
    dequant16_ctx c16 = {c, out, dt, 0};
    parallel_for(dequant16_range, &c16, N, grain_for(N, 16));
    return atomic_load(&c16.failed) ? -1 : 0;
}

typedef struct {
    dequant_ctx d;
    float *P;
    int64_t N;
    _Atomic int failed;
} dequant_panels_ctx;

static void dequant_panels_range(void *p, int64_t begin, int64_t end) {
    dequant_panels_ctx *c = (dequant_panels_ctx *)p;
    int64_t K = c->d.K;
    float *buf = pack_buffer((size_t)(8 * K));
    if (!buf) {
        atomic_store(&c->failed, 1);
        return;
    }
    dequant_ctx d = c->d;
    for (int64_t q = begin; q < end; q++) {
        int64_t n = q * 8, rows = c->N - n < 8 ? c->N - n : 8;
        d.out = buf - n * K; /* dequant_range writes row r at out + r * K */
        dequant_range(&d, n, n + rows);
        for (int64_t k = 0; k < K; k += 8) transpose8(buf + k, K, c->P + n * K + k * 8, 8, (int)rows);
    }
}

/* Dequantize an [N, K] weight into the panels of plinth_pack_f32_panels; returns 0, or -1 when
 * out of memory. */
int plinth_dequant_panels(int fmt, const void *w, float *P, int64_t N, int64_t K) {
    dequant_panels_ctx c = {{fmt, (const char *)w, NULL, K, K / QK, fmt == 0 ? sizeof(block_q4_1) : sizeof(block_q8_0)},
                            P, N, 0};
    int64_t panels = (N + 7) / 8;
    parallel_for(dequant_panels_range, &c, panels, grain_for(panels, 4));
    return atomic_load(&c.failed) ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Small ops over [T, H] rows.
 */
typedef struct {
    const void *x;
    void *residual;
    const void *w;
    void *out;
    int64_t H;     /* values per normed row */
    float eps;
    int64_t heads; /* rows per token (1, or the heads of rms_norm_heads) */
    int64_t sx;    /* elements from one token's rows to the next's (rows of a token are H apart) */
    int dt;        /* the element kind of x, residual, w and out: W_F32, W_BF16 or W_F16 */
} norm_ctx;

/* Activations of kind dt are widened exactly as they are read and rounded once as they are stored
 * (as torch's bf16/fp16 RMSNorm computes in fp32 and rounds its result); `dt` is a constant wherever
 * the workers below are inlined, so the fp32 loops are the plain ones. */
static inline __attribute__((always_inline)) void rms_norm_rows(const norm_ctx *c, int64_t begin, int64_t end,
                                                                int dt) {
    int64_t H = c->H;
    for (int64_t t = begin; t < end; t++) {
        const void *src = wat(c->x, (t / c->heads) * c->sx + (t % c->heads) * H, dt);
        if (c->residual) { /* the sum is stored (rounded to dt) and the stored sum is normed */
            void *r = (void *)wat(c->residual, t * H, dt);
            int64_t h = 0;
#if PLINTH_AVX512
            for (; h + 16 <= H; h += 16) store16w(r, h, _mm512_add_ps(load16w(r, h, dt), load16w(src, h, dt)), dt);
#endif
            for (; h < H; h += 8) store8w(r, h, _mm256_add_ps(load8w(r, h, dt), load8w(src, h, dt)), dt);
            src = r;
        }
        /* the sum of squares in four chains (one chain was bound by the FMA latency: ~5% of a bf16
         * prefill); the AVX-512 build's 16 lanes folded into the 8-lane chains for the tail */
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t hs = 0;
#if PLINTH_AVX512
        {
            __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
            for (; hs + 64 <= H; hs += 64) {
                __m512 v0 = load16w(src, hs, dt), v1 = load16w(src, hs + 16, dt);
                __m512 v2 = load16w(src, hs + 32, dt), v3 = load16w(src, hs + 48, dt);
                z0 = _mm512_fmadd_ps(v0, v0, z0), z1 = _mm512_fmadd_ps(v1, v1, z1);
                z2 = _mm512_fmadd_ps(v2, v2, z2), z3 = _mm512_fmadd_ps(v3, v3, z3);
            }
            for (; hs + 16 <= H; hs += 16) {
                __m512 v0 = load16w(src, hs, dt);
                z0 = _mm512_fmadd_ps(v0, v0, z0);
            }
            s0 = fold_halves(_mm512_add_ps(z0, z1)), s1 = fold_halves(_mm512_add_ps(z2, z3));
        }
#endif
        for (; hs + 32 <= H; hs += 32) {
            __m256 v0 = load8w(src, hs, dt), v1 = load8w(src, hs + 8, dt);
            __m256 v2 = load8w(src, hs + 16, dt), v3 = load8w(src, hs + 24, dt);
            s0 = _mm256_fmadd_ps(v0, v0, s0), s1 = _mm256_fmadd_ps(v1, v1, s1);
            s2 = _mm256_fmadd_ps(v2, v2, s2), s3 = _mm256_fmadd_ps(v3, v3, s3);
        }
        for (; hs < H; hs += 8) {
            __m256 v = load8w(src, hs, dt);
            s0 = _mm256_fmadd_ps(v, v, s0);
        }
        __m256 ss = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
        __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum256(ss) / (float)H + c->eps));
        void *o = (void *)wat(c->out, t * H, dt);
        int64_t h = 0;
#if PLINTH_AVX512
        __m512 scale16 = _mm512_broadcast_f32x8(scale);
        for (; h + 16 <= H; h += 16)
            store16w(o, h, _mm512_mul_ps(_mm512_mul_ps(load16w(src, h, dt), scale16), load16w(c->w, h, dt)), dt);
#endif
        for (; h < H; h += 8)
            store8w(o, h, _mm256_mul_ps(_mm256_mul_ps(load8w(src, h, dt), scale), load8w(c->w, h, dt)), dt);
    }
}

/* items are rows: row t is head t % heads of token t / heads */
static void rms_norm_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = (norm_ctx *)p;
    if (c->dt == W_BF16)
        rms_norm_rows(c, begin, end, W_BF16);
    else if (c->dt == W_F16)
        rms_norm_rows(c, begin, end, W_F16);
    else
        rms_norm_rows(c, begin, end, W_F32);
}

/* out = x * rsqrt(mean(x^2) + eps) * w (H a multiple of 8); with residual: residual += x first and
 * the sum is normed. Every tensor holds elements of kind dt. */
void plinth_rms_norm(int dt, const void *x, void *residual, const void *w, void *out, int64_t T, int64_t H,
                     float eps) {
    norm_ctx c = {x, residual, w, out, H, eps, 1, H, dt};
    parallel_for(rms_norm_range, &c, T, grain_for(T, 16));
}

/* out[T, Hh, D] (contiguous) = RMSNorm of each head of x [T, Hh, D] over its D values times w [D]:
 * heads dense, tokens sx elements apart (a view of a fused QKV projection); D a multiple of 8; every
 * tensor of kind dt. */
void plinth_rms_norm_heads(int dt, const void *x, int64_t sx, const void *w, void *out, int64_t T, int64_t Hh,
                           int64_t D, float eps) {
    norm_ctx c = {x, NULL, w, out, D, eps, Hh, sx, dt};
    parallel_for(rms_norm_range, &c, T * Hh, grain_for(T * Hh, 16));
}

typedef struct {
    const void *x;
    void *out;
    int64_t I;
    int gelu; /* 0: silu(g) = g sigmoid(g); 1: GELU's tanh form, g sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)) */
    int dt;   /* the element kind of x and out */
} silu_ctx;

/* 2 sqrt(2 / pi): 0.5 (1 + tanh(u)) = sigmoid(2u), so GELU-tanh is g / (1 + e^(-2u)) */
#define GELU_2C 1.5957691216057308f

static inline __attribute__((always_inline)) void silu_rows(const silu_ctx *c, int64_t begin, int64_t end, int dt) {
    const __m256 one = _mm256_set1_ps(1.0f), k3 = _mm256_set1_ps(0.044715f), c2 = _mm256_set1_ps(-GELU_2C);
    for (int64_t t = begin; t < end; t++) {
        const void *g = wat(c->x, t * 2 * c->I, dt), *u = wat(c->x, t * 2 * c->I + c->I, dt);
        void *o = (void *)wat(c->out, t * c->I, dt);
        int64_t i = 0;
#if PLINTH_AVX512
        const __m512 one16 = _mm512_set1_ps(1.0f), k3_16 = _mm512_set1_ps(0.044715f), c2_16 = _mm512_set1_ps(-GELU_2C);
        for (; i + 16 <= c->I; i += 16) {
            __m512 gv = load16w(g, i, dt);
            __m512 arg = c->gelu ? _mm512_mul_ps(c2_16, _mm512_fmadd_ps(_mm512_mul_ps(k3_16, gv), _mm512_mul_ps(gv, gv), gv))
                                 : _mm512_sub_ps(_mm512_setzero_ps(), gv);
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one16, exp512(arg)));
            store16w(o, i, _mm512_mul_ps(sv, load16w(u, i, dt)), dt);
        }
#endif
        for (; i + 8 <= c->I; i += 8) {
            __m256 gv = load8w(g, i, dt);
            __m256 arg = c->gelu ? _mm256_mul_ps(c2, _mm256_fmadd_ps(_mm256_mul_ps(k3, gv), _mm256_mul_ps(gv, gv), gv))
                                 : _mm256_sub_ps(_mm256_setzero_ps(), gv);
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(arg)));
            store8w(o, i, _mm256_mul_ps(sv, load8w(u, i, dt)), dt);
        }
        for (; i < c->I; i++) {
            float gi = load1w(g, i, dt);
            float arg = c->gelu ? -GELU_2C * (gi + 0.044715f * gi * gi * gi) : -gi;
            store1w(o, i, gi / (1.0f + expf(arg)) * load1w(u, i, dt), dt);
        }
    }
}

static void silu_range(void *p, int64_t begin, int64_t end) {
    silu_ctx *c = (silu_ctx *)p;
    if (c->dt == W_BF16)
        silu_rows(c, begin, end, W_BF16);
    else if (c->dt == W_F16)
        silu_rows(c, begin, end, W_F16);
    else
        silu_rows(c, begin, end, W_F32);
}

/* out[T, I] = silu(x[:, :I]) * x[:, I:] for x [T, 2I], elements of kind dt (rounded once). */
void plinth_silu_and_mul(int dt, const void *x, void *out, int64_t T, int64_t I) {
    silu_ctx c = {x, out, I, 0, dt};
    parallel_for(silu_range, &c, T, grain_for(T, 8));
}

/* out[T, I] = gelu_tanh(x[:, :I]) * x[:, I:] for x [T, 2I] (Gemma 3's gated MLP), elements of kind dt. */
void plinth_gelu_tanh_and_mul(int dt, const void *x, void *out, int64_t T, int64_t I) {
    silu_ctx c = {x, out, I, 1, dt};
    parallel_for(silu_range, &c, T, grain_for(T, 8));
}

typedef struct {
    const void *src;
    int64_t ss;
    void *dst;
    int64_t H;
    int st, dt;
} convert_ctx;

static void convert_range(void *p, int64_t begin, int64_t end) {
    convert_ctx *c = (convert_ctx *)p;
    for (int64_t t = begin; t < end; t++) {
        const void *s = wat(c->src, t * c->ss, c->st);
        void *d = (char *)c->dst + t * c->H * (int64_t)wsize(c->dt);
        int64_t i = 0;
#if PLINTH_AVX512
        if (c->st == W_F32 && c->dt == W_BF16)
            for (; i + 16 <= c->H; i += 16) store16w(d, i, load16w(s, i, W_F32), W_BF16);
        else if (c->st == W_BF16 && c->dt == W_F32)
            for (; i + 16 <= c->H; i += 16) store16w(d, i, load16w(s, i, W_BF16), W_F32);
#endif
        for (; i + 8 <= c->H; i += 8) store8w(d, i, load8w(s, i, c->st), c->dt);
        for (; i < c->H; i++) store1w(d, i, load1w(s, i, c->st), c->dt);
    }
}

/* dst [T, H] (contiguous, elements of kind dt) = src [T, H] (kind st, rows ss elements apart), each
 * value widened exactly or rounded as torch rounds: the boundary between a 16-bit model's tensors and
 * the fp32 kernels, recorded in step graphs like the kernels themselves. */
void plinth_convert(int st, const void *src, int64_t ss, int dt, void *dst, int64_t T, int64_t H) {
    convert_ctx c = {src, ss, dst, H, st, dt};
    parallel_for(convert_range, &c, T, grain_for(T, 64));
}

/* Structured output: logits[s, t] = -inf where bit t % 32 of word t // 32 of row s of the bitmask
 * [S, W] is clear (llguidance's layout). One pass on the calling thread: a constrained step masks a
 * few rows of the vocabulary, far less work than waking the pool for. Words with every bit set
 * (the common case in free-text parts of a grammar) are skipped. */
void plinth_apply_token_bitmask(float *logits, int64_t stride, const int32_t *bitmask, int64_t S, int64_t V,
                                int64_t W) {
    for (int64_t s = 0; s < S; s++) {
        float *row = logits + s * stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + s * W);
        for (int64_t w = 0; w < W && w * 32 < V; w++) {
            uint32_t b = bits[w];
            if (b == 0xFFFFFFFFu) continue;
            int64_t base = w * 32, n = V - base < 32 ? V - base : 32;
            for (int64_t i = 0; i < n; i++)
                if (!((b >> i) & 1u)) row[base + i] = -INFINITY;
        }
    }
}

/* The index of the first maximum of the n floats at x, a NaN counting as the maximum (torch's argmax):
 * one pass for the maximum (NaNs noted apart: max_ps drops them), a scalar search for the first NaN
 * where there is one, else a second pass for the first element equal to the maximum (-0 and +0
 * equal, as torch's comparison has them). */
static int64_t argmax_row(const float *x, int64_t n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
        m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b), m2 = _mm256_max_ps(m2, c), m3 = _mm256_max_ps(m3, d);
    }
    float tail[8], best = -INFINITY;
    int any_nan = _mm256_movemask_ps(nan) != 0;
    _mm256_storeu_ps(tail, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (int t = 0; t < 8; t++) best = tail[t] > best ? tail[t] : best;
    for (; i < n; i++) {
        if (x[i] != x[i]) any_nan = 1;
        else if (x[i] > best) best = x[i];
    }
    if (any_nan) {
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    }
    __m256 target = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0; /* not reached: some element equals the maximum (an all -inf row: the first) */
}

typedef struct {
    const float *x;
    int64_t stride, width;
    int64_t *out;
} argmax_ctx;

static void argmax_range(void *p, int64_t begin, int64_t end) {
    const argmax_ctx *c = (const argmax_ctx *)p;
    for (int64_t r = begin; r < end; r++) c->out[r] = argmax_row(c->x + r * c->stride, c->width);
}

/* out[r] = the index of the first maximum of row r of x (rows floats stride apart, width >= 1 each; a
 * NaN counts as the maximum): torch's argmax(dim=-1). A single row runs on the calling thread (a
 * vocabulary's 200 KB, just written by the LM head, is less work than waking the pool for). */
void plinth_argmax_rows(const float *x, int64_t stride, int64_t rows, int64_t width, int64_t *out) {
    argmax_ctx c = {x, stride, width, out};
    if (rows == 1) {
        argmax_range(&c, 0, 1);
        return;
    }
    parallel_for(argmax_range, &c, rows, grain_for(rows, 1));
}

typedef struct {
    const void *x;
    int64_t sx;
    void *out;
    const int64_t *positions;
    const float *cos_sin;
    int64_t H, D, rotary_dim;
    int dt; /* the element kind of x and out (cos_sin is fp32) */
} rotary_ctx;

static inline __attribute__((always_inline)) void rotary_rows(const rotary_ctx *c, int64_t begin, int64_t end,
                                                              int dt) {
    int64_t H = c->H, D = c->D, rd = c->rotary_dim, half = rd / 2;
    for (int64_t t = begin; t < end; t++) {
        const float *cs = c->cos_sin + c->positions[t] * rd;
        for (int64_t h = 0; h < H; h++) {
            const void *r = wat(c->x, t * c->sx + h * D, dt);
            void *o = (void *)wat(c->out, (t * H + h) * D, dt);
            for (int64_t i = 0; i < half; i++) {
                float x1 = load1w(r, i, dt), x2 = load1w(r, i + half, dt), cv = cs[i], sv = cs[half + i];
                store1w(o, i, x1 * cv - x2 * sv, dt);
                store1w(o, i + half, x2 * cv + x1 * sv, dt);
            }
            for (int64_t i = rd; i < D; i++) store1w(o, i, load1w(r, i, dt), dt);
        }
    }
}

static void rotary_range(void *p, int64_t begin, int64_t end) {
    rotary_ctx *c = (rotary_ctx *)p;
    if (c->dt == W_BF16)
        rotary_rows(c, begin, end, W_BF16);
    else if (c->dt == W_F16)
        rotary_rows(c, begin, end, W_F16);
    else
        rotary_rows(c, begin, end, W_F32);
}

/*
 * Rotary (NeoX rotate-half) of x [T, H, D] (row stride sx elements between tokens, heads dense) into
 * out [T, H, D] contiguous, both of kind dt: the first rotary_dim features of every head are rotated
 * (in fp32, rounded once), the rest copied. cos_sin is fp32 [P, rotary_dim]: cos in the first half,
 * sin in the second.
 */
void plinth_rotary(int dt, const void *x, int64_t sx, void *out, const int64_t *positions, const float *cos_sin,
                   int64_t T, int64_t H, int64_t D, int64_t rotary_dim) {
    rotary_ctx c = {x, sx, out, positions, cos_sin, H, D, rotary_dim, dt};
    parallel_for(rotary_range, &c, T, grain_for(T, 32));
}

/*
 * Store k and v ([T, Hk, D] fp32, row strides sk and sv floats between tokens, heads dense) into the
 * head-major cache [2, num_blocks, Hk, bs, D] of element kind kt (W_F32, W_BF16, W_F16 or W_F8: rounded
 * as torch rounds, so the cache holds k.to(cache dtype) bit for bit) at slot_mapping [T]; slots < 0
 * are skipped.
 */
static inline __attribute__((always_inline)) void write_kv_w(const float *k, int64_t sk, const float *v, int64_t sv,
                                                             void *cache, const int64_t *slot_mapping, int64_t T,
                                                             int64_t Hk, int64_t D, int64_t num_blocks, int64_t bs,
                                                             int kt) {
    int64_t half = num_blocks * Hk * bs * D; /* elements from a K row to its V row */
    for (int64_t t = 0; t < T; t++) {
        if (slot_mapping[t] < 0) continue;
        int64_t blk = slot_mapping[t] / bs, off = slot_mapping[t] % bs;
        for (int64_t h = 0; h < Hk; h++) {
            int64_t at = ((blk * Hk + h) * bs + off) * D; /* the element index of this K row */
            const float *ks = k + t * sk + h * D, *vs = v + t * sv + h * D;
            if (kt == W_F32) {
                memcpy((float *)cache + at, ks, (size_t)D * sizeof(float));
                memcpy((float *)cache + at + half, vs, (size_t)D * sizeof(float));
                continue;
            }
            int64_t d = 0;
            for (; d + 8 <= D; d += 8) {
                store8w(cache, at + d, _mm256_loadu_ps(ks + d), kt);
                store8w(cache, at + half + d, _mm256_loadu_ps(vs + d), kt);
            }
            for (; d < D; d++) store1w(cache, at + d, ks[d], kt), store1w(cache, at + half + d, vs[d], kt);
        }
    }
}

void plinth_write_kv(int kt, const float *k, int64_t sk, const float *v, int64_t sv, void *cache,
                     const int64_t *slot_mapping, int64_t T, int64_t Hk, int64_t D, int64_t num_blocks, int64_t bs) {
    if (kt == W_BF16) write_kv_w(k, sk, v, sv, cache, slot_mapping, T, Hk, D, num_blocks, bs, W_BF16);
    else if (kt == W_F16) write_kv_w(k, sk, v, sv, cache, slot_mapping, T, Hk, D, num_blocks, bs, W_F16);
    else if (kt == W_F8) write_kv_w(k, sk, v, sv, cache, slot_mapping, T, Hk, D, num_blocks, bs, W_F8);
    else write_kv_w(k, sk, v, sv, cache, slot_mapping, T, Hk, D, num_blocks, bs, W_F32);
}

/* ---------------------------------------------------------------------------------------------
 * Decode attention straight over the paged, head-major cache [2, num_blocks, Hk, bs, D] of element
 * kind kt (W_F32, or W_BF16 / W_F16: half the bytes a step reads, W_F8 a quarter; each K and V element
 * widened to fp32 exactly, as it is loaded, or for W_F8 once per kv head into L1 (attend_rows_w: to fp32
 * rows, or to bf16 rows in the AVX-512 build, widened again as loaded), so the
 * sums are the fp32 cache's of the same values bit for bit).
 * q [B, H, D] fp32 (row stride sq floats between sequences, heads dense), out [B, H, D] fp32
 * contiguous. One item per (sequence, kv head): its group of query heads scores every visible key
 * once, then sums V. window > 0 keeps only the last `window` positions; soft_cap > 0 applies
 * cap * tanh(s / cap).
 */
typedef struct {
    const float *q;
    int64_t sq;
    const void *cache; /* elements of the kind (kt) the range function was made for */
    const int32_t *block_tables;
    int64_t max_blocks;
    const int32_t *seq_lens;
    float *out;
    int64_t B, H, Hk, D, bs, num_blocks;
    float scale;
    int64_t window;
    float soft_cap;
    int seq_items; /* decode: items are whole sequences (every kv head), not (sequence, kv head) */
    _Atomic int failed;
    int amx; /* a bf16 cache's scores on AMX tiles where the queries are bf16 values */
} attn_ctx;

#define DECODE_SEQ_ITEMS 4

/* [sum(a0), ..., sum(a7)] */
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* [s0 s1 s2 s3 | s0 s1 s2 s3] halves */
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Pages are scattered 2-12 KiB runs: the hardware prefetcher does not cross into the next one, so
 * the attention loops prefetch the pages ahead in software: the run of the page PF_DIST ahead in the
 * sweep (the keys' pages, then the values') is queued as a page's reading begins, and each step of the
 * inner loops prefetches its share of the queue's lines (PF_PERCENT of the lines it reads itself),
 * into L2. Into L2, not L1, by measurement (presumably a core keeps more misses to L2 in flight than
 * to L1, whose few the loads need too); whole pages at once into L1 had stalled the loads. Measured
 * (AMD EPYC Zen 4, 2 threads, benchmarks/attention.py --layers 30 --processes 2, SmolLM2's heads,
 * caches from memory, against the page-ahead prefetch into L1 at a line per step before it): bf16
 * cache 64 x 225 x 1 1.46x, 64 x 2048 x 1 1.53x (48 -> 74 GFLOP/s, 16 -> 25 GB/s), 2 x 8192 x 1 (kv head items) 1.27x;
 * fp32 cache 1.36-1.52x; fp8 1.12-1.23x; the AVX2 build's fp32 1.21-1.27x. Caches held in L3 (one
 * layer): 0.89-1.00x. The same queue into L1: 0.92x; 100-150% alike; 250% three pages ahead 1.25x. */
#define PF_DIST 2
#define PF_PERCENT 150

typedef struct {
    const char *p, *end;   /* the next line to prefetch, and the end of its run */
    const char *p2, *end2; /* the run queued after it */
    int rate, credit;      /* lines a step, in 256ths (set for each loop), and those owed */
} page_prefetch;

/* queue the run of `bytes` at `run` (NULL: none) behind the one being prefetched; a run still queued
 * behind it moves up, and what was left of the older run is dropped: the loops are reading it now */
static inline void prefetch_queue(page_prefetch *pf, const void *run, int64_t bytes) {
    if (!run) return;
    if (pf->p2 < pf->end2) pf->p = pf->p2, pf->end = pf->end2, pf->p2 = pf->end2 = NULL;
    if (pf->p < pf->end) pf->p2 = (const char *)run, pf->end2 = (const char *)run + bytes;
    else pf->p = (const char *)run, pf->end = (const char *)run + bytes;
}

/* a step's share of the queued runs' lines, prefetched into L2 */
static inline __attribute__((always_inline)) void prefetch_step(page_prefetch *pf) {
    for (pf->credit += pf->rate; pf->credit >= 256; pf->credit -= 256) {
        if (pf->p >= pf->end) {
            if (pf->p2 >= pf->end2) {
                pf->credit = 0;
                return;
            }
            pf->p = pf->p2, pf->end = pf->end2, pf->p2 = pf->end2 = NULL;
        }
        _mm_prefetch(pf->p, _MM_HINT_T1);
        pf->p += 64;
    }
}

#if !PLINTH_AVX512
/* The AVX2 build: scores of query q against the 8 key rows at k (consecutive positions of one page, D elements of
 * kind kt apart). */
static inline __attribute__((always_inline)) __m256 dot8(const float *q, const void *k, int64_t D, page_prefetch *pf,
                                                         int kt) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int64_t d = 0;
    for (; d < D; d += 8) {
        prefetch_step(pf);
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, load8w(k, d, kt), a0);
        a1 = _mm256_fmadd_ps(qv, load8w(k, D + d, kt), a1);
        a2 = _mm256_fmadd_ps(qv, load8w(k, 2 * D + d, kt), a2);
        a3 = _mm256_fmadd_ps(qv, load8w(k, 3 * D + d, kt), a3);
        a4 = _mm256_fmadd_ps(qv, load8w(k, 4 * D + d, kt), a4);
        a5 = _mm256_fmadd_ps(qv, load8w(k, 5 * D + d, kt), a5);
        a6 = _mm256_fmadd_ps(qv, load8w(k, 6 * D + d, kt), a6);
        a7 = _mm256_fmadd_ps(qv, load8w(k, 7 * D + d, kt), a7);
    }
    return hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* The AVX2 build: o[0..64) += sum over n positions of p[pos] * v[pos * D + 0..64) (elements of kind
 * kt), in eight registers */
static inline __attribute__((always_inline)) void pv64(const void *v, int64_t D, const float *p, int64_t n, float *o,
                                                       page_prefetch *pf, int kt) {
    __m256 o0 = _mm256_loadu_ps(o), o1 = _mm256_loadu_ps(o + 8), o2 = _mm256_loadu_ps(o + 16);
    __m256 o3 = _mm256_loadu_ps(o + 24), o4 = _mm256_loadu_ps(o + 32), o5 = _mm256_loadu_ps(o + 40);
    __m256 o6 = _mm256_loadu_ps(o + 48), o7 = _mm256_loadu_ps(o + 56);
    for (int64_t i = 0; i < n; i++, v = wat(v, D, kt)) {
        prefetch_step(pf);
        __m256 w = _mm256_broadcast_ss(p + i);
        o0 = _mm256_fmadd_ps(w, load8w(v, 0, kt), o0), o1 = _mm256_fmadd_ps(w, load8w(v, 8, kt), o1);
        o2 = _mm256_fmadd_ps(w, load8w(v, 16, kt), o2), o3 = _mm256_fmadd_ps(w, load8w(v, 24, kt), o3);
        o4 = _mm256_fmadd_ps(w, load8w(v, 32, kt), o4), o5 = _mm256_fmadd_ps(w, load8w(v, 40, kt), o5);
        o6 = _mm256_fmadd_ps(w, load8w(v, 48, kt), o6), o7 = _mm256_fmadd_ps(w, load8w(v, 56, kt), o7);
    }
    _mm256_storeu_ps(o, o0), _mm256_storeu_ps(o + 8, o1), _mm256_storeu_ps(o + 16, o2), _mm256_storeu_ps(o + 24, o3);
    _mm256_storeu_ps(o + 32, o4), _mm256_storeu_ps(o + 40, o5), _mm256_storeu_ps(o + 48, o6), _mm256_storeu_ps(o + 56, o7);
}


/* Its 16 registers keep one query head at a time (the AVX-512 build's versions below take up to 3) */
#define SHARED_HEADS 1
#define PF_STEP_FLOATS 8 /* of D, a key step of dot8 reads */
static inline __attribute__((always_inline)) void dot8_heads_any(int nh, const float *q, const void *k, int64_t D,
                                                                 page_prefetch *pf, int kt, float *out,
                                                                 int64_t stride) {
    (void)nh, (void)stride;
    _mm256_storeu_ps(out, dot8(q, k, D, pf, kt));
}
static inline __attribute__((always_inline)) void pv64_heads_any(int nh, const void *v, int64_t D, const float *p,
                                                                 int64_t ps, int64_t n, float *o, page_prefetch *pf,
                                                                 int kt) {
    (void)nh, (void)ps;
    pv64(v, D, p, n, o, pf, kt);
}
#else
/* Up to this many query heads of a group read each key and value element of a page together (the
 * AVX-512 build: 8 positions x 3 heads of scores are 24 of its 32 registers), so a 16-bit or fp8
 * element is widened once per 3 heads, not once per head. Measured (AMD EPYC Zen 4, 2 threads,
 * SmolLM2's 9/3 x 64 heads, bf16-valued queries, benchmarks/attention.py --against the per-head loops
 * --processes 6, medians): bf16 cache 64 x 225 x 1 1.22x (1.19-1.30x), 1 x 4096 x 1 1.29x, 64 x 2048 x 1
 * (from memory) 0.98x; fp8 cache 1.13-1.17x (4 processes); fp32 cache 0.98-1.04x (bound by memory).
 * The AVX2 build's 16 registers keep one head at a time. */
#define SHARED_HEADS 3
#define PF_STEP_FLOATS 16 /* of D, a key step of dot8_heads reads */
/* Scores of nh (1..SHARED_HEADS, a constant where inlined) query heads at once (query head h at
 * q + h * D) against the 8 key rows at k (consecutive positions of one page, D elements of kind kt
 * apart), head h's 8 scores stored at out + h * stride: each key element is loaded, and a 16-bit or
 * widened fp8 one widened, once for the nh heads. Each score: 16 of D a step, the halves folded,
 * then the 8-wide steps of a D that is not a multiple of 16 and the sums (one prefetch step per
 * head and step): one head's value is what the per-head loop computed, bit for bit. */
static inline __attribute__((always_inline)) void dot8_heads(int nh, const float *q, const void *k, int64_t D,
                                                             page_prefetch *pf, int kt, float *out, int64_t stride) {
    /* z<h><p>: head h, position p (explicit registers: arrays of them were kept in memory) */
    __m512 z00 = _mm512_setzero_ps(), z01 = z00, z02 = z00, z03 = z00, z04 = z00, z05 = z00, z06 = z00, z07 = z00;
    __m512 z10 = z00, z11 = z00, z12 = z00, z13 = z00, z14 = z00, z15 = z00, z16 = z00, z17 = z00;
    __m512 z20 = z00, z21 = z00, z22 = z00, z23 = z00, z24 = z00, z25 = z00, z26 = z00, z27 = z00;
#define D8_POS(p)                                                                                              \
    {                                                                                                          \
        __m512 kv = load16w(k, p * D + d, kt);                                                                 \
        z0##p = _mm512_fmadd_ps(q0, kv, z0##p);                                                                \
        if (nh > 1) z1##p = _mm512_fmadd_ps(q1, kv, z1##p);                                                    \
        if (nh > 2) z2##p = _mm512_fmadd_ps(q2, kv, z2##p);                                                    \
    }
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        __m512 q0 = _mm512_loadu_ps(q + d), q1 = q0, q2 = q0;
        prefetch_step(pf);
        if (nh > 1) q1 = _mm512_loadu_ps(q + D + d);
        if (nh > 2) q2 = _mm512_loadu_ps(q + 2 * D + d);
        D8_POS(0) D8_POS(1) D8_POS(2) D8_POS(3) D8_POS(4) D8_POS(5) D8_POS(6) D8_POS(7)
    }
#undef D8_POS
#define D8_FOLD(h)                                                                                             \
    __m256 a##h##0 = fold_halves(z##h##0), a##h##1 = fold_halves(z##h##1), a##h##2 = fold_halves(z##h##2);     \
    __m256 a##h##3 = fold_halves(z##h##3), a##h##4 = fold_halves(z##h##4), a##h##5 = fold_halves(z##h##5);     \
    __m256 a##h##6 = fold_halves(z##h##6), a##h##7 = fold_halves(z##h##7);
    D8_FOLD(0) D8_FOLD(1) D8_FOLD(2)
#undef D8_FOLD
#define D8_POS(p)                                                                                              \
    {                                                                                                          \
        __m256 kv = load8w(k, p * D + d, kt);                                                                  \
        a0##p = _mm256_fmadd_ps(q0, kv, a0##p);                                                                \
        if (nh > 1) a1##p = _mm256_fmadd_ps(q1, kv, a1##p);                                                    \
        if (nh > 2) a2##p = _mm256_fmadd_ps(q2, kv, a2##p);                                                    \
    }
    for (; d < D; d += 8) { /* the last 8 of a D that is not a multiple of 16 */
        __m256 q0 = _mm256_loadu_ps(q + d), q1 = q0, q2 = q0;
        prefetch_step(pf);
        if (nh > 1) q1 = _mm256_loadu_ps(q + D + d);
        if (nh > 2) q2 = _mm256_loadu_ps(q + 2 * D + d);
        D8_POS(0) D8_POS(1) D8_POS(2) D8_POS(3) D8_POS(4) D8_POS(5) D8_POS(6) D8_POS(7)
    }
#undef D8_POS
    _mm256_storeu_ps(out, hsum8x8(a00, a01, a02, a03, a04, a05, a06, a07));
    if (nh > 1) _mm256_storeu_ps(out + stride, hsum8x8(a10, a11, a12, a13, a14, a15, a16, a17));
    if (nh > 2) _mm256_storeu_ps(out + 2 * stride, hsum8x8(a20, a21, a22, a23, a24, a25, a26, a27));
}

/* o[h][0..64) += sum over n positions of p[h * ps + pos] * v[pos * D + 0..64) for nh (1..SHARED_HEADS)
 * heads at once (head h's output slice at o + h * D), each value element loaded (and widened) once
 * for the nh heads; per output one FMA chain over the positions in order, as the AVX2 build's. */
static inline __attribute__((always_inline)) void pv64_heads(int nh, const void *v, int64_t D, const float *p,
                                                             int64_t ps, int64_t n, float *o, page_prefetch *pf,
                                                             int kt) {
    __m512 z00 = _mm512_loadu_ps(o), z01 = _mm512_loadu_ps(o + 16), z02 = _mm512_loadu_ps(o + 32);
    __m512 z03 = _mm512_loadu_ps(o + 48), z10 = z00, z11 = z00, z12 = z00, z13 = z00, z20 = z00, z21 = z00;
    __m512 z22 = z00, z23 = z00;
    if (nh > 1)
        z10 = _mm512_loadu_ps(o + D), z11 = _mm512_loadu_ps(o + D + 16), z12 = _mm512_loadu_ps(o + D + 32),
        z13 = _mm512_loadu_ps(o + D + 48);
    if (nh > 2)
        z20 = _mm512_loadu_ps(o + 2 * D), z21 = _mm512_loadu_ps(o + 2 * D + 16),
        z22 = _mm512_loadu_ps(o + 2 * D + 32), z23 = _mm512_loadu_ps(o + 2 * D + 48);
#define PV_HEAD(h)                                                                                             \
    {                                                                                                          \
        __m512 w = _mm512_set1_ps(p[h * ps + i]);                                                              \
        z##h##0 = _mm512_fmadd_ps(w, v0, z##h##0), z##h##1 = _mm512_fmadd_ps(w, v1, z##h##1);                  \
        z##h##2 = _mm512_fmadd_ps(w, v2, z##h##2), z##h##3 = _mm512_fmadd_ps(w, v3, z##h##3);                  \
    }
    for (int64_t i = 0; i < n; i++, v = wat(v, D, kt)) {
        __m512 v0 = load16w(v, 0, kt), v1 = load16w(v, 16, kt), v2 = load16w(v, 32, kt), v3 = load16w(v, 48, kt);
        prefetch_step(pf);
        PV_HEAD(0)
        if (nh > 1) PV_HEAD(1)
        if (nh > 2) PV_HEAD(2)
    }
#undef PV_HEAD
    _mm512_storeu_ps(o, z00), _mm512_storeu_ps(o + 16, z01), _mm512_storeu_ps(o + 32, z02), _mm512_storeu_ps(o + 48, z03);
    if (nh > 1)
        _mm512_storeu_ps(o + D, z10), _mm512_storeu_ps(o + D + 16, z11), _mm512_storeu_ps(o + D + 32, z12),
            _mm512_storeu_ps(o + D + 48, z13);
    if (nh > 2)
        _mm512_storeu_ps(o + 2 * D, z20), _mm512_storeu_ps(o + 2 * D + 16, z21), _mm512_storeu_ps(o + 2 * D + 32, z22),
            _mm512_storeu_ps(o + 2 * D + 48, z23);
}

/* dot8_heads and pv64_heads for a run-time nh and element kind, out of line: inlined into the
 * attention loops their 24-28 live registers were partly kept on the stack */
#define HEADS_SWITCH(call, kind)                                                                               \
    switch (nh) {                                                                                              \
    case 3: call(3, kind); break;                                                                              \
    case 2: call(2, kind); break;                                                                              \
    default: call(1, kind); break;                                                                             \
    }
#define KINDS_SWITCH(call)                                                                                     \
    switch (kt) {                                                                                              \
    case W_BF16: HEADS_SWITCH(call, W_BF16) break;                                                             \
    case W_F16: HEADS_SWITCH(call, W_F16) break;                                                               \
    default: HEADS_SWITCH(call, W_F32) break;                                                                  \
    }
static __attribute__((noinline)) void dot8_heads_any(int nh, const float *q, const void *k, int64_t D,
                                                     page_prefetch *pf, int kt, float *out, int64_t stride) {
#define CALL(n, kind) dot8_heads(n, q, k, D, pf, kind, out, stride)
    KINDS_SWITCH(CALL)
#undef CALL
}
static __attribute__((noinline)) void pv64_heads_any(int nh, const void *v, int64_t D, const float *p, int64_t ps,
                                                     int64_t n, float *o, page_prefetch *pf, int kt) {
#define CALL(h, kind) pv64_heads(h, v, D, p, ps, n, o, pf, kind)
    KINDS_SWITCH(CALL)
#undef CALL
}
#undef KINDS_SWITCH
#undef HEADS_SWITCH
#endif

/* the same for one 8-wide slice (head sizes not a multiple of 64) */
static inline __attribute__((always_inline)) void pv8(const void *v, int64_t D, const float *p, int64_t n, float *o,
                                                      int kt) {
    __m256 acc = _mm256_loadu_ps(o);
    for (int64_t i = 0; i < n; i++, v = wat(v, D, kt))
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i), load8w(v, 0, kt), acc);
    _mm256_storeu_ps(o, acc);
}

/* Up to ATTN_ROWS consecutive query rows of one sequence are attended together: each block of 8
 * keys and each page of values is read from memory once and stays in L1 for every row and head. */
#define ATTN_ROWS 4
/* An fp8 cache's K and V are widened once into fp32 rows (at most WIDEN_ROWS of them at a time) that
 * the fp32 loops then read from L1 for every query row and head of the group: widened as loaded, an
 * element would be widened once per query head, and fp8's widening costs several operations (bf16's
 * and fp16's one or two are left as they are). */
#define WIDEN_ROWS 16
#if PLINTH_AVX512
/* The AVX-512 build widens fp8 rows to bf16 instead (exact: every e4m3 value is a bf16 value), half
 * the bytes in L1, by table: the bf16 bits of each fp8 magnitude (the low 7 bits; 0x7F, NaN, is bf16's
 * quiet NaN), generated from torch's own conversion. The bf16 loops then read them as they read a bf16
 * cache, with the fp32 loops' FMA chains, so the sums are unchanged bit for bit. AMD EPYC Zen 4, 2
 * threads, benchmarks/attention.py --cache-dtype float8_e4m3fn --bf16-queries --against the fp32 rows
 * --processes 8: 64 x 2048 x 1 1.07x (1.05-1.11x), 64 x 225 x 1 1.09x (1.03-1.14x), 1 x 4096 x 1 1.05x
 * (1.02-1.06x), faster in every process. */
static const uint16_t F8_BF16[128] __attribute__((aligned(64))) = {
    0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60, 0x3C80, 0x3C90, 0x3CA0, 0x3CB0, 0x3CC0, 0x3CD0, 0x3CE0, 0x3CF0,
    0x3D00, 0x3D10, 0x3D20, 0x3D30, 0x3D40, 0x3D50, 0x3D60, 0x3D70, 0x3D80, 0x3D90, 0x3DA0, 0x3DB0, 0x3DC0, 0x3DD0, 0x3DE0, 0x3DF0,
    0x3E00, 0x3E10, 0x3E20, 0x3E30, 0x3E40, 0x3E50, 0x3E60, 0x3E70, 0x3E80, 0x3E90, 0x3EA0, 0x3EB0, 0x3EC0, 0x3ED0, 0x3EE0, 0x3EF0,
    0x3F00, 0x3F10, 0x3F20, 0x3F30, 0x3F40, 0x3F50, 0x3F60, 0x3F70, 0x3F80, 0x3F90, 0x3FA0, 0x3FB0, 0x3FC0, 0x3FD0, 0x3FE0, 0x3FF0,
    0x4000, 0x4010, 0x4020, 0x4030, 0x4040, 0x4050, 0x4060, 0x4070, 0x4080, 0x4090, 0x40A0, 0x40B0, 0x40C0, 0x40D0, 0x40E0, 0x40F0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4190, 0x41A0, 0x41B0, 0x41C0, 0x41D0, 0x41E0, 0x41F0,
    0x4200, 0x4210, 0x4220, 0x4230, 0x4240, 0x4250, 0x4260, 0x4270, 0x4280, 0x4290, 0x42A0, 0x42B0, 0x42C0, 0x42D0, 0x42E0, 0x42F0,
    0x4300, 0x4310, 0x4320, 0x4330, 0x4340, 0x4350, 0x4360, 0x4370, 0x4380, 0x4390, 0x43A0, 0x43B0, 0x43C0, 0x43D0, 0x43E0, 0x7FC0};
#define F8_WIDE W_BF16 /* the kind of an fp8 cache's widened rows */
/* n (a multiple of 8) fp8 values at src as bf16 at dst: 32 at a time two vpermt2w look up the magnitude
 * in the table's halves (its bit 6 picks one), the sign moved up into bit 15; ~8 operations per 32
 * values where widening to fp32 (load16w) takes ~10 per 16. The tail of 8s through fp32. */
static inline __attribute__((always_inline)) void widen_rows(const void *src, int64_t n, void *dst) {
    const uint8_t *b = (const uint8_t *)src;
    uint16_t *w = (uint16_t *)dst;
    const __m512i t0 = _mm512_load_si512(F8_BF16), t1 = _mm512_load_si512(F8_BF16 + 32);
    const __m512i t2 = _mm512_load_si512(F8_BF16 + 64), t3 = _mm512_load_si512(F8_BF16 + 96);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + i)));
        __m512i lo = _mm512_permutex2var_epi16(t0, x, t1), hi = _mm512_permutex2var_epi16(t2, x, t3);
        __m512i m = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
        /* m | (x << 8 & 0x8000): the sign */
        m = _mm512_ternarylogic_epi32(m, _mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000), 0xF8);
        _mm512_storeu_si512(w + i, m);
    }
    for (; i < n; i += 8) { /* the fp32 widening's bits shifted down: exact (a NaN stays a NaN) */
        __m256i h = _mm256_srli_epi32(_mm256_castps_si256(load8w(src, i, W_F8)), 16);
        h = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08); /* the 8 words in order, low half */
        _mm_storeu_si128((__m128i *)(w + i), _mm256_castsi256_si128(h));
    }
}
#else
#define F8_WIDE W_F32
/* n (a multiple of 8) fp8 values at src as fp32 at dst */
static inline __attribute__((always_inline)) void widen_rows(const void *src, int64_t n, void *dst) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps((float *)dst + i, load8w(src, i, W_F8));
}
#endif

/* Attention of R <= ATTN_ROWS query rows of one sequence for the nkh kv heads kh0.. over the pages
 * of `table`: row r (positions last[0] < ... < last[R-1]) sees positions [first_r, last[r]]
 * (first_r > 0 only with a window), with the query heads of those kv heads at q[r] and its output at
 * o[r] (heads D apart). Scores for 8 positions of a page at a time, a vector exp for the softmax,
 * then the weighted sum of values page by page. A page holds its kv heads' rows one head after the
 * other, so several kv heads together read one longer run of memory per page (measured: random 12 KiB
 * runs read 1.6x faster than 4 KiB ones). `scores` holds R * nkh * group * n floats, n the span from
 * the first row's first position to the last row's last. kt, the cache's element kind, is a constant
 * in each inlined copy: each kind has its own decode and prefill range functions, so the fp32 ones
 * hold the code they held before 16-bit caches (one copy each, laid out as before). */
/* where the item after this one starts reading (attend_rows_w's `next`: NULL where none is known) */
typedef struct {
    const int32_t *table;    /* its sequence's block table */
    int64_t kh0, page, pages; /* its first kv head, the table index of its first page, and its pages */
} next_sweep;

static inline __attribute__((always_inline)) void attend_rows_w(const attn_ctx *c, const int32_t *table, int64_t kh0,
                                                                int64_t nkh, int64_t R, const float *const *q,
                                                                float *const *o, const int64_t *last, float *scores,
                                                                const next_sweep *next, int kt) {
    int64_t Hk = c->Hk, D = c->D, bs = c->bs, group = c->H / Hk, heads = nkh * group;
    int64_t esize = (int64_t)wsize(kt); /* bytes per cache element */
    int rk = kt == W_F8 ? F8_WIDE : kt; /* the kind the inner loops read: fp8 rows widened first */
    float wide[kt == W_F8 ? WIDEN_ROWS * D : 1];
    const void *kcache = c->cache, *vcache = wat(c->cache, c->num_blocks * Hk * bs * D, kt);
    int64_t first[ATTN_ROWS];
    for (int64_t r = 0; r < R; r++) first[r] = c->window > 0 && last[r] + 1 > c->window ? last[r] + 1 - c->window : 0;
    int64_t lo = first[0], hi = last[R - 1] + 1, n = hi - lo;
#define ROW(cache, kh, pos) wat(cache, (((int64_t)table[(pos) / bs] * Hk + (kh)) * bs + (pos) % bs) * D, kt)
#define SCORES(r, j) (scores + ((r) * heads + (j)) * n - lo) /* indexed by absolute position */
    /* scores: positions outer, rows and heads inner, so a page's keys are read from memory once and
     * stay in L1 for every row and head */
    int64_t pos = lo;
    /* the pages of the sweep, PF_DIST ahead of the one being read: the keys' pages, then the values',
     * then the next item's first keys */
    int64_t pg0 = lo / bs, npg = (hi - 1) / bs - pg0 + 1, run_bytes = nkh * bs * D * esize;
#define NEXT_RUN(j) wat(kcache, ((int64_t)next->table[next->page + (j)] * Hk + next->kh0) * bs * D, kt)
#define SWEEP_RUN(i)                                                                                           \
    ((i) < npg                                ? ROW(kcache, kh0, (pg0 + (i)) * bs)                               \
     : (i) < 2 * npg                          ? ROW(vcache, kh0, (pg0 + (i) - npg) * bs)                         \
     : next && (i) - 2 * npg < next->pages ? NEXT_RUN((i) - 2 * npg)                                            \
                                              : NULL)
    /* a page's lines are spread over every call that reads it (each row's, each group of heads'): a
     * key step reads 8 positions x PF_STEP_FLOATS of D, a value step one position's 64 of D (in bytes
     * of the cache: an fp8 page is prefetched as the bytes it is) */
    int64_t calls = R * ((group + SHARED_HEADS - 1) / SHARED_HEADS);
#define STEP_RATE(bytes) ((int)(256 * PF_PERCENT / 100 * (bytes) / 64 / calls)) /* lines a call's step, in 256ths */
    page_prefetch pf = {NULL, NULL, NULL, NULL, STEP_RATE(8 * PF_STEP_FLOATS * esize), 0};
    for (int64_t i = 1; i <= PF_DIST; i++) prefetch_queue(&pf, SWEEP_RUN(i), run_bytes);
    if (bs % 8 == 0) { /* eight positions of one page at a time */
        for (; pos < hi && pos % 8; pos++)
            for (int64_t r = 0; r < R; r++)
                for (int64_t j = 0; j < heads; j++)
                    SCORES(r, j)[pos] = dot1_w(q[r] + j * D, ROW(kcache, kh0 + j / group, pos), D, kt);
        for (; pos + 8 <= hi; pos += 8) {
            if (pos % bs == 0 && pos > lo) prefetch_queue(&pf, SWEEP_RUN(pos / bs - pg0 + PF_DIST), run_bytes);
            for (int64_t h = 0; h < nkh; h++) {
                const void *k8 = ROW(kcache, kh0 + h, pos);
                if (kt == W_F8) widen_rows(k8, 8 * D, wide), k8 = wide;
                for (int64_t r = 0; r < R; r++)
                    for (int64_t g = 0; g < group; g += SHARED_HEADS) { /* the group's heads SHARED_HEADS at a time */
                        int64_t j = h * group + g;
                        int nh = group - g < SHARED_HEADS ? (int)(group - g) : SHARED_HEADS;
                        dot8_heads_any(nh, q[r] + j * D, k8, D, &pf, rk, SCORES(r, j) + pos, n);
                    }
            }
        }
    }
    for (; pos < hi; pos++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < heads; j++)
                SCORES(r, j)[pos] = dot1_w(q[r] + j * D, ROW(kcache, kh0 + j / group, pos), D, kt);
    /* softmax of each row and head over its own positions */
    for (int64_t r = 0; r < R; r++) {
        int64_t nr = last[r] + 1 - first[r];
        for (int64_t j = 0; j < heads; j++) {
            float *sg = SCORES(r, j) + first[r];
            int64_t i = 0;
            __m256 scale = _mm256_set1_ps(c->scale), vmax = _mm256_set1_ps(-INFINITY);
            if (c->soft_cap > 0.0f) {
                for (i = 0; i < nr; i++) sg[i] = c->soft_cap * tanhf(sg[i] * c->scale / c->soft_cap);
            } else {
                for (i = 0; i + 8 <= nr; i += 8) _mm256_storeu_ps(sg + i, _mm256_mul_ps(_mm256_loadu_ps(sg + i), scale));
                for (; i < nr; i++) sg[i] *= c->scale;
            }
            for (i = 0; i + 8 <= nr; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sg + i));
            float m = -INFINITY, tail[8];
            _mm256_storeu_ps(tail, vmax);
            for (int t = 0; t < 8; t++) m = tail[t] > m ? tail[t] : m;
            for (; i < nr; i++) m = sg[i] > m ? sg[i] : m;
            __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
            float total = 0.0f;
            for (i = 0; i + 8 <= nr; i += 8) {
                __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));
                _mm256_storeu_ps(sg + i, e);
                vsum = _mm256_add_ps(vsum, e);
            }
            for (; i < nr; i++) total += sg[i] = expf(sg[i] - m);
            __m256 inv = _mm256_set1_ps(1.0f / (total + hsum256(vsum)));
            for (i = 0; i + 8 <= nr; i += 8) _mm256_storeu_ps(sg + i, _mm256_mul_ps(_mm256_loadu_ps(sg + i), inv));
            for (; i < nr; i++) sg[i] *= _mm256_cvtss_f32(inv);
        }
        memset(o[r], 0, sizeof(float) * (size_t)(heads * D));
    }
    /* values: one page's run of positions at a time (read from memory once, in L1 for every row
     * and head), each 64-wide slice of a head's output accumulated in registers over the run */
    pf.rate = STEP_RATE(64 * esize);
    for (int64_t p0 = lo; p0 < hi;) {
        int64_t p1 = (p0 / bs + 1) * bs < hi ? (p0 / bs + 1) * bs : hi;
        prefetch_queue(&pf, SWEEP_RUN(npg + p0 / bs - pg0 + PF_DIST), run_bytes);
        for (int64_t h = 0; h < nkh; h++) {
            const void *v0 = ROW(vcache, kh0 + h, p0); /* positions p0..p1 are consecutive rows of one page */
            /* the run as one piece, or an fp8 one WIDEN_ROWS widened rows at a time (pv64 and pv8 add
             * to the output as they go, so the pieces sum what the whole run sums, in the same order) */
            for (int64_t s0 = p0; s0 < p1; s0 += kt == W_F8 ? WIDEN_ROWS : p1 - p0) {
                int64_t s1 = kt == W_F8 && s0 + WIDEN_ROWS < p1 ? s0 + WIDEN_ROWS : p1;
                const void *vs = wat(v0, (s0 - p0) * D, kt);
                if (kt == W_F8) widen_rows(vs, (s1 - s0) * D, wide), vs = wide;
                for (int64_t r = 0; r < R; r++) {
                    int64_t a = first[r] > s0 ? first[r] : s0, e = last[r] + 1 < s1 ? last[r] + 1 : s1;
                    for (int64_t g = 0; a < e && g < group; g += SHARED_HEADS) { /* SHARED_HEADS at a time */
                        int64_t j = h * group + g, nh = group - g < SHARED_HEADS ? group - g : SHARED_HEADS;
                        const float *sg = SCORES(r, j) + a;
                        const void *va = wat(vs, (a - s0) * D, rk);
                        float *og = o[r] + j * D;
                        int64_t d0 = 0;
                        for (; d0 + 64 <= D; d0 += 64)
                            pv64_heads_any((int)nh, wat(va, d0, rk), D, sg, n, e - a, og + d0, &pf, rk);
                        for (; d0 < D; d0 += 8)
                            for (int64_t i = 0; i < nh; i++) pv8(wat(va, d0, rk), D, sg + i * n, e - a, og + i * D + d0, rk);
                    }
                }
            }
        }
        p0 = p1;
    }
#undef STEP_RATE
#undef SWEEP_RUN
#undef NEXT_RUN
#undef SCORES
#undef ROW
}

/* One query row per sequence. Items are (sequence, kv head) pairs, kv head outer, or with many
 * sequences (c->seq_items) whole sequences, every kv head at once (longer runs of each page). */
static inline __attribute__((always_inline)) void decode_attention_range_w(void *p, int64_t begin, int64_t end,
                                                                           int kt) {
    attn_ctx *c = (attn_ctx *)p;
    int64_t H = c->H, Hk = c->Hk, D = c->D, group = H / Hk, nkh = c->seq_items ? Hk : 1;
    for (int64_t task = begin; task < end; task++) {
        int64_t b = task % c->B, kh = c->seq_items ? 0 : task / c->B, last = c->seq_lens[b] - 1;
        float *scores = (float *)malloc(sizeof(float) * (size_t)((last + 1) * nkh * group + 8));
        if (!scores) {
            atomic_store(&c->failed, 1);
            return;
        }
        const float *q = c->q + b * c->sq + kh * group * D;
        float *o = c->out + (b * H + kh * group) * D; /* the heads are adjacent rows */
        /* the next item's first pages are prefetched as this one's last values are read */
        int64_t nb = (task + 1) % c->B, nlast = c->seq_lens[nb] - 1;
        int64_t nfirst = c->window > 0 && nlast + 1 > c->window ? nlast + 1 - c->window : 0;
        next_sweep next = {c->block_tables + nb * c->max_blocks, c->seq_items ? 0 : (task + 1) / c->B,
                           nfirst / c->bs, nlast / c->bs - nfirst / c->bs + 1};
        attend_rows_w(c, c->block_tables + b * c->max_blocks, kh, nkh, 1, &q, &o, &last, scores,
                      task + 1 < end && nlast >= 0 ? &next : NULL, kt);
        free(scores);
    }
}

static void decode_attention_range(void *p, int64_t begin, int64_t end) {
    decode_attention_range_w(p, begin, end, W_F32);
}

#if PLINTH_AVX512 && PLINTH_AMX
/*
 * Decode attention over a bf16 cache on AMX tiles. Where a query head group's values are all bf16
 * values (a bf16 model's queries, widened to fp32 exactly on their way here), the scores of 16
 * positions are one small product: A = the 16 key rows of a page (loaded straight from the cache,
 * 32 of D a tile), B = the group's queries as 16 columns (column g = head g; the rest zero), so
 * TDPBF16PS writes a [16 positions][16] tile of scores (exact products of bf16 values summed in fp32,
 * as the widened FMAs sum them, in another order). The softmax then runs down the columns, every
 * head of the group at once, and the values are summed with each V row widened once for the whole
 * group (the fp32 path widens it once per head). Queries that are not all bf16 values (an fp32
 * model over a bf16 cache) keep the fp32 path. Pages of a multiple of 16 positions, D a multiple
 * of 32 up to 192 (tiles 2-7 hold the queries), groups of up to 16 heads, no soft cap.
 */
#define AMX_ATTN_MAX_CHUNKS 6

/* 1 where each of the n floats at v is a bf16 value (its low 16 bits zero) */
static inline int bf16_exact(const float *v, int64_t n) {
    __m512i acc = _mm512_setzero_si512(), low = _mm512_set1_epi32(0xFFFF);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_or_si512(acc, _mm512_and_si512(_mm512_loadu_si512(v + i), low));
    uint32_t tail = 0;
    for (; i < n; i++) {
        uint32_t u;
        memcpy(&u, v + i, sizeof u);
        tail |= u & 0xFFFFu;
    }
    return !_mm512_reduce_or_epi32(acc) && !tail;
}

/* tiles 0: scores (16 x 16 fp32), 1: 16 key rows (32 bf16 each), 2-7: the queries (16 k pairs x 16 heads) */
static AMX_TARGET void amx_attn_configure(void) {
    amx_tilecfg t;
    memset(&t, 0, sizeof t);
    t.palette = 1;
    for (int i = 0; i < 8; i++) t.rows[i] = 16, t.colsb[i] = 64;
    __asm__ volatile("" : : "r"(&t) : "memory"); /* gcc 12 dropped the stores above without it */
    _tile_loadconfig(&t);
}


/* o[g][d0 + 16j] (nh heads from g0, nv vectors of 16) = sum over positions first..last of
 * st[pos][g] * V[pos], then times inv[g]; each V row (elements of kind kt: bf16 or fp8) widened once
 * for the nh heads */
static inline __attribute__((always_inline)) void amx_attn_pv(int nh, int nv, const attn_ctx *c,
                                                              const int32_t *table, int64_t kh, const float *st,
                                                              int64_t a0, int64_t first, int64_t last, int64_t g0,
                                                              int64_t d0, float *o, const float *inv, int kt) {
    int64_t Hk = c->Hk, D = c->D, bs = c->bs, esize = (int64_t)wsize(kt);
    const void *vc = wat(c->cache, c->num_blocks * Hk * bs * D, kt);
    __m512 acc[4][4];
    for (int i = 0; i < nh; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = first; p <= last;) {
        int64_t pe = (p / bs + 1) * bs <= last + 1 ? (p / bs + 1) * bs : last + 1;
        const void *v = wat(vc, ((table[p / bs] * Hk + kh) * bs + p % bs) * D + d0, kt);
        const char *next = pe <= last ? (const char *)wat(vc, ((table[pe / bs] * Hk + kh) * bs) * D + d0, kt) : NULL;
        for (; p < pe; p++, v = wat(v, D, kt)) {
            if (next) _mm_prefetch(next, _MM_HINT_T0), _mm_prefetch(next + 64, _MM_HINT_T0), next += D * esize;
            const float *pr = st + (p - a0) * 16 + g0;
            __m512 vv[4];
            for (int j = 0; j < nv; j++) vv[j] = load16w(v, j * 16, kt);
            for (int i = 0; i < nh; i++) {
                __m512 w = _mm512_set1_ps(pr[i]);
                for (int j = 0; j < nv; j++) acc[i][j] = _mm512_fmadd_ps(w, vv[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nh; i++)
        for (int j = 0; j < nv; j++)
            _mm512_storeu_ps(o + (g0 + i) * D + d0 + j * 16, _mm512_mul_ps(acc[i][j], _mm512_set1_ps(inv[g0 + i])));
}

#define AMX_PV_HEADS(nv)                                                                                     \
    switch (nh) {                                                                                              \
    case 4: amx_attn_pv(4, nv, c, table, kh, st, a0, first, last, g0, d0, o, inv, kt); break;               \
    case 3: amx_attn_pv(3, nv, c, table, kh, st, a0, first, last, g0, d0, o, inv, kt); break;               \
    case 2: amx_attn_pv(2, nv, c, table, kh, st, a0, first, last, g0, d0, o, inv, kt); break;               \
    default: amx_attn_pv(1, nv, c, table, kh, st, a0, first, last, g0, d0, o, inv, kt); break;              \
    }

/* kv head kh of one sequence (positions first..last, its table) for the group's queries q (heads D
 * apart, all bf16 values) into o, over a cache of kind kt: bf16, whose 16 key rows a block are the A
 * tile straight from the page, or fp8, whose rows are first rounded to bf16 (exactly: every e4m3fn
 * value is a bf16 value) into kb; st holds (last - first + 32) x 16 floats, 64-byte aligned; the tiles
 * are configured */
static inline __attribute__((always_inline)) AMX_TARGET void amx_attend_head_w(const attn_ctx *c, const int32_t *table,
                                                                    int64_t kh, const float *q, float *o,
                                                                    int64_t first, int64_t last, float *st, int kt) {
    int64_t Hk = c->Hk, D = c->D, bs = c->bs, group = c->H / Hk, chunks = D / 32, esize = (int64_t)wsize(kt);
    const void *kc = c->cache;
    uint16_t kb[kt == W_F8 ? 16 * 32 * AMX_ATTN_MAX_CHUNKS : 1] __attribute__((aligned(64)));
    uint32_t qt[AMX_ATTN_MAX_CHUNKS][16][16] __attribute__((aligned(64)));
    memset(qt, 0, sizeof(qt[0]) * (size_t)chunks);
    for (int64_t g = 0; g < group; g++)
        for (int64_t dp = 0; dp < D / 2; dp++) {
            uint32_t lo, hi;
            memcpy(&lo, q + g * D + 2 * dp, sizeof lo), memcpy(&hi, q + g * D + 2 * dp + 1, sizeof hi);
            qt[dp / 16][dp % 16][g] = (lo >> 16) | (hi & 0xFFFF0000u);
        }
    switch (chunks) { /* a tile's number is an immediate */
    case 6: _tile_loadd(7, qt[5], 64); /* fall through */
    case 5: _tile_loadd(6, qt[4], 64); /* fall through */
    case 4: _tile_loadd(5, qt[3], 64); /* fall through */
    case 3: _tile_loadd(4, qt[2], 64); /* fall through */
    case 2: _tile_loadd(3, qt[1], 64); /* fall through */
    default: _tile_loadd(2, qt[0], 64);
    }
    int64_t a0 = first / 16 * 16; /* 16-position blocks never cross a page (bs % 16 == 0) */
    for (int64_t p = a0; p <= last; p += 16) {
        const uint16_t *k = (const uint16_t *)wat(kc, ((table[p / bs] * Hk + kh) * bs + p % bs) * D, kt);
        if (p + 16 <= last) { /* the next block's keys */
            const char *nk = (const char *)wat(kc, ((table[(p + 16) / bs] * Hk + kh) * bs + (p + 16) % bs) * D, kt);
            for (int64_t b = 0; b < 16 * D * esize; b += 64) _mm_prefetch(nk + b, _MM_HINT_T0);
        }
        if (kt == W_F8) widen_rows(k, 16 * D, kb), k = kb; /* the block's 16 rows as bf16 (exactly) */
        _tile_zero(0);
        switch (chunks) {
        case 6: _tile_loadd(1, k + 160, D * 2); _tile_dpbf16ps(0, 1, 7); /* fall through */
        case 5: _tile_loadd(1, k + 128, D * 2); _tile_dpbf16ps(0, 1, 6); /* fall through */
        case 4: _tile_loadd(1, k + 96, D * 2); _tile_dpbf16ps(0, 1, 5); /* fall through */
        case 3: _tile_loadd(1, k + 64, D * 2); _tile_dpbf16ps(0, 1, 4); /* fall through */
        case 2: _tile_loadd(1, k + 32, D * 2); _tile_dpbf16ps(0, 1, 3); /* fall through */
        default: _tile_loadd(1, k, D * 2); _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, st + (p - a0) * 16, 64);
    }
    /* softmax down each column (head) over the visible rows */
    __m512 scale = _mm512_set1_ps(c->scale), vmax = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
    for (int64_t p = first; p <= last; p++) {
        float *row = st + (p - a0) * 16;
        __m512 v = _mm512_mul_ps(_mm512_load_ps(row), scale);
        _mm512_store_ps(row, v);
        vmax = _mm512_max_ps(vmax, v);
    }
    for (int64_t p = first; p <= last; p++) {
        float *row = st + (p - a0) * 16;
        __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(row), vmax));
        _mm512_store_ps(row, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), vsum));
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            int nh = group - g0 < 4 ? (int)(group - g0) : 4;
            if (D - d0 >= 64) { AMX_PV_HEADS(4) }
            else { AMX_PV_HEADS(2) } /* the last 32 of D */
        }
    }
}
#undef AMX_PV_HEADS

static AMX_TARGET void amx_attend_head(const attn_ctx *c, const int32_t *table, int64_t kh, const float *q, float *o,
                                       int64_t first, int64_t last, float *st) {
    amx_attend_head_w(c, table, kh, q, o, first, last, st, W_BF16);
}
static AMX_TARGET void amx_attend_head_f8(const attn_ctx *c, const int32_t *table, int64_t kh, const float *q,
                                          float *o, int64_t first, int64_t last, float *st) {
    amx_attend_head_w(c, table, kh, q, o, first, last, st, W_F8);
}

/* decode items over a bf16 or fp8 cache (kt) where c->amx: each kv head whose queries are bf16
 * values on the tiles, any other by the fp32 path */
static inline __attribute__((always_inline)) AMX_TARGET void decode_attention_range_amx_w(void *p, int64_t begin, int64_t end,
                                                                               int kt) {
    attn_ctx *c = (attn_ctx *)p;
    int64_t H = c->H, Hk = c->Hk, D = c->D, group = H / Hk, nkh = c->seq_items ? Hk : 1;
    amx_attn_configure();
    for (int64_t task = begin; task < end; task++) {
        int64_t b = task % c->B, kh0 = c->seq_items ? 0 : task / c->B, last = c->seq_lens[b] - 1;
        int64_t first = c->window > 0 && last + 1 > c->window ? last + 1 - c->window : 0;
        const int32_t *table = c->block_tables + b * c->max_blocks;
        float *scores = (float *)aligned_alloc(64, sizeof(float) * (size_t)((last - first + 32) * 16));
        if (!scores) {
            atomic_store(&c->failed, 1);
            break;
        }
        for (int64_t kh = kh0; kh < kh0 + nkh; kh++) {
            const float *q = c->q + b * c->sq + kh * group * D;
            float *o = c->out + (b * H + kh * group) * D;
            if (!bf16_exact(q, group * D))
                attend_rows_w(c, table, kh, 1, 1, &q, &o, &last, scores, NULL, kt);
            else if (kt == W_F8)
                amx_attend_head_f8(c, table, kh, q, o, first, last, scores);
            else
                amx_attend_head(c, table, kh, q, o, first, last, scores);
        }
        free(scores);
    }
    _tile_release();
}
static AMX_TARGET void decode_attention_range_amx(void *p, int64_t begin, int64_t end) {
    decode_attention_range_amx_w(p, begin, end, W_BF16);
}
static AMX_TARGET void decode_attention_range_amx_f8(void *p, int64_t begin, int64_t end) {
    decode_attention_range_amx_w(p, begin, end, W_F8);
}
#endif

static void decode_attention_range_bf16(void *p, int64_t begin, int64_t end) {
    decode_attention_range_w(p, begin, end, W_BF16);
}
static void decode_attention_range_f16(void *p, int64_t begin, int64_t end) {
    decode_attention_range_w(p, begin, end, W_F16);
}
static void decode_attention_range_f8(void *p, int64_t begin, int64_t end) {
    decode_attention_range_w(p, begin, end, W_F8);
}

/* Returns 0, or -1 when out of memory. Every seq_len must be >= 1. */
int plinth_decode_attention(int kt, const float *q, int64_t sq, const void *cache, const int32_t *block_tables,
                            int64_t max_blocks, const int32_t *seq_lens, float *out, int64_t B, int64_t H, int64_t Hk,
                            int64_t D, int64_t bs, int64_t num_blocks, float scale, int64_t window, float soft_cap) {
    /* whole sequences as items once there are enough of them to share out (DECODE_SEQ_ITEMS per thread) */
    int seq_items = Hk > 1 && B >= DECODE_SEQ_ITEMS * (int64_t)pool.nthreads;
    attn_ctx c = {q, sq, cache, block_tables, max_blocks, seq_lens, out, B, H, Hk, D, bs, num_blocks, scale, window,
                  soft_cap, seq_items, 0};
    /* items of at least ~64k multiply-adds: waking a thread costs more than a short sequence's work */
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) total += seq_lens[b];
    int64_t per_item = (total / B + 1) * (seq_items ? H : H / Hk) * D * 2;
    int64_t grain = 65536 / per_item + 1;
    void (*range)(void *, int64_t, int64_t) = kt == W_BF16  ? decode_attention_range_bf16
                                                : kt == W_F16 ? decode_attention_range_f16
                                                : kt == W_F8  ? decode_attention_range_f8
                                                              : decode_attention_range;
#if PLINTH_AVX512 && PLINTH_AMX
    if ((kt == W_BF16 || kt == W_F8) && bs % 16 == 0 && D % 32 == 0 && D <= 32 * AMX_ATTN_MAX_CHUNKS && H / Hk <= 16 &&
        soft_cap <= 0.0f && plinth_amx_bf16(-1))
        range = kt == W_F8 ? decode_attention_range_amx_f8 : decode_attention_range_amx;
#endif
    parallel_for(range, &c, seq_items ? B : B * Hk, grain);
    return atomic_load(&c.failed) ? -1 : 0;
}

/* ---- prefill attention in tiles (head sizes a multiple of 16) ----
 * A chunk's query rows attend in tiles of up to tile_rows_for(group) rows and one kv head: the
 * tile's M = rows x group query vectors are the columns of a small GEMM against each block of 16
 * keys, so every key and value element loaded from a page serves all M of them from a register (the
 * 4-row path above serves one query vector per load). Lane m of a 16-wide unit is query vector m (row m / group,
 * head m % group); the queries are transposed once per tile ([D][Mp], Mp = M rounded up to 16),
 * so a score is a broadcast key element times a vector of queries, and the softmax runs down the
 * lanes (one row's running max and sum per lane: no horizontal reductions). Per block of keys:
 * scores S[j][m] (each the FMA chain over d in order, in either build), scaled, capped, masked;
 * the running max and sum updated online and the weighted sums O[m][0..D) rescaled where the max
 * grew; then O[m] += P[j][m] V[j] (values loaded as vectors, probabilities broadcast). Keys and
 * values of a 16-bit cache (or a block that is not 16 consecutive rows of one page) are first
 * widened or gathered into a 16-row fp32 buffer, exactly, so a 16-bit cache gives the fp32 cache's
 * result bit for bit. Every reduction is lane-wise and in a fixed order, so both builds compute the
 * same values. */
#define FT_KEYS 16
#define FT_MAX_ROWS 32 /* rows of a tile at most (4 with the largest groups: 64 query vectors) */
#ifndef FT_MIN_VECTORS /* (-D...: to measure another) */
#define FT_MIN_VECTORS 24 /* a chunk of fewer query vectors (rows x group) takes the 4-row path */
#endif

/* Rows per tile: about 64 query vectors, 4 to FT_MAX_ROWS rows. */
static inline int64_t tile_rows_for(int64_t group) {
    int64_t r = 64 / group;
    return r < ATTN_ROWS ? ATTN_ROWS : r > FT_MAX_ROWS ? FT_MAX_ROWS : r;
}
/* Whether a chunk of q_len rows (of seq_len positions) attends in GEMM tiles: positions are compared
 * as floats there, exact below 2^24. */
static inline int tile_uses_gemm(int64_t q_len, int64_t seq_len, int64_t group, int64_t D) {
    return D % 16 == 0 && q_len * group >= FT_MIN_VECTORS && seq_len < (1 << 24);
}

#if PLINTH_AVX512
typedef __m512 v16;
#define V16_UNITS 4 /* units of 16 lanes a score tile spans */
#ifndef FT_TILE_KEYS
#define FT_TILE_KEYS 6 /* keys of a score tile: 24 accumulators */
#endif
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
/* a where lo <= p <= hi lane-wise, else -inf */
static inline v16 v16_visible(v16 a, float p, v16 lo, v16 hi) {
    __mmask16 k = _mm512_cmp_ps_mask(lo, v16_set1(p), _CMP_LE_OQ) & _mm512_cmp_ps_mask(v16_set1(p), hi, _CMP_LE_OQ);
    return _mm512_mask_blend_ps(k, v16_set1(-INFINITY), a);
}
/* 0 where a is -inf, else a */
static inline v16 v16_finite_or_zero(v16 a) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, v16_set1(-INFINITY), _CMP_EQ_OQ), a, v16_zero());
}
/* exp256's steps on 16 lanes (exp512) */
static inline v16 v16_exp(__m512 x) { return exp512(x); }
/* 16 elements of kind kt from element i, widened */
static inline __attribute__((always_inline)) v16 v16_loadw(const void *P, int64_t i, int kt) {
    return load16w(P, i, kt);
}
#else
typedef struct {
    __m256 lo, hi;
} v16;
#define V16_UNITS 1
#ifndef FT_TILE_KEYS
#define FT_TILE_KEYS 6 /* keys of a score tile: 12 accumulators (two registers a unit) */
#endif
static inline v16 v16_make(__m256 lo, __m256 hi) {
    v16 v = {lo, hi};
    return v;
}
static inline v16 v16_load(const float *p) { return v16_make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v16_store(float *p, v16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline v16 v16_set1(float x) { return v16_make(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline v16 v16_zero(void) { return v16_make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) {
    return v16_make(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline v16 v16_mul(v16 a, v16 b) { return v16_make(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline v16 v16_add(v16 a, v16 b) { return v16_make(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline v16 v16_sub(v16 a, v16 b) { return v16_make(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline v16 v16_max(v16 a, v16 b) { return v16_make(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline __m256 visible8(__m256 a, __m256 p, __m256 lo, __m256 hi) {
    __m256 k = _mm256_and_ps(_mm256_cmp_ps(lo, p, _CMP_LE_OQ), _mm256_cmp_ps(p, hi, _CMP_LE_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), a, k);
}
static inline v16 v16_visible(v16 a, float p, v16 lo, v16 hi) {
    __m256 pv = _mm256_set1_ps(p);
    return v16_make(visible8(a.lo, pv, lo.lo, hi.lo), visible8(a.hi, pv, lo.hi, hi.hi));
}
static inline __m256 finite_or_zero8(__m256 a) {
    return _mm256_blendv_ps(a, _mm256_setzero_ps(), _mm256_cmp_ps(a, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ));
}
static inline v16 v16_finite_or_zero(v16 a) { return v16_make(finite_or_zero8(a.lo), finite_or_zero8(a.hi)); }
static inline v16 v16_exp(v16 x) { return v16_make(exp256(x.lo), exp256(x.hi)); }
static inline __attribute__((always_inline)) v16 v16_loadw(const void *P, int64_t i, int kt) {
    return v16_make(load8w(P, i, kt), load8w(P, i + 8, kt));
}
#endif

/* One tile's scratch (floats): Mp = M rounded up to 16 lanes. */
typedef struct {
    float *qt;            /* [D][Mp] the queries, transposed (lanes past M zero) */
    float *s;             /* [FT_KEYS][Mp] a block's scores, then its probabilities */
    float *o;             /* [Mp][D] the queries gathered (for the transpose), then the M running weighted sums */
    float *kb, *vb;       /* [FT_KEYS][D] a block's keys and values, widened or gathered */
    float *mx, *l, *alpha, *bmax; /* [Mp] each lane's running max and sum, a block's rescale and max */
    float *first, *last;  /* [Mp] each lane's visible positions (floats: exact below 2^24) */
    uint32_t *qp;         /* [D / 2][Mp] the transposed queries as bf16 pairs (the AMX path's B tiles) */
} tile_buf;

static float *tile_buf_alloc(tile_buf *b, int64_t Mp, int64_t D) {
    size_t n = (size_t)(D * Mp + FT_KEYS * Mp + Mp * D + 2 * FT_KEYS * D + 6 * Mp + D / 2 * Mp);
    float *f = (float *)aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    if (!f) return NULL;
    b->qt = f, b->s = b->qt + D * Mp, b->o = b->s + FT_KEYS * Mp, b->kb = b->o + Mp * D, b->vb = b->kb + FT_KEYS * D;
    b->mx = b->vb + FT_KEYS * D, b->l = b->mx + Mp, b->alpha = b->l + Mp, b->bmax = b->alpha + Mp;
    b->first = b->bmax + Mp;
    b->last = b->first + Mp;
    b->qp = (uint32_t *)(b->last + Mp);
    return f;
}

/* What a block's score tiles need besides the operands. */
typedef struct {
    const float *qt;   /* [D][Mp] */
    int64_t Mp, D;
    v16 scale;
    float soft_cap;    /* > 0: cap * tanh(s / cap) */
    int masked;        /* some lane cannot see some key of the block */
    const float *first, *last; /* [Mp] each lane's visible positions */
    float *bmax;       /* [Mp] the block's running max per lane */
} score_args;

/* The raw scores sv of key position pos for the 16 lanes from `lane`: scaled, capped, masked (-inf
 * where a lane cannot see the key), stored at row[lane..], and folded into the lanes' max mx */
static inline __attribute__((always_inline)) v16 score_fold(const score_args *a, v16 sv, int64_t pos, int64_t lane,
                                                            float *row, v16 mx) {
    sv = v16_mul(sv, a->scale);
    if (a->soft_cap > 0.0f) {
        float t[16];
        v16_store(t, sv);
        for (int i = 0; i < 16; i++) t[i] = a->soft_cap * tanhf(t[i] / a->soft_cap);
        sv = v16_load(t);
    }
    if (a->masked) sv = v16_visible(sv, (float)pos, v16_load(a->first + lane), v16_load(a->last + lane));
    v16_store(row + lane, sv);
    return v16_max(mx, sv);
}

/* s[j][lanes of `units` units from mu] for `keys` keys j (k[j][d], D apart) from position pos: each
 * the FMA chain over d in order, scaled, capped, masked (-inf where the lane cannot see the key), and
 * folded into the lanes' block max; keys x units accumulators in registers (both constants in each
 * inlined copy). */
static inline __attribute__((always_inline)) void tile_scores(const score_args *a, const float *k, float *s,
                                                              int64_t pos, int64_t mu, int units, int keys) {
    int64_t Mp = a->Mp, D = a->D;
    v16 acc[FT_TILE_KEYS][V16_UNITS];
    for (int j = 0; j < keys; j++)
        for (int u = 0; u < units; u++) acc[j][u] = v16_zero();
    for (int64_t d = 0; d < D; d++) {
        v16 q[V16_UNITS];
        for (int u = 0; u < units; u++) q[u] = v16_load(a->qt + d * Mp + (mu + u) * 16);
        for (int j = 0; j < keys; j++) {
            v16 kv = v16_set1(k[j * D + d]);
            for (int u = 0; u < units; u++) acc[j][u] = v16_fmadd(q[u], kv, acc[j][u]);
        }
    }
    for (int u = 0; u < units; u++) {
        float *bm = a->bmax + (mu + u) * 16;
        v16 mx = v16_load(bm);
        for (int j = 0; j < keys; j++) mx = score_fold(a, acc[j][u], pos + j, (mu + u) * 16, s + j * Mp, mx);
        v16_store(bm, mx);
    }
}

/* o[m][d0..d0+16 units) += sum over the block's keys j of p[j][m] * v[j][...], for `rows` query
 * vectors from m0 (rows and units constants in each inlined copy) */
static inline __attribute__((always_inline)) void tile_values(const float *p, int64_t Mp, const float *v, int64_t D,
                                                              float *o, int64_t m0, int64_t d0, int rows, int units) {
    v16 acc[6][V16_UNITS];
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < units; u++) acc[r][u] = v16_load(o + (m0 + r) * D + d0 + u * 16);
    for (int j = 0; j < FT_KEYS; j++) {
        v16 vv[V16_UNITS];
        for (int u = 0; u < units; u++) vv[u] = v16_load(v + j * D + d0 + u * 16);
        for (int r = 0; r < rows; r++) {
            v16 w = v16_set1(p[j * Mp + m0 + r]);
            for (int u = 0; u < units; u++) acc[r][u] = v16_fmadd(w, vv[u], acc[r][u]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < units; u++) v16_store(o + (m0 + r) * D + d0 + u * 16, acc[r][u]);
}

static inline __attribute__((always_inline)) void tile_values_rows(const float *p, int64_t Mp, const float *v,
                                                                   int64_t D, float *o, int64_t m0, int64_t d0,
                                                                   int64_t rows, int units) {
    switch (rows) {
    case 6: tile_values(p, Mp, v, D, o, m0, d0, 6, units); break;
    case 5: tile_values(p, Mp, v, D, o, m0, d0, 5, units); break;
    case 4: tile_values(p, Mp, v, D, o, m0, d0, 4, units); break;
    case 3: tile_values(p, Mp, v, D, o, m0, d0, 3, units); break;
    case 2: tile_values(p, Mp, v, D, o, m0, d0, 2, units); break;
    default: tile_values(p, Mp, v, D, o, m0, d0, 1, units); break;
    }
}

/* The 16 rows of positions p0.. of kv head kh from `cache` (K or V), as fp32 rows D apart: the page
 * itself where they are 16 consecutive fp32 rows of one page, else widened/gathered into buf (rows
 * outside [lo, hi) zero). */
static inline __attribute__((always_inline)) const float *tile_rows(const attn_ctx *c, const int32_t *table,
                                                                    const void *cache, int64_t kh, int64_t p0,
                                                                    int64_t lo, int64_t hi, float *buf, int kt) {
    int64_t Hk = c->Hk, D = c->D, bs = c->bs;
#define TROW(pos) wat(cache, (((int64_t)table[(pos) / bs] * Hk + kh) * bs + (pos) % bs) * D, kt)
    if (kt == W_F32 && p0 >= lo && p0 + FT_KEYS <= hi && p0 % bs + FT_KEYS <= bs) return (const float *)TROW(p0);
    for (int64_t j = 0; j < FT_KEYS; j++) {
        int64_t pos = p0 + j;
        float *dst = buf + j * D;
        if (pos < lo || pos >= hi) {
            memset(dst, 0, sizeof(float) * (size_t)D);
            continue;
        }
        const void *src = TROW(pos);
        for (int64_t d = 0; d < D; d += 16) v16_store(dst + d, v16_loadw(src, d, kt));
    }
#undef TROW
    return buf;
}

/* A block's scores s[j][lanes] made elsewhere (on AMX tiles) through score_fold, as tile_scores
 * folds its own */
static inline void tile_scores_finish(const score_args *a, float *s, int64_t pos, int64_t units) {
    for (int64_t u = 0; u < units; u++) {
        v16 mx = v16_load(a->bmax + u * 16);
        for (int j = 0; j < FT_KEYS; j++) {
            float *row = s + j * a->Mp;
            mx = score_fold(a, v16_load(row + u * 16), pos + j, u * 16, row, mx);
        }
        v16_store(a->bmax + u * 16, mx);
    }
}

#if PLINTH_AVX512 && PLINTH_AMX
/* s[j][m] (rows Mp apart) = the dot products of the 16 bf16 key rows at k (D apart) with the Mp
 * query lanes of qp ([D / 2][Mp] bf16 pairs), each 16 lanes a C tile summed over D in chunks of 32 */
static AMX_TARGET void amx_block_scores(const uint16_t *k, int64_t D, const uint32_t *qp, int64_t Mp, float *s) {
    for (int64_t u = 0; u < Mp / 16; u++) {
        _tile_zero(0);
        for (int64_t ch = 0; ch < D / 32; ch++) {
            _tile_loadd(1, k + ch * 32, D * 2);
            _tile_loadd(2, qp + ch * 16 * Mp + u * 16, Mp * 4);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, s + u * 16, Mp * 4);
    }
}
/* the same over 16 fp8 key rows, rounded to bf16 (exactly) into kb first */
static AMX_TARGET void amx_block_scores_f8(const uint8_t *k, int64_t D, const uint32_t *qp, int64_t Mp, float *s,
                                           uint16_t *kb) {
    widen_rows(k, 16 * D, kb); /* exactly: every e4m3fn value is a bf16 value */
    amx_block_scores(kb, D, qp, Mp, s);
}
static AMX_TARGET void amx_attn_release(void) { _tile_release(); }
#endif

/* Attention of R query rows of one chunk (positions last[0] < ... < last[R-1], consecutive) for kv
 * head kh: the query vectors of row r at q[r] (its group's heads D apart), outputs at o[r]. */
static inline __attribute__((always_inline)) void attend_tile_w(const attn_ctx *c, const int32_t *table, int64_t kh,
                                                                int64_t R, const float *const *q, float *const *o,
                                                                const int64_t *last, tile_buf *b, int kt) {
    int64_t Hk = c->Hk, D = c->D, group = c->H / Hk, M = R * group, Mp = (M + 15) / 16 * 16, units = Mp / 16;
    const void *kcache = c->cache, *vcache = wat(c->cache, c->num_blocks * Hk * c->bs * D, kt);
    int64_t first0 = c->window > 0 && last[0] + 1 > c->window ? last[0] + 1 - c->window : 0;
    int64_t lo = first0, hi = last[R - 1] + 1, max_first = 0, min_last = last[0];
    for (int64_t m = 0; m < Mp; m++) {
        int64_t r = m < M ? m / group : R - 1;
        int64_t f = c->window > 0 && last[r] + 1 > c->window ? last[r] + 1 - c->window : 0;
        b->first[m] = (float)f, b->last[m] = (float)last[r], b->mx[m] = -INFINITY, b->l[m] = 0.0f;
        if (m < M && f > max_first) max_first = f;
    }
    /* the queries gathered into o's rows (lanes past M zero), then transposed 8 x 8 into qt */
    for (int64_t m = 0; m < Mp; m++) {
        if (m < M) memcpy(b->o + m * D, q[m / group] + (m % group) * D, sizeof(float) * (size_t)D);
        else memset(b->o + m * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t m = 0; m < Mp; m += 8)
        for (int64_t d = 0; d < D; d += 8) transpose8(b->o + m * D + d, D, b->qt + d * Mp + m, Mp, 8);
    memset(b->o, 0, sizeof(float) * (size_t)(M * D));
    v16 scale = v16_set1(c->scale);
    int amx = 0; /* the scores on AMX tiles: a bf16 or fp8 cache, pages of whole blocks, queries of bf16 values */
#if PLINTH_AVX512 && PLINTH_AMX
    if ((kt == W_BF16 || kt == W_F8) && c->amx && bf16_exact(b->qt, D * Mp)) {
        for (int64_t i = 0; i < D / 2; i++)
            for (int64_t m = 0; m < Mp; m++) {
                uint32_t lo16, hi16;
                memcpy(&lo16, b->qt + 2 * i * Mp + m, sizeof lo16), memcpy(&hi16, b->qt + (2 * i + 1) * Mp + m, sizeof hi16);
                b->qp[i * Mp + m] = (lo16 >> 16) | (hi16 & 0xFFFF0000u);
            }
        amx = 1;
    }
#endif
    for (int64_t p0 = lo / FT_KEYS * FT_KEYS; p0 < hi; p0 += FT_KEYS) {
        score_args sa = {b->qt, Mp, D, scale, c->soft_cap, p0 < max_first || p0 + FT_KEYS - 1 > min_last,
                         b->first, b->last, b->bmax};
        for (int64_t m = 0; m < Mp; m += 16) v16_store(b->bmax + m, v16_set1(-INFINITY));
#if PLINTH_AVX512 && PLINTH_AMX
        if (amx) { /* 16 consecutive rows of one page: bs % 16 == 0 where c->amx */
            const void *k16 = wat(kcache, (((int64_t)table[p0 / c->bs] * Hk + kh) * c->bs + p0 % c->bs) * D, kt);
            if (kt == W_F8) amx_block_scores_f8((const uint8_t *)k16, D, b->qp, Mp, b->s, (uint16_t *)b->kb);
            else amx_block_scores((const uint16_t *)k16, D, b->qp, Mp, b->s);
            tile_scores_finish(&sa, b->s, p0, units);
        }
#endif
        const float *k = amx ? NULL : tile_rows(c, table, kcache, kh, p0, lo, hi, b->kb, kt);
        for (int64_t j = 0; !amx && j < FT_KEYS; j += FT_TILE_KEYS) {
            int keys = FT_KEYS - j < FT_TILE_KEYS ? FT_KEYS - j : FT_TILE_KEYS;
            const float *kj = k + j * D;
            float *sj = b->s + j * Mp;
            int64_t mu = 0;
            for (; mu + V16_UNITS <= units; mu += V16_UNITS) {
                if (keys == FT_TILE_KEYS) tile_scores(&sa, kj, sj, p0 + j, mu, V16_UNITS, FT_TILE_KEYS);
                else tile_scores(&sa, kj, sj, p0 + j, mu, V16_UNITS, FT_KEYS % FT_TILE_KEYS);
            }
#if V16_UNITS > 1
#define FT_SCORES(u)                                                                           \
    (keys == FT_TILE_KEYS ? tile_scores(&sa, kj, sj, p0 + j, mu, (u), FT_TILE_KEYS)             \
                          : tile_scores(&sa, kj, sj, p0 + j, mu, (u), FT_KEYS % FT_TILE_KEYS))
            switch (units - mu) { /* the units left: fewer than V16_UNITS */
            case 3: FT_SCORES(3); break;
            case 2: FT_SCORES(2); break;
            case 1: FT_SCORES(1); break;
            default: break;
            }
#undef FT_SCORES
#endif
        }
        /* the online softmax down each lane */
        for (int64_t u = 0; u < units; u++) {
            float *su = b->s + u * 16;
            v16 bmax = v16_load(b->bmax + u * 16);
            v16 mold = v16_load(b->mx + u * 16), mnew = v16_max(mold, bmax), base = v16_finite_or_zero(mnew);
            v16 sum = v16_zero();
            for (int64_t j = 0; j < FT_KEYS; j++) {
                v16 e = v16_exp(v16_sub(v16_load(su + j * Mp), base));
                v16_store(su + j * Mp, e);
                sum = v16_add(sum, e);
            }
            v16 alpha = v16_exp(v16_sub(mold, base));
            v16_store(b->alpha + u * 16, alpha);
            v16_store(b->l + u * 16, v16_fmadd(v16_load(b->l + u * 16), alpha, sum));
            v16_store(b->mx + u * 16, mnew);
        }
        for (int64_t m = 0; m < M; m++)
            if (b->alpha[m] != 1.0f) {
                v16 a = v16_set1(b->alpha[m]);
                for (int64_t d = 0; d < D; d += 16) v16_store(b->o + m * D + d, v16_mul(v16_load(b->o + m * D + d), a));
            }
        const float *v = tile_rows(c, table, vcache, kh, p0, lo, hi, b->vb, kt);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            int64_t rows = M - m0 < 6 ? M - m0 : 6, d0 = 0;
            for (; d0 + 16 * V16_UNITS <= D; d0 += 16 * V16_UNITS)
                tile_values_rows(b->s, Mp, v, D, b->o, m0, d0, rows, V16_UNITS);
            for (; d0 < D; d0 += 16) tile_values_rows(b->s, Mp, v, D, b->o, m0, d0, rows, 1);
        }
    }
    for (int64_t m = 0; m < M; m++) {
        v16 inv = v16_set1(1.0f / b->l[m]);
        float *out = o[m / group] + (m % group) * D;
        for (int64_t d = 0; d < D; d += 16) v16_store(out + d, v16_mul(v16_load(b->o + m * D + d), inv));
    }
}

/* Prefill chunks: chunk g's q_lens[g] query rows start at row q_start[g] of q (rows sq apart) and
 * are the last q_lens[g] of its seq_lens[g] positions (their K/V already in the cache); row j sees
 * the positions up to its own. Outputs go to the same rows of out ([rows][H][D], dense). */
typedef struct {
    attn_ctx a;
    const int64_t *q_start;
    const int32_t *q_lens;
    const int32_t *chunk_lens;
    const int64_t *tile_chunk; /* the chunk of each tile */
    const int64_t *tile_row;   /* its first row within the chunk */
    const int64_t *tile_len;   /* its rows: ATTN_ROWS at most for the 4-row path, more in a GEMM tile */
    int64_t tiles;
    int64_t tile_mp; /* lanes of the largest GEMM tile (0: none) */
} prefill_ctx;

/* items are (row tile, kv head) pairs, kv head outer */
static inline __attribute__((always_inline)) void prefill_attention_range_w(void *p, int64_t begin, int64_t end,
                                                                            int kt) {
    prefill_ctx *c = (prefill_ctx *)p;
    int64_t H = c->a.H, Hk = c->a.Hk, D = c->a.D, group = H / Hk;
    tile_buf tb;
    float *tile_mem = NULL;
    for (int64_t task = begin; task < end; task++) {
        int64_t t = task % c->tiles, kh = task / c->tiles, g = c->tile_chunk[t], j0 = c->tile_row[t];
        int64_t R = c->tile_len[t], first_pos = c->chunk_lens[g] - c->q_lens[g];
        const float *q[FT_MAX_ROWS];
        float *o[FT_MAX_ROWS];
        int64_t last[FT_MAX_ROWS];
        for (int64_t r = 0; r < R; r++) {
            int64_t row = c->q_start[g] + j0 + r;
            last[r] = first_pos + j0 + r;
            q[r] = c->a.q + row * c->a.sq + kh * group * D;
            o[r] = c->a.out + (row * H + kh * group) * D;
        }
        const int32_t *table = c->a.block_tables + g * c->a.max_blocks;
        if (c->tile_mp && tile_uses_gemm(c->q_lens[g], c->chunk_lens[g], group, D)) {
            if (!tile_mem && !(tile_mem = tile_buf_alloc(&tb, c->tile_mp, D))) {
                atomic_store(&c->a.failed, 1);
                return;
            }
            attend_tile_w(&c->a, table, kh, R, q, o, last, &tb, kt);
            continue;
        }
        float *scores = (float *)malloc(sizeof(float) * (size_t)(R * group * (last[R - 1] + 1) + 8));
        if (!scores) {
            atomic_store(&c->a.failed, 1);
            break;
        }
        attend_rows_w(&c->a, table, kh, 1, R, q, o, last, scores, NULL, kt);
        free(scores);
    }
    free(tile_mem);
}

static void prefill_attention_range(void *p, int64_t begin, int64_t end) {
    prefill_attention_range_w(p, begin, end, W_F32);
}
static void prefill_attention_range_bf16(void *p, int64_t begin, int64_t end) {
    prefill_attention_range_w(p, begin, end, W_BF16);
}
static void prefill_attention_range_f16(void *p, int64_t begin, int64_t end) {
    prefill_attention_range_w(p, begin, end, W_F16);
}
static void prefill_attention_range_f8(void *p, int64_t begin, int64_t end) {
    prefill_attention_range_w(p, begin, end, W_F8);
}
#if PLINTH_AVX512 && PLINTH_AMX
/* a bf16 or fp8 cache where c->a.amx: the GEMM tiles' scores on AMX tiles (configured for the range) */
static void prefill_attention_range_amx(void *p, int64_t begin, int64_t end) {
    amx_attn_configure();
    prefill_attention_range_w(p, begin, end, W_BF16);
    amx_attn_release();
}
static void prefill_attention_range_amx_f8(void *p, int64_t begin, int64_t end) {
    amx_attn_configure();
    prefill_attention_range_w(p, begin, end, W_F8);
    amx_attn_release();
}
#endif

/* Returns 0, or -1 when out of memory. Every q_len must be >= 1 and <= its chunk's seq_len. kt: the
 * cache's element kind, as for decodes. */
int plinth_prefill_attention(int kt, const float *q, int64_t sq, const void *cache, const int32_t *block_tables,
                             int64_t max_blocks, const int64_t *q_start, const int32_t *q_lens, const int32_t *seq_lens,
                             float *out, int64_t G, int64_t H, int64_t Hk, int64_t D, int64_t bs, int64_t num_blocks,
                             float scale, int64_t window, float soft_cap) {
    int64_t group = H / Hk, big = tile_rows_for(group), tiles = 0, work = 0, tile_mp = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t rows = tile_uses_gemm(q_lens[g], seq_lens[g], group, D) ? big : ATTN_ROWS;
        tiles += (q_lens[g] + rows - 1) / rows, work += (int64_t)q_lens[g] * seq_lens[g];
        if (rows == big) tile_mp = (big * group + 15) / 16 * 16;
    }
    int64_t *tile_chunk = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * tiles + 1));
    if (!tile_chunk) return -1;
    int64_t *tile_row = tile_chunk + tiles, *tile_len = tile_row + tiles, t = 0;
    for (int64_t g = 0; g < G; g++) {
        int64_t rows = tile_uses_gemm(q_lens[g], seq_lens[g], group, D) ? big : ATTN_ROWS;
        for (int64_t j = 0; j < q_lens[g]; j += rows, t++)
            tile_chunk[t] = g, tile_row[t] = j, tile_len[t] = q_lens[g] - j < rows ? q_lens[g] - j : rows;
    }
    prefill_ctx c = {{q, sq, cache, block_tables, max_blocks, NULL, out, 0, H, Hk, D, bs, num_blocks, scale, window,
                      soft_cap, 0, 0},
                     q_start, q_lens, seq_lens, tile_chunk, tile_row, tile_len, tiles, tile_mp};
    /* items of at least ~64k multiply-adds, as for decodes */
    int64_t per_item = (work / (tiles ? tiles : 1) + 1) * (H / Hk) * D * 2;
    void (*range)(void *, int64_t, int64_t) = kt == W_BF16  ? prefill_attention_range_bf16
                                                : kt == W_F16 ? prefill_attention_range_f16
                                                : kt == W_F8  ? prefill_attention_range_f8
                                                              : prefill_attention_range;
#if PLINTH_AVX512 && PLINTH_AMX
    if ((kt == W_BF16 || kt == W_F8) && tile_mp && bs % FT_KEYS == 0 && D % 32 == 0 && plinth_amx_bf16(-1))
        c.a.amx = 1, range = kt == W_F8 ? prefill_attention_range_amx_f8 : prefill_attention_range_amx;
#endif
    parallel_for(range, &c, tiles * Hk, 65536 / per_item + 1);
    free(tile_chunk);
    return atomic_load(&c.a.failed) ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Step graphs: a recorded sequence of the calls above, replayed in one call. The Python side
 * records each call's arguments as it runs once (native.py, NativeGraph); replaying skips the
 * Python that issued them (at batch 1 that Python cost as much as the arithmetic). Every pointer
 * is fixed at recording: the caller refills the same buffers before each replay. The op kinds,
 * the recorded-op struct (plinth_op) and the switch that runs one (run_op) are generated into abi.h.
 */

/* Runs ops[0..n) in order. Recorded with `captured` rows, the ops run over the first `rows`
 * (<= captured) only: every op kind with a row count works row by row, so an op whose row count
 * is `captured` is run with `rows` (the padding rows of a step graph's bucket cost nothing).
 * Returns 0, or i + 1 for the first op i that failed (out of memory), or -(i + 1) for an op i of an
 * unknown kind; the ops after a failure are not run. */
int64_t plinth_graph_run(const plinth_op *ops, int64_t n, int64_t captured, int64_t rows) {
    for (int64_t i = 0; i < n; i++) {
        const plinth_op *op = ops + i;
        plinth_op shrunk;
        int r = op_rows_arg(op->kind), failed;
        if (rows > 0 && rows < captured && r >= 0 && op->a[r] == captured) {
            shrunk = *op;
            shrunk.a[r] = rows;
            op = &shrunk;
        }
        failed = run_op(op);
        if (failed < 0) return -(i + 1);
        if (failed) return i + 1;
    }
    return 0;
}
