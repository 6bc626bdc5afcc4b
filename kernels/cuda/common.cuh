// common.cuh: device code that several kernel families share, pasted into each family's
// source by kernels/cuda/__init__.py (so that a change here changes every module's hash and
// therefore every cached compile).
//
// - warp_sum / block_sum: sums in a fixed tree order, so every run adds the same numbers in
//   the same order and gets the same bits (DESIGN.md: no order-dependent atomics).
// - sum_partials: the fixed-order final pass over per-block partial results, as a launch of its
//   own; last_block and added_partials: the same pass inside the launch that wrote them.
// - Floats, load_floats, store_floats, to_float, stored: VEC values of float32 or bfloat16 storage
//   (bf16.cuh) as floats, the storage type a kernel's template parameter.
// - channel_element: where the e-th value of one channel lies in an NCHW array.
// - Tile64, Tile128 and gemm_mainloop: the shared-memory tiled matrix product that the
//   convolutions and the linear layer feed through their own tile loaders.
//
// Launchers guarantee that every index fits in an int (kernels/cuda/launch.py).
#pragma once
#include "bf16.cuh"

constexpr unsigned kFullMask = 0xffffffffu;

// The lanes of a warp exchange partial sums in a butterfly: every lane ends with the same
// total, added in the same order. LANES < 32: the sums of aligned groups of LANES lanes (a power
// of two), each lane getting its group's; every lane of the warp must call it.
template <int LANES = 32>
__device__ __forceinline__ float warp_sum(float v) {
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "a power of two of lanes");
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
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

// How the threads that finish a block's work together wait for each other (last_block, bn_stats.cuh's
// merges): BlockSync, every thread of the block that has not returned (__syncthreads()); sm90.cuh's
// NamedSync, some warps of it (a warp-specialised kernel's consumers, while its producer loads on).
struct BlockSync {
    __device__ void sync() const { __syncthreads(); }
    __device__ int any(int predicate) const { return __syncthreads_or(predicate); }
};

// A reduction split over several blocks, finished in the same launch: every block of a group
// writes its partial result, then calls last_block(the group's counter, the group's block count);
// the block that comes last, whichever it is, gets true and adds the group's partials in a fixed
// order (added_partials), so the result does not depend on which block that was. The counter is
// one of the backend's zeroed counters (Backend.counters) and is zero again when the launch ends.
// Every thread that `sync` waits for must call it, the block's last thread (which counts the block)
// among them: a warp-specialised kernel's producers, its first threads, take no part.
template <class Sync = BlockSync>
__device__ __forceinline__ bool last_block(unsigned* counter, unsigned blocks, const Sync& sync = Sync()) {
    __threadfence();   // this block's partials reach the device before it counts itself
    sync.sync();
    int last = 0;
    if (threadIdx.x == blockDim.x - 1) {
        last = atomicAdd(counter, 1u) == blocks - 1;
        if (last) *counter = 0u;   // every other block has counted: ready for the next launch
    }
    last = sync.any(last);
    if (last) __threadfence();
    return last;
}

// The sum over s in 0..splits-1, in that order, of partial[s * stride]: the partials of other
// blocks of this launch, read past the L1 cache (volatile), which may not have seen them.
__device__ __forceinline__ float added_partials(const float* partial, int splits, int stride) {
    const volatile float* p = partial;
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) total += p[s * stride];
    return total;
}

// out[i] = scale * sum over s in 0..splits-1, in that order, of partial[s * rows + i]:
// one thread per row, threads over rows in a 1-D grid.
extern "C" __global__ void __launch_bounds__(256)
sum_partials(const float* __restrict__ partial, int splits, int rows, float scale, float* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    out[i] = added_partials(partial + i, splits, rows) * scale;
}

// VEC consecutive floats (VEC = 1, or 4 at a 16-byte-aligned address: one 16-byte access), which
// the element-wise kernels move per thread and step.
template <int VEC>
struct Floats {
    float v[VEC];
};

template <int VEC>
__device__ __forceinline__ Floats<VEC> load_floats(const float* p) {
    Floats<VEC> f;
    if constexpr (VEC == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        f.v[0] = q.x, f.v[1] = q.y, f.v[2] = q.z, f.v[3] = q.w;
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) f.v[e] = p[e];
    }
    return f;
}

template <int VEC>
__device__ __forceinline__ void store_floats(float* p, const Floats<VEC>& f) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(f.v[0], f.v[1], f.v[2], f.v[3]);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = f.v[e];
    }
}

// VEC consecutive bfloat16 (VEC = 4 at an 8-byte-aligned address: one 8-byte access), widened;
// stored rounded to nearest even, two at a time (bf16.cuh).
template <int VEC>
__device__ __forceinline__ Floats<VEC> load_floats(const bf16* p) {
    Floats<VEC> f;
    if constexpr (VEC == 4) {
        const uint2 q = *reinterpret_cast<const uint2*>(p);
        f.v[0] = bf16x2_low(q.x), f.v[1] = bf16x2_high(q.x), f.v[2] = bf16x2_low(q.y), f.v[3] = bf16x2_high(q.y);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) f.v[e] = bf16_float(p[e]);
    }
    return f;
}

template <int VEC>
__device__ __forceinline__ void store_floats(bf16* p, const Floats<VEC>& f) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<uint2*>(p) = make_uint2(bf16x2_round(f.v[0], f.v[1]), bf16x2_round(f.v[2], f.v[3]));
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = bf16_round(f.v[e]);
    }
}

// One value of float32 or bfloat16 storage as a float, and a float as the storage type T.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 h) { return bf16_float(h); }

template <class T>
__device__ __forceinline__ T stored(float x) {
    if constexpr (sizeof(T) == 2) return bf16_round(x);
    else return x;
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
// K advances BK at a time through shared memory, As[k][m] and Bs[k][n], each row padded by
// 32 / BK words: then the BK x (32 / BK) elements a warp stores k-fastest fall in 32 different
// banks.
template <int BM_, int BN_, int BK_, int TM_, int TN_>
struct GemmTile {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, TM = TM_, TN = TN_;
    static constexpr int THREADS_M = BM / TM, THREADS_N = BN / TN, THREADS = THREADS_M * THREADS_N;
    static constexpr int PAD = 32 / BK;
    static_assert(THREADS % BM == 0 && THREADS % BN == 0 && THREADS % BK == 0 && 32 % BK == 0, "tile maps");
    // Row (m or n) of C that accumulator i (or j) of this thread holds, relative to the tile.
    __device__ static int row(int i) { return int(threadIdx.x) / THREADS_N + i * THREADS_M; }
    __device__ static int col(int j) { return int(threadIdx.x) % THREADS_N + j * THREADS_N; }
};

// 256 threads each; the launchers pick the large tile when it still gives enough blocks.
struct Tile64 : GemmTile<64, 64, 16, 4, 4> {};
struct Tile128 : GemmTile<128, 128, 8, 8, 8> {};

// Which COUNT elements (k(i), w(i)) of a BK x W shared-memory tile (W = BM or BN) thread t
// loads. K_FAST: consecutive threads take consecutive k, k(i) = t % BK for every i (coalesced
// when k is the contiguous index in memory); else consecutive w, w(i) = t % W.
template <class T, int W, bool K_FAST>
struct TileMap {
    static constexpr int COUNT = T::BK * W / T::THREADS;
    __device__ static int k(int i) {
        return K_FAST ? int(threadIdx.x) % T::BK : int(threadIdx.x) / W + i * (T::THREADS / W);
    }
    __device__ static int w(int i) {
        return K_FAST ? int(threadIdx.x) / T::BK + i * (T::THREADS / T::BK) : int(threadIdx.x) % W;
    }
};

// What every tile loader has: the values this thread fetched from global memory for the next
// tile, held in registers until store() puts them in shared memory. A loader adds
//   fetch(k0, k_end): staged[i] = its matrix at (k0 + Map::k(i), w0 + Map::w(i)), 0 outside.
template <class T, int W, bool K_FAST>
struct Staged {
    using Map = TileMap<T, W, K_FAST>;
    float staged[Map::COUNT];

    __device__ void store(float (*tile)[W + T::PAD]) const {
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) tile[Map::k(i)][Map::w(i)] = staged[i];
    }
};

// Accumulates A(m0.., k) B(k, n0..) over k in [k_begin, k_end) into acc (see GemmTile), with
// loaders a (W = BM) and b (W = BN). Two shared-memory buffers: the global loads of tile k+1
// are in flight while tile k is multiplied, and one barrier per tile suffices (a buffer is
// refilled only after every thread has passed the barrier that ends its last use).
template <class T, class LoaderA, class LoaderB>
__device__ __forceinline__ void gemm_mainloop(LoaderA& a, LoaderB& b, int k_begin, int k_end,
                                              float (&acc)[T::TM][T::TN]) {
    __shared__ float As[2][T::BK][T::BM + T::PAD];
    __shared__ float Bs[2][T::BK][T::BN + T::PAD];
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
        for (int j = 0; j < T::TN; ++j) acc[i][j] = 0.0f;
    if (k_begin >= k_end) return;  // the same for the whole block
    a.fetch(k_begin, k_end);
    b.fetch(k_begin, k_end);
    a.store(As[0]);
    b.store(Bs[0]);
    __syncthreads();
    int buffer = 0;
    for (int k0 = k_begin; k0 < k_end; k0 += T::BK) {
        const bool more = k0 + T::BK < k_end;
        if (more) {
            a.fetch(k0 + T::BK, k_end);
            b.fetch(k0 + T::BK, k_end);
        }
#pragma unroll
        for (int k = 0; k < T::BK; ++k) {
            float av[T::TM], bv[T::TN];
#pragma unroll
            for (int i = 0; i < T::TM; ++i) av[i] = As[buffer][k][T::row(i)];
#pragma unroll
            for (int j = 0; j < T::TN; ++j) bv[j] = Bs[buffer][k][T::col(j)];
#pragma unroll
            for (int i = 0; i < T::TM; ++i)
#pragma unroll
                for (int j = 0; j < T::TN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        if (more) {
            a.store(As[buffer ^ 1]);
            b.store(Bs[buffer ^ 1]);
        }
        __syncthreads();
        buffer ^= 1;
    }
}

// The loader of a plain matrix whose element (w, k) lies at p[w * w_stride + k * k_stride],
// zeros outside w < w_size, k < k_end; K_FAST for k_stride 1, else w-fastest for w_stride 1,
// so that the global loads are coalesced either way.
template <class T, int W, bool K_FAST>
struct MatrixTile : Staged<T, W, K_FAST> {
    using Map = TileMap<T, W, K_FAST>;
    const float* p;
    int w0, w_size, w_stride, k_stride;

    __device__ MatrixTile(const float* p_, int w0_, int w_size_, int w_stride_, int k_stride_)
        : p(p_), w0(w0_), w_size(w_size_), w_stride(w_stride_), k_stride(k_stride_) {}

    __device__ void fetch(int k0, int k_end) {
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int k = k0 + Map::k(i), w = w0 + Map::w(i);
            this->staged[i] = (k < k_end && w < w_size) ? p[w * w_stride + k * k_stride] : 0.0f;
        }
    }
};
