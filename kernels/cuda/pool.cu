// pool.cu: max pooling with argmax indices on NCHW float32 arrays, and global average pooling
// of NCHW or channels-last ones. Launched by kernels/cuda/pool.py; checked by
// tests/test_kernels_cuda.py against tests/reference.py and kernels/cpu/pool.py.
//
// The argmax of an output is the flat index h * W + w into its (unpadded) input plane; ties
// go to the first cell in row-major window order, and a NaN wins over numbers (the first
// NaN), as NumPy's argmax and the CPU backend have it. The backward has only the argmax,
// not the window geometry, so it cannot gather per input cell; each plane is instead added
// up by one thread in output order: deterministic, without atomics.
#include "common.cuh"

// y, argmax of max pooling x (planes, H, W) -> (planes, OH, OW): one thread per output cell
// scans its window's cells inside the input (padding never wins), threads grid-stride.
extern "C" __global__ void __launch_bounds__(256)
max_pool2d_forward(const float* __restrict__ x, int planes, int h, int w, int kh, int kw, int sh, int sw, int ph,
                   int pw, int oh, int ow, float* __restrict__ y, long long* __restrict__ argmax) {
    const int total = planes * oh * ow;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int plane = i / (oh * ow), pq = i - plane * (oh * ow), p = pq / ow, q = pq - p * ow;
        const int h0 = max(p * sh - ph, 0), h1 = min(p * sh - ph + kh, h);
        const int w0 = max(q * sw - pw, 0), w1 = min(q * sw - pw + kw, w);
        const float* xp = x + plane * h * w;
        int best_at = h0 * w + w0;
        float best = xp[best_at];
        for (int hh = h0; hh < h1; ++hh)
            for (int ww = w0; ww < w1; ++ww) {
                const float v = xp[hh * w + ww];
                if (v > best || (isnan(v) && !isnan(best))) {
                    best = v;
                    best_at = hh * w + ww;
                }
            }
        y[i] = best;
        argmax[i] = best_at;
    }
}

// dx of max pooling: dy (planes, OH*OW) added at its argmax cells of dx (planes, H*W). One
// thread per plane zeroes its plane of dx and adds the plane's dy in output order (no two
// threads touch one cell, and the order is fixed); threads grid-stride over planes.
extern "C" __global__ void __launch_bounds__(256)
max_pool2d_backward(const float* __restrict__ dy, const long long* __restrict__ argmax, int planes, int in_plane,
                    int out_plane, float* __restrict__ dx) {
    for (int plane = blockIdx.x * blockDim.x + threadIdx.x; plane < planes; plane += gridDim.x * blockDim.x) {
        float* dxp = dx + plane * in_plane;
        for (int j = 0; j < in_plane; ++j) dxp[j] = 0.0f;
        for (int j = plane * out_plane; j < (plane + 1) * out_plane; ++j) dxp[argmax[j]] += dy[j];
    }
}

// y (N*C) = the mean of each plane (image, channel) of x, (N, C, plane) or, channels-last,
// (N, plane, C): one warp per plane, its lanes over the plane's cells, warp_sum; 8 warps
// (planes) per 256-thread block.
extern "C" __global__ void __launch_bounds__(256)
global_avg_pool_forward(const float* __restrict__ x, int planes, int plane, int channels, int channels_last,
                        float* __restrict__ y) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= planes) return;  // the whole warp: no lane is left out of the shuffles
    const int image = row / channels, c = row - image * channels;
    float total = 0.0f;
    for (int j = lane; j < plane; j += 32)
        total += x[channels_last ? (image * plane + j) * channels + c : row * plane + j];
    total = warp_sum(total);
    if (lane == 0) y[row] = total / float(plane);
}

// dx (N, C, plane) or, channels-last, (N, plane, C) = dy (N, C) / plane broadcast over each
// plane: threads over dx's elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
global_avg_pool_backward(const float* __restrict__ dy, int total, int plane, int channels, int channels_last,
                         float* __restrict__ dx) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        dx[i] = dy[channels_last ? i / (plane * channels) * channels + i % channels : i / plane] / float(plane);
}
