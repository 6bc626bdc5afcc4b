// Warp-level primitives: a shuffle reduction, and every primitive's result per lane, for
// comparison with a model of CUDA's documented semantics.

// Sum of each warp's 32 values, by shuffling down, then broadcast from lane 0 to every lane.
extern "C" __global__ void warp_sum(const float* x, float* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    out[i] = __shfl_sync(0xffffffffu, v, 0);
}

// out[op * n + i] for each primitive op, with the given lane/offset and width; lanes of an
// odd warp take part only in the shuffles of the low half (mask 0x0000ffff), the others skip them,
// and shuffle within segments of at most 16 lanes, so that no lane reads one outside the mask.
extern "C" __global__ void warp_primitives(const int* v, const int* predicate, int* out, int lane_arg,
                                           int width) {
    const int n = blockDim.x * gridDim.x;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x % 32;
    const bool odd_warp = (threadIdx.x / 32) % 2 == 1;
    const unsigned mask = odd_warp ? 0x0000ffffu : 0xffffffffu;
    for (int op = 0; op < 4; ++op) out[op * n + i] = -7;
    if (odd_warp && width > 16) width = 16;
    if (!odd_warp || lane < 16) {
        out[0 * n + i] = __shfl_sync(mask, v[i], lane_arg, width);
        out[1 * n + i] = __shfl_up_sync(mask, v[i], lane_arg, width);
        out[2 * n + i] = __shfl_down_sync(mask, v[i], lane_arg, width);
        out[3 * n + i] = __shfl_xor_sync(mask, v[i], lane_arg, width);
    }
    out[4 * n + i] = (int)__ballot_sync(0xffffffffu, predicate[i]);
    out[5 * n + i] = __any_sync(0xffffffffu, predicate[i]);
    out[6 * n + i] = __all_sync(0xffffffffu, predicate[i]);
    __syncwarp();
    const double wide = __shfl_xor_sync(0xffffffffu, (double)v[i] + 0.25, 1);
    out[7 * n + i] = (int)(wide * 4.0);
}
