// Tiled matrix multiply C (M x N) = A (M x K) @ B (K x N), row-major, with TILE x TILE
// blocks and both tiles in dynamic shared memory (2 * TILE * TILE floats), any M, N, K.
#define TILE 16

extern "C" __global__ void matmul_tiled(const float* A, const float* B, float* C, int M, int N, int K) {
    extern __shared__ float tiles[];
    float* As = tiles;
    float* Bs = tiles + TILE * TILE;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TILE + ty, col = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[ty * TILE + tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
        Bs[ty * TILE + tx] = (k0 + ty < K && col < N) ? B[(k0 + ty) * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[ty * TILE + k] * Bs[k * TILE + tx];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}
