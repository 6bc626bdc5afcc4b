// linear.cu: the fully connected layer's matrix products on row-major float32 matrices, through
// common.cuh's tiled GEMM. Launched by kernels/cuda/linear.py; checked by
// tests/test_kernels_cuda.py against tests/reference.py and kernels/cpu/linear.py.
//
//   forward   y  = x (N x I) . w^T (I x O) + b     matmul<T, true, true>
//   backward  dx = dy (N x O) . w (O x I)          matmul<T, true, false>
//             dw = dy^T (O x N) . x (N x I)        matmul<T, false, false>
//             db = column sums of dy               sum_partials, rows added in order
#include "common.cuh"

// c (M x N) = A . B (+ bias[n] when bias is not null), A(m, k) = a[m * a_m + k * a_k],
// B(k, n) = b[n * b_n + k * b_k]: one block per Tile::BM x Tile::BN tile of c (grid.x over N,
// grid.y over M), each thread TM x TN elements; A_K_FAST / B_K_FAST say which index is
// contiguous, so that the tile loads are coalesced.
template <class T, bool A_K_FAST, bool B_K_FAST>
__global__ void __launch_bounds__(T::THREADS)
matmul(const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ bias, float* __restrict__ c,
       int m_size, int n_size, int k_size, int a_m, int a_k, int b_n, int b_k) {
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN;
    MatrixTile<T, T::BM, A_K_FAST> a_tile(a, m0, m_size, a_m, a_k);
    MatrixTile<T, T::BN, B_K_FAST> b_tile(b, n0, n_size, b_n, b_k);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a_tile, b_tile, 0, k_size, acc);
#pragma unroll
    for (int i = 0; i < T::TM; ++i) {
        const int m = m0 + T::row(i);
#pragma unroll
        for (int j = 0; j < T::TN; ++j) {
            const int n = n0 + T::col(j);
            if (m < m_size && n < n_size) c[m * n_size + n] = bias ? acc[i][j] + bias[n] : acc[i][j];
        }
    }
}
