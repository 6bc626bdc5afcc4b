// common.cuh: device code that several kernel families share, pasted into each family's
// source by kernels/cuda/__init__.py (so that a change here changes every module's hash and
// therefore every cached compile).
//
// - warp_sum / block_sum: sums in a fixed tree order, so every run adds the same numbers in
//   the same order and gets the same bits (DESIGN.md: no order-dependent atomics).
// - sum_partials: the fixed-order final pass over per-block partial results.
// - channel_element: where the e-th value of one channel lies in an NCHW array.
// - Tile64, Tile128 and gemm_mainloop: the shared-memory tiled matrix product that the
//   convolutions and the linear layer feed through their own tile loaders.
//
// Launchers guarantee that every index fits in an int (kernels/cuda/launch.py).
#pragma once

constexpr unsigned kFullMask = 0xffffffffu;

// The lanes of a warp exchange partial sums in a butterfly: every lane ends with the same
// total, added in the same order.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

// The sum of v over a block of whole warps, returned to every thread. `scratch` holds 32
// floats of shared memory; every thread of the block must call this (no early returns).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    v = warp_sum(v);
    __syncthreads();  // an earlier call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < int(blockDim.x / 32) ? scratch[lane] : 0.0f);
}

// out[i] = scale * sum over s in 0..splits-1, in that order, of partial[s * rows + i]:
// one thread per row, threads over rows in a 1-D grid.
extern "C" __global__ void __launch_bounds__(256)
sum_partials(const float* __restrict__ partial, int splits, int rows, float scale, float* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) total += partial[s * rows + i];
    out[i] = total * scale;
}

// Offset in an (N, C, HW) array of the e-th value of channel c, e in [0, N * HW).
__device__ __forceinline__ int channel_element(int e, int c, int channels, int hw) {
    const int n = e / hw;
    return (n * channels + c) * hw + (e - n * hw);
}

// ---- the tiled matrix product -------------------------------------------------------------
// C (M x N) = A (M x K) B (K x N). A block computes a BM x BN tile of C with THREADS threads;
// thread (ty, tx) = (t / THREADS_N, t % THREADS_N) owns the TM x TN elements
// (ty + i * THREADS_M, tx + j * THREADS_N): strided, so that a warp reads 16 consecutive
// words of a shared-memory row (no bank conflicts) and writes C in 16-wide coalesced runs.
// K advances BK at a time through shared memory, As[k][m] and Bs[k][n], each row padded by 4
// words so that loaders filling them k-fastest do not conflict either.
template <int BM_, int BN_, int BK_, int TM_, int TN_>
struct GemmTile {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, TM = TM_, TN = TN_;
    static constexpr int THREADS_M = BM / TM, THREADS_N = BN / TN, THREADS = THREADS_M * THREADS_N;
    static constexpr int PAD = 4;
    static_assert(THREADS % BM == 0 && THREADS % BN == 0 && THREADS % BK == 0, "fill mappings");
    // Row (m or n) of C that accumulator i (or j) of this thread holds, relative to the tile.
    __device__ static int row(int i) { return int(threadIdx.x) / THREADS_N + i * THREADS_M; }
    __device__ static int col(int j) { return int(threadIdx.x) % THREADS_N + j * THREADS_N; }
};

// 256 threads each; the launchers pick the large tile when it still gives enough blocks.
struct Tile64 : GemmTile<64, 64, 16, 4, 4> {};
struct Tile128 : GemmTile<128, 128, 16, 8, 8> {};

// How a loader's THREADS threads cover a BK x W tile of shared memory, W = BM or BN.
// W-fastest: thread t fills column t % W at k = t / W + i * STEP (coalesced when consecutive
// columns are consecutive in memory). K-fastest: thread t fills k = t % BK at column
// t / BK + i * STEP (coalesced when consecutive k are).
template <class T, int W>
struct FillWFast {
    static constexpr int STEP = T::THREADS / W, COUNT = T::BK / STEP;
    __device__ static int w() { return int(threadIdx.x) % W; }
    __device__ static int k(int i) { return int(threadIdx.x) / W + i * STEP; }
};
template <class T, int W>
struct FillKFast {
    static constexpr int STEP = T::THREADS / T::BK, COUNT = W / STEP;
    __device__ static int w(int i) { return int(threadIdx.x) / T::BK + i * STEP; }
    __device__ static int k() { return int(threadIdx.x) % T::BK; }
};

// Accumulates A(m0.., k) B(k, n0..) over k in [k_begin, k_end) into acc (see GemmTile).
// The loaders fill whole tiles, zeros outside the matrices:
//   a.fill(As, k0, k_end) writes As[k][m] = A(m0 + m, k0 + k),
//   b.fill(Bs, k0, k_end) writes Bs[k][n] = B(k0 + k, n0 + n).
template <class T, class LoaderA, class LoaderB>
__device__ __forceinline__ void gemm_mainloop(LoaderA& a, LoaderB& b, int k_begin, int k_end,
                                              float (&acc)[T::TM][T::TN]) {
    __shared__ float As[T::BK][T::BM + T::PAD];
    __shared__ float Bs[T::BK][T::BN + T::PAD];
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
        for (int j = 0; j < T::TN; ++j) acc[i][j] = 0.0f;
    for (int k0 = k_begin; k0 < k_end; k0 += T::BK) {
        a.fill(As, k0, k_end);
        b.fill(Bs, k0, k_end);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < T::BK; ++k) {
            float av[T::TM], bv[T::TN];
#pragma unroll
            for (int i = 0; i < T::TM; ++i) av[i] = As[k][T::row(i)];
#pragma unroll
            for (int j = 0; j < T::TN; ++j) bv[j] = Bs[k][T::col(j)];
#pragma unroll
            for (int i = 0; i < T::TM; ++i)
#pragma unroll
                for (int j = 0; j < T::TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
}

// A BK x W tile of a plain matrix whose element (w, k) lies at p[w * w_stride + k * k_stride],
// with zeros outside w < w_size, k < k_end. K_FAST fills k-fastest (for k_stride 1), else
// w-fastest (for w_stride 1), so that the global loads are coalesced either way.
template <class T, int W, bool K_FAST>
struct MatrixTile {
    const float* p;
    int w0, w_size, w_stride, k_stride;

    __device__ void fill(float (*tile)[W + T::PAD], int k0, int k_end) const {
        if constexpr (K_FAST) {
            using F = FillKFast<T, W>;
            const int k = k0 + F::k();
#pragma unroll
            for (int i = 0; i < F::COUNT; ++i) {
                const int w = w0 + F::w(i);
                tile[F::k()][F::w(i)] = (k < k_end && w < w_size) ? p[w * w_stride + k * k_stride] : 0.0f;
            }
        } else {
            using F = FillWFast<T, W>;
            const int w = w0 + F::w();
#pragma unroll
            for (int i = 0; i < F::COUNT; ++i) {
                const int k = k0 + F::k(i);
                tile[F::k(i)][F::w()] = (k < k_end && w < w_size) ? p[w * w_stride + k * k_stride] : 0.0f;
            }
        }
    }
};
