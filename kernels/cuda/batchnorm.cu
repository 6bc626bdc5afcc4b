// batchnorm.cu: batch normalisation over (N, H, W) per channel of NCHW arrays.
// Launched by kernels/cuda/batchnorm.py; checked by tests/test_kernels_cuda.py and tests/test_bn_rows.py
// (float32), tests/test_bf16_ops.py (bfloat16) against tests/reference.py (float64) and
// kernels/cpu/batchnorm.py.
//
// The kernels that read or write activations or their gradients (x, y, dy, dx, residual, the masked
// dy) take their storage type T, float32 or bfloat16 (bf16.cuh): last and float32 by default where
// they were templates before. They widen what they load, compute and sum in float32, and round what
// they store once; the statistics, the parameters and their gradients are float32 whatever T.
//
// Training forward, two launches:
//   bn_stats           one pass over x: per (channel, split) block, the sums of x - shift and of
//                      its square, shift a value near the channel's mean (its first value, or the
//                      mean over every replica), so that the
//                      variance does not cancel when the mean is far from zero; the last block of
//                      each channel adds the splits in order (last_block) into mean and invstd
//                      and moves the running statistics, or, for synchronised batch norm, into
//                      the sums that replicas add (then bn_stats_finish reads the added sums)
//   bn_stats_rows      the same for rows of C channels (channels-last memory, or 1x1 images), C a
//                      multiple of 32: per (32-channel group, split) block, lane l of every warp sums
//                      channel l of the group over the rows its warp takes, so that a warp reads 32
//                      consecutive floats, whole sectors, and each sector of x is read once; bn_stats
//                      reads 4 useful bytes of each 32-byte sector there (bench/bn_plan.py counts them)
//   bn_apply<MODE>     y = x * scale + shift, scale = gamma * invstd, in one pass; MODE 1 adds
//                      relu, MODE 2 relu(. + residual): the joins of a residual block
// Training backward, two launches: bn_backward_sums (sum dy * xhat and sum dy in one pass, the
//   last block per channel writing dgamma and dbeta; bn_backward_sums_rows on channels-last memory,
//   as bn_stats_rows), bn_backward_dx. Given the output y of a fused relu, both take dy where y > 0
//   and 0 elsewhere (bn_backward_dx, given beta instead of y, the relu alone's mask recomputed from
//   x: bn_stats.cuh's bn_affine), and bn_backward_dx can also write that masked dy (the gradient of a residual
//   join's shortcut). The sums of a norm whose output a global average pool reads come from the
//   pool's backward, bn_pooled_backward (as bn_backward_sums_rows, dy made as it is stored).
// Inference: bn_invstd from the running variance, then bn_apply; its backward
//   bn_backward_sums (or _rows) + bn_inference_dx.
// bn_update_running: PyTorch's running-statistics update, in place (synchronised batch norm).
// Every sum is added in an order fixed by the shapes alone: the same bits on every run.
#include "bn_stats.cuh"
#include "tf32.cuh"

// mean and 1/sqrt(biased variance + eps) of channel c from its sums of x - shift and of its square
// over `count` values.
__device__ __forceinline__ void bn_finish(int c, float sum, float squares, float shift, int count, float eps,
                                          float* mean, float* invstd) {
    const float centre = sum / float(count);
    mean[c] = shift + centre;
    invstd[c] = 1.0f / sqrtf(fmaxf(squares / float(count) - centre * centre, 0.0f) + eps);
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

// What bn_stats and bn_stats_rows do with channel c's totals over all of its `count` values: the sums (2, C)
// when sums is not null, else mean and invstd, and then the running statistics when running_mean is not null.
__device__ __forceinline__ void bn_stats_store(int c, float sum, float squares, float shift, int channels, int count,
                                               float* sums, float eps, float* mean, float* invstd,
                                               float* running_mean, float* running_var, float momentum,
                                               float correction) {
    if (sums) {
        sums[c] = sum;
        sums[channels + c] = squares;
        return;
    }
    bn_finish(c, sum, squares, shift, count, eps, mean, invstd);
    if (running_mean) bn_move_running(c, running_mean, running_var, mean, invstd, momentum, eps, correction);
}

// One value v of a channel into its sums of v - shift and of its square.
__device__ __forceinline__ void bn_add_value(float v, float shift, float& sum, float& squares) {
    const float d = v - shift;
    sum += d;
    squares = fmaf(d, d, squares);
}

// Per-channel statistics of x (N, C, plane): block (c, s) of a (C, splits) grid reduces channel
// c's values e in [s * chunk, (s + 1) * chunk) of its N*plane, each thread a strided subset in
// order, then block_sum, shifted by shifts[c], or by the channel's first value of x when shifts is
// null. With one split the block finishes its channel itself; else it writes partial (splits, 2, C)
// and the channel's last block (counters[c]) adds the splits in order. The totals go where
// bn_stats_store puts them.
template <class T>
__global__ void __launch_bounds__(256)
bn_stats(const T* __restrict__ x, const float* __restrict__ shifts, int n, int channels, int plane, int chunk,
         float* partial, unsigned* counters, float* __restrict__ sums, float eps, float* __restrict__ mean,
         float* __restrict__ invstd, float* __restrict__ running_mean, float* __restrict__ running_var,
         float momentum, float correction) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    const float shift = shifts ? shifts[c] : to_float(x[channel_element(0, c, channels, plane)]);
    float sum = 0.0f, squares = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x)
        bn_add_value(to_float(x[channel_element(e, c, channels, plane)]), shift, sum, squares);
    sum = block_sum(sum, scratch);
    squares = block_sum(squares, scratch);
    if (!bn_channel_totals(sum, squares, c, channels, partial, counters) || threadIdx.x != 0) return;
    bn_stats_store(c, sum, squares, shift, channels, n * plane, sums, eps, mean, invstd, running_mean, running_var,
                   momentum, correction);
}

// ---- channels-last memory: rows of C channels, C a multiple of 32 ----------------------------
// A block (g, s) of a (C / 32, splits) grid reduces the 32 channels [32g, 32g + 32) over the rows
// [s * chunk, (s + 1) * chunk): lane l of each warp channel 32g + l, warp w of the block the rows
// begin + w, begin + w + warps, ..., each lane in row order. One channel per lane rather than more
// (a float4 each): a block then spans the fewest channels, and the grid has the most blocks for the
// fewest splits, which the last block of each group adds.

// The sum, in warp order, of the values v that lane l of each warp of the block holds: every thread
// gets its lane's. `scratch` holds a row of 32 floats of shared memory per warp; every thread must call it.
__device__ __forceinline__ float bn_sum_over_warps(float v, float (*scratch)[32]) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    __syncthreads();  // an earlier call's readers are done with scratch
    scratch[warp][lane] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) total += scratch[w][lane];
    return total;
}

// bn_channel_totals for a block of 32 channels, c this lane's, from the block's sums (a, b) that every
// warp holds (bn_sum_over_warps): warp 0 writes them to partial (splits, 2, C), and the group's last
// block to finish (last_block on counters[blockIdx.x]) gets the sums over the splits: its warp w adds
// the splits w, w + warps, ... in order (added_partials), then the warps' sums are added in warp order,
// an order that does not depend on which block is last, with a chain of loads warps times shorter than
// one thread's over every split. Every thread of the block must call it.
__device__ __forceinline__ bool bn_rows_totals(float& a, float& b, int c, int channels, float* partial,
                                               unsigned* counters, float (*scratch)[32]) {
    if (gridDim.y == 1) return true;
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32, stride = warps * 2 * channels;
    if (warp == 0) {
        partial[(blockIdx.y * 2) * channels + c] = a;
        partial[(blockIdx.y * 2 + 1) * channels + c] = b;
    }
    if (!last_block(counters + blockIdx.x, gridDim.y)) return false;
    const int mine = (int(gridDim.y) - warp + warps - 1) / warps;  // splits warp, warp + warps, ... < splits
    a = bn_sum_over_warps(added_partials(partial + (warp * 2) * channels + c, mine, stride), scratch);
    b = bn_sum_over_warps(added_partials(partial + (warp * 2 + 1) * channels + c, mine, stride), scratch);
    return true;
}

// bn_stats on channels-last x (rows, C), C a multiple of 32, by (32-channel group, split) blocks (see
// above): the shift of channel c is shifts[c] (the replicas' shift), or x's first row when shifts is
// null; the totals go where bn_stats_store puts them, from warp 0 of the group's last block.
template <class T>
__global__ void __launch_bounds__(256)
bn_stats_rows(const T* __restrict__ x, const float* __restrict__ shifts, int rows, int channels, int chunk,
              float* partial, unsigned* counters, float* __restrict__ sums, float eps, float* __restrict__ mean,
              float* __restrict__ invstd, float* __restrict__ running_mean, float* __restrict__ running_var,
              float momentum, float correction) {
    __shared__ float scratch[256 / 32][32];
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int c = blockIdx.x * 32 + threadIdx.x % 32, begin = blockIdx.y * chunk, end = min(begin + chunk, rows);
    const float shift = shifts ? shifts[c] : to_float(x[c]);
    float sum = 0.0f, squares = 0.0f;
#pragma unroll 8  // the loads of 8 rows in flight before their adds, in order: 32 (bfloat16: 16) bytes a lane
    for (int r = begin + warp; r < end; r += warps)
        bn_add_value(to_float(x[r * channels + c]), shift, sum, squares);
    sum = bn_sum_over_warps(sum, scratch);
    squares = bn_sum_over_warps(squares, scratch);
    if (!bn_rows_totals(sum, squares, c, channels, partial, counters, scratch) || warp != 0) return;
    bn_stats_store(c, sum, squares, shift, channels, rows, sums, eps, mean, invstd, running_mean, running_var,
                   momentum, correction);
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
template <int MODE, int VEC, class T = float>
__global__ void __launch_bounds__(256)
bn_apply(const T* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ invstd,
         const float* __restrict__ gamma, const float* __restrict__ beta, const T* __restrict__ residual,
         int total, int channels, int plane, T* __restrict__ y) {
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < total; i += gridDim.x * blockDim.x * VEC) {
        Floats<VEC> v = load_floats<VEC>(x + i);
        Floats<VEC> r;
        if (MODE == 2) r = load_floats<VEC>(residual + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const int c = ((i + e) / plane) % channels;
            float out = bn_affine(v.v[e], mean[c], invstd[c], gamma[c], beta[c]);
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

// Element i, of dy d, into the backward's sums of g * xhat and of g, g = d where y[i] > 0 (d itself
// without y), xhat = (x - m) * inv.
template <class T>
__device__ __forceinline__ void bn_add_gradient(float d, const T* __restrict__ y, const T* __restrict__ x, int i,
                                                float m, float inv, float& dy_xhat, float& dy_sum) {
    const float g = !y || to_float(y[i]) > 0.0f ? d : 0.0f;
    dy_xhat = fmaf(g, (to_float(x[i]) - m) * inv, dy_xhat);
    dy_sum += g;
}

// Element i of dy into them.
template <class T>
__device__ __forceinline__ void bn_add_gradient(const T* __restrict__ dy, const T* __restrict__ y,
                                                const T* __restrict__ x, int i, float m, float inv,
                                                float& dy_xhat, float& dy_sum) {
    bn_add_gradient(to_float(dy[i]), y, x, i, m, inv, dy_xhat, dy_sum);
}

// The two per-channel sums of the backward, in one pass over dy (masked by y, see bn_add_gradient) and
// x: block (c, s) of a (C, splits) grid reduces channel c's values e in [s * chunk, ...), each
// thread a strided subset in order, then block_sum, into dgamma[c] = sum(dy * xhat) and
// dbeta[c] = sum(dy), xhat = (x - mean) * invstd; with several splits through partial
// (splits, 2, C), added in order by the channel's last block (counters[c]).
template <class T>
__global__ void __launch_bounds__(256)
bn_backward_sums(const T* __restrict__ dy, const T* __restrict__ y, const T* __restrict__ x,
                 const float* __restrict__ mean, const float* __restrict__ invstd, int n, int channels, int plane,
                 int chunk, float* partial, unsigned* counters, float* __restrict__ dgamma,
                 float* __restrict__ dbeta) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    const float m = mean[c], inv = invstd[c];
    float dy_xhat = 0.0f, dy_sum = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x)
        bn_add_gradient(dy, y, x, channel_element(e, c, channels, plane), m, inv, dy_xhat, dy_sum);
    dy_xhat = block_sum(dy_xhat, scratch);
    dy_sum = block_sum(dy_sum, scratch);
    if (!bn_channel_totals(dy_xhat, dy_sum, c, channels, partial, counters)) return;
    if (threadIdx.x == 0) {
        dgamma[c] = dy_xhat;
        dbeta[c] = dy_sum;
    }
}

// The backward's sums over channels-last y and x (rows, C), C a multiple of 32, by (32-channel group,
// split) blocks as bn_stats_rows, element (r, c)'s dy from gradient(r, c): each sector of y and x is
// read once; warp 0 of the group's last block writes dgamma and dbeta. Every thread of the block must
// call it.
template <class T, class Gradient>
__device__ __forceinline__ void bn_rows_backward_sums(const Gradient& gradient, const T* __restrict__ y,
                                                      const T* __restrict__ x, const float* __restrict__ mean,
                                                      const float* __restrict__ invstd, int rows, int channels,
                                                      int chunk, float* partial, unsigned* counters,
                                                      float* __restrict__ dgamma, float* __restrict__ dbeta) {
    __shared__ float scratch[256 / 32][32];
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int c = blockIdx.x * 32 + threadIdx.x % 32, begin = blockIdx.y * chunk, end = min(begin + chunk, rows);
    const float m = mean[c], inv = invstd[c];
    float dy_xhat = 0.0f, dy_sum = 0.0f;
#pragma unroll 4  // the loads of 4 rows of dy, y and x in flight before their adds, in order: 48 (24) bytes a lane
    for (int r = begin + warp; r < end; r += warps)
        bn_add_gradient(gradient(r, c), y, x, r * channels + c, m, inv, dy_xhat, dy_sum);
    dy_xhat = bn_sum_over_warps(dy_xhat, scratch);
    dy_sum = bn_sum_over_warps(dy_sum, scratch);
    if (!bn_rows_totals(dy_xhat, dy_sum, c, channels, partial, counters, scratch) || warp != 0) return;
    dgamma[c] = dy_xhat;
    dbeta[c] = dy_sum;
}

// bn_backward_sums on channels-last dy, y and x (rows, C), C a multiple of 32 (bn_rows_backward_sums).
template <class T>
__global__ void __launch_bounds__(256)
bn_backward_sums_rows(const T* __restrict__ dy, const T* __restrict__ y, const T* __restrict__ x,
                      const float* __restrict__ mean, const float* __restrict__ invstd, int rows, int channels,
                      int chunk, float* partial, unsigned* counters, float* __restrict__ dgamma,
                      float* __restrict__ dbeta) {
    const auto gradient = [&](int r, int c) { return to_float(dy[r * channels + c]); };
    bn_rows_backward_sums(gradient, y, x, mean, invstd, rows, channels, chunk, partial, counters, dgamma, dbeta);
}

// The backward of a global average pool whose input is the output y of a training batch norm (x its
// input), with that norm's sums: dx (rows, C) channels-last, each image's `plane` rows its pooled
// gradient (N, C) / plane (as global_avg_pool_backward stores it), and the norm's sums of that dx as
// bn_backward_sums_rows adds them, in one pass; C a multiple of 32.
template <class T>
__global__ void __launch_bounds__(256)
bn_pooled_backward(const float* __restrict__ pooled, int plane, T* __restrict__ dx, const T* __restrict__ y,
                   const T* __restrict__ x, const float* __restrict__ mean, const float* __restrict__ invstd,
                   int rows, int channels, int chunk, float* partial, unsigned* counters, float* __restrict__ dgamma,
                   float* __restrict__ dbeta) {
    const auto gradient = [&](int r, int c) {
        const T d = stored<T>(pooled[r / plane * channels + c] / float(plane));
        dx[r * channels + c] = d;
        return to_float(d);
    };
    bn_rows_backward_sums(gradient, y, x, mean, invstd, rows, channels, chunk, partial, counters, dgamma, dbeta);
}

// dx of training-mode batch norm, gamma * invstd * (g - dbeta / M - xhat * dgamma / M) with g the
// masked dy (dy where y > 0; without y, where bn_affine(x) > 0 when beta is not null, a relu alone
// whose mask is recomputed; else dy itself) and M = count, and g itself into masked when it is not null;
// dx rounded to TF32 where round_tf32 & 1, g where round_tf32 & 2 (float32 storage: for the TF32
// backward-data that reads it, tf32.cuh's tf32_value): VEC elements per thread and step, grid-stride.
template <int VEC, class T = float>
__global__ void __launch_bounds__(256)
bn_backward_dx(const T* __restrict__ dy, const T* __restrict__ y, const T* __restrict__ x,
               const float* __restrict__ mean, const float* __restrict__ invstd, const float* __restrict__ gamma,
               const float* __restrict__ beta, const float* __restrict__ dgamma, const float* __restrict__ dbeta,
               int count, int total, int channels, int plane, T* __restrict__ dx, T* __restrict__ masked,
               int round_tf32) {
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < total; i += gridDim.x * blockDim.x * VEC) {
        Floats<VEC> g = load_floats<VEC>(dy + i);
        const Floats<VEC> xs = load_floats<VEC>(x + i);
        Floats<VEC> out;
        if (y) out = load_floats<VEC>(y + i);
        Floats<VEC> d;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const int c = ((i + e) / plane) % channels;
            const float m = mean[c], inv = invstd[c], scale = gamma[c];
            if (y)
                g.v[e] = out.v[e] > 0.0f ? g.v[e] : 0.0f;
            else if (beta)   // a relu alone: its mask recomputed from x, as bn_apply computed it
                g.v[e] = bn_affine(xs.v[e], m, inv, scale, beta[c]) > 0.0f ? g.v[e] : 0.0f;
            const float xhat = (xs.v[e] - m) * inv;
            const float centred = g.v[e] - dbeta[c] / float(count) - xhat * (dgamma[c] / float(count));
            d.v[e] = round_tf32 & 1 ? tf32_value(centred * (scale * inv)) : centred * (scale * inv);
        }
        if (masked && round_tf32 & 2) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) g.v[e] = tf32_value(g.v[e]);
        }
        if (masked) store_floats<VEC>(masked + i, g);
        store_floats<VEC>(dx + i, d);
    }
}

// dx of inference-mode batch norm, dy * gamma * invstd: threads over elements, grid-stride.
template <class T>
__global__ void __launch_bounds__(256)
bn_inference_dx(const T* __restrict__ dy, const float* __restrict__ invstd, const float* __restrict__ gamma,
                int total, int channels, int plane, T* __restrict__ dx) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int c = (i / plane) % channels;
        dx[i] = stored<T>(to_float(dy[i]) * (gamma[c] * invstd[c]));
    }
}

// PyTorch's running-statistics update (bn_move_running), in place: one thread per channel.
extern "C" __global__ void __launch_bounds__(256)
bn_update_running(float* __restrict__ running_mean, float* __restrict__ running_var, const float* __restrict__ mean,
                  const float* __restrict__ invstd, int channels, float momentum, float eps, float correction) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < channels) bn_move_running(c, running_mean, running_var, mean, invstd, momentum, eps, correction);
}
