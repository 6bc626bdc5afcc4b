// conv_tc.cu: 2-D convolution on TF32 tensor cores, as implicit GEMMs on channels-last (NHWC)
// float32 activations. Launched by kernels/cuda/conv_tc.py (the convolutions and the linear
// layer under the tf32 precision); checked by tests/test_conv_tc.py against the float64
// reference of TF32-rounded and of raw inputs, on the CPU emulator in CI and on a GPU under
// `pytest -m gpu`.
//
//   conv_tc_forward  y (N*OH*OW x O)  = im2col(x) (N*OH*OW x KH*KW*C) . w_krsc^T (KH*KW*C x O) + b
//   conv_tc_dgrad    dx (cells x C)   = dy gathered (cells x taps*O) . w (taps*O x C), one GEMM per
//                                       stride phase of the input cells (conv_geometry.cuh)
//   conv_tc_wgrad    dw (O x KH*KW*C)  = dy^T (O x N*OH*OW) . im2col(x) (N*OH*OW x KH*KW*C),
//                                       written in (O, KH, KW, C) or (O, C, KH, KW) order
//                    and the bias gradient, the per-channel sums of dy, in the same pass
//
// Each GEMM may split its K over grid.z into parts (split-K: a small grid's blocks then fill the
// GPU): each part writes its partial tile, and the last part of each tile to finish adds the
// tile's parts in order (last_block), in the same launch. Backward-data's grid.z also runs over
// the phases.
//
// The weights come as w_krsc (O, KH, KW, C), the memory of channels-last weights (a flat buffer's
// parameters are; the launcher copies others): the forward reads them along k, backward-data along
// its n (the input channels).
//
// A block of 4 warps (2 x 2) computes a BM x BN tile of the output, each warp (BM/2) x (BN/2) as
// m16n8k8 mma.sync tiles (tensor_core.cuh). K advances BK = 16 at a time through a STAGES-deep
// ring of shared-memory tiles filled by cp.async: while stage s is multiplied, the copies of the
// next STAGES - 1 stages are in flight. An operand whose global rows run along k (K_MAJOR: the
// forward's two and backward-data's dy) sits in shared memory as [row][BK + 4], read by
// ldmatrix.x4 as 8x4 TF32 matrices, without bank conflicts (a row is 20 words); one whose rows run
// along m or n (backward-weight's, whose k is the pixel, and backward-data's weights) sits as
// [k][W + 8] and is read a word per lane, the
// 32 lanes (t, g) at t * (W + 8) + g, in 32 banks. Fragments are rounded to TF32 (cvt.rna) before
// the mma, so that the product is that of the TF32-rounded inputs, summed in float32.
//
// VEC = 4 copies 16-byte chunks (4 channels), for channel counts that are multiples of 4;
// VEC = 1 copies single elements (the first convolution, C = 1). Results are deterministic:
// every output element is one thread's sum in a fixed order, and split-K partials are added in
// split order.
#include "common.cuh"
#include "conv_geometry.cuh"
#include "tensor_core.cuh"

constexpr int TC_BK = 16, TC_STAGES = 3, TC_THREADS = 128;

// The tile of a block: BM x BN outputs, 2 x 2 warps, each MI x NI mma tiles of 16 x 8.
template <int BM_, int BN_>
struct TcTile {
    static constexpr int BM = BM_, BN = BN_, WARP_M = BM / 2, WARP_N = BN / 2;
    static constexpr int MI = WARP_M / 16, NI = WARP_N / 8;
    static_assert(WARP_M % 16 == 0 && NI % 2 == 0, "warp tiles of whole m16 x n16 pieces");
};
struct Tc128x64 : TcTile<128, 64> {};
struct Tc64x64 : TcTile<64, 64> {};

// One stage of one operand in shared memory, W rows (m or n) by TC_BK k; K_MAJOR: [W][BK + 4],
// else [BK][W + 8] (see the header).
template <int W, bool K_MAJOR>
struct TcStage {
    static constexpr int PITCH = K_MAJOR ? TC_BK + 4 : W + 8;
    static constexpr int SIZE = (K_MAJOR ? W : TC_BK) * PITCH;
    __device__ static int offset(int row, int k) { return K_MAJOR ? row * PITCH + k : k * PITCH + row; }
};

// Copies one stage of an operand: W x BK elements (row, k0 + k) of `source` into `tile`, VEC at a
// time, the chunks running along k (K_MAJOR) or along the rows. source.at(row, k) is the address
// of the VEC elements (row, k..k+VEC-1), or null where they are zero (padding, past the edge);
// rows past the matrix and k >= k_end are zero too. A zero chunk copies nothing from `base`, a
// valid address that keeps the instruction well formed.
template <int W, bool K_MAJOR, int VEC, class Source>
__device__ __forceinline__ void tc_load_stage(float* tile, const Source& source, int row0, int k0, int k_end,
                                              const float* base) {
    constexpr int LINE = (K_MAJOR ? TC_BK : W) / VEC;  // chunks per shared-memory line
    constexpr int CHUNKS = W * TC_BK / VEC;
    static_assert(CHUNKS % TC_THREADS == 0, "whole chunks per thread");
#pragma unroll
    for (int i = 0; i < CHUNKS / TC_THREADS; ++i) {
        const int idx = i * TC_THREADS + int(threadIdx.x);
        const int line = idx / LINE, along = (idx % LINE) * VEC;
        const int row = K_MAJOR ? line : along, k = K_MAJOR ? along : line;
        const float* src = k0 + k < k_end ? source.at(row0 + row, k0 + k) : nullptr;
        float* dst = tile + TcStage<W, K_MAJOR>::offset(row, k);
        if (VEC == 4)
            cp_async_cg(dst, src ? src : base, src ? 16 : 0);
        else
            cp_async_ca<4>(dst, src ? src : base, src ? 4 : 0);
    }
}

// The A fragment of mma tile (row0.., k..k+7) for this lane (tensor_core.cuh's layout).
template <int W, bool K_MAJOR>
__device__ __forceinline__ void tc_fragment_a(unsigned (&a)[4], const float* tile, int row0, int k) {
    const int lane = int(threadIdx.x) % 32;
    if (K_MAJOR) {
        // matrices: rows 0-7 and 8-15 at k..k+3, then at k+4..k+7
        ldmatrix_x4(a, tile + TcStage<W, true>::offset(row0 + lane % 8 + (lane / 8 % 2) * 8, k + lane / 16 * 4));
    } else {
        const int g = lane / 4, t = lane % 4;
        const auto at = [&](int r, int c) { return __float_as_uint(tile[TcStage<W, false>::offset(row0 + r, k + c)]); };
        a[0] = at(g, t);
        a[1] = at(g + 8, t);
        a[2] = at(g, t + 4);
        a[3] = at(g + 8, t + 4);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = tf32_round(__uint_as_float(a[i]));
}

// The B fragments of two mma tiles side by side, columns col0..col0+7 and col0+8..col0+15.
template <int W, bool K_MAJOR>
__device__ __forceinline__ void tc_fragments_b(unsigned (&b)[2][2], const float* tile, int col0, int k) {
    const int lane = int(threadIdx.x) % 32;
    if (K_MAJOR) {
        // matrices: columns 0-7 at k..k+3 and k+4..k+7, then columns 8-15
        unsigned r[4];
        ldmatrix_x4(r, tile + TcStage<W, true>::offset(col0 + lane % 8 + lane / 16 * 8, k + (lane / 8 % 2) * 4));
        b[0][0] = r[0];
        b[0][1] = r[1];
        b[1][0] = r[2];
        b[1][1] = r[3];
    } else {
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            b[j][0] = __float_as_uint(tile[TcStage<W, false>::offset(col0 + 8 * j + g, k + t)]);
            b[j][1] = __float_as_uint(tile[TcStage<W, false>::offset(col0 + 8 * j + g, k + t + 4)]);
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) b[j][i] = tf32_round(__uint_as_float(b[j][i]));
}

struct NoTileWork {
    __device__ void operator()(const float*) const {}
};

// acc += A (m0.., k) . B (k, n0..) over k in [k_begin, k_end) for this warp's part of the block's
// tile: acc[i][j] is mma tile (i, j) of the warp, in the C layout of tensor_core.cuh. Every
// thread of the block must call it (it synchronises the block). on_tile(as) sees each stage of A
// in shared memory (raw float32 values, zero past the matrix) once it has landed.
template <class T, int VEC, bool A_K_MAJOR, bool B_K_MAJOR, class SourceA, class SourceB, class OnTile = NoTileWork>
__device__ __forceinline__ void tc_gemm(const SourceA& a, const SourceB& b, const float* a_base, const float* b_base,
                                        int m0, int n0, int k_begin, int k_end, float (&acc)[T::MI][T::NI][4],
                                        OnTile on_tile = OnTile()) {
    using StageA = TcStage<T::BM, A_K_MAJOR>;
    using StageB = TcStage<T::BN, B_K_MAJOR>;
    __shared__ __align__(16) float As[TC_STAGES][StageA::SIZE];
    __shared__ __align__(16) float Bs[TC_STAGES][StageB::SIZE];
    const int warp = int(threadIdx.x) / 32, wm = (warp / 2) * T::WARP_M, wn = (warp % 2) * T::WARP_N;
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int j = 0; j < T::NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;   // none for an empty part
    const auto load = [&](int tile) {
        if (tile < tiles) {
            const int k0 = k_begin + tile * TC_BK, stage = tile % TC_STAGES;
            tc_load_stage<T::BM, A_K_MAJOR, VEC>(As[stage], a, m0, k0, k_end, a_base);
            tc_load_stage<T::BN, B_K_MAJOR, VEC>(Bs[stage], b, n0, k0, k_end, b_base);
        }
        cp_async_commit();  // one group per tile, empty past the end, so that the waits count tiles
    };
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) load(s);
    for (int tile = 0; tile < tiles; ++tile) {
        cp_async_wait<TC_STAGES - 2>();  // this thread's copies of `tile` have landed
        __syncthreads();                 // everyone's have, and everyone is done with tile - 1
        load(tile + TC_STAGES - 1);      // into the stage of tile - 1
        const float* as = As[tile % TC_STAGES];
        const float* bs = Bs[tile % TC_STAGES];
        on_tile(as);
#pragma unroll
        for (int k = 0; k < TC_BK; k += 8) {
            unsigned fa[T::MI][4], fb[T::NI / 2][2][2];
#pragma unroll
            for (int i = 0; i < T::MI; ++i) tc_fragment_a<T::BM, A_K_MAJOR>(fa[i], as, wm + 16 * i, k);
#pragma unroll
            for (int j = 0; j < T::NI / 2; ++j) tc_fragments_b<T::BN, B_K_MAJOR>(fb[j], bs, wn + 16 * j, k);
#pragma unroll
            for (int i = 0; i < T::MI; ++i)
#pragma unroll
                for (int j = 0; j < T::NI; ++j) mma_tf32(acc[i][j], fa[i], fb[j / 2][j % 2], acc[i][j]);
        }
    }
    cp_async_wait<0>();  // the empty groups: nothing may be pending when the thread exits
}

// Where the GEMM's outputs go: element (m, n) at out.row(m) + out.column(n), either -1 past the
// end. The Out structs below keep the two apart so that a row's offset is computed once.
//
// Writes the warp's accumulators to base + that offset, adding bias[n] when bias is not null and
// what is there already when `add` is set.
template <class T, class Out>
__device__ __forceinline__ void tc_store(const Out& out, float* base, int m0, int n0, const float* bias, bool add,
                                         const float (&acc)[T::MI][T::NI][4]) {
    const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
    const int wm = m0 + (warp / 2) * T::WARP_M + lane / 4, wn = n0 + (warp % 2) * T::WARP_N + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = out.row(wm + 16 * i + 8 * h);
            if (row < 0) continue;
#pragma unroll
            for (int j = 0; j < T::NI; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int n = wn + 8 * j + e, column = out.column(n);
                    if (column >= 0)
                        base[row + column] = acc[i][j][2 * h + e] + (bias ? bias[n] : 0.0f) +
                                             (add ? base[row + column] : 0.0f);
                }
        }
}

// The end of a GEMM: with one part, the accumulators and bias go to y; else to this part's
// partial output (partial + part * size, size the elements of y), and the tile's last part to
// finish (last_block on `counter`) adds the tile's parts in order into y, with the bias; `add`:
// to what y holds (a gradient accumulated in place). Returns
// whether this block finished the tile (then the partials the other parts wrote before it, of
// anything, are visible to it). Every thread of the block must call it.
template <class T, class Out>
__device__ __forceinline__ bool tc_finish(const Out& out, float* y, float* partial, int size, int parts, int part,
                                          unsigned* counter, int m0, int n0, const float* bias, bool add,
                                          const float (&acc)[T::MI][T::NI][4]) {
    if (parts == 1) {
        tc_store<T>(out, y, m0, n0, bias, add, acc);
        return true;
    }
    tc_store<T>(out, partial + part * size, m0, n0, nullptr, false, acc);
    if (!last_block(counter, parts)) return false;
    for (int idx = int(threadIdx.x); idx < T::BM * T::BN; idx += TC_THREADS) {
        const int n = n0 + idx % T::BN, row = out.row(m0 + idx / T::BN), column = out.column(n);
        if (row >= 0 && column >= 0)
            y[row + column] = added_partials(partial + row + column, parts, size) + (bias ? bias[n] : 0.0f) +
                              (add ? y[row + column] : 0.0f);
    }
    return true;
}

// ---- forward ----------------------------------------------------------------------------

// The im2col element of the NHWC image x for the output pixel (img, p, q) and the column (r, s, ci):
// the address of x[img, p*sh - ph + r, q*sw - pw + s, ci], or null in the padding.
__device__ __forceinline__ const float* im2col_at(const Geometry<0, 0>& g, const float* x, int pixel, int column) {
    const int img = pixel / g.out_plane(), pq = pixel - img * g.out_plane(), p = pq / g.ow, q = pq - p * g.ow;
    const int tap = column / g.c, ci = column - tap * g.c, r = tap / g.kw(), s = tap - r * g.kw();
    const int hh = p * g.sh - g.ph + r, ww = q * g.sw - g.pw + s;
    if (unsigned(hh) >= unsigned(g.h) || unsigned(ww) >= unsigned(g.w)) return nullptr;
    return x + ((img * g.h + hh) * g.w + ww) * g.c + ci;
}

// A(m, k) = im2col(x) for the output pixel m and the column k = (r, s, ci), read along the channels.
struct ImageRows {
    Geometry<0, 0> g;
    const float* x;
    __device__ const float* at(int m, int k) const { return m < g.n * g.out_plane() ? im2col_at(g, x, m, k) : nullptr; }
};

// Row `row` of a row-major (rows x ld) matrix, read along k.
struct MatrixRows {
    const float* p;
    int rows, ld;
    __device__ const float* at(int row, int k) const { return row < rows ? p + row * ld + k : nullptr; }
};

// The elements of a row-major (rows x columns) matrix.
struct RowsOut {
    int rows, columns;
    __device__ int row(int m) const { return m < rows ? m * columns : -1; }
    __device__ int column(int n) const { return n < columns ? n : -1; }
};

// The counter (of the backend's, see last_block) of this block's output tile, in phase `phase`.
__device__ __forceinline__ unsigned* tile_counter(unsigned* counters, int phase) {
    return counters + (phase * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
}

// y (N*OH*OW x O, NHWC) = im2col(x) . w_krsc^T + bias (bias may be null): block (x, y, z) computes
// output pixels [x * BM, ...) by channels [y * BN, ...) over k in [z * k_chunk, (z + 1) * k_chunk)
// (split-K over the gridDim.z parts through partial, see tc_finish).
template <class T, int VEC>
__global__ void __launch_bounds__(TC_THREADS)
conv_tc_forward(const float* __restrict__ x, const float* __restrict__ w_krsc, const float* __restrict__ bias,
                float* __restrict__ y, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, depth = g.taps() * g.c, pixels = g.n * g.out_plane();
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, depth);
    float acc[T::MI][T::NI][4];
    tc_gemm<T, VEC, true, true>(ImageRows{g, x}, MatrixRows{w_krsc, g.o, depth}, x, w_krsc, m0, n0, k_begin, k_end,
                                acc);
    tc_finish<T>(RowsOut{pixels, g.o}, y, partial, pixels * g.o, gridDim.z, blockIdx.z, tile_counter(counters, 0),
                 m0, n0, bias, false, acc);
}

// ---- backward-data ----------------------------------------------------------------------

// A(m, k) = dy[img, t_h + u - i, t_w + v - j, co] for the phase's cell m = (img, u, v) and
// k = (i, j, co), zero where that falls outside the output.
struct GradientRows {
    Geometry<0, 0> g;
    Phase f;
    const float* dy;
    __device__ const float* at(int m, int k) const {
        if (m >= g.n * f.cells()) return nullptr;
        const int img = m / f.cells(), uv = m - img * f.cells(), u = uv / f.cols, v = uv - u * f.cols;
        const int tap = k / g.o, co = k - tap * g.o, i = tap / f.taps_w, j = tap - i * f.taps_w;
        const int p = f.t_h + u - i, q = f.t_w + v - j;
        if (unsigned(p) >= unsigned(g.oh) || unsigned(q) >= unsigned(g.ow)) return nullptr;
        return dy + ((img * g.oh + p) * g.ow + q) * g.o + co;
    }
};

// B(k, n) = w_krsc[co, a + sh*i, b + sw*j, ci] for the input channel n = ci and k = (i, j, co), read
// along the channels (n): the weights as the forward reads them, no copy in another order.
struct WeightRows {
    Geometry<0, 0> g;
    Phase f;
    const float* w_krsc;
    __device__ const float* at(int ci, int k) const {
        if (ci >= g.c) return nullptr;
        const int tap = k / g.o, co = k - tap * g.o, i = tap / f.taps_w, j = tap - i * f.taps_w;
        return w_krsc + ((co * g.kh() + f.a + g.sh * i) * g.kw() + f.b + g.sw * j) * g.c + ci;
    }
};

// The dx rows (NHWC) of the phase's cells.
struct PhaseRowsOut {
    Geometry<0, 0> g;
    Phase f;
    __device__ int row(int m) const {
        if (m >= g.n * f.cells()) return -1;
        const int img = m / f.cells(), uv = m - img * f.cells(), u = uv / f.cols, v = uv - u * f.cols;
        return ((img * g.h + f.h_first + g.sh * u) * g.w + f.w_first + g.sw * v) * g.c;
    }
    __device__ int column(int n) const { return n < g.c ? n : -1; }
};

// dx (N*H*W x C, NHWC): blockIdx.z = phase * splits + part, for the sh*sw stride phases and the
// splits = gridDim.z / (sh*sw) parts of each phase's k; block (x, y, z) computes the phase's cells
// [x * BM, ...) by input channels [y * BN, ...) over k in [part * k_chunk, ...) (split-K, see
// tc_finish), added to what dx holds when `add` is set. Blocks past the phase's cells (phases differ in size by a
// row or column) leave at once; a phase, or a part of one, that no tap reaches gets zeros.
template <class T, int VEC>
__global__ void __launch_bounds__(TC_THREADS)
conv_tc_dgrad(const float* __restrict__ dy, const float* __restrict__ w_krsc, float* __restrict__ dx, int add,
              float* partial, unsigned* counters, CONV_PARAMS, int k_chunk) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int splits = gridDim.z / (g.sh * g.sw), part = blockIdx.z % splits;
    const int phase = blockIdx.z / splits;
    const Phase f = stride_phase(g, phase);
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;
    if (m0 >= g.n * f.cells()) return;  // the same for the whole block
    const int k_begin = part * k_chunk, k_end = min(k_begin + k_chunk, f.taps() * g.o);
    float acc[T::MI][T::NI][4];
    tc_gemm<T, VEC, true, false>(GradientRows{g, f, dy}, WeightRows{g, f, w_krsc}, dy, w_krsc, m0, n0, k_begin,
                                 k_end, acc);
    tc_finish<T>(PhaseRowsOut{g, f}, dx, partial, g.n * g.h * g.w * g.c, splits, part, tile_counter(counters, phase),
                 m0, n0, nullptr, add, acc);
}

// ---- backward-weight --------------------------------------------------------------------

// A(m, k) = dy[k, m]: the output channel m of the pixel k, read along the channels.
struct ChannelsOfPixels {
    const float* p;
    int channels;
    __device__ const float* at(int m, int k) const { return m < channels ? p + k * channels + m : nullptr; }
};

// B(k, n) = im2col(x) for the pixel k and the column n = (r, s, ci), read along the channels.
struct ImageColumns {
    Geometry<0, 0> g;
    const float* x;
    __device__ const float* at(int n, int k) const { return n < g.taps() * g.c ? im2col_at(g, x, k, n) : nullptr; }
};

// The elements of dw for the GEMM's rows m = o and columns n = (r, s, ci): in (O, KH, KW, C) order
// (krsc: the model's weights channels-last, as the parameters of a flat buffer are), else in
// (O, C, KH, KW) order.
struct WeightsOut {
    Geometry<0, 0> g;
    int krsc;
    __device__ int row(int m) const { return m < g.o ? m * g.c * g.taps() : -1; }
    __device__ int column(int n) const {
        if (n >= g.taps() * g.c) return -1;
        const int tap = n / g.c;
        return krsc ? n : (n - tap * g.c) * g.taps() + tap;
    }
};

// dw (see WeightsOut) = the sum over the pixels k of dy[k, m] im2col(x)[k, n]: block (x, y, z)
// computes output channels [x * BM, ...) by columns (r, s, ci) [y * BN, ...) over the pixels
// [z * k_chunk, (z + 1) * k_chunk) (split-K, see tc_finish). And, unless db is null, the bias
// gradient db[m] = the sum of dy[k, m] over the pixels: the blocks of the first column (y = 0) add
// the raw dy of each A tile as it passes through shared memory, a thread per row, in k order;
// with several parts each writes db_partial (parts, O), which the tile's last part adds in order.
template <class T, int VEC>
__global__ void __launch_bounds__(TC_THREADS)
conv_tc_wgrad(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ dw, int krsc,
              float* __restrict__ db, float* partial, float* db_partial, unsigned* counters, CONV_PARAMS,
              int k_chunk) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, columns = g.taps() * g.c;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    const int row = int(threadIdx.x), m = m0 + row;
    const bool sums_bias = db && blockIdx.y == 0 && row < T::BM;
    float acc[T::MI][T::NI][4], bias = 0.0f;
    tc_gemm<T, VEC, false, false>(ChannelsOfPixels{dy, g.o}, ImageColumns{g, x}, dy, x, m0, n0, k_begin, k_end, acc,
                                  [&](const float* as) {
                                      if (!sums_bias) return;
#pragma unroll
                                      for (int k = 0; k < TC_BK; ++k) bias += as[TcStage<T::BM, false>::offset(row, k)];
                                  });
    if (sums_bias && gridDim.z > 1 && m < g.o) db_partial[blockIdx.z * g.o + m] = bias;
    const bool last = tc_finish<T>(WeightsOut{g, krsc}, dw, partial, g.o * columns, gridDim.z, blockIdx.z,
                                   tile_counter(counters, 0), m0, n0, nullptr, false, acc);
    if (sums_bias && last && m < g.o) db[m] = gridDim.z == 1 ? bias : added_partials(db_partial + m, gridDim.z, g.o);
}
