// cuda_emu.h: CUDA C's device vocabulary with a CPU meaning, so that g++ compiles a kernel
// source unchanged (it is force-included before the source; see README.md in this folder).
//
// Only what CUDA itself offers is defined: a kernel that calls something CUDA lacks (a float
// atomicMax, arithmetic on float4) fails to compile here as it fails in NVRTC.
#pragma once
#include <cassert>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <type_traits>
#include <utility>

#include "emu_abi.h"

#define __CUDACC__ 1
#define __CUDA_EMU__ 1

// ---- qualifiers --------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
// `thread_local` is the one C++ storage class that reads right both in a block-scope
// `__shared__ float tile[32][32];` (implies static: one array that the fibers of a block
// share) and in `extern __shared__ float smem[];` (a declaration the module defines, see
// build.py). One OS thread runs one block at a time, so per-thread is per-block.
#define __shared__ thread_local

inline constexpr int warpSize = 32;

namespace emu {
// The descriptor at the base of the running fiber's stack slot (see emu_abi.h).
inline const emu_thread* self() {
    std::uintptr_t sp;
#if defined(__x86_64__)
    asm("movq %%rsp, %0" : "=r"(sp));
#elif defined(__aarch64__)
    asm("mov %0, sp" : "=r"(sp));
#else
    sp = reinterpret_cast<std::uintptr_t>(__builtin_frame_address(0));
#endif
    return reinterpret_cast<const emu_thread*>((sp & ~(kEmuSlotBytes - 1)) + kEmuThreadOffset);
}
}  // namespace emu

// Not the kernel's own work: what the sanitizer leaves alone, its memory traffic and its comparisons (see
// EMU_SANITIZE below).
#ifdef EMU_SANITIZE
#define EMU_UNCHECKED __attribute__((no_sanitize_thread, no_sanitize_coverage))
#else
#define EMU_UNCHECKED
#endif

namespace emu {
// threadIdx & co. by value, read where the sanitizer does not look: a kernel reads them all the time,
// and they are registers on a GPU.
template <class T, T emu_thread::*field>
EMU_UNCHECKED inline T descriptor() { return self()->*field; }
}  // namespace emu

#define threadIdx (::emu::descriptor<uint3, &emu_thread::thread_idx>())
#define blockIdx (::emu::descriptor<uint3, &emu_thread::block_idx>())
#define blockDim (::emu::descriptor<dim3, &emu_thread::block_dim>())
#define gridDim (::emu::descriptor<dim3, &emu_thread::grid_dim>())

// ---- synchronisation ---------------------------------------------------------------------
// A barrier's call site (hidden arguments): the threads a barrier releases must all wait at one
// (see emu_syncthreads_reduce).
#define EMU_BARRIER_SITE const char *barrier_file = __builtin_FILE(), int barrier_line = __builtin_LINE()
inline void __syncthreads(EMU_BARRIER_SITE) { emu_syncthreads_reduce(1, 0, barrier_file, barrier_line); }
inline int __syncthreads_count(int predicate, EMU_BARRIER_SITE) {
    return emu_syncthreads_reduce(predicate, 0, barrier_file, barrier_line);
}
inline int __syncthreads_and(int predicate, EMU_BARRIER_SITE) {
    return emu_syncthreads_reduce(predicate, 1, barrier_file, barrier_line);
}
inline int __syncthreads_or(int predicate, EMU_BARRIER_SITE) {
    return emu_syncthreads_reduce(predicate, 2, barrier_file, barrier_line);
}
#undef EMU_BARRIER_SITE
// Blocks run one after another and each thread's writes are visible at once: fences order
// nothing further, but they still stop the compiler from caching memory across them. Under the
// sanitizer a fence beyond the block also tells racecheck that the block's writes before it may be
// handed on to another block (emu_threadfence).
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#ifdef EMU_SANITIZE
inline void __threadfence() { emu_threadfence(); }
inline void __threadfence_system() { emu_threadfence(); }
#else
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif

inline void __syncwarp(unsigned mask = 0xffffffffu) { emu_warp(EMU_SYNCWARP, mask, 0, 0, 32, 0); }
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return unsigned(emu_warp(EMU_BALLOT, mask, predicate != 0, 0, 32, 0));
}
inline int __any_sync(unsigned mask, int predicate) {
    return int(emu_warp(EMU_ANY, mask, predicate != 0, 0, 32, 0));
}
inline int __all_sync(unsigned mask, int predicate) {
    return int(emu_warp(EMU_ALL, mask, predicate != 0, 0, 32, 0));
}

// CUDA's overload set of the shuffles, no more; inlined, so that a message names the kernel's line. A lane
// that reads one outside the mask gets a poison of its type's size (runtime.cpp).
#define EMU_SHUFFLE inline __attribute__((always_inline))
#define EMU_SHUFFLES(T)                                                                        \
    EMU_SHUFFLE T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {           \
        return emu::from_bits<T>(emu_warp(EMU_SHFL_IDX, mask, emu::to_bits(var), src_lane, width, sizeof(T))); \
    }                                                                                          \
    EMU_SHUFFLE T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = warpSize) {  \
        return emu::from_bits<T>(emu_warp(EMU_SHFL_UP, mask, emu::to_bits(var), int(delta), width, sizeof(T))); \
    }                                                                                          \
    EMU_SHUFFLE T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = warpSize) { \
        return emu::from_bits<T>(emu_warp(EMU_SHFL_DOWN, mask, emu::to_bits(var), int(delta), width, sizeof(T))); \
    }                                                                                          \
    EMU_SHUFFLE T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {      \
        return emu::from_bits<T>(emu_warp(EMU_SHFL_XOR, mask, emu::to_bits(var), lane_mask, width, sizeof(T))); \
    }
EMU_SHUFFLES(int)
EMU_SHUFFLES(unsigned int)
EMU_SHUFFLES(long)
EMU_SHUFFLES(unsigned long)
EMU_SHUFFLES(long long)
EMU_SHUFFLES(unsigned long long)
EMU_SHUFFLES(float)
EMU_SHUFFLES(double)
#undef EMU_SHUFFLES
#undef EMU_SHUFFLE

// ---- atomics: exactly CUDA's overloads -----------------------------------------------------
// Under the sanitizer (EMU_SANITIZE, see build.py) an atomic is checked for bounds and alignment
// but is not a plain store: atomics never race. So the compiler must not instrument them, nor inline
// them into a kernel that it does instrument; the check names the kernel's call. Its operand is a
// value the atomic uses: it must not be an undefined shuffle value.
#ifdef EMU_SANITIZE
#define EMU_ATOMIC __attribute__((no_sanitize_thread, no_sanitize_coverage, noinline)) inline
#define EMU_CHECK_OPERAND(val) \
    emu_check_defined(emu::to_bits(val), int(sizeof(val)), "as an atomic's operand", __builtin_return_address(0))
#define EMU_CHECK_ATOMIC(address, val) \
    (emu_check_access(address, sizeof *(address), 2, __builtin_return_address(0)), EMU_CHECK_OPERAND(val))
#else
#define EMU_ATOMIC inline
#define EMU_CHECK_OPERAND(val) ((void)0)
#define EMU_CHECK_ATOMIC(address, val) ((void)0)
#endif
#define EMU_INTEGER_ATOMIC(name, T, builtin) \
    EMU_ATOMIC T name(T* address, T val) {    \
        EMU_CHECK_ATOMIC(address, val);         \
        return builtin(address, val, __ATOMIC_RELAXED); \
    }
#define EMU_INTEGER_ATOMICS(T)                               \
    EMU_INTEGER_ATOMIC(atomicAdd, T, __atomic_fetch_add)     \
    EMU_INTEGER_ATOMIC(atomicExch, T, __atomic_exchange_n)   \
    EMU_INTEGER_ATOMIC(atomicAnd, T, __atomic_fetch_and)     \
    EMU_INTEGER_ATOMIC(atomicOr, T, __atomic_fetch_or)       \
    EMU_INTEGER_ATOMIC(atomicXor, T, __atomic_fetch_xor)
EMU_INTEGER_ATOMICS(int)
EMU_INTEGER_ATOMICS(unsigned int)
EMU_INTEGER_ATOMICS(unsigned long long)
EMU_INTEGER_ATOMIC(atomicSub, int, __atomic_fetch_sub)
EMU_INTEGER_ATOMIC(atomicSub, unsigned int, __atomic_fetch_sub)
EMU_INTEGER_ATOMIC(atomicAnd, long long, __atomic_fetch_and)
EMU_INTEGER_ATOMIC(atomicOr, long long, __atomic_fetch_or)
EMU_INTEGER_ATOMIC(atomicXor, long long, __atomic_fetch_xor)
#undef EMU_INTEGER_ATOMICS
#undef EMU_INTEGER_ATOMIC

namespace emu {
// Read-modify-write by compare-and-swap: what the operations without a fetch-op builtin need.
template <class T, class F>
EMU_ATOMIC T atomic_update(T* address, F update) {
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(address, &old, update(old), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}

template <class T, class Bits>
EMU_ATOMIC T atomic_float_add(T* address, T val) {
    Bits* word = reinterpret_cast<Bits*>(address);
    Bits old = atomic_update(word, [val](Bits b) { return Bits(to_bits(from_bits<T>(b) + val)); });
    return from_bits<T>(old);
}
}  // namespace emu

EMU_ATOMIC float atomicAdd(float* address, float val) {
    EMU_CHECK_ATOMIC(address, val);
    return emu::atomic_float_add<float, std::uint32_t>(address, val);
}
EMU_ATOMIC double atomicAdd(double* address, double val) {
    EMU_CHECK_ATOMIC(address, val);
    return emu::atomic_float_add<double, std::uint64_t>(address, val);
}
EMU_ATOMIC float atomicExch(float* address, float val) {
    EMU_CHECK_ATOMIC(address, val);
    return emu::from_bits<float>(__atomic_exchange_n(reinterpret_cast<std::uint32_t*>(address),
                                                     std::uint32_t(emu::to_bits(val)), __ATOMIC_RELAXED));
}

#define EMU_MIN_MAX_ATOMICS(T)                                                                \
    EMU_ATOMIC T atomicMin(T* address, T val) {                                               \
        EMU_CHECK_ATOMIC(address, val);                                                       \
        return emu::atomic_update(address, [val](T old) { return old < val ? old : val; });   \
    }                                                                                         \
    EMU_ATOMIC T atomicMax(T* address, T val) {                                               \
        EMU_CHECK_ATOMIC(address, val);                                                       \
        return emu::atomic_update(address, [val](T old) { return old > val ? old : val; });   \
    }
EMU_MIN_MAX_ATOMICS(int)
EMU_MIN_MAX_ATOMICS(unsigned int)
EMU_MIN_MAX_ATOMICS(long long)
EMU_MIN_MAX_ATOMICS(unsigned long long)
#undef EMU_MIN_MAX_ATOMICS

#define EMU_CAS(T)                                                                            \
    EMU_ATOMIC T atomicCAS(T* address, T compare, T val) {                                   \
        EMU_CHECK_OPERAND(compare);                                                           \
        EMU_CHECK_ATOMIC(address, val);                                                       \
        __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); \
        return compare;                                                                       \
    }
EMU_CAS(int)
EMU_CAS(unsigned int)
EMU_CAS(unsigned long long)
EMU_CAS(unsigned short)
#undef EMU_CAS

EMU_ATOMIC unsigned int atomicInc(unsigned int* address, unsigned int val) {
    EMU_CHECK_ATOMIC(address, val);
    return emu::atomic_update(address, [val](unsigned int old) { return old >= val ? 0u : old + 1; });
}
EMU_ATOMIC unsigned int atomicDec(unsigned int* address, unsigned int val) {
    EMU_CHECK_ATOMIC(address, val);
    return emu::atomic_update(address,
                              [val](unsigned int old) { return (old == 0 || old > val) ? val : old - 1; });
}

// ---- vector types ----------------------------------------------------------------------------
namespace emu {
// What the launcher needs to check a pointer to a vector type against an array's dtype.
template <class T>
struct vector_info {
    using component = T;
    static constexpr int count = 1;
};
}  // namespace emu

#define EMU_VECTOR_INFO(V, T, N)             \
    namespace emu {                          \
    template <>                              \
    struct vector_info<V> {                  \
        using component = T;                 \
        static constexpr int count = N;      \
    };                                       \
    }
#define EMU_VECTOR1(V, T, A)                                                   \
    struct __attribute__((aligned(A))) V { T x; };                            \
    inline V make_##V(T x) { return V{x}; }                                   \
    EMU_VECTOR_INFO(V, T, 1)
#define EMU_VECTOR2(V, T, A)                                                   \
    struct __attribute__((aligned(A))) V { T x, y; };                         \
    inline V make_##V(T x, T y) { return V{x, y}; }                           \
    EMU_VECTOR_INFO(V, T, 2)
#define EMU_VECTOR3(V, T)                                                      \
    struct V { T x, y, z; };                                                   \
    inline V make_##V(T x, T y, T z) { return V{x, y, z}; }                   \
    EMU_VECTOR_INFO(V, T, 3)
#define EMU_VECTOR4(V, T, A)                                                   \
    struct __attribute__((aligned(A))) V { T x, y, z, w; };                   \
    inline V make_##V(T x, T y, T z, T w) { return V{x, y, z, w}; }           \
    EMU_VECTOR_INFO(V, T, 4)
// name, component, alignment of the 1-, 2- and 4-vectors (CUDA's vector_types.h)
#define EMU_VECTORS(P, T, A1, A2, A4) \
    EMU_VECTOR1(P##1, T, A1) EMU_VECTOR2(P##2, T, A2) EMU_VECTOR3(P##3, T) EMU_VECTOR4(P##4, T, A4)
EMU_VECTORS(char, signed char, 1, 2, 4)
EMU_VECTORS(uchar, unsigned char, 1, 2, 4)
EMU_VECTORS(short, short, 2, 4, 8)
EMU_VECTORS(ushort, unsigned short, 2, 4, 8)
EMU_VECTORS(int, int, 4, 8, 16)
EMU_VECTORS(long, long, 8, 16, 16)
EMU_VECTORS(ulong, unsigned long, 8, 16, 16)
EMU_VECTORS(longlong, long long, 8, 16, 16)
EMU_VECTORS(ulonglong, unsigned long long, 8, 16, 16)
EMU_VECTORS(float, float, 4, 8, 16)
EMU_VECTORS(double, double, 8, 16, 16)
// uint3 is threadIdx's type and lives in emu_abi.h.
EMU_VECTOR1(uint1, unsigned int, 4)
EMU_VECTOR2(uint2, unsigned int, 8)
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }
EMU_VECTOR_INFO(uint3, unsigned int, 3)
EMU_VECTOR4(uint4, unsigned int, 16)
#undef EMU_VECTORS
#undef EMU_VECTOR1
#undef EMU_VECTOR2
#undef EMU_VECTOR3
#undef EMU_VECTOR4
#undef EMU_VECTOR_INFO

// __ldg: a plain load here, for CUDA's list of types.
#define EMU_LDG(T) \
    inline T __ldg(const T* p) { return *p; }
EMU_LDG(char) EMU_LDG(signed char) EMU_LDG(short) EMU_LDG(int) EMU_LDG(long) EMU_LDG(long long)
EMU_LDG(unsigned char) EMU_LDG(unsigned short) EMU_LDG(unsigned int) EMU_LDG(unsigned long)
EMU_LDG(unsigned long long) EMU_LDG(float) EMU_LDG(double)
EMU_LDG(char2) EMU_LDG(char4) EMU_LDG(short2) EMU_LDG(short4) EMU_LDG(int2) EMU_LDG(int4)
EMU_LDG(longlong2) EMU_LDG(uchar2) EMU_LDG(uchar4) EMU_LDG(ushort2) EMU_LDG(ushort4)
EMU_LDG(uint2) EMU_LDG(uint4) EMU_LDG(ulonglong2) EMU_LDG(float2) EMU_LDG(float4) EMU_LDG(double2)
#undef EMU_LDG

// ---- math ------------------------------------------------------------------------------------
// The C library supplies expf, sqrtf, fmaxf, ... under CUDA's names; here are CUDA's own.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float fdividef(float x, float y) { return x / y; }
inline float sinpif(float x) { return sinf(float(M_PI) * x); }
inline float cospif(float x) { return cosf(float(M_PI) * x); }
inline void sincospif(float x, float* s, float* c) { *s = sinpif(x); *c = cospif(x); }
// The fast intrinsics are computed exactly: their error on a GPU is not modelled.
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __dsub_rn(double x, double y) { return x - y; }
inline double __dmul_rn(double x, double y) { return x * y; }
inline double __ddiv_rn(double x, double y) { return x / y; }
inline double __drcp_rn(double x) { return 1.0 / x; }
inline double __dsqrt_rn(double x) { return sqrt(x); }
inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }

inline int __float_as_int(float x) { return emu::from_bits<int>(emu::to_bits(x)); }
inline unsigned int __float_as_uint(float x) { return emu::from_bits<unsigned int>(emu::to_bits(x)); }
inline float __int_as_float(int x) { return emu::from_bits<float>(emu::to_bits(x)); }
inline float __uint_as_float(unsigned int x) { return emu::from_bits<float>(emu::to_bits(x)); }
inline long long __double_as_longlong(double x) { return emu::from_bits<long long>(emu::to_bits(x)); }
inline double __longlong_as_double(long long x) { return emu::from_bits<double>(emu::to_bits(x)); }
inline int __double2hiint(double x) { return int(emu::to_bits(x) >> 32); }
inline int __double2loint(double x) { return int(emu::to_bits(x)); }
inline double __hiloint2double(int hi, int lo) {
    return emu::from_bits<double>((std::uint64_t(unsigned(hi)) << 32) | unsigned(lo));
}

inline int __float2int_rn(float x) { return int(nearbyintf(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline int __float2int_rd(float x) { return int(floorf(x)); }
inline int __float2int_ru(float x) { return int(ceilf(x)); }
inline unsigned int __float2uint_rn(float x) { return (unsigned int)(nearbyintf(x)); }
inline unsigned int __float2uint_rz(float x) { return (unsigned int)(x); }
inline long long __float2ll_rn(float x) { return (long long)(nearbyintf(x)); }
inline long long __float2ll_rz(float x) { return (long long)(x); }
inline float __int2float_rn(int x) { return float(x); }
inline float __uint2float_rn(unsigned int x) { return float(x); }
inline float __ll2float_rn(long long x) { return float(x); }
inline int __double2int_rn(double x) { return int(nearbyint(x)); }
inline int __double2int_rz(double x) { return int(x); }
inline float __double2float_rn(double x) { return float(x); }
inline double __int2double_rn(int x) { return double(x); }

// Integer intrinsics.
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned long long __brevll(unsigned long long x) {
    return (static_cast<unsigned long long>(__brev(unsigned(x))) << 32) | __brev(unsigned(x >> 32));
}
inline int __mul24(int x, int y) { return int((long long)((x << 8) >> 8) * ((y << 8) >> 8)); }
inline unsigned int __umul24(unsigned int x, unsigned int y) { return (x & 0xffffffu) * (y & 0xffffffu); }
inline int __mulhi(int x, int y) { return int(((long long)x * y) >> 32); }
inline unsigned int __umulhi(unsigned int x, unsigned int y) {
    return unsigned(((unsigned long long)x * y) >> 32);
}
inline long long __mul64hi(long long x, long long y) { return (long long)(((__int128)x * y) >> 64); }
inline unsigned long long __umul64hi(unsigned long long x, unsigned long long y) {
    return (unsigned long long)(((unsigned __int128)x * y) >> 64);
}
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long bytes = (static_cast<unsigned long long>(y) << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= unsigned((bytes >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline unsigned int __funnelshift_l(unsigned int lo, unsigned int hi, unsigned int shift) {
    return unsigned(((static_cast<unsigned long long>(hi) << 32 | lo) << (shift & 31)) >> 32);
}
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int shift) {
    return unsigned((static_cast<unsigned long long>(hi) << 32 | lo) >> (shift & 31));
}

// CUDA's min and max overloads (the host has none in the global namespace).
#define EMU_MIN_MAX(R, A, B)                                                 \
    inline R min(A a, B b) {                                                 \
        const R x = static_cast<R>(a), y = static_cast<R>(b);                \
        return x < y ? x : y;                                                \
    }                                                                        \
    inline R max(A a, B b) {                                                 \
        const R x = static_cast<R>(a), y = static_cast<R>(b);                \
        return x > y ? x : y;                                                \
    }
EMU_MIN_MAX(int, int, int)
EMU_MIN_MAX(unsigned int, unsigned int, unsigned int)
EMU_MIN_MAX(unsigned int, int, unsigned int)
EMU_MIN_MAX(unsigned int, unsigned int, int)
EMU_MIN_MAX(long, long, long)
EMU_MIN_MAX(unsigned long, unsigned long, unsigned long)
EMU_MIN_MAX(unsigned long, long, unsigned long)
EMU_MIN_MAX(unsigned long, unsigned long, long)
EMU_MIN_MAX(long long, long long, long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
EMU_MIN_MAX(unsigned long long, long long, unsigned long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, long long)
#undef EMU_MIN_MAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(double a, float b) { return fmax(a, b); }

// ---- traps -----------------------------------------------------------------------------------
// A failed device assert ends the launch with an error naming the thread, as on a GPU,
// instead of aborting the whole process.
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : emu_assert_fail(#e, __FILE__, __LINE__, __func__))
#endif
inline void __trap() { emu_trap("__trap() called"); }

// ---- what the generated entry points use -------------------------------------------------------
namespace emu {
// Calls a kernel with its arguments read from CUDA's kernelParams layout: one pointer per
// parameter, pointing at a value of the parameter's declared type. Not the kernel's own accesses:
// the sanitizer leaves them alone (the launcher's memory, where the parameters come from).
template <class... A, std::size_t... I>
__attribute__((no_sanitize_thread)) inline void invoke(void (*kernel)(A...), void** args,
                                                        std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <class... A>
__attribute__((no_sanitize_thread)) inline void invoke(void (*kernel)(A...), void** args) {
    invoke(kernel, args, std::index_sequence_for<A...>{});
}

// One parameter as "pointer,const,kind,size,count,align": pointer 0/1; for a pointer, what
// it points to; kind i/u/f/b/v (void)/s (anything else), or a struct's own `emu_kind` (bf16.cuh's
// bf16: 'B'); size of a component, count of components (vector types); the alignment the pointee
// needs.
template <class C>
constexpr char kind_of() {
    if constexpr (requires { C::emu_kind; }) return C::emu_kind;
    else return std::is_same_v<C, bool>          ? 'b'
                : std::is_floating_point_v<C>    ? 'f'
                : std::is_integral_v<C>          ? (std::is_signed_v<C> ? 'i' : 'u')
                : std::is_void_v<C>              ? 'v'
                                                 : 's';
}

template <class T>
inline int describe_value(char* out, int n, int pointer, int is_const) {
    using C = typename vector_info<T>::component;
    const char kind = kind_of<C>();
    int size = 0, align = 1;
    if constexpr (!std::is_void_v<T>) {
        size = int(sizeof(C));
        align = int(alignof(T));
    }
    return std::snprintf(out, n, "%d,%d,%c,%d,%d,%d;", pointer, is_const, kind, size, vector_info<T>::count,
                         align);
}

template <class P>
inline int describe_parameter(char* out, int n) {
    if constexpr (std::is_pointer_v<P>) {
        using T = std::remove_pointer_t<P>;
        if constexpr (std::is_pointer_v<T>)
            return std::snprintf(out, n, "1,0,s,8,1,8;");
        else
            return describe_value<std::remove_cv_t<T>>(out, n, 1, std::is_const_v<T>);
    } else {
        return describe_value<std::remove_cv_t<P>>(out, n, 0, 0);
    }
}

template <class... A>
inline void signature(void (*)(A...), char* out, int n) {
    int used = 0;
    out[0] = '\0';
    ((used += describe_parameter<A>(out + used, used < n ? n - used : 0)), ...);
}
}  // namespace emu

// ---- the sanitizer's view of memcpy and memset ---------------------------------------------------
// The compiler instruments a kernel's loads and stores but not the library calls memcpy and memset
// make: under the sanitizer the kernel's own calls are checked as its accesses are. (Defined last,
// after every use of them in this header.)
#ifdef EMU_SANITIZE
inline void* emu_checked_memcpy(void* to, const void* from, std::size_t n) {
    emu_check_access(from, n, 0, nullptr);
    emu_check_access(to, n, 1, nullptr);
    return std::memcpy(to, from, n);
}
inline void* emu_checked_memset(void* to, int value, std::size_t n) {
    emu_check_access(to, n, 1, nullptr);
    return std::memset(to, value, n);
}
#define memcpy emu_checked_memcpy
#define memset emu_checked_memset
#endif

#define EMU_KERNEL_ENTRY(i, ...)                                                                      \
    extern "C" __attribute__((no_sanitize_thread)) void emu_entry_##i(void** args) {                   \
        ::emu::invoke(&__VA_ARGS__, args);                                                                \
    }                                                                                                     \
    extern "C" void emu_signature_##i(char* out, int n) { ::emu::signature(&__VA_ARGS__, out, n); }  \
    extern "C" void* emu_kernel_##i() { return reinterpret_cast<void*>(&__VA_ARGS__); }
