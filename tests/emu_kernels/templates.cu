// A templated kernel, instantiated through name expressions: per-block sums of a * x in
// the element type T, with the block size a template parameter.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK) scaled_block_sum(T a, const T* x, T* partial, int n) {
    __shared__ T s[BLOCK];
    const int t = threadIdx.x, i = blockIdx.x * BLOCK + t;
    s[t] = i < n ? a * x[i] : T(0);
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) partial[blockIdx.x] = s[0];
}
