// Float arithmetic on subnormal numbers: CuPy compiles with -ftz=true, so a GPU flushes a
// subnormal input to zero before an operation (x * 1) and a subnormal result after it (x * s).
// `scale_then_fault` ends its launch with a fault after computing, for the host's mode afterwards.

__device__ void scale_one(const float* x, float s, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}

extern "C" __global__ void scale(const float* x, float s, float* y, int n) { scale_one(x, s, y, n); }

extern "C" __global__ void scale_then_fault(const float* x, float s, float* y, int n) {
    scale_one(x, s, y, n);
    if (threadIdx.x == 0) *static_cast<volatile float*>(nullptr) = y[0];
}
