// tf32.cuh: TF32, what the tf32 precision's tensor cores multiply (10 mantissa bits of a float32's 23),
// rounded as cvt.rna.tf32.f32 rounds: to nearest, ties away from zero; tests/test_tensor_core.py holds both
// to a NumPy model on the emulator.
//
//   tf32_round(x)   the bits the mma reads for x: the top 19 are x rounded to TF32, the low 13 are x's plus
//                   0x1000 (half a TF32 unit added to the magnitude), not cleared, since the tensor core
//                   ignores them: two instructions (a test for infinity and NaN, which stay as they are,
//                   and an add), where cvt.rna and a use outside an mma take three
//   tf32_round4(v)  the 4 values of a chunk so rounded, as floats (the bits the mma reads)
//   tf32_value(x)   x rounded to TF32 as a float32, its low 13 bits zero (infinity and NaN as they are): the
//                   flat buffer's TF32 copy of the weights, which the GEMMs read as it is
#pragma once

__device__ __forceinline__ unsigned tf32_round(float x) {
    const unsigned bits = __float_as_uint(x);
    return fabsf(x) < __uint_as_float(0x7f800000u) ? bits + 0x1000u : bits;   // infinity and NaN stay
}

__device__ __forceinline__ float4 tf32_round4(float4 v) {
    return {__uint_as_float(tf32_round(v.x)), __uint_as_float(tf32_round(v.y)), __uint_as_float(tf32_round(v.z)),
            __uint_as_float(tf32_round(v.w))};
}

__device__ __forceinline__ float tf32_value(float x) {
    return fabsf(x) < __uint_as_float(0x7f800000u) ? __uint_as_float(tf32_round(x) & 0xffffe000u) : x;
}
