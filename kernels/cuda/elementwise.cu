// elementwise.cu: relu, its backward, the residual join relu(a + b), uint8 images (gathered by
// a batch's indices) to float32 and the gather of labels, on flat contiguous arrays. Launched by kernels/cuda/elementwise.py; checked by
// tests/test_kernels_cuda.py against tests/reference.py and kernels/cpu/elementwise.py.
// Every kernel is memory-bound: one thread per element, grid-stride, coalesced. relu keeps a
// NaN as NaN (as NumPy's maximum and PyTorch do), so that a NaN upstream is not hidden.

// y = max(x, 0): threads over elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
relu_forward(const float* __restrict__ x, int total, float* __restrict__ y) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        y[i] = x[i] < 0.0f ? 0.0f : x[i];
}

// dx = dy where y > 0, else 0 (the mask from the output, which serves relu and add_relu
// alike): threads over elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
relu_backward(const float* __restrict__ dy, const float* __restrict__ y, int total, float* __restrict__ dx) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

// y = a + b (y may be a or b: gradient accumulation in place): threads over elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
add(const float* a, const float* b, int total, float* y) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

// y = max(a + b, 0): threads over elements, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
add_relu_forward(const float* __restrict__ a, const float* __restrict__ b, int total, float* __restrict__ y) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const float v = a[i] + b[i];
        y[i] = v < 0.0f ? 0.0f : v;
    }
}

// x = images[idx] / 255 as float32, image n of x being image idx[n] of images (n itself when idx
// is null), `plane` pixels each: threads over x's pixels, grid-stride.
template <class Index>
__global__ void __launch_bounds__(256)
images_to_float(const unsigned char* __restrict__ images, const Index* __restrict__ idx, int plane, int total,
                float* __restrict__ x) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int n = i / plane;
        const long long image = idx ? static_cast<long long>(idx[n]) : n;
        x[i] = float(images[image * plane + (i - n * plane)]) * (1.0f / 255.0f);
    }
}

// out = a[idx] for int32 a (a batch's labels): one thread per output, grid-stride.
template <class Index>
__global__ void __launch_bounds__(256)
take(const int* __restrict__ a, const Index* __restrict__ idx, int total, int* __restrict__ out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) out[i] = a[idx[i]];
}
