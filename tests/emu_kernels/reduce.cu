// Block reductions through shared memory: per-block partial sums, summed in a second,
// fixed-order pass by the caller. `block_sum_missing_sync` leaves out the barrier between
// the steps of the tree, the bug the emulator must show. `unwritten_shared` reads shared
// memory that half of the threads never wrote.
#define BLOCK 256

extern "C" __global__ void __launch_bounds__(BLOCK) block_sum(const float* x, float* partial, int n) {
    __shared__ float s[BLOCK];
    const int t = threadIdx.x, i = blockIdx.x * BLOCK + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) partial[blockIdx.x] = s[0];
}

extern "C" __global__ void __launch_bounds__(BLOCK)
block_sum_missing_sync(const float* x, float* partial, int n) {
    __shared__ float s[BLOCK];
    const int t = threadIdx.x, i = blockIdx.x * BLOCK + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];  // no __syncthreads(): the next step may read a stale s[t + k]
    }
    if (t == 0) partial[blockIdx.x] = s[0];
}

// Block 0 fills all of s, the other blocks only the even slots: their odd slots must read
// as NaN, not as what block 0 left there. The same for the dynamic shared memory.
extern "C" __global__ void unwritten_shared(const float* x, float* out, float* dynamic_out) {
    __shared__ float s[64];
    extern __shared__ float d[];
    const int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    if (blockIdx.x == 0 || t % 2 == 0) {
        s[t] = x[i];
        d[t] = x[i];
    }
    __syncthreads();
    out[i] = s[t];
    dynamic_out[i] = d[t];
}
