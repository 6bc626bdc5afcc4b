// conv.cu: 2-D convolution (cross-correlation, as in PyTorch) on NCHW float32 arrays, as
// implicit GEMMs: the im2col matrix is never built; the tile loaders gather its elements
// from the image straight into shared memory. Launched by kernels/cuda/conv.py; checked by
// tests/test_kernels_cuda.py against tests/reference.py (float64) and kernels/cpu/conv.py,
// on the CPU emulator in CI and on a GPU under `pytest -m gpu`.
//
//   conv2d_forward   y (O x N*OH*OW)   = w (O x C*KH*KW)  . im2col(x) (C*KH*KW x N*OH*OW) + b
//   conv2d_dgrad     dx (C x N*H*W)    = w^T gathered (C x O*KH*KW) . dy scattered to input
//                                        positions (O*KH*KW x N*H*W): every input cell gathers
//                                        from the outputs whose window covers it, so each dx
//                                        element is written once, by one thread
//   conv2d_wgrad     dw (O x C*KH*KW)  = dy (O x N*OH*OW) . im2col(x)^T, split over K = N*OH*OW
//                                        into per-split partials that sum_partials adds in order
//   bias_grad_partials  per-channel sums of dy, finished by sum_partials
//
// Each GEMM is templated on the tile (Tile64, Tile128 in common.cuh) and on the kernel size
// (KH, KW), 0 meaning "given at run time": the 3x3 and 1x1 instantiations divide by constants.
#include "common.cuh"

// Sizes of one convolution; the kernel size is a template constant when KH, KW are not 0.
template <int KH, int KW>
struct Geometry {
    int n, c, h, w, o, kh_run, kw_run, sh, sw, ph, pw, oh, ow;
    __device__ int kh() const { return KH ? KH : kh_run; }
    __device__ int kw() const { return KW ? KW : kw_run; }
    __device__ int taps() const { return kh() * kw(); }
    __device__ int out_plane() const { return oh * ow; }
};

// The kernels' size parameters, named apart from the Geometry fields they initialise.
#define CONV_PARAMS \
    int n_, int c_, int h_, int w_, int o_, int kh_, int kw_, int sh_, int sw_, int ph_, int pw_, int oh_, int ow_
#define CONV_GEOMETRY {n_, c_, h_, w_, o_, kh_, kw_, sh_, sw_, ph_, pw_, oh_, ow_}

// Forward B(k, n) = x[img, ci, p*sh - ph + r, q*sw - pw + s] for k = (ci, r, s), n = (img, p, q):
// each thread keeps one column n across the K loop, so its window origin is computed once.
template <class T, int KH, int KW>
struct ForwardColumns : Staged<T, T::BN, false> {
    using Map = TileMap<T, T::BN, false>;
    Geometry<KH, KW> g;
    const float* x_img;
    int h0, w0;
    bool valid;

    __device__ ForwardColumns(const Geometry<KH, KW>& geometry, const float* x, int n0) : g(geometry) {
        const int col = n0 + Map::w(0);
        valid = col < g.n * g.out_plane();
        const int img = valid ? col / g.out_plane() : 0;
        const int pq = col - img * g.out_plane(), p = pq / g.ow, q = pq - p * g.ow;
        x_img = x + img * g.c * g.h * g.w;
        h0 = p * g.sh - g.ph;
        w0 = q * g.sw - g.pw;
    }

    __device__ void fetch(int k0, int k_end) {
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int k = k0 + Map::k(i);
            float v = 0.0f;
            if (valid && k < k_end) {
                const int ci = k / g.taps(), rs = k - ci * g.taps(), r = rs / g.kw(), s = rs - r * g.kw();
                const int hh = h0 + r, ww = w0 + s;
                if (unsigned(hh) < unsigned(g.h) && unsigned(ww) < unsigned(g.w)) v = x_img[(ci * g.h + hh) * g.w + ww];
            }
            this->staged[i] = v;
        }
    }
};

// y = conv(x, w) + b (bias may be null): one block per Tile::BM output channels x Tile::BN output pixels
// (grid.x over N*OH*OW, grid.y over O), each thread TM x TN of them (common.cuh's GEMM).
template <class T, int KH, int KW>
__global__ void __launch_bounds__(T::THREADS)
conv2d_forward(const float* __restrict__ x, const float* __restrict__ weight, const float* __restrict__ bias,
               float* __restrict__ y, CONV_PARAMS) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN, depth = g.c * g.taps();
    MatrixTile<T, T::BM, true> a(weight, m0, g.o, depth, 1);
    ForwardColumns<T, KH, KW> b(g, x, n0);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a, b, 0, depth, acc);
    const int plane = g.out_plane();
#pragma unroll
    for (int j = 0; j < T::TN; ++j) {
        const int col = n0 + T::col(j);
        if (col >= g.n * plane) continue;
        const int img = col / plane, pq = col - img * plane;
#pragma unroll
        for (int i = 0; i < T::TM; ++i) {
            const int m = m0 + T::row(i);
            if (m < g.o) y[(img * g.o + m) * plane + pq] = bias ? acc[i][j] + bias[m] : acc[i][j];
        }
    }
}

// Backward-data A(m, k) = w[co, m, r, s] for input channel m and k = (co, r, s).
template <class T, int KH, int KW>
struct DataWeights : Staged<T, T::BM, true> {
    using Map = TileMap<T, T::BM, true>;
    Geometry<KH, KW> g;
    const float* w;
    int m0;

    __device__ DataWeights(const Geometry<KH, KW>& geometry, const float* weight, int m0_)
        : g(geometry), w(weight), m0(m0_) {}

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0);
        const int co = k / g.taps(), base = co * g.c * g.taps() + (k - co * g.taps());
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int m = m0 + Map::w(i);
            this->staged[i] = (k < k_end && m < g.c) ? w[base + m * g.taps()] : 0.0f;
        }
    }
};

// Backward-data B(k, n) = dy[img, co, p, q] for k = (co, r, s) and input cell n = (img, hh, ww)
// when hh + ph - r = p*sh and ww + pw - s = q*sw inside the output, else 0.
template <class T, int KH, int KW>
struct DataColumns : Staged<T, T::BN, false> {
    using Map = TileMap<T, T::BN, false>;
    Geometry<KH, KW> g;
    const float* dy_img;
    int hp, wp;
    bool valid;

    __device__ DataColumns(const Geometry<KH, KW>& geometry, const float* dy, int n0) : g(geometry) {
        const int col = n0 + Map::w(0), plane = g.h * g.w;
        valid = col < g.n * plane;
        const int img = valid ? col / plane : 0;
        const int hw = col - img * plane, hh = hw / g.w;
        dy_img = dy + img * g.o * g.out_plane();
        hp = hh + g.ph;
        wp = hw - hh * g.w + g.pw;
    }

    __device__ void fetch(int k0, int k_end) {
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int k = k0 + Map::k(i);
            float v = 0.0f;
            if (valid && k < k_end) {
                const int co = k / g.taps(), rs = k - co * g.taps(), r = rs / g.kw(), s = rs - r * g.kw();
                const int pn = hp - r, qn = wp - s;
                if (pn >= 0 && qn >= 0) {
                    const int p = pn / g.sh, q = qn / g.sw;
                    if (p * g.sh == pn && q * g.sw == qn && p < g.oh && q < g.ow)
                        v = dy_img[(co * g.oh + p) * g.ow + q];
                }
            }
            this->staged[i] = v;
        }
    }
};

// dx = the gradient of conv(x, w) with respect to x: one block per Tile::BM input channels x
// Tile::BN input cells (grid.x over N*H*W, grid.y over C), each thread TM x TN of them.
template <class T, int KH, int KW>
__global__ void __launch_bounds__(T::THREADS)
conv2d_dgrad(const float* __restrict__ dy, const float* __restrict__ weight, float* __restrict__ dx, CONV_PARAMS) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN, depth = g.o * g.taps();
    DataWeights<T, KH, KW> a(g, weight, m0);
    DataColumns<T, KH, KW> b(g, dy, n0);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a, b, 0, depth, acc);
    const int plane = g.h * g.w;
#pragma unroll
    for (int j = 0; j < T::TN; ++j) {
        const int col = n0 + T::col(j);
        if (col >= g.n * plane) continue;
        const int img = col / plane, hw = col - img * plane;
#pragma unroll
        for (int i = 0; i < T::TM; ++i) {
            const int m = m0 + T::row(i);
            if (m < g.c) dx[(img * g.c + m) * plane + hw] = acc[i][j];
        }
    }
}

// Backward-weight A(m, k) = dy[img, m, p, q] for output channel m and k = (img, p, q).
template <class T, int KH, int KW>
struct WeightGradRows : Staged<T, T::BM, true> {
    using Map = TileMap<T, T::BM, true>;
    Geometry<KH, KW> g;
    const float* dy;
    int m0;

    __device__ WeightGradRows(const Geometry<KH, KW>& geometry, const float* dy_, int m0_)
        : g(geometry), dy(dy_), m0(m0_) {}

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0), plane = g.out_plane();
        const int img = k / plane, base = img * g.o * plane + (k - img * plane);
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int m = m0 + Map::w(i);
            this->staged[i] = (k < k_end && m < g.o) ? dy[base + m * plane] : 0.0f;
        }
    }
};

// Backward-weight B(k, n) = x[img, ci, p*sh - ph + r, q*sw - pw + s] for k = (img, p, q) and
// n = (ci, r, s): im2col transposed, read k-fastest so that a warp's loads run along q.
template <class T, int KH, int KW>
struct WeightGradColumns : Staged<T, T::BN, true> {
    using Map = TileMap<T, T::BN, true>;
    Geometry<KH, KW> g;
    const float* x;
    int n0;

    __device__ WeightGradColumns(const Geometry<KH, KW>& geometry, const float* x_, int n0_)
        : g(geometry), x(x_), n0(n0_) {}

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0), plane = g.out_plane();
        const int img = k / plane, pq = k - img * plane, p = pq / g.ow, q = pq - p * g.ow;
        const int h0 = p * g.sh - g.ph, w0 = q * g.sw - g.pw, columns = g.c * g.taps();
        const float* x_img = x + (k < k_end ? img : 0) * g.c * g.h * g.w;
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int col = n0 + Map::w(i);
            float v = 0.0f;
            if (k < k_end && col < columns) {
                const int ci = col / g.taps(), rs = col - ci * g.taps(), r = rs / g.kw(), s = rs - r * g.kw();
                const int hh = h0 + r, ww = w0 + s;
                if (unsigned(hh) < unsigned(g.h) && unsigned(ww) < unsigned(g.w)) v = x_img[(ci * g.h + hh) * g.w + ww];
            }
            this->staged[i] = v;
        }
    }
};

// One split's share of dw = the gradient of conv(x, w) with respect to w: block (x, y, z) sums
// k = (img, p, q) in [z * k_chunk, (z + 1) * k_chunk) for Tile::BM output channels (grid.y) x
// Tile::BN columns (ci, r, s) (grid.x), into partial[z] (O x C*KH*KW), each thread TM x TN.
template <class T, int KH, int KW>
__global__ void __launch_bounds__(T::THREADS)
conv2d_wgrad(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ partial, CONV_PARAMS,
             int k_chunk) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN, columns = g.c * g.taps();
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    WeightGradRows<T, KH, KW> a(g, dy, m0);
    WeightGradColumns<T, KH, KW> b(g, x, n0);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a, b, k_begin, k_end, acc);
    float* out = partial + blockIdx.z * g.o * columns;
#pragma unroll
    for (int i = 0; i < T::TM; ++i) {
        const int m = m0 + T::row(i);
#pragma unroll
        for (int j = 0; j < T::TN; ++j) {
            const int col = n0 + T::col(j);
            if (m < g.o && col < columns) out[m * columns + col] = acc[i][j];
        }
    }
}

// Per-channel sums of dy (N, O, OH*OW) for the bias gradient: block (c, s) of a (O, splits)
// grid adds channel c's values e in [s * chunk, (s + 1) * chunk) of its N*OH*OW, each thread
// a strided subset in order, then block_sum; partial[s * O + c] holds the result.
extern "C" __global__ void __launch_bounds__(256)
bias_grad_partials(const float* __restrict__ dy, int n, int channels, int plane, int chunk,
                   float* __restrict__ partial) {
    __shared__ float scratch[32];
    const int c = blockIdx.x, begin = blockIdx.y * chunk, end = min(begin + chunk, n * plane);
    float total = 0.0f;
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) total += dy[channel_element(e, c, channels, plane)];
    total = block_sum(total, scratch);
    if (threadIdx.x == 0) partial[blockIdx.y * channels + c] = total;
}
