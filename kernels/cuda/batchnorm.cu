// batchnorm.cu: batch normalisation over (N, H, W) per channel of NCHW float32 arrays.
// Launched by kernels/cuda/batchnorm.py; checked by tests/test_kernels_cuda.py against
// tests/reference.py (float64) and kernels/cpu/batchnorm.py.
//
// Training forward, three launches:
//   bn_stats_partials  one pass over x: per (channel, split) block, the sums of x - shift and
//                      of its square, shift[c] a value near the channel's mean (a sample of the
//                      channel, or the mean over every replica), so that the variance does not
//                      cancel when the mean is far from zero
//   bn_stats_finish    per channel: the splits added in order -> mean, invstd
// Synchronised batch norm runs the same kernels in parts: bn_stats_partials + sum_partials
// give the sums that replicas add, and bn_stats_finish reads the added sums as one split.
//   bn_apply<RELU>     y = x * scale + shift (+ relu), scale = gamma * invstd, in one pass
// Training backward: bn_backward_partials (sum dy * xhat and sum dy fused in one pass),
//   sum_partials (splits in order -> dgamma, dbeta), bn_backward_dx.
// Inference: bn_invstd from the running variance, then bn_apply; its backward
//   bn_backward_partials + sum_partials + bn_inference_dx.
// bn_update_running: PyTorch's running-statistics update, in place.
#include "common.cuh"

// Per-channel shifted sums over x (N, C, plane): block (c, s) of a (C, splits) grid reduces
// channel c's values e in [s * chunk, (s + 1) * chunk) of its N*plane, each thread a strided
// subset in order, then block_sum; partial (splits, 2, C) gets [sum(x - shift), sum((x - shift)^2)].
extern "C" __global__ void __launch_bounds__(256)
bn_stats_partials(const float* __restrict__ x, const float* __restrict__ shifts, int n, int channels, int plane,
                  int chunk, float* __restrict__ partial) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    const float shift = shifts[c];
    float sum = 0.0f, squares = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const float d = x[channel_element(e, c, channels, plane)] - shift;
        sum += d;
        squares = fmaf(d, d, squares);
    }
    sum = block_sum(sum, scratch);
    squares = block_sum(squares, scratch);
    if (threadIdx.x == 0) {
        partial[(blockIdx.y * 2) * channels + c] = sum;
        partial[(blockIdx.y * 2 + 1) * channels + c] = squares;
    }
}

// mean and 1/sqrt(biased variance + eps) per channel from bn_stats_partials over `count`
// values per channel: one thread per channel adds the splits in order.
extern "C" __global__ void __launch_bounds__(256)
bn_stats_finish(const float* __restrict__ shifts, const float* __restrict__ partial, int splits, int channels,
                int count, float eps, float* __restrict__ mean, float* __restrict__ invstd) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    float sum = 0.0f, squares = 0.0f;
    for (int s = 0; s < splits; ++s) {
        sum += partial[(s * 2) * channels + c];
        squares += partial[(s * 2 + 1) * channels + c];
    }
    const float centre = sum / float(count);
    mean[c] = shifts[c] + centre;
    invstd[c] = 1.0f / sqrtf(fmaxf(squares / float(count) - centre * centre, 0.0f) + eps);
}

// y = gamma * (x - mean) * invstd + beta, then relu if RELU, over x (N, C, plane): threads
// over elements, grid-stride.
template <bool RELU>
__global__ void __launch_bounds__(256)
bn_apply(const float* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ invstd,
         const float* __restrict__ gamma, const float* __restrict__ beta, int total, int channels, int plane,
         float* __restrict__ y) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int c = (i / plane) % channels;
        const float scale = gamma[c] * invstd[c];
        const float v = x[i] * scale + (beta[c] - mean[c] * scale);
        y[i] = RELU && v < 0.0f ? 0.0f : v;
    }
}

// 1 / sqrt(var + eps) per channel: one thread per channel.
extern "C" __global__ void __launch_bounds__(256)
bn_invstd(const float* __restrict__ var, int channels, float eps, float* __restrict__ invstd) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels) invstd[c] = 1.0f / sqrtf(var[c] + eps);
}

// The two per-channel sums of the backward, in one pass over dy and x: block (c, s) of a
// (C, splits) grid reduces channel c's values e in [s * chunk, (s + 1) * chunk), each thread a
// strided subset in order, then block_sum; partial (splits, 2, C) gets
// [sum(dy * xhat), sum(dy)], xhat = (x - mean) * invstd.
extern "C" __global__ void __launch_bounds__(256)
bn_backward_partials(const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ mean,
                     const float* __restrict__ invstd, int n, int channels, int plane, int chunk,
                     float* __restrict__ partial) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    const float m = mean[c], inv = invstd[c];
    float dy_xhat = 0.0f, dy_sum = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const int i = channel_element(e, c, channels, plane);
        dy_xhat = fmaf(dy[i], (x[i] - m) * inv, dy_xhat);
        dy_sum += dy[i];
    }
    dy_xhat = block_sum(dy_xhat, scratch);
    dy_sum = block_sum(dy_sum, scratch);
    if (threadIdx.x == 0) {
        partial[(blockIdx.y * 2) * channels + c] = dy_xhat;
        partial[(blockIdx.y * 2 + 1) * channels + c] = dy_sum;
    }
}

// dx of training-mode batch norm, gamma * invstd * (dy - dbeta / M - xhat * dgamma / M) with
// grads = [dgamma; dbeta] (2, C) and M = count: threads over elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
bn_backward_dx(const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ mean,
               const float* __restrict__ invstd, const float* __restrict__ gamma, const float* __restrict__ grads,
               int count, int total, int channels, int plane, float* __restrict__ dx) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int c = (i / plane) % channels;
        const float xhat = (x[i] - mean[c]) * invstd[c];
        const float centred = dy[i] - grads[channels + c] / float(count) - xhat * (grads[c] / float(count));
        dx[i] = centred * (gamma[c] * invstd[c]);
    }
}

// dx of inference-mode batch norm, dy * gamma * invstd: threads over elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
bn_inference_dx(const float* __restrict__ dy, const float* __restrict__ invstd, const float* __restrict__ gamma,
                int total, int channels, int plane, float* __restrict__ dx) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int c = (i / plane) % channels;
        dx[i] = dy[i] * (gamma[c] * invstd[c]);
    }
}

// running <- keep * running + momentum * batch statistic (keep = 1 - momentum), in place, the
// variance made unbiased by `correction` = count / (count - 1): one thread per channel.
extern "C" __global__ void __launch_bounds__(256)
bn_update_running(float* __restrict__ running_mean, float* __restrict__ running_var, const float* __restrict__ mean,
                  const float* __restrict__ invstd, int channels, float keep, float momentum, float eps,
                  float correction) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float unbiased = fmaxf(1.0f / (invstd[c] * invstd[c]) - eps, 0.0f) * correction;
    running_mean[c] = running_mean[c] * keep + momentum * mean[c];
    running_var[c] = running_var[c] * keep + momentum * unbiased;
}
