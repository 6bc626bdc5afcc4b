// Global loads whose traffic tests/test_emu.py counts (emu.traffic()): thread t of the grid loads as
// each kernel's comment says and stores what it read to out[t] (stores are not counted).

// x[t]: a warp's 32 lanes read 32 consecutive floats, 4 whole sectors of an aligned x.
extern "C" __global__ void coalesced(const float* __restrict__ x, float* __restrict__ out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    out[t] = x[t];
}

// x[t * stride]: with a stride of 8 floats, each lane a sector of its own, 4 bytes of it used.
extern "C" __global__ void strided(const float* __restrict__ x, float* __restrict__ out, int stride) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    out[t] = x[t * stride];
}

// x[blockIdx.x]: every lane the same 4 bytes, one sector.
extern "C" __global__ void broadcast(const float* __restrict__ x, float* __restrict__ out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = x[blockIdx.x];
}

// x[t] as a float4: 512 consecutive bytes a warp, 16 sectors.
extern "C" __global__ void vectors(const float4* __restrict__ x, float4* __restrict__ out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    out[t] = x[t];
}

// x[r * threads + t] for r < rows, one load instruction executed `rows` times: a request per row and warp.
extern "C" __global__ void rows(const float* __restrict__ x, float* __restrict__ out, int rows) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
    float sum = 0.0f;
    for (int r = 0; r < rows; ++r) sum += x[r * threads + t];
    out[t] = sum;
}
