// Kernels that go wrong, for the emulator's diagnostics, and one whose parameters exercise
// the argument checks.

// Writes one element past the end of y (the last thread's i == n).
extern "C" __global__ void write_one_past_end(const float* x, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) y[i] = i < n ? 2.0f * x[i] : 0.0f;
}

// Writes far beyond the end of y, past the canary zone: a fault.
extern "C" __global__ void write_far_past_end(float* y) {
    y[(int)threadIdx.x * 100000] = 1.0f;
}

extern "C" __global__ void parameters(float* out, const int* index, int n, float a, double b,
                                      unsigned long long big, const float4* vectors) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * (float)index[i] + (float)b + (float)(big & 1ull) + vectors[i].w;
}

// Half of each warp shuffles with a full mask while the other half waits at the barrier.
extern "C" __global__ void divergent_shuffle(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x % 32 < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}

extern "C" __global__ void checks_its_input(const int* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) assert(x[i] >= 0);
}

// Writes one float past the dynamic shared memory the launch asks for (blockDim.x floats).
extern "C" __global__ void write_past_dynamic_shared(float* out) {
    extern __shared__ float d[];
    d[threadIdx.x + 1] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = d[threadIdx.x];
}
