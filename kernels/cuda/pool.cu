// pool.cu: max pooling with argmax indices on NCHW arrays, and global average pooling of NCHW or
// channels-last ones, each kernel on activations of storage type T, float32 or bfloat16 (bf16.cuh),
// computing in float32. Launched by kernels/cuda/pool.py; checked by tests/test_kernels_cuda.py
// (float32) and tests/test_bf16_ops.py (bfloat16) against tests/reference.py and kernels/cpu/pool.py.
//
// The argmax of an output is the flat index h * W + w into its (unpadded) input plane; ties
// go to the first cell in row-major window order, and a NaN wins over numbers (the first
// NaN), as NumPy's argmax and the CPU backend have it. The backward has only the argmax,
// not the window geometry, so it cannot gather per input cell; each plane is instead added
// up by one thread in output order: deterministic, without atomics. Into float32 sums where T is
// bfloat16, so that a cell that several windows chose is rounded once.
#include "common.cuh"

// y, argmax of max pooling x (planes, H, W) -> (planes, OH, OW): one thread per output cell
// scans its window's cells inside the input (padding never wins), threads grid-stride. y is one of
// x's values: stored exactly.
template <class T>
__global__ void __launch_bounds__(256)
max_pool2d_forward(const T* __restrict__ x, int planes, int h, int w, int kh, int kw, int sh, int sw, int ph,
                   int pw, int oh, int ow, T* __restrict__ y, long long* __restrict__ argmax) {
    const int total = planes * oh * ow;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int plane = i / (oh * ow), pq = i - plane * (oh * ow), p = pq / ow, q = pq - p * ow;
        const int h0 = max(p * sh - ph, 0), h1 = min(p * sh - ph + kh, h);
        const int w0 = max(q * sw - pw, 0), w1 = min(q * sw - pw + kw, w);
        const T* xp = x + plane * h * w;
        int best_at = h0 * w + w0;
        float best = to_float(xp[best_at]);
        for (int hh = h0; hh < h1; ++hh)
            for (int ww = w0; ww < w1; ++ww) {
                const float v = to_float(xp[hh * w + ww]);
                if (v > best || (isnan(v) && !isnan(best))) {
                    best = v;
                    best_at = hh * w + ww;
                }
            }
        y[i] = stored<T>(best);
        argmax[i] = best_at;
    }
}

// dx of max pooling: dy (planes, OH*OW) added at its argmax cells of dx (planes, H*W). One
// thread per plane zeroes its plane of the sums and adds the plane's dy in output order (no two
// threads touch one cell, and the order is fixed); threads grid-stride over planes. The sums are dx
// itself for float32; for bfloat16, `sums` (float32, dx's shape), which the thread then rounds into dx.
template <class T>
__global__ void __launch_bounds__(256)
max_pool2d_backward(const T* __restrict__ dy, const long long* __restrict__ argmax, int planes, int in_plane,
                    int out_plane, float* __restrict__ sums, T* __restrict__ dx) {
    for (int plane = blockIdx.x * blockDim.x + threadIdx.x; plane < planes; plane += gridDim.x * blockDim.x) {
        float* sp;
        if constexpr (sizeof(T) == 4) sp = dx + plane * in_plane;
        else sp = sums + plane * in_plane;
        for (int j = 0; j < in_plane; ++j) sp[j] = 0.0f;
        for (int j = plane * out_plane; j < (plane + 1) * out_plane; ++j) sp[argmax[j]] += to_float(dy[j]);
        if constexpr (sizeof(T) == 2)
            for (int j = 0; j < in_plane; ++j) dx[plane * in_plane + j] = bf16_round(sp[j]);
    }
}

// y (N*C) = the mean of each plane (image, channel) of x, (N, C, plane) or, channels-last,
// (N, plane, C): one warp per plane, its lanes over the plane's cells, warp_sum; 8 warps
// (planes) per 256-thread block. y is float32 whatever T: it feeds the float32 linear layer.
template <class T>
__global__ void __launch_bounds__(256)
global_avg_pool_forward(const T* __restrict__ x, int planes, int plane, int channels, int channels_last,
                        float* __restrict__ y) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= planes) return;  // the whole warp: no lane is left out of the shuffles
    const int image = row / channels, c = row - image * channels;
    float total = 0.0f;
    for (int j = lane; j < plane; j += 32)
        total += to_float(x[channels_last ? (image * plane + j) * channels + c : row * plane + j]);
    total = warp_sum(total);
    if (lane == 0) y[row] = total / float(plane);
}

// dx (N, C, plane) or, channels-last, (N, plane, C) = dy (N, C, float32) / plane broadcast over
// each plane: threads over dx's elements, grid-stride.
template <class T>
__global__ void __launch_bounds__(256)
global_avg_pool_backward(const float* __restrict__ dy, int total, int plane, int channels, int channels_last,
                         T* __restrict__ dx) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        dx[i] = stored<T>(dy[channels_last ? i / (plane * channels) * channels + i % channels : i / plane] /
                          float(plane));
}
