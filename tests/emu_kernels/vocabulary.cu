// CUDA's device vocabulary that the emulator claims to offer, all in one kernel, so that
// NVRTC and the emulation header are held to the same list: every atomic overload, the
// shuffles on every type, __ldg, vector types, integer and float intrinsics, min and max.
// One thread runs it; `out` gets values the test knows (shuffles read the thread's own lane:
// width 1, or a source below lane 0).

#define ATOMICS_ON(T, p)                                      \
    atomicAdd(p, (T)1); atomicExch(p, (T)2); atomicCAS(p, (T)2, (T)3)
#define BITWISE_ON(T, p) \
    atomicAnd(p, (T)7); atomicOr(p, (T)8); atomicXor(p, (T)1)
#define MIN_MAX_ON(T, p) \
    atomicMin(p, (T)5); atomicMax(p, (T)9)

extern "C" __global__ void vocabulary(int* i, unsigned int* u, long long* ll, unsigned long long* ull,
                                      unsigned short* us, float* f, double* d, const float4* v, float* out) {
    ATOMICS_ON(int, i); ATOMICS_ON(unsigned int, u); ATOMICS_ON(unsigned long long, ull);
    BITWISE_ON(int, i); BITWISE_ON(unsigned int, u);
    BITWISE_ON(long long, ll); BITWISE_ON(unsigned long long, ull);
    MIN_MAX_ON(int, i); MIN_MAX_ON(unsigned int, u);
    MIN_MAX_ON(long long, ll); MIN_MAX_ON(unsigned long long, ull);
    atomicSub(i, 1); atomicSub(u, 1u); atomicInc(u, 100u); atomicDec(u, 100u);
    atomicCAS(us, (unsigned short)0, (unsigned short)4);
    atomicAdd(f, 1.5f); atomicExch(f, 2.5f); atomicAdd(d, 0.25);

    const unsigned full = 0x1u;   // the one lane of the launch
    const float4 q = __ldg(v);
    out[0] = __shfl_sync(full, q.x, 0) + __shfl_up_sync(full, 1.0, 1) + __shfl_down_sync(full, 1, 1, 1) +
             __shfl_xor_sync(full, 1u, 1, 1) + __shfl_sync(full, 1l, 0) + __shfl_sync(full, 1ul, 0) +
             __shfl_sync(full, 1ll, 0) + __shfl_sync(full, 1ull, 0);                  // q.x + 7
    out[1] = __ballot_sync(full, 1) + __any_sync(full, 0) + __all_sync(full, 1);         // 1 + 0 + 1
    __syncwarp();
    out[2] = rsqrtf(4.0f) + __expf(0.0f) + __fdividef(1.0f, 4.0f) + __saturatef(2.0f);   // 2.75
    out[3] = __popc(0xffu) + __clz(1) + __ffs(8) + __popcll(3ull);                     // 8 + 31 + 4 + 2
    out[4] = __int_as_float(__float_as_int(1.25f)) + (float)__double2hiint(2.0);        // 1.25 + 0x40000000
    out[5] = (float)(__brev(1u) >> 31) + (float)__byte_perm(0x33221100u, 0x77665544u, 0x0004u);  // 1 + 0x4400
    out[6] = min(3, 4) + max(3u, 4u) + min(2.5f, 1.5f) + max(1.0, 2.0) + min(-1ll, 2ll);  // 3 + 4 + 1.5 + 2 - 1
    const float2 p = make_float2(1.0f, 2.0f);
    const int4 k = make_int4(1, 2, 3, 4);
    const dim3 shape(2, 3);
    out[7] = p.y + k.w + shape.x * shape.y * shape.z + warpSize + __ldg(&v[0].w);        // 2 + 4 + 6 + 32 + v.w
    out[8] = __syncthreads_count(1) + __syncthreads_and(1) + __syncthreads_or(0);        // 1 + 1 + 0
    __threadfence();
}
