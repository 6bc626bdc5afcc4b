// A grid-stride elementwise kernel: y = SCALE * a * x + y, with SCALE from -DSCALE=...
// and the helper from common.cuh through -I (the test passes both options); one that may
// run in place (x and y the same array); and one in a namespace, which CuPy finds by its C name.
#include "common.cuh"

extern "C" __global__ void axpy(float a, const float* __restrict__ x, float* __restrict__ y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        y[i] += scaled(a * x[i]);
}

extern "C" __global__ void scale(const float* x, float* y, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) y[i] = a * x[i];
}

namespace elementwise {
extern "C" __global__ void negate(float* x, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) x[i] = -x[i];
}
}  // namespace elementwise
