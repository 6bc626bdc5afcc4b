// loss.cu: softmax cross-entropy, the batch mean of -log softmax(logits)[label], forward and
// backward, and the count of correct predictions, on (N, K) float32 logits and integer labels
// (uint8, int32 or int64: the template parameter L). Launched by kernels/cuda/loss.py; checked
// by tests/test_kernels_cuda.py against tests/reference.py and kernels/cpu/loss.py.
//
// The forward subtracts each row's maximum before exponentiating, writes the probabilities
// (the backward's input) and each block's sum of row losses; sum_partials adds the blocks in
// order and divides by N, giving the loss as a 0-d array without a host synchronisation. A
// label outside [0, K) cannot be reported without one: it makes its row's loss, and so the
// loss, NaN.
#include "common.cuh"

constexpr int kRowsPerBlock = 8;  // one warp per row, 256 threads

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

// probs = softmax(logits) per row, partial[block] = the sum of the block's row losses
// log(sum exp(shifted)) - shifted[label]: one warp per row (lanes over the K classes, warp
// max and warp sums), 8 rows per block, the rows' losses added in row order by thread 0.
template <class L>
__global__ void __launch_bounds__(256)
softmax_xent_forward(const float* __restrict__ logits, const L* __restrict__ labels, int n, int k,
                     float* __restrict__ probs, float* __restrict__ partial) {
    __shared__ float row_loss[kRowsPerBlock];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row = blockIdx.x * kRowsPerBlock + warp;
    if (row < n) {  // the whole warp takes the same side: its shuffles see every lane
        const float* z = logits + row * k;
        float peak = z[0];
        for (int j = lane; j < k; j += 32) peak = fmaxf(peak, z[j]);
        peak = warp_max(peak);
        float total = 0.0f;
        for (int j = lane; j < k; j += 32) total += expf(z[j] - peak);
        total = warp_sum(total);
        for (int j = lane; j < k; j += 32) probs[row * k + j] = expf(z[j] - peak) / total;
        const long long label = labels[row];
        const bool valid = label >= 0 && label < k;
        if (lane == 0) row_loss[warp] = valid ? logf(total) - (z[valid ? label : 0] - peak) : nanf("");
    } else if (lane == 0) {
        row_loss[warp] = 0.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int w = 0; w < kRowsPerBlock; ++w) sum += row_loss[w];
        partial[blockIdx.x] = sum;
    }
}

// dlogits = (probs - onehot(label)) * dloss / N, dloss read from the device (the loss's
// gradient, a 0-d array): threads over the N*K elements, grid-stride.
template <class L>
__global__ void __launch_bounds__(256)
softmax_xent_backward(const float* __restrict__ dloss, const float* __restrict__ probs, const L* __restrict__ labels,
                      int n, int k, float* __restrict__ dlogits) {
    const float scale = dloss[0] / float(n);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * k; i += gridDim.x * blockDim.x) {
        const int row = i / k;
        const float hot = (long long)labels[row] == i - row * k ? 1.0f : 0.0f;
        dlogits[i] = (probs[i] - hot) * scale;
    }
}

// count[0] = how many rows of logits (N, K) have their first largest value (a NaN counting as
// largest, as in NumPy's argmax) at the label: one block, each thread a row per round of 256
// rows, the round's hits totalled by __syncthreads_count.
template <class L>
__global__ void __launch_bounds__(256)
count_correct(const float* __restrict__ logits, const L* __restrict__ labels, int n, int k,
              long long* __restrict__ count) {
    long long total = 0;
    for (int first = 0; first < n; first += blockDim.x) {
        const int row = first + threadIdx.x;
        int hit = 0;
        if (row < n) {
            const float* z = logits + row * k;
            int best = 0;
            for (int j = 1; j < k; ++j)
                if (z[j] > z[best] || (isnan(z[j]) && !isnan(z[best]))) best = j;
            hit = (long long)labels[row] == best;
        }
        total += __syncthreads_count(hit);
    }
    if (threadIdx.x == 0) count[0] = total;
}
