/*
 * The AVX-512 build's instructions in portable code, for testing its paths on any x86-64 host.
 *
 * kernels.c includes this instead of <immintrin.h> when built with -DPLINTH_EMULATE (native.py's
 * PLINTH_CPU_EMULATE=1): the AVX-512 F/BW/VL/DQ/VNNI/BF16 intrinsics come from SIMDe (SIMD Everywhere,
 * the simde-py package's headers, which implement each in AVX2 or scalar code where the CPU lacks
 * it), the few SIMDe lacks and the AMX tile instructions from here. The result computes what the
 * AVX-512 and AMX paths compute, on a CPU that has neither: a correctness build, several times
 * slower, never chosen by itself. AVX2, FMA and F16C stay native (SIMDe passes them through).
 *
 * The AMX tiles follow the instruction set reference: eight tiles of up to 16 rows of 64 bytes per
 * thread, shaped by the 64-byte configuration TILELOADCONFIG reads (palette 1); a load fills a tile's
 * configured rows and bytes and zeroes the rest; TDPBF16PS adds to each fp32 C[m][n] the products
 * A[m][2k] B[k][2n] and A[m][2k + 1] B[k][2n + 1] over the bf16 pairs k of A's row. The hardware
 * flushes bf16 inputs below the normal range to zero and rounds to nearest even; so does this.
 */
#ifndef PLINTH_EMULATE_H
#define PLINTH_EMULATE_H

#define SIMDE_ENABLE_NATIVE_ALIASES
/* immediates the compiler folds only after unrolling (a shift by 4 * s in an unrolled loop): clang checks
 * SIMDe's immediate arguments before that, gcc after */
#define SIMDE_NO_CHECK_IMMEDIATE_CONSTANT
#if defined(__clang__)
#define __mmask64 __mmask64 /* clang's <immintrin.h>, which SIMDe includes, has it: SIMDe must not typedef it again */
#endif
#include <simde/x86/avx512.h>
#include <stdint.h>
#include <string.h>

/* ---- AVX-512 intrinsics SIMDe (0.8.2) lacks: lane by lane through memory ---- */

static inline __m256i plinth_emu_cvtepi32_epi16(__m512i a) {
    int32_t s[16];
    int16_t d[16];
    _mm512_storeu_si512(s, a);
    for (int i = 0; i < 16; i++) d[i] = (int16_t)s[i]; /* truncation, as VPMOVDW */
    return _mm256_loadu_si256((const __m256i *)d);
}
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) plinth_emu_cvtepi32_epi16(a)

static inline __m512i plinth_emu_cvtepu8_epi16(__m256i a) {
    uint8_t s[32];
    int16_t d[32];
    _mm256_storeu_si256((__m256i *)s, a);
    for (int i = 0; i < 32; i++) d[i] = s[i];
    return _mm512_loadu_si512(d);
}
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) plinth_emu_cvtepu8_epi16(a)

/* F16C is native: two 8-lane conversions */
#undef _mm512_cvtps_ph
#define _mm512_cvtps_ph(a, rounding)                                                                        \
    _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(_mm512_castps512_ps256(a), (rounding))), \
                            _mm256_cvtps_ph(_mm512_extractf32x8_ps((a), 1), (rounding)), 1)

static inline int plinth_emu_reduce_or_epi32(__m512i a) {
    int32_t s[16], r = 0;
    _mm512_storeu_si512(s, a);
    for (int i = 0; i < 16; i++) r |= s[i];
    return r;
}
#undef _mm512_reduce_or_epi32
#define _mm512_reduce_or_epi32(a) plinth_emu_reduce_or_epi32(a)

/* Masked loads and stores touch only the lanes their mask selects, as the hardware's do (SIMDe's
 * write every lane: zeros past the end of a row, into whatever follows it). */
static inline void plinth_emu_mask_storeu_ps(void *p, __mmask16 k, __m512 a) {
    float s[16];
    _mm512_storeu_ps(s, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((float *)p + i, s + i, 4);
}
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) plinth_emu_mask_storeu_ps((p), (k), (a))

static inline __m512 plinth_emu_maskz_loadu_ps(__mmask16 k, const void *p) {
    float d[16];
    for (int i = 0; i < 16; i++) {
        d[i] = 0.0f;
        if ((k >> i) & 1) memcpy(d + i, (const float *)p + i, 4);
    }
    return _mm512_loadu_ps(d);
}
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) plinth_emu_maskz_loadu_ps((k), (p))

static inline void plinth_emu_mask_storeu_epi16_256(void *p, __mmask16 k, __m256i a) {
    uint16_t s[16];
    _mm256_storeu_si256((__m256i *)s, a);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy((uint16_t *)p + i, s + i, 2);
}
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, a) plinth_emu_mask_storeu_epi16_256((p), (k), (a))

/* fp32 -> bf16, round to nearest even (NaN stays a quiet NaN), as VCVTNEPS2BF16 */
static inline uint16_t plinth_emu_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

static inline __m256bh plinth_emu_cvtneps_pbh(__m512 a) {
    float s[16];
    uint16_t d[16];
    __m256bh r;
    _mm512_storeu_ps(s, a);
    for (int i = 0; i < 16; i++) d[i] = plinth_emu_bf16(s[i]);
    memcpy(&r, d, sizeof r);
    return r;
}
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(a) plinth_emu_cvtneps_pbh(a)

/* ---- AMX: the tile registers of the calling thread ---- */

typedef struct {
    int rows, colsb;
    _Alignas(64) uint8_t data[16][64];
} plinth_emu_tile;

static __thread plinth_emu_tile plinth_emu_tiles[8];
static __thread int plinth_emu_configured;

/* the palette-1 configuration: byte 0 palette, bytes 16.. colsb (uint16 x 16), bytes 48.. rows (uint8 x 16) */
static inline void plinth_emu_tile_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        plinth_emu_tiles[t].colsb = colsb;
        plinth_emu_tiles[t].rows = c[48 + t];
        memset(plinth_emu_tiles[t].data, 0, sizeof plinth_emu_tiles[t].data);
    }
    plinth_emu_configured = c[0] == 1;
}

static inline plinth_emu_tile *plinth_emu_tile_at(int t) {
    if (!plinth_emu_configured || t < 0 || t > 7) __builtin_trap(); /* the hardware faults (#UD) */
    return &plinth_emu_tiles[t];
}

static inline void plinth_emu_tile_loadd(int t, const void *base, long stride) {
    plinth_emu_tile *r = plinth_emu_tile_at(t);
    memset(r->data, 0, sizeof r->data);
    for (int i = 0; i < r->rows; i++) memcpy(r->data[i], (const uint8_t *)base + i * stride, (size_t)r->colsb);
}

static inline void plinth_emu_tile_stored(int t, void *base, long stride) {
    plinth_emu_tile *r = plinth_emu_tile_at(t);
    for (int i = 0; i < r->rows; i++) memcpy((uint8_t *)base + i * stride, r->data[i], (size_t)r->colsb);
}

static inline void plinth_emu_tile_zero(int t) { memset(plinth_emu_tile_at(t)->data, 0, sizeof plinth_emu_tiles[0].data); }

/* a bf16 widened, inputs below the normal range flushed to zero (the instruction's DAZ) */
static inline float plinth_emu_bf16_in(uint16_t h) {
    uint32_t u = (h & 0x7F80u) ? (uint32_t)h << 16 : (uint32_t)(h & 0x8000u) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* C[m][n] += A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over k: the tiles widened to fp32 first (each
 * product of two bf16 is exact in fp32, so the order of the two adds is the instruction's) */
static inline void plinth_emu_tile_dpbf16ps(int tc, int ta, int tb) {
    plinth_emu_tile *c = plinth_emu_tile_at(tc), *a = plinth_emu_tile_at(ta), *b = plinth_emu_tile_at(tb);
    int pairs = a->colsb / 4, cols = c->colsb / 4;
    if (b->rows < pairs || b->colsb < c->colsb) __builtin_trap(); /* shapes the hardware refuses */
    float aw[16][32], be[16][16], bo[16][16], acc[16];
    for (int m = 0; m < c->rows; m++)
        for (int k = 0; k < 2 * pairs; k++) {
            uint16_t h;
            memcpy(&h, a->data[m] + 2 * k, 2);
            aw[m][k] = plinth_emu_bf16_in(h);
        }
    for (int k = 0; k < pairs; k++)
        for (int n = 0; n < 16; n++) {
            uint16_t h0 = 0, h1 = 0;
            if (n < cols) memcpy(&h0, b->data[k] + 4 * n, 2), memcpy(&h1, b->data[k] + 4 * n + 2, 2);
            be[k][n] = plinth_emu_bf16_in(h0), bo[k][n] = plinth_emu_bf16_in(h1);
        }
    for (int m = 0; m < c->rows; m++) {
        memcpy(acc, c->data[m], 64);
        for (int k = 0; k < pairs; k++)
            for (int n = 0; n < 16; n++) { /* vectorised by the compiler: 16 independent lanes */
                acc[n] += aw[m][2 * k] * be[k][n];
                acc[n] += aw[m][2 * k + 1] * bo[k][n];
            }
        memcpy(c->data[m], acc, (size_t)cols * 4);
    }
}

/* C[m][n] += sum over k and j < 4 of A[m][4k + j] B[k][4n + j], A's and B's bytes signed or unsigned as
 * the instruction names them (TDPBSSD: both signed, TDPBSUD: A signed, B unsigned, ...); exact in
 * 32 bits, wrapping as the hardware does */
static inline void plinth_emu_tile_dpb(int tc, int ta, int tb, int a_signed, int b_signed) {
    plinth_emu_tile *c = plinth_emu_tile_at(tc), *a = plinth_emu_tile_at(ta), *b = plinth_emu_tile_at(tb);
    int quads = a->colsb / 4, cols = c->colsb / 4;
    if (b->rows < quads || b->colsb < c->colsb) __builtin_trap(); /* shapes the hardware refuses */
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < cols; n++) {
            uint32_t acc;
            memcpy(&acc, c->data[m] + 4 * n, 4);
            for (int k = 0; k < quads; k++)
                for (int j = 0; j < 4; j++) {
                    uint8_t ab = a->data[m][4 * k + j], bb = b->data[k][4 * n + j];
                    int32_t av = a_signed ? (int8_t)ab : ab, bv = b_signed ? (int8_t)bb : bb;
                    acc += (uint32_t)(av * bv);
                }
            memcpy(c->data[m] + 4 * n, &acc, 4);
        }
}

static inline void plinth_emu_tile_release(void) {
    memset(plinth_emu_tiles, 0, sizeof plinth_emu_tiles);
    plinth_emu_configured = 0;
}

#undef _tile_loadconfig
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_release
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#define _tile_loadconfig(config) plinth_emu_tile_loadconfig(config)
#define _tile_loadd(t, base, stride) plinth_emu_tile_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) plinth_emu_tile_stored((t), (base), (long)(stride))
#define _tile_zero(t) plinth_emu_tile_zero(t)
#define _tile_dpbf16ps(c, a, b) plinth_emu_tile_dpbf16ps((c), (a), (b))
#define _tile_release() plinth_emu_tile_release()
#define _tile_dpbssd(c, a, b) plinth_emu_tile_dpb((c), (a), (b), 1, 1)
#define _tile_dpbsud(c, a, b) plinth_emu_tile_dpb((c), (a), (b), 1, 0)
#define _tile_dpbusd(c, a, b) plinth_emu_tile_dpb((c), (a), (b), 0, 1)
#define _tile_dpbuud(c, a, b) plinth_emu_tile_dpb((c), (a), (b), 0, 0)

#endif
