// sm90.cuh: Hopper's asynchronous instructions (sm_90a), each behind a small __device__ wrapper, the only
// way a kernel reaches them: inline PTX on the GPU; under the CPU emulator (__CUDA_EMU__), an exact emulation
// that also refuses what the hardware assumes and punishes (kernels/emu/README.md, "Hopper"). The PTX ISA
// manual says what each does; CUTLASS's cute/arch/mma_sm90_gmma.hpp, copy_sm90_tma.hpp and
// cutlass/arch/barrier.h use them the same way.
//
//   smem_address(p)                 the 32-bit shared-memory address of a generic pointer into shared memory
//                                   (cvta.to.shared): what descriptors, barriers and TMA take
//   mbarrier_init(bar, count)       mbarrier.init.shared::cta.b64: phase 0 awaits `count` arrivals
//   fence_barrier_init()            fence.mbarrier_init.release.cluster: the inits visible (then a barrier)
//   mbarrier_arrive(bar)            mbarrier.arrive.shared::cta.b64: one arrival
//   mbarrier_arrive_expect_tx(bar, bytes)  mbarrier.arrive.expect_tx: one arrival, and `bytes` more of
//                                   transactions (TMA's complete_tx) that the phase awaits
//   mbarrier_wait(bar, parity)      mbarrier.try_wait.parity.shared::cta.b64 until it succeeds: returns once
//                                   the phase of that parity has completed (the barrier's current phase has
//                                   the other parity). A fresh barrier is in phase 0: a wait on parity 1
//                                   returns at once (the producer's first pass over empty stages).
//   tma_load_2d/4d(dst, map, bar, c0, ...)  cp.async.bulk.tensor.{2,4}d.shared::cluster.global.mbarrier::
//                                   complete_tx::bytes: the box of the tensor map at the coordinates
//                                   (innermost first, elements; out of the tensor's bounds: zeros) into dst
//                                   (shared, 128-byte aligned; 1024 for the 128-byte swizzle), its bytes
//                                   completed on `bar`. Issued by one thread.
//   tma_prefetch(map)               prefetch.tensormap: the map's descriptor into the cache
//   fence_proxy_async()             fence.proxy.async.shared::cta: this thread's generic-proxy accesses of
//                                   shared memory ordered with the async proxy's (TMA, wgmma)
//   wgmma_descriptor_sw128(p, lbo)  the matrix descriptor of a bf16 operand in shared memory at p, in lines of 64
//                                   elements (128 bytes) swizzled by 16-byte chunks (chunk j of line l at
//                                   j ^ (l % 8), TMA's CU_TENSOR_MAP_SWIZZLE_128B), 8-line groups 1024 bytes apart
//                                   from a 1024-byte aligned address. K-major: a line a row, 64 k; advancing k by 16
//                                   adds 32 bytes to p. MN-major: a line a k, 64 rows (m or n); advancing k by 16
//                                   adds 2048 bytes; the next 64 rows are `lbo` bytes further.
//   wgmma_fence()                   wgmma.fence.sync.aligned: before the first wgmma of a batch, after the
//                                   accumulators were last touched by other instructions
//   wgmma_bf16<N, MN>(d, a, b, acc)  wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16: d = A B (+ d if acc)
//                                   for the warpgroup's 64 x 16 A (descriptor a) and 16 x N B (descriptor b), both
//                                   K-major, or both MN-major (MN: imm-trans-a and -b). Asynchronous: d may be neither read
//                                   nor written until a wgmma_wait retires its group. Thread t of the
//                                   warpgroup (warp w = t / 32, lane l) holds in d[4j + i] the element
//                                   row 16 w + l / 4 + 8 (i / 2), column 8 j + 2 (l % 4) + i % 2: each warp's
//                                   16 rows as mma.sync's m16n8 accumulators, N / 8 of them side by side.
//   wgmma_tf32<N>(d, a, b, acc)     wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32: the same of TF32 operands
//                                   (float32's whose low 13 bits the tensor cores ignore: a 128-byte line 32 k,
//                                   advancing k by 8 adds 32 bytes), K-major only
//   wgmma_commit()                  wgmma.commit_group.sync.aligned: the wgmmas since the last commit, a group
//   wgmma_wait<N>()                 wgmma.wait_group.sync.aligned N: all but the N most recent groups retired
//   wgmma_fence_operands(d)         an empty asm that reads and writes each accumulator register (CUTLASS's
//                                   warpgroup_fence_operand): the compiler moves no access of them across it; around
//                                   a batch of wgmmas, so that it neither reads them early nor serialises the wgmmas
//   setmaxnreg_inc<R>(), _dec<R>()  setmaxnreg.{inc,dec}.sync.aligned.u32 R: the warpgroup's registers a thread (ptxas
//                                   ignores it in a kernel without __launch_bounds__)
//   named_barrier_sync(id, n)       bar.sync id, n: waits until n threads (a multiple of 32, whole warps) arrived at
//                                   barrier id (1..15; 0 is __syncthreads()'s): some warps of a block, such as a
//                                   warp-specialised kernel's consumers while its producer loads on
//   named_barrier_any(id, n, p)     bar.red.or.pred: the same, returning whether any of them passed p != 0
//   NamedSync<THREADS, ID>          those two as common.cuh's BlockSync is __syncthreads(): for last_block and
//                                   bn_stats.cuh's merges among a block's consumers
//
// Every thread of a warpgroup (128 consecutive threads, from a multiple of 128) must call the wgmma_* and
// setmaxnreg wrappers together, at the same call.
#pragma once
#include "tensor_core.cuh"

// CUtensorMap: the 128 bytes that cuTensorMapEncodeTiled writes on the host, passed by value to a kernel
// (`const __grid_constant__ TensorMap map`), whose address TMA takes. Opaque on the GPU; under the emulator,
// the emulator's own record of the same tensor map (kernels/emu, emu.TensorMap).
struct alignas(64) TensorMap {
    unsigned long long bits[16];
};

#ifdef __CUDA_EMU__
// The emulation (kernels/emu): call sites named in errors, as tensor_core.cuh's.
extern "C" unsigned emu_shared_address(const void* p, const char* file, int line);
extern "C" void emu_mbarrier_init(void* bar, unsigned count, const char* file, int line);
extern "C" void emu_fence_barrier_init(void);
extern "C" void emu_mbarrier_arrive(void* bar, unsigned tx_bytes, int expect_tx, const char* file, int line);
extern "C" void emu_mbarrier_wait(void* bar, unsigned parity, const char* file, int line);
extern "C" void emu_tma_load(void* dst, const TensorMap* map, void* bar, int rank, const int* coords,
                             const char* file, int line);
extern "C" void emu_fence_proxy_async(void);
extern "C" void emu_wgmma_fence(const char* file, int line);
extern "C" void emu_wgmma_commit(const char* file, int line);
extern "C" void emu_wgmma_wait(int pending, const char* file, int line);
extern "C" void emu_wgmma_bf16(float* d, int n, unsigned long long a, unsigned long long b, int accumulate,
                               int mn_major, const char* file, int line);
extern "C" void emu_wgmma_tf32(float* d, int n, unsigned long long a, unsigned long long b, int accumulate,
                               const char* file, int line);
extern "C" void emu_setmaxnreg(int registers, int increase, const char* file, int line);
extern "C" int emu_named_barrier(int id, int threads, int predicate, const char* file, int line);
#define SM90_SITE call_file, call_line
#endif
// the call site of a wrapper without other parameters, and a site passed on to another wrapper
#ifdef __CUDA_EMU__
#define SM90_CALL_SITE const char *call_file = __builtin_FILE(), int call_line = __builtin_LINE()
#define SM90_PASS_SITE , call_file, call_line
#define SM90_SITE_ONLY call_file, call_line
#else
#define SM90_CALL_SITE
#define SM90_PASS_SITE
#define SM90_SITE_ONLY
#endif

__device__ __forceinline__ unsigned smem_address(const void* p TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    return emu_shared_address(p, SM90_SITE);
#else
    return unsigned(__cvta_generic_to_shared(p));
#endif
}

// ---- mbarrier -----------------------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(unsigned long long* bar, unsigned count TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_mbarrier_init(bar, count, SM90_SITE);
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_address(bar)), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void fence_barrier_init() {
#ifdef __CUDA_EMU__
    emu_fence_barrier_init();
#else
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbarrier_arrive(unsigned long long* bar TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_mbarrier_arrive(bar, 0, 0, SM90_SITE);
#else
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_address(bar)) : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned long long* bar, unsigned bytes TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_mbarrier_arrive(bar, bytes, 1, SM90_SITE);
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_address(bar)), "r"(bytes)
                 : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long* bar, unsigned parity TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_mbarrier_wait(bar, parity, SM90_SITE);
#else
    asm volatile("{\n.reg .pred done;\nsm90_wait:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra sm90_wait;\n}"
                 :: "r"(smem_address(bar)), "r"(parity) : "memory");
#endif
}

// ---- the tensor memory accelerator ----------------------------------------------------------------

__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, unsigned long long* bar, int c0, int c1
                                            TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    const int coords[2] = {c0, c1};
    emu_tma_load(dst, &map, bar, 2, coords, SM90_SITE);
#else
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_address(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(smem_address(bar)) : "memory");
#endif
}

__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, unsigned long long* bar, int c0, int c1,
                                            int c2, int c3 TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    const int coords[4] = {c0, c1, c2, c3};
    emu_tma_load(dst, &map, bar, 4, coords, SM90_SITE);
#else
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 :: "r"(smem_address(dst)), "l"(&map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
                 : "memory");
#endif
}

__device__ __forceinline__ void tma_prefetch(const TensorMap& map) {
#ifndef __CUDA_EMU__
    asm volatile("prefetch.tensormap [%0];" :: "l"(&map) : "memory");
#endif
}

__device__ __forceinline__ void fence_proxy_async() {
#ifdef __CUDA_EMU__
    emu_fence_proxy_async();
#else
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// ---- warpgroup MMA ----------------------------------------------------------------------------------

// Bits 0-13: the address / 16; 16-29: the leading byte offset / 16 (unused by a swizzled K-major operand: 16 bytes;
// an MN-major one's next 64 rows); 32-45: the stride byte offset / 16 (1024: from one group of 8 lines to the next);
// 49-51: the base offset (0: the swizzle's pattern from 1024-byte aligned addresses); 62-63: the swizzle (1: 128
// bytes).
__device__ __forceinline__ unsigned long long wgmma_descriptor_sw128(const void* p, unsigned leading_bytes = 16
                                                                      TC_CALL_SITE) {
    const unsigned long long address = smem_address(p SM90_PASS_SITE);
    return (address & 0x3ffff) >> 4 | (leading_bytes & 0x3ffffull) >> 4 << 16 | (1024ull >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void wgmma_fence(SM90_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_wgmma_fence(SM90_SITE);
#else
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit(SM90_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_wgmma_commit(SM90_SITE);
#else
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait(SM90_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_wgmma_wait(N, SM90_SITE);
#else
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
#endif
}

#ifndef __CUDA_EMU__
#define SM90_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                   "+f"(d[i + 6]), "+f"(d[i + 7])
// wgmma of N columns, A and B K-major (T = 0) or both MN-major (T = 1: imm-trans-a and imm-trans-b)
template <int N, int T>
struct WgmmaBf16Asm;

template <int T>
struct WgmmaBf16Asm<64, T> {
    __device__ __forceinline__ static void run(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                     "}, %32, %33, p, 1, 1, %35, %35;\n}"
                     : SM90_D8(0), SM90_D8(8), SM90_D8(16), SM90_D8(24)
                     : "l"(a), "l"(b), "r"(accumulate), "n"(T));
    }
};

template <int T>
struct WgmmaBf16Asm<128, T> {
    __device__ __forceinline__ static void run(float (&d)[64], unsigned long long a, unsigned long long b, int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                     "}, %64, %65, p, 1, 1, %67, %67;\n}"
                     : SM90_D8(0), SM90_D8(8), SM90_D8(16), SM90_D8(24), SM90_D8(32), SM90_D8(40), SM90_D8(48), SM90_D8(56)
                     : "l"(a), "l"(b), "r"(accumulate), "n"(T));
    }
};
// wgmma of TF32 operands, both K-major (TF32's are not transposed)
template <int N>
struct WgmmaTf32Asm;

template <>
struct WgmmaTf32Asm<64> {
    __device__ __forceinline__ static void run(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                     "}, %32, %33, p, 1, 1;\n}"
                     : SM90_D8(0), SM90_D8(8), SM90_D8(16), SM90_D8(24)
                     : "l"(a), "l"(b), "r"(accumulate));
    }
};

template <>
struct WgmmaTf32Asm<128> {
    __device__ __forceinline__ static void run(float (&d)[64], unsigned long long a, unsigned long long b, int accumulate) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                     "}, %64, %65, p, 1, 1;\n}"
                     : SM90_D8(0), SM90_D8(8), SM90_D8(16), SM90_D8(24), SM90_D8(32), SM90_D8(40), SM90_D8(48), SM90_D8(56)
                     : "l"(a), "l"(b), "r"(accumulate));
    }
};
#undef SM90_D8
#endif

template <int N, bool MN_MAJOR = false>
__device__ __forceinline__ void wgmma_bf16(float (&d)[N / 2], unsigned long long a, unsigned long long b,
                                           int accumulate TC_CALL_SITE) {
    static_assert(N == 64 || N == 128, "wgmma_bf16 is written for n64 and n128");
#ifdef __CUDA_EMU__
    emu_wgmma_bf16(d, N, a, b, accumulate, MN_MAJOR, SM90_SITE);
#else
    WgmmaBf16Asm<N, MN_MAJOR>::run(d, a, b, accumulate);
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_tf32(float (&d)[N / 2], unsigned long long a, unsigned long long b,
                                           int accumulate TC_CALL_SITE) {
    static_assert(N == 64 || N == 128, "wgmma_tf32 is written for n64 and n128");
#ifdef __CUDA_EMU__
    emu_wgmma_tf32(d, N, a, b, accumulate, SM90_SITE);
#else
    WgmmaTf32Asm<N>::run(d, a, b, accumulate);
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#ifndef __CUDA_EMU__
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
#endif
}

// setmaxnreg.inc (INCREASE) or .dec to R registers a thread
template <int R, bool INCREASE>
__device__ __forceinline__ void setmaxnreg(SM90_CALL_SITE) {
    static_assert(R % 8 == 0 && R >= 24 && R <= 256, "setmaxnreg takes a multiple of 8 in [24, 256]");
#ifdef __CUDA_EMU__
    emu_setmaxnreg(R, INCREASE, SM90_SITE);
#else
    if constexpr (INCREASE)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(R));
    else
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(R));
#endif
}

template <int R>
__device__ __forceinline__ void setmaxnreg_inc(SM90_CALL_SITE) {
    setmaxnreg<R, true>(SM90_SITE_ONLY);
}

template <int R>
__device__ __forceinline__ void setmaxnreg_dec(SM90_CALL_SITE) {
    setmaxnreg<R, false>(SM90_SITE_ONLY);
}

// ---- named barriers ---------------------------------------------------------------------------------

__device__ __forceinline__ void named_barrier_sync(int id, int threads TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    emu_named_barrier(id, threads, 0, SM90_SITE);
#else
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
#endif
}

__device__ __forceinline__ int named_barrier_any(int id, int threads, int predicate TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    return emu_named_barrier(id, threads, predicate, SM90_SITE);
#else
    int any;
    asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.s32 p, %1, 0;\n\tbar.red.or.pred q, %2, %3, p;\n\t"
                 "selp.s32 %0, 1, 0, q;\n\t}" : "=r"(any) : "r"(predicate), "r"(id), "r"(threads) : "memory");
    return any;
#endif
}

template <int THREADS, int ID = 1>
struct NamedSync {
    __device__ void sync() const { named_barrier_sync(ID, THREADS); }
    __device__ int any(int predicate) const { return named_barrier_any(ID, THREADS, predicate); }
};
