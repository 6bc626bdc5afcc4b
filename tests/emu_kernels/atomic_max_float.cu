// CUDA has no atomicMax on float: NVRTC refuses this kernel, and so must the emulator.
extern "C" __global__ void float_max(const float* x, int n, float* result) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicMax(result, x[i]);
}
