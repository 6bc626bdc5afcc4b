// batchnorm.cu: batch normalisation over (N, H, W) per channel of NCHW float32 arrays.
// Launched by kernels/cuda/batchnorm.py; checked by tests/test_kernels_cuda.py against
// tests/reference.py (float64) and kernels/cpu/batchnorm.py.
//
// Training forward, two launches:
//   bn_stats           one pass over x: per (channel, split) block, the sums of x - shift and of
//                      its square, shift a value near the channel's mean (its first value, read
//                      through the channel's stride, or the mean over every replica), so that the
//                      variance does not cancel when the mean is far from zero; the last block of
//                      each channel adds the splits in order (last_block) into mean and invstd
//                      and moves the running statistics, or, for synchronised batch norm, into
//                      the sums that replicas add (then bn_stats_finish reads the added sums)
//   bn_apply<MODE>     y = x * scale + shift, scale = gamma * invstd, in one pass; MODE 1 adds
//                      relu, MODE 2 relu(. + residual): the joins of a residual block
// Training backward, two launches: bn_backward_sums (sum dy * xhat and sum dy in one pass, the
//   last block per channel writing dgamma and dbeta), bn_backward_dx. Given the output y of a
//   fused relu, both take dy where y > 0 and 0 elsewhere, and bn_backward_dx can also write that
//   masked dy (the gradient of a residual join's shortcut).
// Inference: bn_invstd from the running variance, then bn_apply; its backward
//   bn_backward_sums + bn_inference_dx.
// bn_update_running: PyTorch's running-statistics update, in place (synchronised batch norm).
#include "common.cuh"

// mean and 1/sqrt(biased variance + eps) of channel c from its sums of x - shift and of its square
// over `count` values.
__device__ __forceinline__ void bn_finish(int c, float sum, float squares, float shift, int count, float eps,
                                          float* mean, float* invstd) {
    const float centre = sum / float(count);
    mean[c] = shift + centre;
    invstd[c] = 1.0f / sqrtf(fmaxf(squares / float(count) - centre * centre, 0.0f) + eps);
}

// running <- (1 - momentum) * running + momentum * batch statistic for channel c, the variance made
// unbiased by `correction` = count / (count - 1).
__device__ __forceinline__ void bn_move_running(int c, float* running_mean, float* running_var, const float* mean,
                                                const float* invstd, float momentum, float eps, float correction) {
    const float unbiased = fmaxf(1.0f / (invstd[c] * invstd[c]) - eps, 0.0f) * correction;
    running_mean[c] = running_mean[c] * (1.0f - momentum) + momentum * mean[c];
    running_var[c] = running_var[c] * (1.0f - momentum) + momentum * unbiased;
}

// The two sums (a, b) of channel c over all of its blocks (c, s), s < gridDim.y, from this block's:
// with one split they are; else every block writes its pair to partial (splits, 2, C), and the
// channel's last block to finish (last_block on counters[c]) replaces them with the sums over the
// splits, in split order, and gets true; the other blocks get false and are done. Every thread of
// the block must call it.
__device__ __forceinline__ bool bn_channel_totals(float& a, float& b, int c, int channels, float* partial,
                                                  unsigned* counters) {
    if (gridDim.y == 1) return true;
    if (threadIdx.x == 0) {
        partial[(blockIdx.y * 2) * channels + c] = a;
        partial[(blockIdx.y * 2 + 1) * channels + c] = b;
    }
    if (!last_block(counters + c, gridDim.y)) return false;
    a = added_partials(partial + c, gridDim.y, 2 * channels);
    b = added_partials(partial + channels + c, gridDim.y, 2 * channels);
    return true;
}

// Per-channel statistics of x (N, C, plane): block (c, s) of a (C, splits) grid reduces channel
// c's values e in [s * chunk, (s + 1) * chunk) of its N*plane, each thread a strided subset in
// order, then block_sum, shifted by shifts[c * shift_stride]. With one split the block finishes
// its channel itself; else it writes partial (splits, 2, C) and the channel's last block
// (counters[c]) adds the splits in order. The totals go to sums (2, C) when it is not null, else
// to mean and invstd, and then to the running statistics when running_mean is not null.
extern "C" __global__ void __launch_bounds__(256)
bn_stats(const float* __restrict__ x, const float* __restrict__ shifts, int shift_stride, int n, int channels,
         int plane, int chunk, float* partial, unsigned* counters, float* __restrict__ sums, int count, float eps,
         float* __restrict__ mean, float* __restrict__ invstd, float* __restrict__ running_mean,
         float* __restrict__ running_var, float momentum, float correction) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    const float shift = shifts[c * shift_stride];
    float sum = 0.0f, squares = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const float d = x[channel_element(e, c, channels, plane)] - shift;
        sum += d;
        squares = fmaf(d, d, squares);
    }
    sum = block_sum(sum, scratch);
    squares = block_sum(squares, scratch);
    if (!bn_channel_totals(sum, squares, c, channels, partial, counters) || threadIdx.x != 0) return;
    if (sums) {
        sums[c] = sum;
        sums[channels + c] = squares;
        return;
    }
    bn_finish(c, sum, squares, shift, count, eps, mean, invstd);
    if (running_mean) bn_move_running(c, running_mean, running_var, mean, invstd, momentum, eps, correction);
}

// mean and invstd per channel from sums (2, C) of x - shifts over `count` values (the sums of
// every replica, added): one thread per channel.
extern "C" __global__ void __launch_bounds__(256)
bn_stats_finish(const float* __restrict__ shifts, const float* __restrict__ sums, int channels, int count,
                float eps, float* __restrict__ mean, float* __restrict__ invstd) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels) bn_finish(c, sums[c], sums[channels + c], shifts[c], count, eps, mean, invstd);
}

// y = gamma * (x - mean) * invstd + beta over x (N, C, plane), then for MODE 1 relu(y), for MODE 2
// relu(y + residual) (residual in x's layout): VEC elements per thread and step (common.cuh's
// Floats; 4 where the launcher found the arrays aligned), grid-stride.
template <int MODE, int VEC>
__global__ void __launch_bounds__(256)
bn_apply(const float* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ invstd,
         const float* __restrict__ gamma, const float* __restrict__ beta, const float* __restrict__ residual,
         int total, int channels, int plane, float* __restrict__ y) {
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < total; i += gridDim.x * blockDim.x * VEC) {
        Floats<VEC> v = load_floats<VEC>(x + i);
        Floats<VEC> r;
        if (MODE == 2) r = load_floats<VEC>(residual + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const int c = ((i + e) / plane) % channels;
            const float scale = gamma[c] * invstd[c];
            float out = v.v[e] * scale + (beta[c] - mean[c] * scale);
            if (MODE == 2) out += r.v[e];
            v.v[e] = MODE != 0 && out < 0.0f ? 0.0f : out;
        }
        store_floats<VEC>(y + i, v);
    }
}

// 1 / sqrt(var + eps) per channel: one thread per channel.
extern "C" __global__ void __launch_bounds__(256)
bn_invstd(const float* __restrict__ var, int channels, float eps, float* __restrict__ invstd) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels) invstd[c] = 1.0f / sqrtf(var[c] + eps);
}

// dy where a relu's output y is positive, else 0; dy itself without a relu (y null).
__device__ __forceinline__ float bn_masked(const float* __restrict__ dy, const float* __restrict__ y, int i) {
    return !y || y[i] > 0.0f ? dy[i] : 0.0f;
}

// The two per-channel sums of the backward, in one pass over dy (masked by y, see bn_masked) and
// x: block (c, s) of a (C, splits) grid reduces channel c's values e in [s * chunk, ...), each
// thread a strided subset in order, then block_sum, into dgamma[c] = sum(dy * xhat) and
// dbeta[c] = sum(dy), xhat = (x - mean) * invstd; with several splits through partial
// (splits, 2, C), added in order by the channel's last block (counters[c]).
extern "C" __global__ void __launch_bounds__(256)
bn_backward_sums(const float* __restrict__ dy, const float* __restrict__ y, const float* __restrict__ x,
                 const float* __restrict__ mean, const float* __restrict__ invstd, int n, int channels, int plane,
                 int chunk, float* partial, unsigned* counters, float* __restrict__ dgamma,
                 float* __restrict__ dbeta) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    const float m = mean[c], inv = invstd[c];
    float dy_xhat = 0.0f, dy_sum = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const int i = channel_element(e, c, channels, plane);
        const float g = bn_masked(dy, y, i);
        dy_xhat = fmaf(g, (x[i] - m) * inv, dy_xhat);
        dy_sum += g;
    }
    dy_xhat = block_sum(dy_xhat, scratch);
    dy_sum = block_sum(dy_sum, scratch);
    if (!bn_channel_totals(dy_xhat, dy_sum, c, channels, partial, counters)) return;
    if (threadIdx.x == 0) {
        dgamma[c] = dy_xhat;
        dbeta[c] = dy_sum;
    }
}

// dx of training-mode batch norm, gamma * invstd * (g - dbeta / M - xhat * dgamma / M) with g the
// masked dy (dy where y > 0, dy itself without y) and M = count, and g itself into masked when it
// is not null: VEC elements per thread and step, grid-stride.
template <int VEC>
__global__ void __launch_bounds__(256)
bn_backward_dx(const float* __restrict__ dy, const float* __restrict__ y, const float* __restrict__ x,
               const float* __restrict__ mean, const float* __restrict__ invstd, const float* __restrict__ gamma,
               const float* __restrict__ dgamma, const float* __restrict__ dbeta, int count, int total,
               int channels, int plane, float* __restrict__ dx, float* __restrict__ masked) {
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < total; i += gridDim.x * blockDim.x * VEC) {
        Floats<VEC> g = load_floats<VEC>(dy + i);
        const Floats<VEC> xs = load_floats<VEC>(x + i);
        if (y) {
            const Floats<VEC> out = load_floats<VEC>(y + i);
#pragma unroll
            for (int e = 0; e < VEC; ++e) g.v[e] = out.v[e] > 0.0f ? g.v[e] : 0.0f;
        }
        if (masked) store_floats<VEC>(masked + i, g);
        Floats<VEC> d;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const int c = ((i + e) / plane) % channels;
            const float xhat = (xs.v[e] - mean[c]) * invstd[c];
            const float centred = g.v[e] - dbeta[c] / float(count) - xhat * (dgamma[c] / float(count));
            d.v[e] = centred * (gamma[c] * invstd[c]);
        }
        store_floats<VEC>(dx + i, d);
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

// PyTorch's running-statistics update (bn_move_running), in place: one thread per channel.
extern "C" __global__ void __launch_bounds__(256)
bn_update_running(float* __restrict__ running_mean, float* __restrict__ running_var, const float* __restrict__ mean,
                  const float* __restrict__ invstd, int channels, float momentum, float eps, float correction) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels) bn_move_running(c, running_mean, running_var, mean, invstd, momentum, eps, correction);
}
