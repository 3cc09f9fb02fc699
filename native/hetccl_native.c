/* hetccl native kernels: element-wise reductions and shared-memory synchronisation.
 *
 * Built by native/build.py (cffi, API mode) into hetccl._native; also compiles standalone:
 *     gcc -O3 -std=gnu11 -fno-strict-aliasing -c native/hetccl_native.c -fopt-info-vec
 *
 * Design notes
 *  - Every (dtype, op) pair has four restrict-qualified kernels (in-place, out-of-place, and both with a
 *    second output) plus one alias-safe fallback. The entry points check which pointers are equal or
 *    overlap and pick the restrict kernel only when that is legal, so the hot loops vectorise without
 *    runtime alias checks.
 *  - On x86_64 with gcc/glibc the kernels are built twice with function multi-versioning
 *    (target_clones: x86-64-v3 = AVX2/FMA/F16C, and the baseline); the dynamic loader picks one per
 *    CPU through an ifunc, so the one binary is fast on AVX2 machines and still runs everywhere.
 *  - float16 <-> float32 conversions are branch-free portable bit manipulation (exact widening;
 *    round-to-nearest-even narrowing with subnormals, overflow to inf, NaN kept as a quiet NaN), written
 *    so that the compiler vectorises them for any target; bfloat16 likewise. On x86_64 CPUs with AVX2
 *    and F16C, hand-written intrinsic kernels (F16C vcvtph2ps/vcvtps2ph; bfloat16 by integer
 *    rounding) replace them at run time; both give bit-identical results (except which NaN payload
 *    comes out of an operation on two NaNs, which IEEE leaves open).
 *  - Integer sum/prod are done in the unsigned type (wrap-around, no undefined behaviour).
 *  - dst is peeled to 32-byte alignment first: split-cache-line vector stores cost ~30% on in-cache data.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <math.h>
#include <sched.h>
#include <time.h>
#if defined(__linux__)
#include <errno.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#define HCCL_CMA 1
#else
#define HCCL_CMA 0
#endif

#include "hetccl_native.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && \
    !defined(HCCL_NO_TARGET_CLONES)
#define HCCL_CLONES 1
#define HCCL_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define HCCL_CLONES 0
#define HCCL_HOT
#endif

/* explicit AVX2/F16C kernels for float16/bfloat16, chosen at run time when the CPU has them (the
 * compiler cannot vectorise the F16C conversions itself, and the bfloat16 packing is tighter by hand) */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(HCCL_NO_EXPLICIT_SIMD)
#define HCCL_X86_SIMD 1
#include <immintrin.h>
#else
#define HCCL_X86_SIMD 0
#endif

#if defined(__GNUC__)
#define HCCL_INLINE static inline __attribute__((always_inline))
#else
#define HCCL_INLINE static inline
#endif

/* ------------------------------------------------------------------------------------------------ */
/* float16 / bfloat16 <-> float32                                                                    */
/* ------------------------------------------------------------------------------------------------ */

HCCL_INLINE float hccl_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

HCCL_INLINE uint32_t hccl_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* IEEE binary16 -> binary32, exact. */
HCCL_INLINE float hccl_h2f(uint16_t h)
{
    uint32_t a = (uint32_t)h & 0x7fffu;
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t normal = (a << 13) + 0x38000000u;          /* rebias exponent: (127 - 15) << 23 */
    uint32_t infnan = (a << 13) | 0x7f800000u;          /* inf, or NaN with its payload */
    uint32_t subnormal = hccl_f32_bits((float)(int32_t)a * 0x1p-24f); /* m * 2^-24, exact */
    /* branch-free selects (bit masks) so that the float ops above are not sunk into branches, which
     * would stop if-conversion and vectorisation under the default -ftrapping-math */
    uint32_t m_sub = 0u - (uint32_t)(a < 0x0400u);
    uint32_t m_inf = 0u - (uint32_t)(a >= 0x7c00u);
    uint32_t r = (subnormal & m_sub) | (normal & ~m_sub);
    r = (infnan & m_inf) | (r & ~m_inf);
    return hccl_bits_f32(r | sign);
}

/* IEEE binary32 -> binary16, round to nearest even; overflow -> inf; NaN -> quiet NaN (sign and the top
 * payload bits kept, as the F16C instruction does). */
HCCL_INLINE uint16_t hccl_f2h(float f)
{
    uint32_t u = hccl_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    /* normal range: rebias, then round the 13 dropped bits to nearest even (a carry into the
     * exponent is correct, including the carry to inf at 65520) */
    uint32_t normal = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    /* below 2^-14: adding 0.5f aligns the result's ulp (2^-24) with float's ulp at 0.5, so the FP add
     * does the round-to-nearest-even; the low bits are then the binary16 subnormal (or 0x0400) */
    uint32_t subnormal = hccl_f32_bits(hccl_bits_f32(a) + 0.5f) - 0x3f000000u;
    uint32_t special = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x03ffu)) : 0x7c00u;
    uint32_t m_sub = 0u - (uint32_t)(a < 0x38800000u);
    uint32_t m_big = 0u - (uint32_t)(a >= 0x47800000u);
    uint32_t r = (subnormal & m_sub) | (normal & ~m_sub);
    r = (special & m_big) | (r & ~m_big);
    return (uint16_t)(r | sign);
}

/* bfloat16 -> float32: the upper 16 bits, exact. */
HCCL_INLINE float hccl_b2f(uint16_t h)
{
    return hccl_bits_f32((uint32_t)h << 16);
}

/* float32 -> bfloat16, round to nearest even (overflow -> inf); NaN -> quiet NaN (sign, top payload kept). */
HCCL_INLINE uint16_t hccl_f2b(float f)
{
    uint32_t u = hccl_f32_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t qnan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? qnan : rounded);
}

/* ------------------------------------------------------------------------------------------------ */
/* element ops                                                                                       */
/* ------------------------------------------------------------------------------------------------ */

#define HCCL_ID(x) (x)

/* integers: T is the (signed or unsigned) storage type, U the unsigned type of the same width */
#define HCCL_ISUM(T, U, a, b) ((T)((U)(a) + (U)(b)))
#define HCCL_IPROD(T, U, a, b) ((T)((U)(a) * (U)(b)))
#define HCCL_IMIN(T, U, a, b) ((a) < (b) ? (a) : (b))
#define HCCL_IMAX(T, U, a, b) ((a) > (b) ? (a) : (b))

/* floats: NaN-propagating min/max (numpy.minimum/maximum); equal operands give b */
#define HCCL_FSUM(T, U, a, b) ((a) + (b))
#define HCCL_FPROD(T, U, a, b) ((a) * (b))
#define HCCL_FMIN(T, U, a, b) ((((a) < (b)) | ((a) != (a))) ? (a) : (b))
#define HCCL_FMAX(T, U, a, b) ((((a) > (b)) | ((a) != (a))) ? (a) : (b))

/* ------------------------------------------------------------------------------------------------ */
/* kernels                                                                                           */
/* ------------------------------------------------------------------------------------------------ */

typedef void (*hccl_k2_fn)(void *restrict x, const void *restrict y, size_t n);
typedef void (*hccl_k3_fn)(void *restrict d, const void *restrict a, const void *restrict b, size_t n);
typedef void (*hccl_k2d_fn)(void *restrict x, void *restrict d2, const void *restrict y, size_t n);
typedef void (*hccl_k3d_fn)(void *restrict d, void *restrict d2, const void *restrict a,
                            const void *restrict b, size_t n);
typedef void (*hccl_kany_fn)(void *d, void *d2, const void *a, const void *b, size_t n);

typedef struct {
    hccl_k2_fn ip;    /* x = x op y;            x, y disjoint */
    hccl_k3_fn oop;   /* d = a op b;            d disjoint from a and b */
    hccl_k2d_fn ipd;  /* x = d2 = x op y;       x, y, d2 pairwise disjoint */
    hccl_k3d_fn oopd; /* d = d2 = a op b;       d, d2 disjoint from each other and from a, b */
    hccl_kany_fn any; /* any aliasing; d2 may be NULL */
} hccl_kset;

/* NAME: prefix; T: storage type; U: unsigned twin (ints); CT: compute type; LD/ST: storage<->compute;
 * OP: one of the HCCL_?SUM/PROD/MIN/MAX macros */
#define HCCL_DEF_KERNELS(NAME, T, U, CT, LD, ST, OP)                                                    \
    HCCL_HOT static void NAME##_ip(void *restrict xv, const void *restrict yv, size_t n)               \
    {                                                                                                   \
        T *restrict x = (T *)xv;                                                                        \
        const T *restrict y = (const T *)yv;                                                            \
        for (size_t i = 0; i < n; i++) {                                                                \
            CT va = LD(x[i]);                                                                           \
            CT vb = LD(y[i]);                                                                           \
            x[i] = ST(OP(CT, U, va, vb));                                                               \
        }                                                                                               \
    }                                                                                                   \
    HCCL_HOT static void NAME##_oop(void *restrict dv, const void *restrict av, const void *restrict bv, \
                                    size_t n)                                                           \
    {                                                                                                   \
        T *restrict d = (T *)dv;                                                                        \
        const T *restrict a = (const T *)av;                                                            \
        const T *restrict b = (const T *)bv;                                                            \
        for (size_t i = 0; i < n; i++) {                                                                \
            CT va = LD(a[i]);                                                                           \
            CT vb = LD(b[i]);                                                                           \
            d[i] = ST(OP(CT, U, va, vb));                                                               \
        }                                                                                               \
    }                                                                                                   \
    HCCL_HOT static void NAME##_ipd(void *restrict xv, void *restrict d2v, const void *restrict yv,    \
                                    size_t n)                                                           \
    {                                                                                                   \
        T *restrict x = (T *)xv;                                                                        \
        T *restrict d2 = (T *)d2v;                                                                      \
        const T *restrict y = (const T *)yv;                                                            \
        for (size_t i = 0; i < n; i++) {                                                                \
            CT va = LD(x[i]);                                                                           \
            CT vb = LD(y[i]);                                                                           \
            T r = ST(OP(CT, U, va, vb));                                                                \
            x[i] = r;                                                                                   \
            d2[i] = r;                                                                                  \
        }                                                                                               \
    }                                                                                                   \
    HCCL_HOT static void NAME##_oopd(void *restrict dv, void *restrict d2v, const void *restrict av,   \
                                     const void *restrict bv, size_t n)                                 \
    {                                                                                                   \
        T *restrict d = (T *)dv;                                                                        \
        T *restrict d2 = (T *)d2v;                                                                      \
        const T *restrict a = (const T *)av;                                                            \
        const T *restrict b = (const T *)bv;                                                            \
        for (size_t i = 0; i < n; i++) {                                                                \
            CT va = LD(a[i]);                                                                           \
            CT vb = LD(b[i]);                                                                           \
            T r = ST(OP(CT, U, va, vb));                                                                \
            d[i] = r;                                                                                   \
            d2[i] = r;                                                                                  \
        }                                                                                               \
    }                                                                                                   \
    /* alias-safe: element i is read completely before it is written, so exact aliasing of any of     \
     * the pointers is fine (partial overlap is outside the contract but still well defined) */        \
    static void NAME##_any(void *dv, void *d2v, const void *av, const void *bv, size_t n)              \
    {                                                                                                   \
        T *d = (T *)dv;                                                                                 \
        T *d2 = (T *)d2v;                                                                               \
        const T *a = (const T *)av;                                                                     \
        const T *b = (const T *)bv;                                                                     \
        if (d2 == NULL) {                                                                               \
            for (size_t i = 0; i < n; i++) {                                                            \
                CT va = LD(a[i]);                                                                       \
                CT vb = LD(b[i]);                                                                       \
                d[i] = ST(OP(CT, U, va, vb));                                                           \
            }                                                                                           \
        } else {                                                                                        \
            for (size_t i = 0; i < n; i++) {                                                            \
                CT va = LD(a[i]);                                                                       \
                CT vb = LD(b[i]);                                                                       \
                T r = ST(OP(CT, U, va, vb));                                                            \
                d[i] = r;                                                                               \
                d2[i] = r;                                                                              \
            }                                                                                           \
        }                                                                                               \
    }

#define HCCL_KSET(NAME) {NAME##_ip, NAME##_oop, NAME##_ipd, NAME##_oopd, NAME##_any}

/* the four ops for one integer dtype */
#define HCCL_DEF_INT(SFX, T, U)                                                                         \
    HCCL_DEF_KERNELS(hccl_sum_##SFX, T, U, T, HCCL_ID, HCCL_ID, HCCL_ISUM)                              \
    HCCL_DEF_KERNELS(hccl_prod_##SFX, T, U, T, HCCL_ID, HCCL_ID, HCCL_IPROD)                            \
    HCCL_DEF_KERNELS(hccl_min_##SFX, T, U, T, HCCL_ID, HCCL_ID, HCCL_IMIN)                              \
    HCCL_DEF_KERNELS(hccl_max_##SFX, T, U, T, HCCL_ID, HCCL_ID, HCCL_IMAX)

/* the four ops for one float dtype */
#define HCCL_DEF_FLT(SFX, T, CT, LD, ST)                                                                \
    HCCL_DEF_KERNELS(hccl_sum_##SFX, T, T, CT, LD, ST, HCCL_FSUM)                                       \
    HCCL_DEF_KERNELS(hccl_prod_##SFX, T, T, CT, LD, ST, HCCL_FPROD)                                     \
    HCCL_DEF_KERNELS(hccl_min_##SFX, T, T, CT, LD, ST, HCCL_FMIN)                                       \
    HCCL_DEF_KERNELS(hccl_max_##SFX, T, T, CT, LD, ST, HCCL_FMAX)

HCCL_DEF_INT(i8, int8_t, uint8_t)
HCCL_DEF_INT(u8, uint8_t, uint8_t)
HCCL_DEF_INT(i32, int32_t, uint32_t)
HCCL_DEF_INT(i64, int64_t, uint64_t)
HCCL_DEF_FLT(f16, uint16_t, float, hccl_h2f, hccl_f2h)
HCCL_DEF_FLT(bf16, uint16_t, float, hccl_b2f, hccl_f2b)
HCCL_DEF_FLT(f32, float, float, HCCL_ID, HCCL_ID)
HCCL_DEF_FLT(f64, double, double, HCCL_ID, HCCL_ID)

#define HCCL_KROW(SFX) \
    {HCCL_KSET(hccl_sum_##SFX), HCCL_KSET(hccl_prod_##SFX), HCCL_KSET(hccl_min_##SFX), HCCL_KSET(hccl_max_##SFX)}

static const hccl_kset hccl_kernels[HCCL_NUM_DTYPES][HCCL_NUM_OPS] = {
    HCCL_KROW(i8), HCCL_KROW(u8), HCCL_KROW(i32), HCCL_KROW(i64),
    HCCL_KROW(f16), HCCL_KROW(bf16), HCCL_KROW(f32), HCCL_KROW(f64),
};

static const size_t hccl_sizes[HCCL_NUM_DTYPES] = {1, 1, 4, 8, 2, 2, 4, 8};

size_t hccl_dtype_size(int dtype)
{
    return (dtype >= 0 && dtype < HCCL_NUM_DTYPES) ? hccl_sizes[dtype] : 0;
}

/* [p, p+n) and [q, q+n) do not overlap */
HCCL_INLINE int hccl_disjoint(const void *p, const void *q, size_t n)
{
    uintptr_t x = (uintptr_t)p, y = (uintptr_t)q;
    return x >= y ? x - y >= n : y - x >= n;
}

/* ------------------------------------------------------------------------------------------------ */
/* explicit AVX2 + F16C kernels for float16 / bfloat16                                               */
/* ------------------------------------------------------------------------------------------------ */

#if HCCL_X86_SIMD
static int hccl_use_x16; /* set by the constructor: CPU has AVX2 and F16C */

#define HCCL_X16_TARGET __attribute__((target("avx2,f16c")))
#define HCCL_X16_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

/* 16 elements <-> two vectors of 8 floats (any fixed assignment of elements to lanes is fine for
 * element-wise work, as long as the store undoes the load) */
HCCL_X16_INLINE void hccl_x16_ld_f16(const uint16_t *p, __m256 *lo, __m256 *hi)
{
    *lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    *hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
}

HCCL_X16_INLINE void hccl_x16_st_f16(uint16_t *p, __m256 lo, __m256 hi)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* bfloat16 without shuffles: `lo` holds the even elements (x << 16), `hi` the odd ones (x & 0xffff0000) */
HCCL_X16_INLINE void hccl_x16_ld_bf16(const uint16_t *p, __m256 *lo, __m256 *hi)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* float32 -> bfloat16 in the high 16 bits of each 32-bit lane (same rounding as hccl_f2b) */
HCCL_X16_INLINE __m256i hccl_x16_round_bf16(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i q = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, q, nan);
}

HCCL_X16_INLINE void hccl_x16_st_bf16(uint16_t *p, __m256 lo, __m256 hi)
{
    __m256i even = _mm256_srli_epi32(hccl_x16_round_bf16(lo), 16);
    __m256i odd = _mm256_and_si256(hccl_x16_round_bf16(hi), _mm256_set1_epi32((int)0xffff0000u));
    _mm256_storeu_si256((__m256i *)p, _mm256_or_si256(even, odd));
}

HCCL_X16_INLINE __m256 hccl_x16_sum(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
HCCL_X16_INLINE __m256 hccl_x16_prod(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
/* min_ps/max_ps(a, b) return b unless a < b (a > b); then a NaN in a is put back: NaN-propagating, and
 * equal operands give b, exactly as HCCL_FMIN/HCCL_FMAX */
HCCL_X16_INLINE __m256 hccl_x16_min(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_min_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
HCCL_X16_INLINE __m256 hccl_x16_max(__m256 a, __m256 b)
{
    return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

/* d (and d2 unless NULL) = a OP b. Each block of 16 is loaded completely before it is stored, so any
 * pointers may be equal (partial overlaps go to the portable kernels). The tail goes through a
 * zero-padded stack block, so every element takes the same path. */
#define HCCL_DEF_X16(NAME, LD, ST, VOP)                                                                 \
    HCCL_X16_TARGET static void NAME(void *dv, void *d2v, const void *av, const void *bv, size_t n)    \
    {                                                                                                   \
        uint16_t *d = (uint16_t *)dv, *d2 = (uint16_t *)d2v;                                            \
        const uint16_t *a = (const uint16_t *)av, *b = (const uint16_t *)bv;                            \
        __m256 alo, ahi, blo, bhi;                                                                      \
        size_t i = 0;                                                                                   \
        if (d2 == NULL) {                                                                               \
            for (; i + 16 <= n; i += 16) {                                                              \
                LD(a + i, &alo, &ahi);                                                                  \
                LD(b + i, &blo, &bhi);                                                                  \
                ST(d + i, VOP(alo, blo), VOP(ahi, bhi));                                                \
            }                                                                                           \
        } else {                                                                                        \
            for (; i + 16 <= n; i += 16) {                                                              \
                LD(a + i, &alo, &ahi);                                                                  \
                LD(b + i, &blo, &bhi);                                                                  \
                __m256 rlo = VOP(alo, blo), rhi = VOP(ahi, bhi);                                        \
                ST(d + i, rlo, rhi);                                                                    \
                ST(d2 + i, rlo, rhi);                                                                   \
            }                                                                                           \
        }                                                                                               \
        if (i < n) {                                                                                    \
            uint16_t ta[16] = {0}, tb[16] = {0}, tr[16];                                                \
            size_t rest = (n - i) * sizeof(uint16_t);                                                   \
            memcpy(ta, a + i, rest);                                                                    \
            memcpy(tb, b + i, rest);                                                                    \
            LD(ta, &alo, &ahi);                                                                         \
            LD(tb, &blo, &bhi);                                                                         \
            ST(tr, VOP(alo, blo), VOP(ahi, bhi));                                                       \
            memcpy(d + i, tr, rest);                                                                    \
            if (d2 != NULL)                                                                             \
                memcpy(d2 + i, tr, rest);                                                               \
        }                                                                                               \
    }

HCCL_DEF_X16(hccl_x16_sum_f16, hccl_x16_ld_f16, hccl_x16_st_f16, hccl_x16_sum)
HCCL_DEF_X16(hccl_x16_prod_f16, hccl_x16_ld_f16, hccl_x16_st_f16, hccl_x16_prod)
HCCL_DEF_X16(hccl_x16_min_f16, hccl_x16_ld_f16, hccl_x16_st_f16, hccl_x16_min)
HCCL_DEF_X16(hccl_x16_max_f16, hccl_x16_ld_f16, hccl_x16_st_f16, hccl_x16_max)
HCCL_DEF_X16(hccl_x16_sum_bf16, hccl_x16_ld_bf16, hccl_x16_st_bf16, hccl_x16_sum)
HCCL_DEF_X16(hccl_x16_prod_bf16, hccl_x16_ld_bf16, hccl_x16_st_bf16, hccl_x16_prod)
HCCL_DEF_X16(hccl_x16_min_bf16, hccl_x16_ld_bf16, hccl_x16_st_bf16, hccl_x16_min)
HCCL_DEF_X16(hccl_x16_max_bf16, hccl_x16_ld_bf16, hccl_x16_st_bf16, hccl_x16_max)

/* [HCCL_FLOAT16 - 4 or HCCL_BFLOAT16 - 4][op] */
static const hccl_kany_fn hccl_x16_kernels[2][HCCL_NUM_OPS] = {
    {hccl_x16_sum_f16, hccl_x16_prod_f16, hccl_x16_min_f16, hccl_x16_max_f16},
    {hccl_x16_sum_bf16, hccl_x16_prod_bf16, hccl_x16_min_bf16, hccl_x16_max_bf16},
};

#define HCCL_DEF_X16_DIV(NAME, LD, ST)                                                                  \
    HCCL_X16_TARGET static void NAME(void *xv, size_t n, float div)                                     \
    {                                                                                                   \
        uint16_t *x = (uint16_t *)xv;                                                                   \
        __m256 vd = _mm256_set1_ps(div), lo, hi;                                                        \
        size_t i = 0;                                                                                   \
        for (; i + 16 <= n; i += 16) {                                                                  \
            LD(x + i, &lo, &hi);                                                                        \
            ST(x + i, _mm256_div_ps(lo, vd), _mm256_div_ps(hi, vd));                                    \
        }                                                                                               \
        if (i < n) {                                                                                    \
            uint16_t t[16] = {0};                                                                       \
            size_t rest = (n - i) * sizeof(uint16_t);                                                   \
            memcpy(t, x + i, rest);                                                                     \
            LD(t, &lo, &hi);                                                                            \
            ST(t, _mm256_div_ps(lo, vd), _mm256_div_ps(hi, vd));                                        \
            memcpy(x + i, t, rest);                                                                     \
        }                                                                                               \
    }

HCCL_DEF_X16_DIV(hccl_x16_div_f16, hccl_x16_ld_f16, hccl_x16_st_f16)
HCCL_DEF_X16_DIV(hccl_x16_div_bf16, hccl_x16_ld_bf16, hccl_x16_st_bf16)
#endif /* HCCL_X86_SIMD */

/* p and q are equal or do not overlap (over n bytes) */
HCCL_INLINE int hccl_same_or_disjoint(const void *p, const void *q, size_t n)
{
    return p == q || hccl_disjoint(p, q, n);
}

/* ------------------------------------------------------------------------------------------------ */
/* reduce entry points                                                                               */
/* ------------------------------------------------------------------------------------------------ */

enum { HCCL_K_IP, HCCL_K_OOP, HCCL_K_IPD, HCCL_K_OOPD, HCCL_K_ANY, HCCL_K_X16 };

/* run the chosen kernel on elements [start, start + n) */
HCCL_INLINE void hccl_run(int kind, int dtype, int op, char *d, char *d2, const char *a, const char *b,
                          size_t start, size_t n)
{
    const hccl_kset *k = &hccl_kernels[dtype][op];
    size_t off = start * hccl_sizes[dtype];
    d += off;
    a += off;
    b += off;
    if (d2 != NULL)
        d2 += off;
    switch (kind) {
    case HCCL_K_IP:
        k->ip(d, b, n);
        break;
    case HCCL_K_OOP:
        k->oop(d, a, b, n);
        break;
    case HCCL_K_IPD:
        k->ipd(d, d2, b, n);
        break;
    case HCCL_K_OOPD:
        k->oopd(d, d2, a, b, n);
        break;
#if HCCL_X86_SIMD
    case HCCL_K_X16:
        hccl_x16_kernels[dtype - HCCL_FLOAT16][op](d, d2, a, b, n);
        break;
#endif
    default:
        k->any(d, d2, a, b, n);
        break;
    }
}

/* which kernel may run on these pointers (restrict ones only where nothing overlaps) */
static int hccl_pick(void *dst, void *dst2, const void *a, const void *b, size_t nb, int dtype)
{
#if HCCL_X86_SIMD
    /* the explicit kernels load each block completely before storing it: equal pointers are fine */
    if ((dtype == HCCL_FLOAT16 || dtype == HCCL_BFLOAT16) && hccl_use_x16 &&
        hccl_same_or_disjoint(dst, a, nb) && hccl_same_or_disjoint(dst, b, nb) &&
        (dst2 == NULL || (hccl_same_or_disjoint(dst2, dst, nb) && hccl_same_or_disjoint(dst2, a, nb) &&
                          hccl_same_or_disjoint(dst2, b, nb))))
        return HCCL_K_X16;
#else
    (void)dtype;
#endif
    if (dst2 == NULL) {
        if (dst == a)
            return hccl_disjoint(dst, b, nb) ? HCCL_K_IP : HCCL_K_ANY;
        return hccl_disjoint(dst, a, nb) && hccl_disjoint(dst, b, nb) ? HCCL_K_OOP : HCCL_K_ANY;
    }
    if (hccl_disjoint(dst2, dst, nb) && hccl_disjoint(dst2, a, nb) && hccl_disjoint(dst2, b, nb)) {
        if (dst == a)
            return hccl_disjoint(dst, b, nb) ? HCCL_K_IPD : HCCL_K_ANY;
        return hccl_disjoint(dst, a, nb) && hccl_disjoint(dst, b, nb) ? HCCL_K_OOPD : HCCL_K_ANY;
    }
    return HCCL_K_ANY;
}

/* Vector stores that straddle cache lines cost a lot when the data is in cache (measured: 87 vs 58 GB/s
 * for in-cache float32 with 16-byte vs 32-byte aligned buffers), and numpy hands out 16-byte aligned
 * memory. So the first few elements are done separately to make dst 32-byte aligned (the sources are
 * then aligned too whenever they share dst's misalignment, the usual case). */
#define HCCL_ALIGN 32
#define HCCL_PEEL_MIN_BYTES 256

int hccl_reduce3_dup(void *dst, void *dst2, const void *a, const void *b, size_t count, int dtype, int op)
{
    if (dtype < 0 || dtype >= HCCL_NUM_DTYPES || op < 0 || op >= HCCL_NUM_OPS)
        return -1;
    if (count == 0)
        return 0;
    size_t esize = hccl_sizes[dtype];
    size_t nb = count * esize;
    if (dst2 == dst)
        dst2 = NULL;
    int kind = hccl_pick(dst, dst2, a, b, nb, dtype);
    size_t head = 0;
    size_t mis = (size_t)((uintptr_t)dst % HCCL_ALIGN);
    if (mis != 0 && nb >= HCCL_PEEL_MIN_BYTES && (HCCL_ALIGN - mis) % esize == 0)
        head = (HCCL_ALIGN - mis) / esize;
    if (head != 0)
        hccl_run(kind, dtype, op, (char *)dst, (char *)dst2, (const char *)a, (const char *)b, 0, head);
    hccl_run(kind, dtype, op, (char *)dst, (char *)dst2, (const char *)a, (const char *)b, head, count - head);
    return 0;
}

int hccl_reduce3(void *dst, const void *a, const void *b, size_t count, int dtype, int op)
{
    return hccl_reduce3_dup(dst, NULL, a, b, count, dtype, op);
}

int hccl_reduce(void *dst, const void *src, size_t count, int dtype, int op)
{
    return hccl_reduce3_dup(dst, NULL, dst, src, count, dtype, op);
}

/* ------------------------------------------------------------------------------------------------ */
/* compressed wire formats (hetccl_native.h says what they are)                                      */
/* ------------------------------------------------------------------------------------------------ */

#define HCCL_TILE 1024 /* values widened or decoded at a time (on the stack, in L1) */

/* float32 -> e4m3fn code (in the low 8 bits), round to nearest even; |f| is at most 448 (the group's scale sees
 * to it); inf and NaN -> NaN. Branch-free selects, as hccl_f2h, so that the loops around it vectorise. */
HCCL_INLINE uint32_t hccl_f2e4m3(float f)
{
    uint32_t u = hccl_f32_bits(f);
    uint32_t a = u & 0x7fffffffu;
    uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - ((127u - 7u) << 3); /* exponent, 3 bits */
    /* below 2^-6 (subnormal, m * 2^-9): adding 2^14 aligns float's ulp with 2^-9, so the FP add rounds to
     * nearest even, and the low bits are m (m = 8 is the smallest normal's code) */
    uint32_t subnormal = hccl_f32_bits(hccl_bits_f32(a) + 16384.0f) - 0x46800000u;
    uint32_t m_sub = 0u - (uint32_t)(a < 0x3c800000u);
    uint32_t m_nan = 0u - (uint32_t)(a >= 0x7f800000u);
    uint32_t r = (subnormal & m_sub) | (normal & ~m_sub);
    r = (0x7fu & m_nan) | (r & ~m_nan);
    return r | ((u >> 24) & 0x80u);
}

static float hccl_e4m3_values[256];
static volatile int hccl_e4m3_ready;

/* the 256 codes' values: a lookup decodes faster than the arithmetic (measured on 2 AVX2 cores, 2026-12-04) */
static void hccl_e4m3_init(void)
{
    if (hccl_e4m3_ready)
        return;
    for (int c = 0; c < 256; c++) { /* the same values from every thread: a race is harmless */
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? (float)m * 0x1p-9f : (e == 15 && m == 7) ? __builtin_nanf("") : ldexpf(1.0f + m / 8.0f, e - 7);
        hccl_e4m3_values[c] = (c & 0x80) ? -v : v;
    }
    hccl_e4m3_ready = 1;
}

size_t hccl_wire_size(size_t count, int wire)
{
    switch (wire) {
    case HCCL_WIRE_BF16:
    case HCCL_WIRE_FP16:
        return 2 * count;
    case HCCL_WIRE_FP8:
        return 4 * ((count + HCCL_FP8_GROUP - 1) / HCCL_FP8_GROUP) + count;
    default:
        return 0;
    }
}

/* n <= HCCL_TILE values of src (dtype) as float32 into t; 0, or -1 for a dtype that is not a float */
static int hccl_widen(float *restrict t, const void *src, size_t n, int dtype)
{
    switch (dtype) {
    case HCCL_FLOAT16: for (size_t i = 0; i < n; i++) t[i] = hccl_h2f(((const uint16_t *)src)[i]); return 0;
    case HCCL_BFLOAT16: for (size_t i = 0; i < n; i++) t[i] = hccl_b2f(((const uint16_t *)src)[i]); return 0;
    case HCCL_FLOAT32: memcpy(t, src, n * sizeof(float)); return 0;
    case HCCL_FLOAT64: for (size_t i = 0; i < n; i++) t[i] = (float)((const double *)src)[i]; return 0;
    default: return -1;
    }
}

/* n <= HCCL_TILE float32 values of t into dst as dtype (a float dtype) */
static void hccl_narrow(void *dst, const float *restrict t, size_t n, int dtype)
{
    switch (dtype) {
    case HCCL_FLOAT16: for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = hccl_f2h(t[i]); break;
    case HCCL_BFLOAT16: for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = hccl_f2b(t[i]); break;
    case HCCL_FLOAT32: memcpy(dst, t, n * sizeof(float)); break;
    default: for (size_t i = 0; i < n; i++) ((double *)dst)[i] = (double)t[i]; break;
    }
}

HCCL_HOT static void hccl_pack_half(uint16_t *restrict dst, const float *restrict t, size_t n, int bf16)
{
    if (bf16)
        for (size_t i = 0; i < n; i++) dst[i] = hccl_f2b(t[i]);
    else
        for (size_t i = 0; i < n; i++) dst[i] = hccl_f2h(t[i]);
}

HCCL_HOT static void hccl_pack_fp8_group(uint8_t *restrict codes, float *restrict scale, const float *restrict t,
                                         size_t n)
{
    uint32_t top = 0; /* the largest finite magnitude: non-negative floats order as their bits do */
    for (size_t i = 0; i < n; i++) {
        uint32_t a = hccl_f32_bits(t[i]) & 0x7fffffffu;
        a &= 0u - (uint32_t)(a < 0x7f800000u);
        top = a > top ? a : top;
    }
    float amax = hccl_bits_f32(top);
    int k = 0;
    if (amax > 0.0f) {
        frexpf(amax / 448.0f, &k); /* amax / 448 < 2^k */
        if (ldexpf(448.0f, k - 1) >= amax)
            k -= 1;
        k = k < -126 ? -126 : k > 127 ? 127 : k;
    }
    float inv = ldexpf(1.0f, -k);
    *scale = ldexpf(1.0f, k);
    uint32_t wide[HCCL_TILE]; /* 32-bit lanes, then narrowed: one loop doing both spills registers (2x slower) */
    for (size_t i = 0; i < n; i++)
        wide[i] = hccl_f2e4m3(t[i] * inv);
    for (size_t i = 0; i < n; i++)
        codes[i] = (uint8_t)wide[i];
}

/* the tile of n values at element `at` of a packed buffer of `count` values: encode n float32 values */
static void hccl_encode_tile(void *dst, size_t count, size_t at, const float *v, size_t n, int wire)
{
    if (wire == HCCL_WIRE_FP8) {
        float s; /* HCCL_TILE == HCCL_FP8_GROUP: one group per tile */
        uint8_t *codes = (uint8_t *)dst + 4 * ((count + HCCL_FP8_GROUP - 1) / HCCL_FP8_GROUP);
        hccl_pack_fp8_group(codes + at, &s, v, n);
        memcpy((float *)dst + at / HCCL_FP8_GROUP, &s, sizeof s);
    } else {
        hccl_pack_half((uint16_t *)dst + at, v, n, wire == HCCL_WIRE_BF16);
    }
}

/* ... and decode one into float32 (hccl_e4m3_init done) */
static void hccl_decode_tile(float *restrict t, const void *src, size_t count, size_t at, size_t n, int wire)
{
    if (wire == HCCL_WIRE_FP8) {
        float s;
        const uint8_t *codes = (const uint8_t *)src + 4 * ((count + HCCL_FP8_GROUP - 1) / HCCL_FP8_GROUP);
        memcpy(&s, (const float *)src + at / HCCL_FP8_GROUP, sizeof s);
        for (size_t i = 0; i < n; i++) t[i] = hccl_e4m3_values[codes[at + i]] * s;
    } else if (wire == HCCL_WIRE_BF16) {
        for (size_t i = 0; i < n; i++) t[i] = hccl_b2f(((const uint16_t *)src)[at + i]);
    } else {
        for (size_t i = 0; i < n; i++) t[i] = hccl_h2f(((const uint16_t *)src)[at + i]);
    }
}

static int hccl_wire_args(int dtype, int wire, int op)
{
    if (dtype < HCCL_FLOAT16 || dtype > HCCL_FLOAT64 || hccl_wire_size(1, wire) == 0 || op >= HCCL_NUM_OPS)
        return -1;
    if (wire == HCCL_WIRE_FP8)
        hccl_e4m3_init();
    return 0;
}

int hccl_pack(void *dst, const void *src, size_t count, int dtype, int wire)
{
    float t[HCCL_TILE];
    size_t isz = hccl_dtype_size(dtype);
    if (hccl_wire_args(dtype, wire, -1))
        return -1;
    for (size_t at = 0; at < count; at += HCCL_TILE) {
        size_t n = count - at < HCCL_TILE ? count - at : HCCL_TILE;
        const float *v = t;
        if (dtype == HCCL_FLOAT32 && ((uintptr_t)src & 3u) == 0)
            v = (const float *)src + at;
        else
            hccl_widen(t, (const char *)src + at * isz, n, dtype);
        hccl_encode_tile(dst, count, at, v, n, wire);
    }
    return 0;
}

int hccl_unpack(void *dst, const void *src, size_t count, int dtype, int wire, int op)
{
    float t[HCCL_TILE];
    double d[HCCL_TILE];
    size_t isz = hccl_dtype_size(dtype);
    if (hccl_wire_args(dtype, wire, op))
        return -1;
    for (size_t at = 0; at < count; at += HCCL_TILE) {
        size_t n = count - at < HCCL_TILE ? count - at : HCCL_TILE;
        char *out = (char *)dst + at * isz;
        hccl_decode_tile(t, src, count, at, n, wire);
        void *tile = t;
        if (dtype != HCCL_FLOAT32) { /* the values in the destination's dtype (exact for float64) */
            tile = d;
            hccl_narrow(d, t, n, dtype);
        }
        if (op < 0)
            memcpy(out, tile, n * isz);
        else
            hccl_reduce(out, tile, n, dtype, op);
    }
    return 0;
}

int hccl_unpack_reduce_pack(void *dst, const void *const *srcs, int nsrc, size_t count, int dtype, int wire,
                            int op, void *packed)
{
    float t[HCCL_TILE];
    double acc[HCCL_TILE], more[HCCL_TILE];
    size_t isz = hccl_dtype_size(dtype);
    if (nsrc < 1 || op < 0 || hccl_wire_args(dtype, wire, op))
        return -1;
    for (size_t at = 0; at < count; at += HCCL_TILE) {
        size_t n = count - at < HCCL_TILE ? count - at : HCCL_TILE;
        hccl_decode_tile(t, srcs[0], count, at, n, wire);
        hccl_narrow(acc, t, n, dtype);
        for (int j = 1; j < nsrc; j++) {
            hccl_decode_tile(t, srcs[j], count, at, n, wire);
            hccl_narrow(more, t, n, dtype);
            hccl_reduce(acc, more, n, dtype, op);
        }
        hccl_widen(t, acc, n, dtype);
        hccl_encode_tile(packed, count, at, t, n, wire);
        hccl_decode_tile(t, packed, count, at, n, wire); /* what every other rank unpacks */
        hccl_narrow((char *)dst + at * isz, t, n, dtype);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* division (avg)                                                                                    */
/* ------------------------------------------------------------------------------------------------ */

/* floats: x = ST(LD(x) / div) */
#define HCCL_DEF_FDIV(SFX, T, CT, LD, ST)                                                               \
    HCCL_HOT static void hccl_div_##SFX(void *restrict xv, size_t n, CT div)                            \
    {                                                                                                   \
        T *restrict x = (T *)xv;                                                                        \
        for (size_t i = 0; i < n; i++)                                                                  \
            x[i] = ST(LD(x[i]) / div);                                                                  \
    }

HCCL_DEF_FDIV(f16, uint16_t, float, hccl_h2f, hccl_f2h)
HCCL_DEF_FDIV(bf16, uint16_t, float, hccl_b2f, hccl_f2b)
HCCL_DEF_FDIV(f32, float, float, HCCL_ID, HCCL_ID)
HCCL_DEF_FDIV(f64, double, double, HCCL_ID, HCCL_ID)

/* small integers (|x| < 2^31): the double quotient truncates to the exact C quotient, because a
 * non-integral x/d is at least 1/|d| (relative 2^-31) away from the next integer, far more than one
 * double rounding (2^-53). Callers handle div == +-1 (INT_MIN / -1 would overflow int32_t). */
#define HCCL_DEF_IDIV_SMALL(SFX, T)                                                                     \
    HCCL_HOT static void hccl_div_##SFX(void *restrict xv, size_t n, double div)                        \
    {                                                                                                   \
        T *restrict x = (T *)xv;                                                                        \
        for (size_t i = 0; i < n; i++)                                                                  \
            x[i] = (T)(int32_t)((double)x[i] / div);                                                    \
    }

HCCL_DEF_IDIV_SMALL(i8, int8_t)
HCCL_DEF_IDIV_SMALL(u8, uint8_t)
HCCL_DEF_IDIV_SMALL(i32, int32_t)

static void hccl_div_i64(void *restrict xv, size_t n, int64_t div) /* div != 0, -1 */
{
    int64_t *restrict x = (int64_t *)xv;
    for (size_t i = 0; i < n; i++)
        x[i] = x[i] / div;
}

int hccl_div(void *dst, size_t count, int dtype, int64_t divisor)
{
    if (dtype < 0 || dtype >= HCCL_NUM_DTYPES || divisor == 0)
        return -1;
    if (count == 0)
        return 0;
    switch (dtype) {
    case HCCL_FLOAT16:
#if HCCL_X86_SIMD
        if (hccl_use_x16) {
            hccl_x16_div_f16(dst, count, (float)divisor);
            return 0;
        }
#endif
        hccl_div_f16(dst, count, (float)divisor);
        return 0;
    case HCCL_BFLOAT16:
#if HCCL_X86_SIMD
        if (hccl_use_x16) {
            hccl_x16_div_bf16(dst, count, (float)divisor);
            return 0;
        }
#endif
        hccl_div_bf16(dst, count, (float)divisor);
        return 0;
    case HCCL_FLOAT32:
        hccl_div_f32(dst, count, (float)divisor);
        return 0;
    case HCCL_FLOAT64:
        hccl_div_f64(dst, count, (double)divisor);
        return 0;
    default:
        break;
    }
    /* integers */
    if (divisor == 1)
        return 0;
    if (divisor == -1) { /* wrapping negation */
        size_t i;
        switch (dtype) {
        case HCCL_INT8:
            for (i = 0; i < count; i++)
                ((int8_t *)dst)[i] = (int8_t)(uint8_t)(0u - (uint8_t)((int8_t *)dst)[i]);
            break;
        case HCCL_UINT8:
            for (i = 0; i < count; i++)
                ((uint8_t *)dst)[i] = (uint8_t)(0u - ((uint8_t *)dst)[i]);
            break;
        case HCCL_INT32:
            for (i = 0; i < count; i++)
                ((int32_t *)dst)[i] = (int32_t)(0u - (uint32_t)((int32_t *)dst)[i]);
            break;
        default: /* HCCL_INT64 */
            for (i = 0; i < count; i++)
                ((int64_t *)dst)[i] = (int64_t)(UINT64_C(0) - (uint64_t)((int64_t *)dst)[i]);
            break;
        }
        return 0;
    }
    switch (dtype) {
    case HCCL_INT8:
        hccl_div_i8(dst, count, (double)divisor);
        break;
    case HCCL_UINT8:
        hccl_div_u8(dst, count, (double)divisor);
        break;
    case HCCL_INT32:
        hccl_div_i32(dst, count, (double)divisor);
        break;
    default: /* HCCL_INT64 */
        hccl_div_i64(dst, count, divisor);
        break;
    }
    return 0;
}

void hccl_copy(void *dst, const void *src, size_t nbytes)
{
    if (nbytes != 0 && dst != src)
        memcpy(dst, src, nbytes);
}

/* ------------------------------------------------------------------------------------------------ */
/* shared-memory synchronisation                                                                     */
/* ------------------------------------------------------------------------------------------------ */

uint64_t hccl_load_acquire(const uint64_t *addr)
{
    return __atomic_load_n(addr, __ATOMIC_ACQUIRE);
}

void hccl_store_release(uint64_t *addr, uint64_t value)
{
    __atomic_store_n(addr, value, __ATOMIC_RELEASE);
}

uint64_t hccl_fetch_add(uint64_t *addr, uint64_t delta)
{
    return __atomic_fetch_add(addr, delta, __ATOMIC_SEQ_CST);
}

uint64_t hccl_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * UINT64_C(1000000000) + (uint64_t)ts.tv_nsec;
}

HCCL_INLINE void hccl_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

HCCL_INLINE uint64_t hccl_sat_add(uint64_t a, uint64_t b)
{
    uint64_t s = a + b;
    return s < a ? UINT64_MAX : s;
}

HCCL_INLINE int hccl_wait_done(const uint64_t *addr, uint64_t v, int ne)
{
    uint64_t x = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    return ne ? x != v : x >= v;
}

/* inlined with a constant `ne` into the two entry points */
HCCL_INLINE int hccl_wait(const uint64_t *addr, uint64_t v, int ne, uint64_t spin_ns, uint64_t yield_ns)
{
    if (hccl_wait_done(addr, v, ne))
        return 1;
    if (spin_ns == 0 && yield_ns == 0)
        return 0;
    uint64_t start = hccl_now_ns();
    uint64_t spin_end = hccl_sat_add(start, spin_ns);
    uint64_t end = hccl_sat_add(spin_end, yield_ns);
    if (spin_ns != 0) {
        for (;;) {
            for (int k = 0; k < 64; k++) {
                hccl_cpu_relax();
                if (hccl_wait_done(addr, v, ne))
                    return 1;
            }
            if (hccl_now_ns() >= spin_end)
                break;
        }
    }
    while (hccl_now_ns() < end) {
        sched_yield();
        if (hccl_wait_done(addr, v, ne))
            return 1;
    }
    return hccl_wait_done(addr, v, ne);
}

int hccl_wait_ge(const uint64_t *addr, uint64_t target, uint64_t spin_ns, uint64_t yield_ns)
{
    return hccl_wait(addr, target, 0, spin_ns, yield_ns);
}

int hccl_wait_ne(const uint64_t *addr, uint64_t value, uint64_t spin_ns, uint64_t yield_ns)
{
    return hccl_wait(addr, value, 1, spin_ns, yield_ns);
}

/* index of the first i with *addrs[i] != vals[i], or -1 */
HCCL_INLINE int hccl_first_changed(uint64_t *const *addrs, const uint64_t *vals, int n)
{
    for (int i = 0; i < n; i++)
        if (__atomic_load_n(addrs[i], __ATOMIC_ACQUIRE) != vals[i])
            return i;
    return -1;
}

/* n <= 0: returns -1 at once (nothing to wait for) */
int hccl_wait_any_change(uint64_t **addrs, const uint64_t *vals, int n, uint64_t spin_ns, uint64_t yield_ns)
{
    if (n <= 0)
        return -1;
    int i = hccl_first_changed(addrs, vals, n);
    if (i >= 0 || (spin_ns == 0 && yield_ns == 0))
        return i;
    uint64_t start = hccl_now_ns();
    uint64_t spin_end = hccl_sat_add(start, spin_ns);
    uint64_t end = hccl_sat_add(spin_end, yield_ns);
    if (spin_ns != 0) {
        for (;;) {
            for (int k = 0; k < 64; k++) {
                hccl_cpu_relax();
                if ((i = hccl_first_changed(addrs, vals, n)) >= 0)
                    return i;
            }
            if (hccl_now_ns() >= spin_end)
                break;
        }
    }
    while (hccl_now_ns() < end) {
        sched_yield();
        if ((i = hccl_first_changed(addrs, vals, n)) >= 0)
            return i;
    }
    return hccl_first_changed(addrs, vals, n);
}

/* ------------------------------------------------------------------------------------------------ */
/* small-message fast path (see hetccl_native.h and hetccl/fastpath.py)                              */
/* ------------------------------------------------------------------------------------------------ */

#define HCCL_FAST_ANN_OFF 4096
#define HCCL_FAST_ANN_N 64
#define HCCL_FAST_SLOTS_OFF 8192
#define HCCL_FAST_DATA_OFF 4096
/* header words (64 bytes apart) of the single-copy all_reduce, after 0-4 (hetccl/fastpath.py names them all) */
#define HCCL_FAST_ABANDONED 5
#define HCCL_FAST_BUSY 6
#define HCCL_FAST_BASE 8

static size_t hccl_fast_stride(size_t max_bytes)
{
    return HCCL_FAST_DATA_OFF + ((max_bytes + 4095) & ~(size_t)4095);
}

size_t hccl_fast_seg_size(size_t max_bytes)
{
    return HCCL_FAST_SLOTS_OFF + 2 * hccl_fast_stride(max_bytes);
}

/* the stride is kept in the segment (word 3) so that the other functions need no size argument */
uint64_t *hccl_fast_word(char *seg, int which)
{
    return (uint64_t *)(seg + 64 * which);
}

char *hccl_fast_slot(char *seg, uint64_t k)
{
    uint64_t stride = __atomic_load_n(hccl_fast_word(seg, 3), __ATOMIC_RELAXED);
    return seg + HCCL_FAST_SLOTS_OFF + (k & 1) * stride;
}

uint64_t *hccl_fast_announce_entry(char *seg, uint64_t seq)
{
    return (uint64_t *)(seg + HCCL_FAST_ANN_OFF + (seq % HCCL_FAST_ANN_N) * 32);
}

uint64_t hccl_fast_post(char **segs, int n, int me, uint64_t k, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3,
                        const void *src, size_t nbytes)
{
    char *slot = hccl_fast_slot(segs[me], k);
    uint64_t *h = (uint64_t *)slot;
    h[0] = w0;
    h[1] = w1;
    h[2] = w2;
    h[3] = w3;
    if (nbytes)
        memcpy(slot + HCCL_FAST_DATA_OFF, src, nbytes);
    __atomic_store_n(hccl_fast_word(segs[me], 2), k + 1, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* pairs with the sleeper's fence after raising its flag */
    uint64_t mask = 0;
    for (int r = 0; r < n; r++) {
        if (r == me || !__atomic_load_n(hccl_fast_word(segs[r], 1), __ATOMIC_RELAXED))
            continue;
        if (r >= 64)
            return ~(uint64_t)0;
        mask |= (uint64_t)1 << r;
    }
    return mask;
}

/* -1: everyone published k with fp; -2: someone has not yet; r: rank r disagrees */
HCCL_INLINE int hccl_fast_check(char **segs, int n, int me, uint64_t k, const uint64_t *fp)
{
    int missing = 0;
    for (int r = 0; r < n; r++) {
        if (r == me)
            continue;
        if (__atomic_load_n(hccl_fast_word(segs[r], 2), __ATOMIC_ACQUIRE) < k + 1) {
            /* announced another collective at this number? (read after the published count: a rank
             * announces only after it published every fast operation before) */
            const uint64_t *a = hccl_fast_announce_entry(segs[r], fp[0]);
            if (__atomic_load_n(&a[0], __ATOMIC_ACQUIRE) == fp[0] + 1 &&
                __atomic_load_n(hccl_fast_word(segs[r], 2), __ATOMIC_ACQUIRE) < k + 1)
                return r;
            missing = 1;
            continue;
        }
        const uint64_t *h = (const uint64_t *)hccl_fast_slot(segs[r], k);
        if (h[0] != fp[0] || h[1] != fp[1] || h[2] != fp[2] || h[3] != fp[3])
            return r;
    }
    return missing ? -2 : -1;
}

int hccl_fast_wait(char **segs, int n, int me, uint64_t k, uint64_t spin_ns, uint64_t yield_ns)
{
    const uint64_t *fp = (const uint64_t *)hccl_fast_slot(segs[me], k);
    int r = hccl_fast_check(segs, n, me, k, fp);
    if (r != -2 || (spin_ns == 0 && yield_ns == 0))
        return r;
    uint64_t start = hccl_now_ns();
    uint64_t spin_end = hccl_sat_add(start, spin_ns);
    uint64_t end = hccl_sat_add(spin_end, yield_ns);
    if (spin_ns != 0) {
        for (;;) {
            for (int i = 0; i < 32; i++) {
                hccl_cpu_relax();
                if ((r = hccl_fast_check(segs, n, me, k, fp)) != -2)
                    return r;
            }
            if (hccl_now_ns() >= spin_end)
                break;
        }
    }
    while (hccl_now_ns() < end) {
        sched_yield();
        if ((r = hccl_fast_check(segs, n, me, k, fp)) != -2)
            return r;
    }
    return hccl_fast_check(segs, n, me, k, fp);
}

void hccl_fast_announce(char *seg, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3)
{
    uint64_t *a = hccl_fast_announce_entry(seg, w0);
    a[1] = w1;
    a[2] = w2;
    a[3] = w3;
    __atomic_store_n(&a[0], w0 + 1, __ATOMIC_RELEASE);
}

int hccl_fast_reduce(void *dst, char **segs, int n, uint64_t k, size_t offset, size_t count, int dtype, int op)
{
    if (n < 1)
        return 0;
    const char *d0 = hccl_fast_slot(segs[0], k) + HCCL_FAST_DATA_OFF + offset;
    if (n == 1) {
        size_t isz = hccl_dtype_size(dtype);
        if (!isz)
            return -1;
        memcpy(dst, d0, count * isz);
        return 0;
    }
    const char *d1 = hccl_fast_slot(segs[1], k) + HCCL_FAST_DATA_OFF + offset;
    if (hccl_reduce3(dst, d0, d1, count, dtype, op))
        return -1;
    for (int r = 2; r < n; r++)
        if (hccl_reduce(dst, hccl_fast_slot(segs[r], k) + HCCL_FAST_DATA_OFF + offset, count, dtype, op))
            return -1;
    return 0;
}

/* dst = the reduction of operation k's slots, divided by n for avg (op 4): -1, or -4 for an unknown dtype/op */
static int hccl_fast_combine(void *dst, char **segs, int n, uint64_t k, uint64_t count, int dtype, int op)
{
    if (hccl_fast_reduce(dst, segs, n, k, 0, count, dtype, op == 4 ? 0 : op))
        return -4;
    if (op == 4 && hccl_div(dst, count, dtype, n))
        return -4;
    return -1;
}

/* post, wait and combine in one call: what a small all_reduce costs when its peers are already there is
 * mostly the crossings between Python and C, so the common case makes one */
int hccl_fast_all_reduce(char **segs, int n, int me, uint64_t k, uint64_t seq, uint64_t count, void *buf,
                         int dtype, int op, uint64_t spin_ns, uint64_t yield_ns, uint64_t *mask)
{
    size_t isz = hccl_dtype_size(dtype);
    if (!isz || op < 0 || op > 4)
        return -4;
    uint64_t w1 = 1 /* CollOp.ALL_REDUCE */ | ((uint64_t)dtype << 8) | ((uint64_t)op << 16);
    *mask = hccl_fast_post(segs, n, me, k, seq, w1, count, ~(uint64_t)0, buf, count * isz);
    if (*mask)
        return -3;
    int r = hccl_fast_wait(segs, n, me, k, spin_ns, yield_ns);
    if (r != -1)
        return r;
    return hccl_fast_combine(buf, segs, n, k, count, dtype, op);
}

/* elements [lo, hi) of a piece of m elements that rank r of n reduces: cut at 64-byte multiples so that no two
 * ranks write one cache line */
static void hccl_fast_part(uint64_t m, int n, int r, size_t isz, uint64_t *lo, uint64_t *hi)
{
    uint64_t align = 64 / isz, part = (m + n - 1) / n;
    part = (part + align - 1) / align * align;
    *lo = (uint64_t)r * part < m ? (uint64_t)r * part : m;
    *hi = *lo + part < m ? *lo + part : m;
}

/* phase 1 of a piece: reduce this rank's part of its own buffer with the peers' parts from their phase-0 slots
 * (operation k), into buf and into the slot of operation k + 1, where the peers copy it from. Own part first,
 * then the peers in rank order: one rank computes each part, so every rank gets the same bits; the last peer
 * goes in one pass with both destinations. -1, or -4 */
static int hccl_fast_reduce_part(char *p, char **segs, int n, int me, uint64_t k, uint64_t lo, uint64_t len,
                                 int dtype, int op)
{
    size_t isz = hccl_dtype_size(dtype), off = HCCL_FAST_DATA_OFF + lo * isz;
    char *mine = p + lo * isz, *out = hccl_fast_slot(segs[me], k + 1) + off;
    int rop = op == 4 ? 0 : op, last = me == n - 1 ? n - 2 : n - 1;
    if (len == 0 || n < 2)
        return -1;
    for (int r = 0; r < n; r++)
        if (r != me && r != last && hccl_reduce(mine, hccl_fast_slot(segs[r], k) + off, len, dtype, rop))
            return -4;
    const char *src = hccl_fast_slot(segs[last], k) + off;
    if (op != 4)
        return hccl_reduce3_dup(mine, out, mine, src, len, dtype, rop) ? -4 : -1;
    if (hccl_reduce(mine, src, len, dtype, rop) || hccl_div(mine, len, dtype, n))
        return -4;
    memcpy(out, mine, len * isz);
    return -1;
}

/* a large all_reduce as a reduce-scatter and an all-gather per piece, two fast operations each: every byte
 * crosses between cores once each way and is reduced once (issue 17, fastpath.py) */
int hccl_fast_all_reduce_pieces(char **segs, int n, int me, uint64_t k0, uint64_t seq, uint64_t count, void *buf,
                                int dtype, int op, uint64_t piece, uint64_t max_pieces, uint64_t spin_ns,
                                uint64_t yield_ns, uint64_t *mask, uint64_t *state)
{
    size_t isz = hccl_dtype_size(dtype);
    if (!isz || op < 0 || op > 4 || piece == 0 || n < 1)
        return -4;
    uint64_t w1 = 1 /* CollOp.ALL_REDUCE */ | ((uint64_t)dtype << 8) | ((uint64_t)op << 16);
    uint64_t steps = 2 * ((count + piece - 1) / piece), ran = 0;
    for (uint64_t j = *state >> 1; j < steps; j++) {
        uint64_t k = k0 + j, first = (j >> 1) * piece, lo, hi;
        uint64_t m = count - first < piece ? count - first : piece;
        char *p = (char *)buf + first * isz;
        hccl_fast_part(m, n, me, isz, &lo, &hi);
        if (!(*state & 1)) {
            if (!(j & 1)) { /* phase 0: the parts the peers reduce, into the slot of operation k */
                if (ran++ == max_pieces)
                    return -5;
                char *slot = hccl_fast_slot(segs[me], k) + HCCL_FAST_DATA_OFF;
                memcpy(slot, p, lo * isz);
                memcpy(slot + hi * isz, p + hi * isz, (m - hi) * isz);
            } else { /* phase 1: every rank posted phase 0, so none reads our slot of operation k - 2 any more */
                int r = hccl_fast_reduce_part(p, segs, n, me, k - 1, lo, hi - lo, dtype, op);
                if (r != -1)
                    return r;
            }
            *state = 2 * j + 1;
            *mask = hccl_fast_post(segs, n, me, k, seq, w1, count, ~(uint64_t)0 - (j & 1), NULL, 0);
            if (*mask)
                return -3;
        }
        int r = hccl_fast_wait(segs, n, me, k, spin_ns, yield_ns);
        if (r != -1)
            return r;
        if (j & 1) /* phase 1 done everywhere: the peers' reduced parts */
            for (int q = 0; q < n; q++) {
                uint64_t qlo, qhi;
                if (q == me)
                    continue;
                hccl_fast_part(m, n, q, isz, &qlo, &qhi);
                const char *theirs = hccl_fast_slot(segs[q], k) + HCCL_FAST_DATA_OFF + qlo * isz;
                memcpy(p + qlo * isz, theirs, (qhi - qlo) * isz);
            }
        *state = 2 * (j + 1);
    }
    return -1;
}

/* reduce_scatter and all_gather above the fast path's limit (hetccl_native.h), one fast operation per piece:
 * every rank's slot of operation k is read by the peers after they waited for k, and written again at k + 2,
 * after this rank waited for k + 1, which every peer posts only once it has read k's slots */
int hccl_fast_reduce_scatter_pieces(char **segs, int n, int me, uint64_t k0, uint64_t seq, uint64_t count,
                                    const void *in, void *out, int dtype, int op, uint64_t piece,
                                    uint64_t max_pieces, uint64_t spin_ns, uint64_t yield_ns, uint64_t *mask,
                                    uint64_t *state)
{
    size_t isz = hccl_dtype_size(dtype);
    if (!isz || op < 0 || op > 4 || piece == 0 || n < 2)
        return -4;
    uint64_t w1 = 3 /* CollOp.REDUCE_SCATTER */ | ((uint64_t)dtype << 8) | ((uint64_t)op << 16);
    uint64_t steps = (count + piece - 1) / piece, ran = 0;
    int rop = op == 4 ? 0 : op;
    for (uint64_t j = *state >> 1; j < steps; j++) {
        uint64_t k = k0 + j, first = j * piece, m = count - first < piece ? count - first : piece;
        if (!(*state & 1)) {
            if (ran++ == max_pieces)
                return -5;
            char *slot = hccl_fast_slot(segs[me], k) + HCCL_FAST_DATA_OFF;
            for (int q = 0; q < n; q++)
                if (q != me)
                    memcpy(slot + q * piece * isz, (const char *)in + (q * count + first) * isz, m * isz);
            *state = 2 * j + 1;
            *mask = hccl_fast_post(segs, n, me, k, seq, w1, count, ~(uint64_t)0, NULL, 0);
            if (*mask)
                return -3;
        }
        int r = hccl_fast_wait(segs, n, me, k, spin_ns, yield_ns);
        if (r != -1)
            return r;
        char *dst = (char *)out + first * isz;
        size_t off = HCCL_FAST_DATA_OFF + (size_t)me * piece * isz;
        int q0 = me == 0 ? 1 : 0;
        if (hccl_reduce3(dst, (const char *)in + (me * count + first) * isz, hccl_fast_slot(segs[q0], k) + off, m,
                         dtype, rop))
            return -4;
        for (int q = q0 + 1; q < n; q++)
            if (q != me && hccl_reduce(dst, hccl_fast_slot(segs[q], k) + off, m, dtype, rop))
                return -4;
        if (op == 4 && hccl_div(dst, m, dtype, n))
            return -4;
        *state = 2 * (j + 1);
    }
    return -1;
}

int hccl_fast_all_gather_pieces(char **segs, int n, int me, uint64_t k0, uint64_t seq, uint64_t count,
                                const void *in, void *out, int dtype, uint64_t piece, uint64_t max_pieces,
                                uint64_t spin_ns, uint64_t yield_ns, uint64_t *mask, uint64_t *state)
{
    size_t isz = hccl_dtype_size(dtype);
    if (!isz || piece == 0 || n < 2)
        return -4;
    uint64_t w1 = 2 /* CollOp.ALL_GATHER */ | ((uint64_t)dtype << 8);
    uint64_t steps = (count + piece - 1) / piece, ran = 0;
    for (uint64_t j = *state >> 1; j < steps; j++) {
        uint64_t k = k0 + j, first = j * piece, m = count - first < piece ? count - first : piece;
        if (!(*state & 1)) {
            if (ran++ == max_pieces)
                return -5;
            *state = 2 * j + 1;
            *mask = hccl_fast_post(segs, n, me, k, seq, w1, count, ~(uint64_t)0, (const char *)in + first * isz,
                                   m * isz);
            if (*mask)
                return -3;
        }
        int r = hccl_fast_wait(segs, n, me, k, spin_ns, yield_ns);
        if (r != -1)
            return r;
        for (int q = 0; q < n; q++)
            if (q != me)
                memcpy((char *)out + (q * count + first) * isz, hccl_fast_slot(segs[q], k) + HCCL_FAST_DATA_OFF,
                       m * isz);
        *state = 2 * (j + 1);
    }
    return -1;
}

/* ---- the single-copy all_reduce: cross-memory attach (process_vm_readv/writev) ------------------- */

#if HCCL_CMA
/* one kernel copy of len bytes between this process and rank q's (pid): 0, or the errno (EFAULT if short) */
static int hccl_cma_copy(int64_t pid, void *mine, uint64_t theirs, size_t len, int write)
{
    struct iovec l = {mine, len}, r = {(void *)(uintptr_t)theirs, len};
    ssize_t got = write ? process_vm_writev((pid_t)pid, &l, 1, &r, 1, 0)
                        : process_vm_readv((pid_t)pid, &l, 1, &r, 1, 0);
    return got == (ssize_t)len ? 0 : got < 0 ? errno : EFAULT;
}
#endif

int hccl_cma_probe(int64_t pid, uint64_t addr, uint64_t expect)
{
#if HCCL_CMA
    uint64_t got = 0;
    /* write only into the process whose memory holds the cookie at addr: a pid of another namespace, or a
     * reused one, reads something else and is never written */
    if (hccl_cma_copy(pid, &got, addr, 8, 0) || got != expect)
        return 0;
    return hccl_cma_copy(pid, &got, addr, 8, 1) == 0;
#else
    (void)pid, (void)addr, (void)expect;
    return 0;
#endif
}

int hccl_fast_all_reduce_cma(char **segs, int n, int me, uint64_t k, const int64_t *pids, const uint64_t *addrs,
                             uint64_t count, void *buf, int dtype, int op, void *tmp, uint64_t chunk,
                             uint64_t max_chunks, uint64_t *state, int *bad, int *err)
{
#if HCCL_CMA
    size_t isz = hccl_dtype_size(dtype);
    if (!isz || op < 0 || op > 4 || chunk < isz || n < 2)
        return -4;
    uint64_t lo, hi, step = chunk / isz, ran = 0;
    int rop = op == 4 ? 0 : op, rc = -1;
    hccl_fast_part(count, n, me, isz, &lo, &hi);
    uint64_t *busy = hccl_fast_word(segs[me], HCCL_FAST_BUSY);
    /* busy, then the abandoned words (seq_cst both sides, hccl_fast_abandon): a rank that abandons either sees
     * us busy and waits, or we see its word before we write */
    __atomic_store_n(busy, k + 1, __ATOMIC_SEQ_CST);
    for (uint64_t i = lo + *state / isz; i < hi; i += step) {
        uint64_t len = hi - i < step ? hi - i : step;
        char *mine = (char *)buf + i * isz;
        if (ran++ == max_chunks) {
            rc = -5;
            break;
        }
        for (int q = 0; q < n && rc == -1; q++)
            if (q != me && __atomic_load_n(hccl_fast_word(segs[q], HCCL_FAST_ABANDONED), __ATOMIC_SEQ_CST))
                *bad = q, rc = -6;
        /* own first, then the peers in rank order: one rank computes each element, every rank gets its bits */
        for (int q = 0; q < n && rc == -1; q++) {
            if (q == me)
                continue;
            if ((*err = hccl_cma_copy(pids[q], tmp, addrs[q] + i * isz, len * isz, 0)))
                *bad = q, rc = -7;
            else if (hccl_reduce(mine, tmp, len, dtype, rop))
                rc = -4;
        }
        if (rc == -1 && op == 4 && hccl_div(mine, len, dtype, n))
            rc = -4;
        for (int q = 0; q < n && rc == -1; q++)
            if (q != me && (*err = hccl_cma_copy(pids[q], mine, addrs[q] + i * isz, len * isz, 1)))
                *bad = q, rc = -7;
        if (rc != -1)
            break;
        *state = (i + len - lo) * isz;
    }
    __atomic_store_n(busy, 0, __ATOMIC_SEQ_CST);
    return rc;
#else
    (void)segs, (void)n, (void)me, (void)k, (void)pids, (void)addrs, (void)count, (void)buf, (void)dtype;
    (void)op, (void)tmp, (void)chunk, (void)max_chunks, (void)state, (void)bad, (void)err;
    return -8;
#endif
}

int hccl_fast_gather_cma(int n, int me, const int64_t *pids, const uint64_t *addrs, uint64_t count, const void *in,
                         void *out, int dtype, int op, int reduce, void *tmp, uint64_t chunk, uint64_t max_chunks,
                         uint64_t *state, int *bad, int *err)
{
#if HCCL_CMA
    size_t isz = hccl_dtype_size(dtype);
    if (!isz || op < 0 || op > 4 || chunk < isz || n < 2)
        return -4;
    uint64_t step = chunk / isz, ran = 0, total = reduce ? count : (uint64_t)(n - 1) * count;
    int rop = op == 4 ? 0 : op;
    for (uint64_t p = *state / isz; p < total;) {
        if (ran++ == max_chunks)
            return -5;
        if (!reduce) { /* p runs over the peers' inputs, in rank order, this rank's left out */
            uint64_t at = p / count, i = p % count, len = count - i < step ? count - i : step;
            int q = (int)at < me ? (int)at : (int)at + 1;
            if ((*err = hccl_cma_copy(pids[q], (char *)out + (q * count + i) * isz, addrs[q] + i * isz, len * isz,
                                      0))) {
                *bad = q;
                return -7;
            }
            p += len;
        } else {
            uint64_t len = count - p < step ? count - p : step;
            char *dst = (char *)out + p * isz;
            const char *own = (const char *)in + (me * count + p) * isz;
            for (int q = 0, first = 1; q < n; q++) { /* the first peer with own in one pass: dst = own op it */
                if (q == me)
                    continue;
                if ((*err = hccl_cma_copy(pids[q], tmp, addrs[q] + (me * count + p) * isz, len * isz, 0))) {
                    *bad = q;
                    return -7;
                }
                if (first ? hccl_reduce3(dst, own, tmp, len, dtype, rop) : hccl_reduce(dst, tmp, len, dtype, rop))
                    return -4;
                first = 0;
            }
            if (op == 4 && hccl_div(dst, len, dtype, n))
                return -4;
            p += len;
        }
        *state = p * isz;
    }
    return -1;
#else
    (void)n, (void)me, (void)pids, (void)addrs, (void)count, (void)in, (void)out, (void)dtype, (void)op;
    (void)reduce, (void)tmp, (void)chunk, (void)max_chunks, (void)state, (void)bad, (void)err;
    return -8;
#endif
}

int hccl_fast_abandon(char **segs, int n, int me, uint64_t k, const int64_t *pids, uint64_t wait_ns)
{
    __atomic_store_n(hccl_fast_word(segs[me], HCCL_FAST_ABANDONED), k + 1, __ATOMIC_SEQ_CST);
    uint64_t end = hccl_sat_add(hccl_now_ns(), wait_ns);
    for (int q = 0; q < n; q++) {
        if (q == me)
            continue;
        while (__atomic_load_n(hccl_fast_word(segs[q], HCCL_FAST_BUSY), __ATOMIC_SEQ_CST) == k + 1) {
#if HCCL_CMA
            uint64_t probe;
            /* a rank killed inside the copy stays busy forever, but writes no more */
            uint64_t base = __atomic_load_n(hccl_fast_word(segs[q], HCCL_FAST_BASE), __ATOMIC_RELAXED);
            if (hccl_cma_copy(pids[q], &probe, base + 64 * HCCL_FAST_BUSY, 8, 0) == ESRCH)
                break;
#endif
            if (hccl_now_ns() >= end)
                return q;
            sched_yield();
        }
    }
    return -1;
}

/* ------------------------------------------------------------------------------------------------ */
/* build info                                                                                        */
/* ------------------------------------------------------------------------------------------------ */

#if defined(__clang__)
#define HCCL_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define HCCL_COMPILER "gcc " __VERSION__
#else
#define HCCL_COMPILER "unknown compiler"
#endif

#if defined(__x86_64__)
#define HCCL_ARCH "x86_64"
#elif defined(__aarch64__)
#define HCCL_ARCH "aarch64"
#else
#define HCCL_ARCH "other-arch"
#endif

#if HCCL_CLONES
#define HCCL_CLONES_INFO "target_clones=on (x86-64-v3,default)"
#else
#define HCCL_CLONES_INFO "target_clones=off"
#endif

static char hccl_info_buf[256] = "hetccl_native " HCCL_ARCH ", " HCCL_COMPILER ", " HCCL_CLONES_INFO;

#if defined(__GNUC__)
/* runs once when the module is loaded (dlopen), before any function here can be called */
__attribute__((constructor)) static void hccl_native_init(void)
{
    const char *clone = "n/a", *f16 = "portable";
#if HCCL_CLONES || HCCL_X86_SIMD
    __builtin_cpu_init();
#endif
#if HCCL_CLONES
    clone = __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3" : "default";
#endif
#if HCCL_X86_SIMD
    hccl_use_x16 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (hccl_use_x16)
        f16 = "avx2+f16c";
#endif
    snprintf(hccl_info_buf, sizeof hccl_info_buf, "hetccl_native %s, %s, %s, clone in use: %s, fp16/bf16: %s",
             HCCL_ARCH, HCCL_COMPILER, HCCL_CLONES_INFO, clone, f16);
}
#endif

const char *hccl_build_info(void)
{
    return hccl_info_buf;
}

/* ================================================================================================ */
/* TCP payload pumps (issue 16 item 2): one native thread per pump, no GIL, completion by eventfd.   */
/* Kept as one block at the end of the file (merging).                                                */
/* ================================================================================================ */

#if defined(_WIN32) || !defined(__linux__)
hccl_pump *hccl_pump_new(void) { return NULL; }
int hccl_pump_notify_fd(hccl_pump *p) { (void)p; return -1; }
int hccl_pump_submit(hccl_pump *p, int fd, int dir, const void *head, size_t hlen, void *body, size_t n)
{
    (void)p; (void)fd; (void)dir; (void)head; (void)hlen; (void)body; (void)n;
    return -1;
}
void hccl_pump_stop(hccl_pump *p) { (void)p; }
void hccl_pump_quit(hccl_pump *p) { (void)p; }
int hccl_pump_reap(hccl_pump *p, size_t *done) { (void)p; *done = 0; return -38; }
void hccl_pump_free(hccl_pump *p) { (void)p; }
#else
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

struct hccl_pump {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    int notify_fd; /* the loop watches it: readable when a job ended */
    int wake_fd;   /* stop/quit wake the thread out of poll() */
    int state;     /* 0 idle, 1 submitted or running, 2 ended (not reaped) */
    int quit;
    int joined;
    int stop;      /* atomic */
    int fd, dir;
    const char *head;
    size_t hlen;
    char *body;
    size_t n;
    int rc;
    size_t done;
};

static void hccl_pump_drain(int fd)
{
    uint64_t v;
    while (read(fd, &v, sizeof v) < 0 && errno == EINTR) {
    }
}

static void hccl_pump_signal(int fd)
{
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* 0: fd ready; HCCL_PUMP_STOPPED; -errno */
static int hccl_pump_wait(hccl_pump *p, short events)
{
    for (;;) {
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
            return HCCL_PUMP_STOPPED;
        struct pollfd fds[2] = {{p->fd, events, 0}, {p->wake_fd, POLLIN, 0}};
        int r = poll(fds, 2, -1);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (fds[1].revents)
            hccl_pump_drain(p->wake_fd); /* the stop flag is read on the next turn */
        if (fds[0].revents)
            return 0; /* ready, or an error/hang-up that the next call reports */
    }
}

static int hccl_pump_io(hccl_pump *p)
{
    size_t total = p->hlen + p->n, moved = 0;
    p->done = 0;
    while (moved < total) {
        if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE))
            return HCCL_PUMP_STOPPED;
        ssize_t r;
        if (p->dir == 0) {
            struct iovec iov[2];
            int k = 0;
            if (moved < p->hlen) {
                iov[k].iov_base = (char *)p->head + moved;
                iov[k++].iov_len = p->hlen - moved;
            }
            if (p->n) {
                size_t off = moved > p->hlen ? moved - p->hlen : 0;
                iov[k].iov_base = p->body + off;
                iov[k++].iov_len = p->n - off;
            }
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            msg.msg_iov = iov;
            msg.msg_iovlen = k;
            r = sendmsg(p->fd, &msg, MSG_NOSIGNAL);
        } else {
            r = recv(p->fd, p->body + moved, total - moved, 0);
            if (r == 0)
                return HCCL_PUMP_EOF;
        }
        if (r > 0) {
            moved += (size_t)r;
            p->done = moved;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -errno;
        int w = hccl_pump_wait(p, p->dir == 0 ? POLLOUT : POLLIN);
        if (w)
            return w;
    }
    return 0;
}

static void *hccl_pump_main(void *arg)
{
    hccl_pump *p = (hccl_pump *)arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (p->state != 1 && !p->quit)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->state != 1)
            break; /* quit with nothing to do */
        pthread_mutex_unlock(&p->mu);
        int rc = hccl_pump_io(p);
        pthread_mutex_lock(&p->mu);
        p->rc = rc;
        p->state = 2;
        hccl_pump_signal(p->notify_fd);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

hccl_pump *hccl_pump_new(void)
{
    hccl_pump *p = (hccl_pump *)calloc(1, sizeof *p);
    if (p == NULL)
        return NULL;
    p->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    p->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->notify_fd < 0 || p->wake_fd < 0)
        goto fail;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the Python threads */
    int e = pthread_create(&p->th, NULL, hccl_pump_main, p);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e == 0)
        return p;
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
fail:
    if (p->notify_fd >= 0)
        close(p->notify_fd);
    if (p->wake_fd >= 0)
        close(p->wake_fd);
    free(p);
    return NULL;
}

int hccl_pump_notify_fd(hccl_pump *p)
{
    return p->notify_fd;
}

int hccl_pump_submit(hccl_pump *p, int fd, int dir, const void *head, size_t hlen, void *body, size_t n)
{
    pthread_mutex_lock(&p->mu);
    if (p->state != 0 || p->quit) {
        pthread_mutex_unlock(&p->mu);
        return -1;
    }
    p->fd = fd;
    p->dir = dir;
    p->head = (const char *)head;
    p->hlen = dir == 0 ? hlen : 0;
    p->body = (char *)body;
    p->n = n;
    p->rc = 0;
    p->done = 0;
    __atomic_store_n(&p->stop, 0, __ATOMIC_RELEASE);
    p->state = 1;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return 0;
}

void hccl_pump_stop(hccl_pump *p)
{
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    hccl_pump_signal(p->wake_fd);
}

int hccl_pump_reap(hccl_pump *p, size_t *done)
{
    pthread_mutex_lock(&p->mu);
    int rc = HCCL_PUMP_BUSY;
    *done = p->done;
    if (p->state == 2) {
        hccl_pump_drain(p->notify_fd);
        rc = p->rc;
        p->state = 0;
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

void hccl_pump_quit(hccl_pump *p)
{
    if (p->joined)
        return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    hccl_pump_stop(p);
    pthread_join(p->th, NULL);
    p->joined = 1;
}

void hccl_pump_free(hccl_pump *p)
{
    if (p == NULL)
        return;
    hccl_pump_quit(p);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    close(p->notify_fd);
    close(p->wake_fd);
    free(p);
}
#endif

/* ---- stream-order words ------------------------------------------------------------------------ */
/* the first word reached (index), or -1 */
HCCL_INLINE int hccl_words_reached(const uint64_t *addrs, const uint32_t *gens, int n)
{
    for (int i = 0; i < n; i++) {
        uint32_t w = __atomic_load_n((const uint32_t *)(uintptr_t)addrs[i], __ATOMIC_ACQUIRE);
        if ((int32_t)(w - gens[i]) >= 0)
            return i;
    }
    return -1;
}

int hccl_words_wait(const uint64_t *addrs, const uint32_t *gens, int n, const uint32_t *bump, uint32_t seen,
                    uint64_t yield_ns, uint64_t pause_ns, uint64_t timeout_ns)
{
#if defined(__linux__)
    /* this thread's sleeps as asked: the default slack of 50 us made each 20 us pause 70-95 us */
    static __thread int slack_set;
    if (!slack_set) {
        prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
        slack_set = 1;
    }
#endif
    uint64_t start = hccl_now_ns();
    uint64_t end = hccl_sat_add(start, timeout_ns), yield_end = hccl_sat_add(start, yield_ns);
    struct timespec pause = {(time_t)(pause_ns / 1000000000u), (long)(pause_ns % 1000000000u)};
    for (;;) {
        int i = hccl_words_reached(addrs, gens, n);
        if (i >= 0)
            return i;
        if (__atomic_load_n(bump, __ATOMIC_ACQUIRE) != seen)
            return HCCL_WORDS_BUMPED;
        uint64_t now = hccl_now_ns();
        if (now >= end)
            return HCCL_WORDS_TIMEOUT;
        if (now < yield_end)
            sched_yield(); /* a word due soon is seen within a microsecond, and a busy core is given up */
        else
            nanosleep(&pause, NULL);
    }
}

/* ---- a batch of stream operations --------------------------------------------------------------- */
typedef int (*hccl_cu_copy_fn)(uint64_t dst, uint64_t src, size_t n, void *stream);
typedef int (*hccl_cu_value_fn)(void *stream, uint64_t addr, uint32_t value, unsigned int flags);
typedef int (*hccl_hip_copy_fn)(void *dst, const void *src, size_t n, int kind, void *stream);
typedef int (*hccl_hip_write_fn)(void *stream, void *addr, uint32_t value, unsigned int flags);
typedef int (*hccl_hip_wait_fn)(void *stream, void *addr, uint32_t value, unsigned int flags, uint32_t mask);

#define HCCL_HIP_MEMCPY_DEFAULT 4

int64_t hccl_stream_batch(const uint64_t *ops, int64_t n, int vendor, uint64_t copy_fn, uint64_t write_fn,
                          uint64_t wait_fn, int *rc)
{
    for (int64_t i = 0; i < n; i++) {
        const uint64_t *op = ops + 5 * i;
        void *stream = (void *)(uintptr_t)op[1];
        int r;
        if (vendor == HCCL_VENDOR_CUDA) {
            switch (op[0]) {
            case HCCL_OP_COPY: r = ((hccl_cu_copy_fn)(uintptr_t)copy_fn)(op[2], op[3], (size_t)op[4], stream); break;
            case HCCL_OP_WRITE: r = ((hccl_cu_value_fn)(uintptr_t)write_fn)(stream, op[2], (uint32_t)op[3], 0); break;
            case HCCL_OP_WAIT: r = ((hccl_cu_value_fn)(uintptr_t)wait_fn)(stream, op[2], (uint32_t)op[3], 0); break;
            default: r = -1;
            }
        } else {
            void *a = (void *)(uintptr_t)op[2];
            switch (op[0]) {
            case HCCL_OP_COPY:
                r = ((hccl_hip_copy_fn)(uintptr_t)copy_fn)(a, (const void *)(uintptr_t)op[3], (size_t)op[4],
                                                           HCCL_HIP_MEMCPY_DEFAULT, stream);
                break;
            case HCCL_OP_WRITE: r = ((hccl_hip_write_fn)(uintptr_t)write_fn)(stream, a, (uint32_t)op[3], 0); break;
            case HCCL_OP_WAIT:
                r = ((hccl_hip_wait_fn)(uintptr_t)wait_fn)(stream, a, (uint32_t)op[3], 0, 0xFFFFFFFFu);
                break;
            default: r = -1;
            }
        }
        if (r != 0) {
            *rc = r;
            return i;
        }
    }
    return -1;
}
