// bias_grad.cuh: the bias gradient of a convolution, which the FP32 kernels (conv.cu) and the
// tensor-core ones (conv_tc.cu) share: per-channel sums of dy, finished by sum_partials. A
// channels-last dy (N*OH*OW, O) is passed as n = N*OH*OW, plane = 1.
#pragma once

// Per-channel sums of dy (N, O, OH*OW) for the bias gradient: block (c, s) of a (O, splits)
// grid adds channel c's values e in [s * chunk, (s + 1) * chunk) of its N*OH*OW, each thread
// a strided subset in order, then block_sum; partial[s * O + c] holds the result.
extern "C" __global__ void __launch_bounds__(256)
bias_grad_partials(const float* __restrict__ dy, int n, int channels, int plane, int chunk,
                   float* __restrict__ partial) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    float total = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) total += dy[channel_element(e, c, channels, plane)];
    total = block_sum(total, scratch);
    if (threadIdx.x == 0) partial[blockIdx.y * channels + c] = total;
}
