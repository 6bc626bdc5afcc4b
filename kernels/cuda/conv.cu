// conv.cu: 2-D convolution (cross-correlation, as in PyTorch) in FP32 as implicit GEMMs: the
// im2col matrix is never built; the tile loaders gather its elements from the image straight
// into shared memory. Every array but the bias is NCHW or channels-last (NHWC memory; for the
// weights and dw, (O, KH, KW, C) memory), each told at run time (Layout): the fp32 precision runs
// every convolution here on NCHW activations, the tf32 precision those its tensor cores do not
// take (channel counts not multiples of 4, as the stem's one input channel) on its channels-last
// activations and weights as they are (no copies: a step of kernels only replays as a graph).
// Launched by kernels/cuda/conv.py; checked by tests/test_kernels_cuda.py (NCHW) and
// tests/test_conv_layouts.py (channels-last) against tests/reference.py (float64) and
// kernels/cpu/conv.py, on the CPU emulator in CI and on a GPU under `pytest -m gpu`.
//
//   conv2d_forward   y (O x N*OH*OW)   = w (O x C*KH*KW)  . im2col(x) (C*KH*KW x N*OH*OW) + b, and
//                                        the statistics of a batch norm after it (bn_stats.cuh)
//   conv2d_dgrad     dx (C x N*H*W)    = w^T gathered (C x O*KH*KW) . dy gathered at the outputs
//                                        whose window covers each input cell (O*KH*KW x N*H*W),
//                                        so each dx element is written once, by one thread; at
//                                        stride > 1 (conv2d_dgrad_strided) one GEMM per stride
//                                        phase of the input cells, over the taps that reach it
//   conv2d_wgrad     dw (O x C*KH*KW)  = dy (O x N*OH*OW) . im2col(x)^T, split over K = N*OH*OW
//                                        into per-split partials that the last block of each tile
//                                        to finish adds in split order (last_block), in the launch,
//                    and the bias gradient db (O), the per-channel sums of dy, from the dy that the
//                    blocks of the first column tile load for the product
//   conv2d_wgrad_one_channel  the same for one input channel (ResNet-18's stem) and channels-last dy, as a
//                    reduction over the pixels rather than a GEMM of KH*KW columns: a thread an output channel
//                    and a group of a block's pixels, every partial added in order by sum_partials
//
// Each GEMM is templated on the tile (Tile64, Tile128 in common.cuh), on the kernel size (KH, KW),
// but for the strided backward-data, 0 meaning "given at run time": the 3x3 and 1x1 instantiations
// divide by constants; and on the storage S of the activations, the weights and their gradients:
// float, or bf16 under the bf16 precision (its convolutions whose channel counts the BF16 tensor
// cores do not take: the stem), read widened and stored rounded once, the weight and bias
// gradients float32 either way. The layouts are run-time arguments, not template ones, so one
// instantiation serves both.
//
// The loads and stores run along pixels or filter taps (consecutive threads, consecutive pixels
// or taps): coalesced on NCHW. On NHWC memory those lie C (or O) floats apart, so a warp's access
// touches up to 32 sectors for 4 to 16 useful bytes of each, instead of 4 whole sectors; the
// block's other warps and later k steps use the rest of those sectors through L1 and L2. A
// coalesced NHWC path would need the GEMMs transposed (threads along channels), a second set of
// instantiations. In ResNet-18 only the stem comes here under tf32: its x and weights have one
// channel (both layouts are the same memory); its y (the forward's stores, 16 sectors per warp
// store) and dy are channels-last. At its shape (64 channels of 28x28) emu.traffic() counts 3.9
// bytes read from L2 per byte used by backward-weight's loads of dy (1.6 on NCHW) and 8.0 by
// the bias gradient's former kernel of its own, a channel per block (1.3 on NCHW): it is now
// summed from backward-weight's loads. The time that costs is unmeasured.
#include "bn_stats.cuh"
#include "conv_geometry.cuh"

// Where value (channel c, pixel hw = h * W + w) of one image of an activation, or of one output
// channel's filter (plane = KH * KW taps), lies from its first value: c * plane + hw in NCHW,
// hw * channels + c in NHWC.
struct Layout {
    int channel_stride, pixel_stride;

    __device__ Layout(int channels, int plane, int channels_last)
        : channel_stride(channels_last ? 1 : plane), pixel_stride(channels_last ? channels : 1) {}
    __device__ int at(int c, int hw) const { return c * channel_stride + hw * pixel_stride; }
};

// im2col(x)[(ci, r, s), (img, p, q)] for the window at (h0, w0) = (p*sh - ph, q*sw - pw) of the
// image x_img (laid out as xl): zero in the padding.
template <int KH, int KW, class S>
__device__ __forceinline__ float im2col(const Geometry<KH, KW>& g, const Layout& xl, const S* x_img, int crs, int h0,
                                        int w0) {
    const int ci = crs / g.taps(), rs = crs - ci * g.taps(), r = rs / g.kw(), s = rs - r * g.kw();
    const int hh = h0 + r, ww = w0 + s;
    return unsigned(hh) < unsigned(g.h) && unsigned(ww) < unsigned(g.w) ? to_float(x_img[xl.at(ci, hh * g.w + ww)])
                                                                        : 0.0f;
}

// Forward A(m, k) = w[m, ci, r, s] for output channel m and k = (ci, r, s).
template <class T, int KH, int KW, class S>
struct ForwardWeights : Staged<T, T::BM, true> {
    using Map = TileMap<T, T::BM, true>;
    Geometry<KH, KW> g;
    Layout wl;
    const S* w;
    int m0;

    __device__ ForwardWeights(const Geometry<KH, KW>& geometry, const S* weight, int w_channels_last, int m0_)
        : g(geometry), wl(g.c, g.taps(), w_channels_last), w(weight), m0(m0_) {}

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0), ci = k / g.taps(), at = wl.at(ci, k - ci * g.taps());
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int m = m0 + Map::w(i);
            this->staged[i] = (k < k_end && m < g.o) ? to_float(w[m * g.c * g.taps() + at]) : 0.0f;
        }
    }
};

// Forward B(k, n) = x[img, ci, p*sh - ph + r, q*sw - pw + s] for k = (ci, r, s), n = (img, p, q):
// each thread keeps one column n across the K loop, so its window origin is computed once.
template <class T, int KH, int KW, class S>
struct ForwardColumns : Staged<T, T::BN, false> {
    using Map = TileMap<T, T::BN, false>;
    Geometry<KH, KW> g;
    Layout xl;
    const S* x_img;
    int h0, w0;
    bool valid;

    __device__ ForwardColumns(const Geometry<KH, KW>& geometry, const S* x, int x_channels_last, int n0)
        : g(geometry), xl(g.c, g.h * g.w, x_channels_last) {
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
            this->staged[i] = valid && k < k_end ? im2col(g, xl, x_img, k, h0, w0) : 0.0f;
        }
    }
};

// The statistics of the batch norm that follows (bn_stats.cuh) from the tile's values as stored: per
// output channel (a row), each thread's TN pixels, then the THREADS_N consecutive threads that share
// the row (shuffles), then the blocks along the pixels (bn_tile_statistics). Every thread calls it.
template <class T, int KH, int KW, class S>
__device__ __forceinline__ void batch_stats(const BnStats& s, const Geometry<KH, KW>& g, int m0, int n0,
                                            const float* bias, const float (&acc)[T::TM][T::TN]) {
    static_assert(32 % T::THREADS_N == 0 && T::THREADS >= T::BM, "a row's threads in one warp; a thread a row");
    __shared__ Moments rows[T::BM];
    const int pixels = g.n * g.out_plane();
#pragma unroll
    for (int i = 0; i < T::TM; ++i) {
        const int m = m0 + T::row(i);
        ShiftedSums sums;
#pragma unroll
        for (int j = 0; j < T::TN; ++j)
            if (n0 + T::col(j) < pixels)
                sums.add(to_float(stored<S>(bias && m < g.o ? acc[i][j] + bias[m] : acc[i][j])));
        Moments part = sums.moments();
#pragma unroll
        for (int x = 1; x < T::THREADS_N; x <<= 1)
            part = merged(part, shuffled_xor(part, x));
        if (int(threadIdx.x) % T::THREADS_N == 0) rows[T::row(i)] = part;
    }
    __syncthreads();
    const int c = m0 + int(threadIdx.x);
    const bool mine = int(threadIdx.x) < T::BM && c < g.o;
    bn_tile_statistics(s, mine ? rows[threadIdx.x] : Moments{0.0f, 0.0f, 0.0f}, mine, c, g.o, int(blockIdx.x),
                       int(gridDim.x), TileRuns{T::BN, pixels}, int(blockIdx.y));
}

// y = conv(x, w) + b (bias may be null): one block per Tile::BM output channels x Tile::BN output pixels
// (grid.x over N*OH*OW, grid.y over O), each thread TM x TN of them (common.cuh's GEMM); x, w and
// y each NCHW or channels-last (the flags), stored as S (float, or bf16 under the bf16 precision:
// read widened, y rounded once); and, unless stats_partial is null, the statistics of y's channels for
// the batch norm that follows (batch_stats).
template <class T, int KH, int KW, class S = float>
__global__ void __launch_bounds__(T::THREADS)
conv2d_forward(const S* __restrict__ x, const S* __restrict__ weight, const float* __restrict__ bias,
               S* __restrict__ y, CONV_PARAMS, int x_channels_last, int w_channels_last, int y_channels_last,
               BN_STATS_PARAMS) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN;
    ForwardWeights<T, KH, KW, S> a(g, weight, w_channels_last, m0);
    ForwardColumns<T, KH, KW, S> b(g, x, x_channels_last, n0);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a, b, 0, g.c * g.taps(), acc);
    const int plane = g.out_plane();
    const Layout yl(g.o, plane, y_channels_last);
#pragma unroll
    for (int j = 0; j < T::TN; ++j) {
        const int col = n0 + T::col(j);
        if (col >= g.n * plane) continue;
        const int img = col / plane, pq = col - img * plane;
#pragma unroll
        for (int i = 0; i < T::TM; ++i) {
            const int m = m0 + T::row(i);
            if (m < g.o) y[img * g.o * plane + yl.at(m, pq)] = stored<S>(bias ? acc[i][j] + bias[m] : acc[i][j]);
        }
    }
    if (stats_partial) batch_stats<T, KH, KW, S>(BnStats BN_STATS, g, m0, n0, bias, acc);
}

// Backward-data A(m, k) = w[co, m, a + sh*i, b + sw*j] for input channel m, k = (co, i, j).
template <class T, int KH, int KW, class S>
struct DataWeights : Staged<T, T::BM, true> {
    using Map = TileMap<T, T::BM, true>;
    Geometry<KH, KW> g;
    Phase f;
    Layout wl;
    const S* w;
    int m0;

    __device__ DataWeights(const Geometry<KH, KW>& geometry, const Phase& phase, const S* weight,
                           int w_channels_last, int m0_)
        : g(geometry), f(phase), wl(g.c, g.taps(), w_channels_last), w(weight), m0(m0_) {}

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0);
        const int co = k / f.taps(), t = k - co * f.taps(), i = t / f.taps_w, j = t - i * f.taps_w;
        const int base = co * g.c * g.taps() + wl.at(0, (f.a + g.sh * i) * g.kw() + f.b + g.sw * j);
#pragma unroll
        for (int n = 0; n < Map::COUNT; ++n) {
            const int m = m0 + Map::w(n);
            this->staged[n] = (k < k_end && m < g.c) ? to_float(w[base + wl.at(m, 0)]) : 0.0f;
        }
    }
};

// Backward-data B(k, n) = dy[img, co, t_h + u - i, t_w + v - j] for k = (co, i, j) and the
// phase's cell n = (img, u, v), 0 where that falls outside the output.
template <class T, int KH, int KW, class S>
struct DataColumns : Staged<T, T::BN, false> {
    using Map = TileMap<T, T::BN, false>;
    Geometry<KH, KW> g;
    Phase f;
    Layout dyl;
    const S* dy_img;
    int p0, q0;  // t_h + u, t_w + v
    bool valid;

    __device__ DataColumns(const Geometry<KH, KW>& geometry, const Phase& phase, const S* dy,
                           int dy_channels_last, int n0)
        : g(geometry), f(phase), dyl(g.o, g.out_plane(), dy_channels_last) {
        const int col = n0 + Map::w(0);
        valid = col < g.n * f.cells();
        const int img = valid ? col / f.cells() : 0;
        const int uv = col - img * f.cells(), u = uv / f.cols;
        dy_img = dy + img * g.o * g.out_plane();
        p0 = f.t_h + u;
        q0 = f.t_w + uv - u * f.cols;
    }

    __device__ void fetch(int k0, int k_end) {
#pragma unroll
        for (int n = 0; n < Map::COUNT; ++n) {
            const int k = k0 + Map::k(n);
            float v = 0.0f;
            if (valid && k < k_end) {
                const int co = k / f.taps(), t = k - co * f.taps(), i = t / f.taps_w;
                const int p = p0 - i, q = q0 - (t - i * f.taps_w);
                if (unsigned(p) < unsigned(g.oh) && unsigned(q) < unsigned(g.ow)) v = to_float(dy_img[dyl.at(co, p * g.ow + q)]);
            }
            this->staged[n] = v;
        }
    }
};

// dx of one phase: Tile::BM input channels x Tile::BN of the phase's cells per block (grid.x
// over N * cells, grid.y over C), each thread TM x TN of them; blocks past the phase's cells
// (the phases differ in size by a row or column) leave at once. dy, w and dx each NCHW or
// channels-last (the flags).
template <class T, int KH, int KW, class S>
__device__ __forceinline__ void data_gradient(const Geometry<KH, KW>& g, const Phase& f, const S* dy, const S* weight,
                                              S* dx, int dy_channels_last, int w_channels_last,
                                              int dx_channels_last) {
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN;
    if (n0 >= g.n * f.cells()) return;  // the same for the whole block
    DataWeights<T, KH, KW, S> a(g, f, weight, w_channels_last, m0);
    DataColumns<T, KH, KW, S> b(g, f, dy, dy_channels_last, n0);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a, b, 0, g.o * f.taps(), acc);
    const Layout dxl(g.c, g.h * g.w, dx_channels_last);
#pragma unroll
    for (int j = 0; j < T::TN; ++j) {
        const int col = n0 + T::col(j);
        if (col >= g.n * f.cells()) continue;
        const int img = col / f.cells(), uv = col - img * f.cells(), u = uv / f.cols, v = uv - u * f.cols;
        const int hw = (f.h_first + g.sh * u) * g.w + f.w_first + g.sw * v;
#pragma unroll
        for (int i = 0; i < T::TM; ++i) {
            const int m = m0 + T::row(i);
            if (m < g.c) dx[img * g.c * g.h * g.w + dxl.at(m, hw)] = stored<S>(acc[i][j]);
        }
    }
}

// dx = the gradient of conv(x, w) with respect to x at stride 1: one phase, all taps, the
// kernel size a template constant for 3x3 and 1x1 (see data_gradient for the split of work).
template <class T, int KH, int KW, class S = float>
__global__ void __launch_bounds__(T::THREADS)
conv2d_dgrad(const S* __restrict__ dy, const S* __restrict__ weight, S* __restrict__ dx, CONV_PARAMS,
             int dy_channels_last, int w_channels_last, int dx_channels_last) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    data_gradient<T>(g, unit_stride_phase(g), dy, weight, dx, dy_channels_last, w_channels_last, dx_channels_last);
}

// dx = the gradient of conv(x, w) with respect to x at any stride: grid.z over the sh*sw
// stride phases, each a dense GEMM (see data_gradient for the split of work).
template <class T, class S = float>
__global__ void __launch_bounds__(T::THREADS)
conv2d_dgrad_strided(const S* __restrict__ dy, const S* __restrict__ weight, S* __restrict__ dx, CONV_PARAMS,
                     int dy_channels_last, int w_channels_last, int dx_channels_last) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    data_gradient<T>(g, stride_phase(g, blockIdx.z), dy, weight, dx, dy_channels_last, w_channels_last,
                     dx_channels_last);
}

// Backward-weight A(m, k) = dy[img, m, p, q] for output channel m and k = (img, p, q).
template <class T, int KH, int KW, class S>
struct WeightGradRows : Staged<T, T::BM, true> {
    using Map = TileMap<T, T::BM, true>;
    Geometry<KH, KW> g;
    Layout dyl;
    const S* dy;
    int m0;

    // with `sums`, bias[i] adds up, in k order, the values staged[i] takes: row m0 + Map::w(i) of
    // dy over this thread's k (bias_total adds the threads that share the row)
    bool sums;
    float bias[Map::COUNT];

    __device__ WeightGradRows(const Geometry<KH, KW>& geometry, const S* dy_, int dy_channels_last, int m0_,
                              bool sums_)
        : g(geometry), dyl(g.o, g.out_plane(), dy_channels_last), dy(dy_), m0(m0_), sums(sums_) {
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) bias[i] = 0.0f;
    }

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0), plane = g.out_plane();
        const int img = k / plane, pq = k - img * plane;
        const S* dy_img = dy + img * g.o * plane;
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int m = m0 + Map::w(i);
            this->staged[i] = (k < k_end && m < g.o) ? to_float(dy_img[dyl.at(m, pq)]) : 0.0f;
            if (sums) bias[i] += this->staged[i];
        }
    }

    // The sum of row m0 + Map::w(i) over the block's k: the T::BK neighbouring lanes that load the
    // row's k (Map::k) add their sums in a fixed butterfly, every one of them getting the total.
    __device__ float bias_total(int i) const { return warp_sum<T::BK>(bias[i]); }
};

// Backward-weight B(k, n) = x[img, ci, p*sh - ph + r, q*sw - pw + s] for k = (img, p, q) and
// n = (ci, r, s): im2col transposed, read k-fastest so that a warp's loads run along q.
template <class T, int KH, int KW, class S>
struct WeightGradColumns : Staged<T, T::BN, true> {
    using Map = TileMap<T, T::BN, true>;
    Geometry<KH, KW> g;
    Layout xl;
    const S* x;
    int n0;

    __device__ WeightGradColumns(const Geometry<KH, KW>& geometry, const S* x_, int x_channels_last, int n0_)
        : g(geometry), xl(g.c, g.h * g.w, x_channels_last), x(x_), n0(n0_) {}

    __device__ void fetch(int k0, int k_end) {
        const int k = k0 + Map::k(0), plane = g.out_plane();
        const int img = k / plane, pq = k - img * plane, p = pq / g.ow, q = pq - p * g.ow;
        const int h0 = p * g.sh - g.ph, w0 = q * g.sw - g.pw, columns = g.c * g.taps();
        const S* x_img = x + (k < k_end ? img : 0) * g.c * g.h * g.w;
#pragma unroll
        for (int i = 0; i < Map::COUNT; ++i) {
            const int col = n0 + Map::w(i);
            this->staged[i] = k < k_end && col < columns ? im2col(g, xl, x_img, col, h0, w0) : 0.0f;
        }
    }
};

// dw = the gradient of conv(x, w) with respect to w: block (x, y, z) sums k = (img, p, q) in
// [z * k_chunk, (z + 1) * k_chunk) for Tile::BM output channels (grid.y) x Tile::BN columns
// (ci, r, s) (grid.x), each thread TM x TN; dy, x and dw each NCHW or channels-last (the flags).
// With one split (grid.z = 1) it writes dw; else partial[z] (O x C*KH*KW, in dw's layout), and the
// last of the tile's blocks to finish (last_block on counters[tile]) adds the splits in order into
// dw, each thread the elements it wrote. The blocks of column tile 0 also sum their rows of dy
// (WeightGradRows::bias_total) into db, or into db_partial[z] (O) when split, which the last block
// of each such tile adds in split order into db.
template <class T, int KH, int KW, class S = float>
__global__ void __launch_bounds__(T::THREADS)
conv2d_wgrad(const S* __restrict__ dy, const S* __restrict__ x, float* partial, float* db_partial,
             unsigned* counters, float* __restrict__ dw, float* __restrict__ db, CONV_PARAMS, int k_chunk,
             int dy_channels_last, int x_channels_last, int dw_channels_last) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    const int m0 = blockIdx.y * T::BM, n0 = blockIdx.x * T::BN, columns = g.c * g.taps(), size = g.o * columns;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    const bool bias_block = blockIdx.x == 0;
    WeightGradRows<T, KH, KW, S> a(g, dy, dy_channels_last, m0, bias_block);
    WeightGradColumns<T, KH, KW, S> b(g, x, x_channels_last, n0);
    float acc[T::TM][T::TN];
    gemm_mainloop<T>(a, b, k_begin, k_end, acc);
    using RowMap = typename WeightGradRows<T, KH, KW, S>::Map;
    if (bias_block) {   // the whole block: every lane takes part in the shuffles
        float* bias_out = gridDim.z == 1 ? db : db_partial + blockIdx.z * g.o;
#pragma unroll
        for (int i = 0; i < RowMap::COUNT; ++i) {
            const float total = a.bias_total(i);
            const int m = m0 + RowMap::w(i);
            if (RowMap::k(i) == 0 && m < g.o) bias_out[m] = total;
        }
    }
    const Layout dwl(g.c, g.taps(), dw_channels_last);
    // where this thread's element (i, j) lies in dw (and in each split's partial), -1 outside
    const auto at = [&](int i, int j) {
        const int m = m0 + T::row(i), col = n0 + T::col(j), ci = col / g.taps();
        return m < g.o && col < columns ? m * columns + dwl.at(ci, col - ci * g.taps()) : -1;
    };
    float* out = gridDim.z == 1 ? dw : partial + blockIdx.z * size;
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
        for (int j = 0; j < T::TN; ++j)
            if (at(i, j) >= 0) out[at(i, j)] = acc[i][j];
    if (gridDim.z == 1 || !last_block(counters + blockIdx.y * gridDim.x + blockIdx.x, gridDim.z)) return;
#pragma unroll
    for (int i = 0; i < T::TM; ++i)
#pragma unroll
        for (int j = 0; j < T::TN; ++j)
            if (at(i, j) >= 0) dw[at(i, j)] = added_partials(partial + at(i, j), gridDim.z, size);
    const int m = m0 + int(threadIdx.x);
    if (bias_block && int(threadIdx.x) < T::BM && m < g.o) db[m] = added_partials(db_partial + m, gridDim.z, g.o);
}


// Backward-weight of a convolution of one input channel (C = 1: dw (O x KH*KW), both weight layouts the same
// memory) whose dy is channels-last, and its bias gradient: a reduction over the N*OH*OW pixels of each output
// channel's KH*KW products and of dy itself, bandwidth-bound on dy (the GEMM of conv2d_wgrad would run KH*KW
// columns of a 64-wide tile in a grid of few blocks). Block b takes pixels [b * pixels, (b + 1) * pixels); its
// thread t the output channel t % O and every (256 / O)-th of them from the group t / O (O divides 256): dy read a
// pixel's O channels at a time (contiguous), x's taps from the image, zero in the padding. The groups' sums are
// added in order in shared memory, and the block's go to slot b of partial_w ((blocks, O, KH*KW)) and of
// partial_b ((blocks, O)), which sum_partials adds in block order.
template <int KH, int KW, class S = float>
__global__ void __launch_bounds__(256)
conv2d_wgrad_one_channel(const S* __restrict__ dy, const S* __restrict__ x, float* __restrict__ partial_w,
                         float* __restrict__ partial_b, CONV_PARAMS, int pixels) {
    const Geometry<KH, KW> g CONV_GEOMETRY;
    constexpr int SUMS = KH * KW + 1;
    __shared__ float block_sums[256 * SUMS];
    const int t = threadIdx.x, channel = t % g.o, group = t / g.o, groups = 256 / g.o;
    const int first = blockIdx.x * pixels, end = min(first + pixels, g.n * g.out_plane());
    float sums[SUMS];
#pragma unroll
    for (int i = 0; i < SUMS; ++i) sums[i] = 0.f;
    for (int p = first + group; p < end; p += groups) {
        const int img = p / g.out_plane(), hw = p - img * g.out_plane(), q = hw % g.ow;
        const int h0 = hw / g.ow * g.sh - g.ph, w0 = q * g.sw - g.pw;
        const float d = to_float(dy[size_t(p) * g.o + channel]);
        const S* image = x + size_t(img) * g.h * g.w;
#pragma unroll
        for (int r = 0; r < KH; ++r)
#pragma unroll
            for (int s = 0; s < KW; ++s) {
                const int y = h0 + r, xq = w0 + s;
                if (y >= 0 && y < g.h && xq >= 0 && xq < g.w) sums[r * KW + s] += d * to_float(image[y * g.w + xq]);
            }
        sums[KH * KW] += d;
    }
#pragma unroll
    for (int i = 0; i < SUMS; ++i) block_sums[t * SUMS + i] = sums[i];
    __syncthreads();
    if (group != 0) return;
    for (int i = 0; i < SUMS; ++i) {
        float total = 0.f;
        for (int k = 0; k < groups; ++k) total += block_sums[(k * g.o + channel) * SUMS + i];
        if (i < KH * KW) partial_w[(size_t(blockIdx.x) * g.o + channel) * (KH * KW) + i] = total;
        else partial_b[size_t(blockIdx.x) * g.o + channel] = total;
    }
}
