// elementwise.cu: relu, its backward, the residual join relu(a + b), the conversion between float32
// and bfloat16, uint8 images (gathered by a batch's indices) to float32 and the gather of labels, on
// flat contiguous arrays; and hold, which keeps a stream busy for a while. Launched by kernels/cuda/elementwise.py; checked by
// tests/test_kernels_cuda.py (float32) and tests/test_bf16_ops.py (bfloat16) against
// tests/reference.py and kernels/cpu/elementwise.py.
// Every kernel is memory-bound: VEC elements per thread and step (VEC = 4: 16-byte loads and
// stores of float32, 8-byte ones of bfloat16, where the launcher found every array aligned to 4
// elements and the count a multiple of 4), grid-stride, coalesced. The activations' kernels take
// their storage type T last, float32 by default, or bfloat16 (bf16.cuh): they compute in float32
// and round what they store once. relu keeps a NaN as NaN (as NumPy's maximum and PyTorch do), so
// that a NaN upstream is not hidden.
#include "common.cuh"
#include "tf32.cuh"
#include "timer.cuh"

// The first element of this thread's VEC, and the stride of the grid, in elements.
#define VEC_LOOP(i, total) \
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * VEC; i < (total); i += gridDim.x * blockDim.x * VEC)

// y = max(x, 0).
template <int VEC, class T = float>
__global__ void __launch_bounds__(256)
relu_forward(const T* __restrict__ x, int total, T* __restrict__ y) {
    VEC_LOOP(i, total) {
        Floats<VEC> v = load_floats<VEC>(x + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v.v[e] = v.v[e] < 0.0f ? 0.0f : v.v[e];
        store_floats<VEC>(y + i, v);
    }
}

// dx = dy where y > 0, else 0 (the mask from the output, which serves relu and add_relu alike).
template <int VEC, class T = float>
__global__ void __launch_bounds__(256)
relu_backward(const T* __restrict__ dy, const T* __restrict__ y, int total, T* __restrict__ dx) {
    VEC_LOOP(i, total) {
        Floats<VEC> g = load_floats<VEC>(dy + i);
        const Floats<VEC> out = load_floats<VEC>(y + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) g.v[e] = out.v[e] > 0.0f ? g.v[e] : 0.0f;
        store_floats<VEC>(dx + i, g);
    }
}

// y = a + b (y may be a or b: gradient accumulation in place).
template <int VEC, class T = float>
__global__ void __launch_bounds__(256)
add(const T* a, const T* b, int total, T* y) {
    VEC_LOOP(i, total) {
        Floats<VEC> u = load_floats<VEC>(a + i);
        const Floats<VEC> v = load_floats<VEC>(b + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) u.v[e] += v.v[e];
        store_floats<VEC>(y + i, u);
    }
}

// y = max(a + b, 0).
template <int VEC, class T = float>
__global__ void __launch_bounds__(256)
add_relu_forward(const T* __restrict__ a, const T* __restrict__ b, int total, T* __restrict__ y) {
    VEC_LOOP(i, total) {
        Floats<VEC> u = load_floats<VEC>(a + i);
        const Floats<VEC> v = load_floats<VEC>(b + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float sum = u.v[e] + v.v[e];
            u.v[e] = sum < 0.0f ? 0.0f : sum;
        }
        store_floats<VEC>(y + i, u);
    }
}

// y = x converted from TIn to TOut, float32 or bfloat16: widened exactly, or rounded to nearest even
// (the bfloat16 copy of the flat float32 parameter buffer, say).
template <int VEC, class TIn, class TOut>
__global__ void __launch_bounds__(256)
cast(const TIn* __restrict__ x, int total, TOut* __restrict__ y) {
    VEC_LOOP(i, total) store_floats<VEC>(y + i, load_floats<VEC>(x + i));
}

// y = x rounded to TF32 (tf32_value): the flat buffer's TF32 copy of the weights when something other than
// the optimizer wrote them, and a weight that is not a flat buffer's or a dy that no batch norm rounded,
// before the TF32 GEMMs read it.
template <int VEC>
__global__ void __launch_bounds__(256)
round_tf32(const float* __restrict__ x, int total, float* __restrict__ y) {
    VEC_LOOP(i, total) {
        Floats<VEC> v = load_floats<VEC>(x + i);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v.v[e] = tf32_value(v.v[e]);
        store_floats<VEC>(y + i, v);
    }
}

// x = images[idx] / 255 as float32, rounded once to the storage T, image n of x being image idx[n] of
// images (n itself when idx is null), `plane` pixels each: threads over x's pixels, grid-stride.
template <class Index, class T = float>
__global__ void __launch_bounds__(256)
images_to_float(const unsigned char* __restrict__ images, const Index* __restrict__ idx, int plane, int total,
                T* __restrict__ x) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int n = i / plane;
        const long long image = idx ? static_cast<long long>(idx[n]) : n;
        x[i] = stored<T>(float(images[image * plane + (i - n * plane)]) * (1.0f / 255.0f));
    }
}

// out = a[idx] for int32 a (a batch's labels): one thread per output, grid-stride.
template <class Index>
__global__ void __launch_bounds__(256)
take(const int* __restrict__ a, const Index* __restrict__ idx, int total, int* __restrict__ out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) out[i] = a[idx[i]];
}

// One thread that keeps its stream busy for `microseconds` of the global timer, doing nothing else: the
// host queues the work behind it before the GPU reaches that work, which then runs back to back, as in
// a CUDA graph, however slowly the host queued it (the profiler's steps, profiler/measure.py).
__global__ void hold(int microseconds) {
    const unsigned long long start = global_timer_ns();
    while (global_timer_ns() - start < 1000ull * static_cast<unsigned long long>(microseconds)) {
    }
}
