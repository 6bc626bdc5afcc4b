// What the emulation header (cuda_emu.h, compiled into every kernel module) and the
// runtime (runtime.cpp, compiled once) agree on: the thread descriptor a kernel reads
// threadIdx & co. from, the size of a fiber's stack slot, and the runtime's C entry points.
// Free of CUDA vocabulary, so that the runtime can include it without the kernel macros.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// Every CUDA thread runs on its own stack slot: kEmuSlotBytes, aligned to kEmuSlotBytes: a
// guard page, the stack, and at the top the thread's descriptor (kEmuThreadBytes at
// kEmuThreadOffset). A kernel finds its descriptor from its stack pointer: no thread-local
// storage, no call.
constexpr std::size_t kEmuSlotBytes = std::size_t(1) << 18;  // 256 KiB
constexpr std::size_t kEmuPageBytes = 4096;
constexpr std::size_t kEmuThreadBytes = 64;
constexpr std::size_t kEmuThreadOffset = kEmuSlotBytes - kEmuThreadBytes;

struct emu_thread {
    uint3 thread_idx;
    uint3 block_idx;
    dim3 block_dim;
    dim3 grid_dim;
};

namespace emu {
// A value of up to 8 bytes as the bits a warp operation carries (the low bytes), and back.
template <class T>
inline std::uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8);
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}

template <class T>
inline T from_bits(std::uint64_t bits) {
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}
}  // namespace emu

// The warp-level operations that need a rendezvous of the lanes named in a mask; EMU_ALIGNED
// is a warp-wide .aligned instruction (mma.sync, ldmatrix), see emu_warp_aligned.
enum emu_warp_op : int {
    EMU_SHFL_IDX, EMU_SHFL_UP, EMU_SHFL_DOWN, EMU_SHFL_XOR,
    EMU_BALLOT, EMU_ANY, EMU_ALL, EMU_SYNCWARP, EMU_ALIGNED,
};

// The most bytes a lane hands to a warp-wide instruction's emulation.
constexpr int kEmuAlignedBytes = 64;

// Dynamic shared memory: one buffer per module and OS thread, as large as the largest opt-in
// a GPU of the project allows (sm_90: 227 KiB), plus room for a canary after what a launch
// asked for (a write past it shows). A launch fills only what it asked for.
constexpr std::size_t kEmuDynamicSharedBytes = 227 * 1024;
constexpr std::size_t kEmuSharedTailBytes = 256;
// The dynamic shared memory starts at a 1024-byte aligned address, as on sm_90 (the period of the 128-byte
// swizzle, a function of the address bits, that TMA writes and wgmma reads).
constexpr std::size_t kEmuDynamicSharedAlign = 1024;

// The emulator's record of a tensor map (sm90.cuh's TensorMap, CUtensorMap's 128 bytes), which the launcher
// writes for an emu.TensorMap argument (arguments.py): the launch's copy of the tensor and its geometry, every
// array innermost dimension first (CUDA's order).
struct EmuTensorMap {
    std::uint64_t magic;           // kEmuTensorMapMagic
    std::uint64_t address;         // the launch's (guarded) copy of the tensor
    std::uint32_t rank, element_bytes, swizzle, nan_fill;   // rank 1..5; swizzle 0 or 128 (bytes); nan_fill: the
                                                            // elements past the tensor NaN (float types), else 0
    std::uint64_t dims[5];         // elements
    std::uint64_t strides[5];      // bytes; strides[0] is the element's size
    std::uint16_t box[5];          // elements, 1..256
    std::uint16_t pad[3];
};
static_assert(sizeof(EmuTensorMap) == 128, "a tensor map is CUtensorMap's 128 bytes");
constexpr std::uint64_t kEmuTensorMapMagic = 0x3170614d54756d45ull;   // "EmuTMap1"

extern "C" {
// A barrier called at file:line; how: 0 count, 1 and, 2 or.
int emu_syncthreads_reduce(int predicate, int how, const char* file, int line);
// A warp-level operation: `bytes`, the size of a shuffle's value (4 or 8; 0 for a vote or __syncwarp),
// is that of the undefined value a lane that reads outside the mask gets (see runtime.cpp, poison).
std::uint64_t emu_warp(int op, unsigned mask, std::uint64_t value, int arg, int width, int bytes);
// A warp-wide .aligned instruction named `what`, called at file:line: returns when all 32 lanes
// of the warp have reached this very call, each lane's `bytes` at `in` gathered, lane by lane,
// into every lane's `out` (32 * bytes). Lanes at another call, or returned, are an error.
void emu_warp_aligned(const char* what, const char* file, int line, const void* in, int bytes, void* out);
// A warp-wide .aligned instruction that loads rows of shared memory (ldmatrix): when all 32 lanes
// have reached this very call, the `row_bytes` at each lane's `row` (none for a null row) are read,
// all at once as the instruction does, into every lane's `out` (32 * row_bytes), lane by lane.
void emu_warp_aligned_rows(const char* what, const char* file, int line, const void* row, int row_bytes, void* out);
// The sanitizer's check of an access the compiler does not instrument (memcpy, memset, an atomic):
// `how` 0 read, 1 write, 2 atomic (bounds and alignment; atomics never race, and one on global memory
// hands on or takes the writes a fence released: see emu_threadfence); `caller`, the return address
// into the kernel to name, or null for the call's own.
void emu_check_access(const void* p, std::size_t bytes, int how, const void* caller);
// The sanitizer's check of a value the kernel uses where the compiler's instrumentation does not see it
// (an atomic's operand): an error if it is an undefined shuffle value (`bytes`: its size); `what` names the use.
void emu_check_defined(std::uint64_t bits, int bytes, const char* what, const void* caller);
// __threadfence() under the sanitizer: the fence, and for racecheck, a block's writes before it handed on
// by its next atomic to the blocks that update the same word after (last_block's counter).
void emu_threadfence(void);
// An error unless [p, p + bytes) lies in the block's shared memory and p is a multiple of `align`.
void emu_check_shared(const void* p, std::size_t bytes, std::size_t align, const char* what, const char* file,
                      int line);
// cp.async of `bytes` (4, 8 or 16) from global `src` to shared `dst`, of which the first
// `src_bytes` are read and the rest zero-filled; `dst` reads as NaN until the wait that covers
// its group. `cache_global`: the .cg variant (16 bytes only).
void emu_cp_async(void* dst, const void* src, int bytes, int src_bytes, int cache_global, const char* file,
                  int line);
void emu_cp_async_commit(void);
void emu_cp_async_wait(int pending_groups);
[[noreturn]] void emu_trap(const char* what);
[[noreturn]] void emu_assert_fail(const char* expr, const char* file, int line, const char* function);
}
