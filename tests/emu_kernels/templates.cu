// Per-block sums of a * x in the element type T, with the block size a template parameter, in the block's
// array s: the templated kernels below, instantiated through name expressions.
template <typename T, int BLOCK>
__device__ void scaled_sum(T* s, T a, const T* x, T* partial, int n) {
    const int t = threadIdx.x, i = blockIdx.x * BLOCK + t;
    s[t] = i < n ? a * x[i] : T(0);
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) partial[blockIdx.x] = s[0];
}

// In static shared memory.
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK) scaled_block_sum(T a, const T* x, T* partial, int n) {
    __shared__ T s[BLOCK];
    scaled_sum<T, BLOCK>(s, a, x, partial, n);
}

// In dynamic shared memory declared in the template's body (extern __shared__ at block scope).
template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK) scaled_block_sum_dynamic(T a, const T* x, T* partial, int n) {
    extern __shared__ __align__(16) unsigned char block_bytes[];
    scaled_sum<T, BLOCK>(reinterpret_cast<T*>(block_bytes), a, x, partial, n);
}
