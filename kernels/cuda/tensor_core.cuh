// tensor_core.cuh: the warp-level instructions of the tensor-core kernels, each behind a small
// __device__ wrapper, the only way a kernel reaches them: inline PTX on the GPU; under the CPU
// emulator (__CUDA_EMU__), an exact emulation that also checks what the hardware assumes and
// punishes (kernels/emu/README.md). tests/test_tensor_core.py holds each wrapper to a NumPy model
// of its fragment layout on the emulator, and, marked gpu, the GPU to the emulator.
//
//   tf32_round(x), tf32_value(x)  tf32.cuh's
//   mma_tf32(d, a, b, c)          mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: d = a b + c for
//                                 a warp's 16x8 A (row), 8x8 B (col), 16x8 C and D; with g = lane / 4,
//                                 t = lane % 4, a lane holds A[g][t], A[g+8][t], A[g][t+4],
//                                 A[g+8][t+4]; B[t][g], B[t+4][g]; C[g][2t], C[g][2t+1], C[g+8][2t],
//                                 C[g+8][2t+1]. The tensor core reads the top 19 bits of each input.
//   mma_bf16(d, a, b, c)          mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: d = a b + c for
//                                 a warp's 16x16 A (row), 16x8 B (col), 16x8 C and D, a register
//                                 holding two b16 elements, the lower index in the low half; a lane
//                                 holds A[g][2t..2t+1], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..];
//                                 B[2t..2t+1][g], B[2t+8..2t+9][g]; C and D as for mma_tf32. The
//                                 products of bfloat16 are exact in float32.
//   ldmatrix_x1/x2/x4[_trans]     ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes
//                                 8j..8j+7 give the 16-byte rows of matrix j; register j of lane l
//                                 holds row l/4, b16 elements 2(l%4), 2(l%4)+1 of matrix j (.trans:
//                                 rows 2(l%4), 2(l%4)+1 of column l/4). For 32-bit data (TF32), a
//                                 register is the element (row l/4, column l%4) of an 8x4 matrix.
//   cp_async_ca<B>(dst, src, n)   cp.async.ca.shared.global of B bytes (4, 8, 16), the first n read
//   cp_async_cg(dst, src, n)      from src and the rest zero-filled; .cg: 16 bytes, past L1
//   cp_async_commit()             cp.async.commit_group
//   cp_async_wait<N>()            cp.async.wait_group N: all but the N most recent groups have landed
//
// Every lane of a warp must call mma_tf32, mma_bf16 and ldmatrix together, at the same call; the emulator
// says which call a divergent lane reached instead. A cp.async destination reads as NaN there
// until the wait that covers it, and its source must lie in one of the kernel's arguments.
#pragma once
#include "tf32.cuh"

// A simulated GPU below sm_80 (kernels/simulated, KERNELS_SIMULATED_COMPUTE_CAPABILITY): what ptxas
// refuses for such a target, mma.sync of TF32 and BF16 and cp.async, fails the module's compile, as the
// module fails to load on such a GPU.
#if defined(__CUDA_EMU__) && defined(EMU_COMPUTE_CAPABILITY) && EMU_COMPUTE_CAPABILITY < 80
#define TC_SM80(what) static_assert(EMU_COMPUTE_CAPABILITY >= 80, what " requires .target sm_80 or higher")
#else
#define TC_SM80(what)
#endif

#ifdef __CUDA_EMU__
// the call site of a wrapper, which the emulator checks all lanes agree on and names in errors
#define TC_CALL_SITE , const char *call_file = __builtin_FILE(), int call_line = __builtin_LINE()
#else
#define TC_CALL_SITE
#endif

#ifdef __CUDA_EMU__
// The emulation of mma.sync: its own arithmetic is not the kernel's memory traffic, so the sanitizer
// does not instrument it (EMU_UNCHECKED); a call of its own, the call instance of the instruction is
// the chain of calls that leads to it.
struct EmuFragments {
    unsigned a[4], b[2];
};

EMU_UNCHECKED inline double emu_tf32_value(unsigned bits) {
    bits &= 0xffffe000u;  // what the tensor core reads
    float v;
    __builtin_memcpy(&v, &bits, 4);
    return double(v);
}

// d = a b + c of one m16n8kK mma.sync for this lane: the warp's fragments gathered, then each of the
// lane's 4 outputs (row g + 8 (i / 2), column 2t + i % 2) the exact sum of c and the K products,
// rounded once; Layout::a(all, row, k) and Layout::b(all, k, col) read an element of A and B from
// the lanes (and registers) that hold it.
template <class Layout>
EMU_UNCHECKED __attribute__((always_inline)) inline void emu_mma(float (&d)[4], const unsigned (&a)[4],
                                                                  const unsigned (&b)[2], const float (&c)[4],
                                                                  const char* call_file, int call_line) {
    EmuFragments mine, all[32];
    for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
    mine.b[0] = b[0];
    mine.b[1] = b[1];
    emu_warp_aligned(Layout::what, call_file, call_line, &mine, sizeof mine, all);
    const int lane = int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32;
    const int g = lane / 4, t = lane % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
        double sum = c[i];   // the products are exact
        for (int k = 0; k < Layout::K; ++k) sum += Layout::a(all, row, k) * Layout::b(all, k, col);
        out[i] = float(sum);
    }
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// TF32's fragments: a lane (g, t) holds A[g + 8 (r % 2)][t + 4 (r / 2)] in register r, B[t + 4 r][g].
struct EmuTf32Layout {
    static constexpr int K = 8;
    static constexpr const char* what = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32";
    EMU_UNCHECKED static double a(const EmuFragments (&all)[32], int row, int k) {
        return emu_tf32_value(all[(row % 8) * 4 + k % 4].a[(row >= 8) + 2 * (k >= 4)]);
    }
    EMU_UNCHECKED static double b(const EmuFragments (&all)[32], int k, int col) {
        return emu_tf32_value(all[col * 4 + k % 4].b[k >= 4]);
    }
};

EMU_UNCHECKED __attribute__((noinline)) void emu_mma_tf32(float (&d)[4], const unsigned (&a)[4],
                                                           const unsigned (&b)[2], const float (&c)[4],
                                                           const char* call_file, int call_line) {
    emu_mma<EmuTf32Layout>(d, a, b, c, call_file, call_line);
}
#endif

__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                         const float (&c)[4] TC_CALL_SITE) {
    TC_SM80("mma.sync .tf32");
#ifdef __CUDA_EMU__
    emu_mma_tf32(d, a, b, c, call_file, call_line);
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

#ifdef __CUDA_EMU__
EMU_UNCHECKED inline double emu_bf16_value(unsigned pair, int high) {
    const unsigned bits = high ? pair & 0xffff0000u : pair << 16;
    float v;
    __builtin_memcpy(&v, &bits, 4);
    return double(v);
}

// BF16's: two elements a register, the lower k in its low half; a lane (g, t) holds A[g + 8 (r % 2)]
// [2t + 8 (r / 2)..+1] in register r, B[2t + 8 r..+1][g].
struct EmuBf16Layout {
    static constexpr int K = 16;
    static constexpr const char* what = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";
    EMU_UNCHECKED static double a(const EmuFragments (&all)[32], int row, int k) {
        return emu_bf16_value(all[(row % 8) * 4 + k % 8 / 2].a[(row >= 8) + 2 * (k >= 8)], k % 2);
    }
    EMU_UNCHECKED static double b(const EmuFragments (&all)[32], int k, int col) {
        return emu_bf16_value(all[col * 4 + k % 8 / 2].b[k >= 8], k % 2);
    }
};

EMU_UNCHECKED __attribute__((noinline)) void emu_mma_bf16(float (&d)[4], const unsigned (&a)[4],
                                                           const unsigned (&b)[2], const float (&c)[4],
                                                           const char* call_file, int call_line) {
    emu_mma<EmuBf16Layout>(d, a, b, c, call_file, call_line);
}
#endif

__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                         const float (&c)[4] TC_CALL_SITE) {
    TC_SM80("mma.sync .bf16");
#ifdef __CUDA_EMU__
    emu_mma_bf16(d, a, b, c, call_file, call_line);
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

#ifdef __CUDA_EMU__
// ldmatrix of M matrices: lanes 0..8M-1 give the rows; each lane gets register j of matrix j
template <int M, bool TRANS>
EMU_UNCHECKED __attribute__((noinline)) void emu_ldmatrix(unsigned (&r)[M], const void* row, const char* call_file,
                                                           int call_line) {
    static const char* const names[2][3] = {
        {"ldmatrix.sync.aligned.m8n8.x1.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
         "ldmatrix.sync.aligned.m8n8.x4.shared.b16"},
        {"ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16",
         "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"}};
    const char* what = names[TRANS][M / 2];
    const int lane = int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32;
    if (lane < 8 * M) emu_check_shared(row, 16, 16, what, call_file, call_line);
    unsigned char rows[32][16];   // read by the instruction, once all 32 lanes are there
    emu_warp_aligned_rows(what, call_file, call_line, lane < 8 * M ? row : nullptr, 16, rows);
    for (int j = 0; j < M; ++j) {
        unsigned short half[2];
        for (int h = 0; h < 2; ++h) {
            const int r8 = TRANS ? 2 * (lane % 4) + h : lane / 4;   // the row of matrix j read
            const int c8 = TRANS ? lane / 4 : 2 * (lane % 4) + h;   // and its b16 column
            __builtin_memcpy(&half[h], rows[8 * j + r8] + 2 * c8, 2);
        }
        r[j] = unsigned(half[0]) | unsigned(half[1]) << 16;
    }
}
#define TC_LDMATRIX(M, TRANS) emu_ldmatrix<M, TRANS>(r, row, call_file, call_line)
#endif

__device__ __forceinline__ void ldmatrix_x1(unsigned (&r)[1], const void* row TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    TC_LDMATRIX(1, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
                 : "=r"(r[0]) : "r"(unsigned(__cvta_generic_to_shared(row))));
#endif
}

__device__ __forceinline__ void ldmatrix_x1_trans(unsigned (&r)[1], const void* row TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    TC_LDMATRIX(1, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];"
                 : "=r"(r[0]) : "r"(unsigned(__cvta_generic_to_shared(row))));
#endif
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    TC_LDMATRIX(2, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(unsigned(__cvta_generic_to_shared(row))));
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    TC_LDMATRIX(2, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(unsigned(__cvta_generic_to_shared(row))));
#endif
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    TC_LDMATRIX(4, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(unsigned(__cvta_generic_to_shared(row))));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row TC_CALL_SITE) {
#ifdef __CUDA_EMU__
    TC_LDMATRIX(4, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(unsigned(__cvta_generic_to_shared(row))));
#endif
}

template <int BYTES>
__device__ __forceinline__ void cp_async_ca(void* dst, const void* src, int src_bytes TC_CALL_SITE) {
    TC_SM80("cp.async");
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
#ifdef __CUDA_EMU__
    emu_cp_async(dst, src, BYTES, src_bytes, 0, call_file, call_line);
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;"
                 :: "r"(unsigned(__cvta_generic_to_shared(dst))), "l"(src), "n"(BYTES), "r"(src_bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_cg(void* dst, const void* src, int src_bytes TC_CALL_SITE) {
    TC_SM80("cp.async");
#ifdef __CUDA_EMU__
    emu_cp_async(dst, src, 16, src_bytes, 1, call_file, call_line);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(unsigned(__cvta_generic_to_shared(dst))), "l"(src), "r"(src_bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_EMU__
    emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_EMU__
    emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
