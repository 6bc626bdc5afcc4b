// bf16.cuh: bfloat16 storage, what the activations and their gradients are between kernels under
// the bf16 precision (kernels.precision()): the type, its widening to float32 and the rounding back.
// Kernels compute in float32: what they load they widen (exactly: a bfloat16 is the top half of a
// float32), what they store they round once, to nearest, ties to even, as cvt.rn.bf16x2.f32 and
// cvt.rn.bf16.f32 do (sm_80 and later; below, and under the CPU emulator (__CUDA_EMU__), the same
// rounding on the bits, so that the families of bf16 kernels compile for every GPU);
// tests/test_tensor_core.py holds them to NumPy's bfloat16 (ml_dtypes) and, marked gpu, the GPU to
// the emulator.
//
//   bf16                    a bfloat16 as its 16 bits; arrays of NumPy's (ml_dtypes') bfloat16
//   bf16_float(h)           h widened to float32
//   bf16_round(x)           x rounded to bfloat16 (cvt.rn.bf16.f32); NaN stays NaN
//   bf16x2_round(lo, hi)    lo and hi rounded, packed lo | hi << 16 (cvt.rn.bf16x2.f32): the b16 pair
//                           of a tensor-core fragment register, or two neighbours in memory
//   load_floats / store_floats on bf16 pointers: as common.cuh's on float pointers, VEC = 4 moving
//                           8 bytes (the launcher checks their alignment)
#pragma once

struct __align__(2) bf16 {
    unsigned short bits;
#ifdef __CUDA_EMU__
    static constexpr char emu_kind = 'B';   // an argument of NumPy's bfloat16 (kernels/emu/arguments.py)
#endif
};

__device__ __forceinline__ float bf16_float(bf16 h) { return __uint_as_float(unsigned(h.bits) << 16); }

// Round to nearest, ties to even, on the bits, what the instructions do; a NaN gives the canonical NaN.
// The emulator's rounding (on the bits, so that its flush of subnormal floats does not touch a
// subnormal input, which the instruction rounds like any other), and the GPUs' below sm_80, which
// lack the instructions.
#if defined(__CUDA_EMU__) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
#define BF16_BY_BITS 1
#ifdef __CUDA_EMU__
EMU_UNCHECKED inline unsigned short bf16_rn_bits(float x) {
    unsigned bits;
    __builtin_memcpy(&bits, &x, 4);
#else
__device__ __forceinline__ unsigned short bf16_rn_bits(float x) {
    const unsigned bits = __float_as_uint(x);
#endif
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
#endif

__device__ __forceinline__ bf16 bf16_round(float x) {
    bf16 h;
#ifdef BF16_BY_BITS
    h.bits = bf16_rn_bits(x);
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
    return h;
}

__device__ __forceinline__ unsigned bf16x2_round(float lo, float hi) {
#ifdef BF16_BY_BITS
    return unsigned(bf16_rn_bits(lo)) | unsigned(bf16_rn_bits(hi)) << 16;
#else
    unsigned packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));   // the first source goes high
    return packed;
#endif
}

// The low and high bfloat16 of a packed pair, widened.
__device__ __forceinline__ float bf16x2_low(unsigned pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16x2_high(unsigned pair) { return __uint_as_float(pair & 0xffff0000u); }
