// bias_grad.cuh: the bias gradient of a convolution, which the FP32 kernels (conv.cu) and the
// tensor-core ones (conv_tc.cu) share: per-channel sums of dy in one launch. A channels-last dy
// (N*OH*OW, O) is passed as n = N*OH*OW, plane = 1.
#pragma once

// db (O) = the per-channel sums of dy (N, O, OH*OW): block (c, s) of an (O, splits) grid adds
// channel c's values e in [s * chunk, (s + 1) * chunk) of its N*OH*OW, each thread a strided subset
// in order, then block_sum; with one split it writes db[c], else partial[s * O + c], and the last
// of the channel's blocks adds the splits in order into db[c] (last_block, counters[c]).
extern "C" __global__ void __launch_bounds__(256)
bias_grad(const float* __restrict__ dy, int n, int channels, int plane, int chunk, float* partial,
          unsigned* counters, float* __restrict__ db) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    float total = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) total += dy[channel_element(e, c, channels, plane)];
    total = block_sum(total, scratch);
    if (gridDim.y == 1) {
        if (threadIdx.x == 0) db[c] = total;
        return;
    }
    if (threadIdx.x == 0) partial[blockIdx.y * channels + c] = total;
    if (last_block(counters + c, gridDim.y) && threadIdx.x == 0)
        db[c] = added_partials(partial + c, gridDim.y, channels);
}
