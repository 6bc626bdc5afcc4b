// conv_tc.cu: 2-D convolution on TF32 tensor cores, as implicit GEMMs on channels-last (NHWC)
// float32 activations. Launched by kernels/cuda/conv_tc.py (the convolutions under the tf32
// precision whose channel counts are multiples of 4); checked by tests/test_conv_tc.py against
// the float64 reference of TF32-rounded and of raw inputs, on the CPU emulator in CI and on a GPU
// under `pytest -m gpu`.
//
//   conv_tc_forward  y (N*OH*OW x O)  = im2col(x) (N*OH*OW x KH*KW*C) . w_krsc^T (KH*KW*C x O) + b
//   conv_tc_dgrad    dx (cells x C)   = dy gathered (cells x taps*O) . w (taps*O x C), one GEMM per
//                                       stride phase of the input cells (conv_geometry.cuh)
//   conv_tc_wgrad    dw^T (KH*KW*C x O) = im2col(x)^T (KH*KW*C x N*OH*OW) . dy (N*OH*OW x O),
//                                       written in (O, KH, KW, C) or (O, C, KH, KW) order,
//                    and the bias gradient, the per-channel sums of dy, in the same pass
//
// Each GEMM may split its K over grid.z into parts (split-K: a small grid's blocks then fill the
// GPU): each part writes its partial tile and the tile's parts are added in a fixed order in the
// same launch, in two levels when there are many: the last part of each group of `group`
// consecutive parts to finish adds the group's parts, and the last group to finish adds the
// groups (tc_finish). Backward-data's grid.z also runs over the phases.
//
// The weights come as w_krsc (O, KH, KW, C), the memory of channels-last weights (a flat buffer's
// parameters are; the launcher copies others): the forward reads them along k, backward-data along
// its n (the input channels).
//
// A block of 4 warps (2 x 2) computes a BM x BN tile of the output, each warp (BM/2) x (BN/2) as
// m16n8k8 mma.sync tiles (tensor_core.cuh). K advances BK = 16 at a time through a STAGES-deep
// ring of shared-memory tiles filled by 16-byte cp.async copies: while stage s is multiplied, the
// copies of the next STAGES - 1 stages are in flight; the loop is unrolled over the ring, so that
// each stage's shared-memory addresses are constants. Each thread rounds the chunks it copied to
// TF32 (tensor_core.cuh's tf32_round) once they land, before the barrier that hands the stage to
// the warps, so that the product is that of the TF32-rounded inputs, summed in float32, and each
// element is rounded once, not once per warp that reads it.
//
// An operand whose global rows run along k (K_MAJOR: the forward's two and backward-data's dy)
// sits in shared memory as [row][BK + 4] and is read by ldmatrix.x4 as 8x4 TF32 matrices without
// bank conflicts (a row is 20 words). One whose rows run along m or n (backward-weight's two,
// whose k is the pixel, and backward-data's weights) sits as [k][W + 8]: B is read a word per
// lane, the 32 lanes (t, g) at t * (W + 8) + g, in 32 banks; A as pairs of words, for which the
// GEMM's rows are taken in a permuted order within each 16: the mma's row r is the tile's row
// 2 (r % 8) + r / 8, so that the rows g and g + 8 that a lane holds are neighbours in memory
// (tc_fragment_a; tc_store writes each accumulator to the row it belongs to).
//
// The copies' addresses: ALIGN = 16 (every channel count a multiple of 16, at most 32 filter
// taps) keeps the 16 k of a stage in one filter tap, and each thread's iterators (the
// ...Aligned structs) work out the image, row and column of their rows once, before the loop;
// a stage then adds a constant to an offset and tests a precomputed bit of the tap's padding
// mask (CUTLASS's "optimized" convolution iterators work the same way). Backward-weight's k is
// the pixel: a thread's chunks of im2col share one pixel, split into image, row and column by
// FastDivmod once per stage. ALIGN = 4 (channel counts multiples of 4) computes every chunk's
// address from its (row, k) with divisions (Gathered). Results are deterministic: every output
// element is one thread's sum in a fixed order, and split-K partials are added in a fixed order.
#include "common.cuh"
#include "conv_geometry.cuh"
#include "tensor_core.cuh"

constexpr int TC_BK = 16, TC_STAGES = 3, TC_THREADS = 128;
// Registers for 3 blocks an SM (170 a thread): at the 128 that 4 blocks allow, ptxas recomputes the
// threads' shared-memory offsets and the loop's bound in every iteration of the main loop
// (bench/tc_plan.py counts the instructions).
constexpr int TC_MIN_BLOCKS = 3;

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

// The 16-byte chunks (4 consecutive elements along the rows or along k) of a stage that this
// thread copies and rounds: CHUNKS of them, chunk c at (row(c), k(c)) of the stage. K_MAJOR (lines
// of 4 chunks along k): 4 threads per line, rows 32 c + t / 4, so that a warp's copy instruction
// reads whole 64-byte lines. Else (16 lines along k): 8 threads per line, line t / 8, rows
// 4 (8 c + t % 8): a warp's instruction reads 128 contiguous bytes of each of its 4 lines, and a
// thread's chunks share their k (backward-weight's pixel).
template <int W, bool K_MAJOR>
struct TcCopy {
    static constexpr int CHUNKS = W * TC_BK / 4 / TC_THREADS;
    static_assert(CHUNKS * 4 * TC_THREADS == W * TC_BK, "whole chunks per thread");
    __device__ static int row(int c) {
        return K_MAJOR ? c * (TC_THREADS / 4) + int(threadIdx.x) / 4 : (c * 8 + int(threadIdx.x) % 8) * 4;
    }
    __device__ static int k(int c) { return K_MAJOR ? int(threadIdx.x) % 4 * 4 : int(threadIdx.x) / 8; }
    __device__ static int offset(int c) { return TcStage<W, K_MAJOR>::offset(row(c), k(c)); }
};

// Copies this thread's chunks of one stage into `tile`: it.at(c, offset) says whether chunk c
// holds data, at it.base + offset in global memory, or is zero (padding, past the matrix or the
// part's k); a zero chunk copies nothing from it.base, a valid address that keeps the instruction
// well formed.
template <int W, bool K_MAJOR, class Iterator>
__device__ __forceinline__ void tc_load_stage(float* tile, const Iterator& it) {
#pragma unroll
    for (int c = 0; c < TcCopy<W, K_MAJOR>::CHUNKS; ++c) {
        int offset = 0;
        const bool data = it.at(c, offset);
        // an unsigned offset: a 64-bit address in one multiply-add, where a signed one is extended first
        cp_async_cg(tile + TcCopy<W, K_MAJOR>::offset(c), it.base + unsigned(data ? offset : 0), data ? 16 : 0);
    }
}

struct NoChunkWork {
    __device__ void operator()(int, const float4&) const {}
};

// Rounds this thread's chunks of a landed stage to TF32 in place; on_chunk(c, raw) sees each
// chunk's values before.
template <int W, bool K_MAJOR, class OnChunk>
__device__ __forceinline__ void tc_round_stage(float* tile, OnChunk on_chunk) {
#pragma unroll
    for (int c = 0; c < TcCopy<W, K_MAJOR>::CHUNKS; ++c) {
        float4* chunk = reinterpret_cast<float4*>(tile + TcCopy<W, K_MAJOR>::offset(c));
        float4 v = *chunk;
        on_chunk(c, v);
        v.x = __uint_as_float(tf32_round(v.x));
        v.y = __uint_as_float(tf32_round(v.y));
        v.z = __uint_as_float(tf32_round(v.z));
        v.w = __uint_as_float(tf32_round(v.w));
        *chunk = v;
    }
}

// The A fragment of mma tile (row0.., k..k+7) for this lane (tensor_core.cuh's layout); rows in
// the permuted order when the stage is not K_MAJOR (see the header).
template <int W, bool K_MAJOR>
__device__ __forceinline__ void tc_fragment_a(unsigned (&a)[4], const float* tile, int row0, int k) {
    const int lane = int(threadIdx.x) % 32;
    if (K_MAJOR) {
        // matrices: rows 0-7 and 8-15 at k..k+3, then at k+4..k+7
        ldmatrix_x4(a, tile + TcStage<W, true>::offset(row0 + lane % 8 + (lane / 8 % 2) * 8, k + lane / 16 * 4));
    } else {   // rows g and g + 8 of the mma are the tile's rows 2g and 2g + 1: a[0], a[1] and a[2], a[3]
        const int g = lane / 4, t = lane % 4;
        *reinterpret_cast<uint2*>(&a[0]) =
            *reinterpret_cast<const uint2*>(tile + TcStage<W, false>::offset(row0 + 2 * g, k + t));
        *reinterpret_cast<uint2*>(&a[2]) =
            *reinterpret_cast<const uint2*>(tile + TcStage<W, false>::offset(row0 + 2 * g, k + t + 4));
    }
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
    } else {   // a word per lane: the two words of a fragment lie 4 k apart
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            b[j][0] = __float_as_uint(tile[TcStage<W, false>::offset(col0 + 8 * j + g, k + t)]);
            b[j][1] = __float_as_uint(tile[TcStage<W, false>::offset(col0 + 8 * j + g, k + t + 4)]);
        }
    }
}

// acc += A (m0.., k) . B (k, n0..) over `tiles` stages of k for this warp's part of the block's
// tile: acc[i][j] is mma tile (i, j) of the warp, in the C layout of tensor_core.cuh (rows and
// columns permuted where an operand is not K_MAJOR: tc_store knows how). The iterators a and b
// give the places of the thread's chunks of the current stage (at(c, offset), see tc_load_stage)
// and move to the next (next()). Every thread of the block must call it (it synchronises the block). on_chunk_b(c, raw)
// sees the raw float32 values of each of this thread's B chunks (zero past the matrix) once they
// have landed.
template <class T, bool A_K_MAJOR, bool B_K_MAJOR, class IteratorA, class IteratorB, class OnChunk = NoChunkWork>
__device__ __forceinline__ void tc_gemm(IteratorA a, IteratorB b, int tiles,
                                        float (&acc)[T::MI][T::NI][4], OnChunk on_chunk_b = OnChunk()) {
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
    const auto load = [&](int tile, int stage) {
        if (tile < tiles) {
            tc_load_stage<T::BM, A_K_MAJOR>(As[stage], a);
            tc_load_stage<T::BN, B_K_MAJOR>(Bs[stage], b);
            a.next();
            b.next();
        }
        cp_async_commit();  // one group per tile, empty past the end, so that the waits count tiles
    };
    // one stage of the loop: tile `tile` from stage `stage` while tile + STAGES - 1 goes into the
    // stage of tile - 1
    const auto step = [&](int tile, int stage) {
        float* as = As[stage];
        float* bs = Bs[stage];
        cp_async_wait<TC_STAGES - 2>();  // this thread's copies of `tile` have landed
        tc_round_stage<T::BM, A_K_MAJOR>(as, NoChunkWork());
        tc_round_stage<T::BN, B_K_MAJOR>(bs, on_chunk_b);
        __syncthreads();                 // everyone's are rounded, and everyone is done with tile - 1
        load(tile + TC_STAGES - 1, (stage + TC_STAGES - 1) % TC_STAGES);
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
    };
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) load(s, s);
    // the loop unrolled over the ring, so that each stage's shared-memory addresses are constants
    for (int tile = 0; tile < tiles; tile += TC_STAGES)
#pragma unroll
        for (int s = 0; s < TC_STAGES; ++s)
            if (tile + s < tiles) step(tile + s, s);
    cp_async_wait<0>();  // the empty groups: nothing may be pending when the thread exits
}

// Where the GEMM's outputs go: element (m, n) at out.row(m) + out.column(n), either -1 past the
// end. The Out structs below keep the two apart so that a row's offset is computed once; their
// M_CONTIGUOUS says whether neighbouring m (else n) are neighbours in memory.
//
// Writes the warp's accumulators to base + that offset, adding bias[n] when bias is not null and
// what is there already when `add` is set. M_PERMUTED: the order of rows in the mma tiles is the
// permuted one (A not K_MAJOR, see the header).
template <class T, bool M_PERMUTED, class Out>
__device__ __forceinline__ void tc_store(const Out& out, float* base, int m0, int n0, const float* bias, bool add,
                                         const float (&acc)[T::MI][T::NI][4]) {
    const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, g = lane / 4, t = lane % 4;
    const int wm = m0 + (warp / 2) * T::WARP_M, wn = n0 + (warp % 2) * T::WARP_N;
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {   // the accumulator rows g + 8h of the mma tile
            const int row = out.row(wm + 16 * i + (M_PERMUTED ? 2 * g + h : g + 8 * h));
            if (row < 0) continue;
#pragma unroll
            for (int j = 0; j < T::NI; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {   // the columns 2t + e
                    const int n = wn + 8 * j + 2 * t + e, column = out.column(n);
                    if (column >= 0)
                        base[row + column] = acc[i][j][2 * h + e] + (bias ? bias[n] : 0.0f) +
                                             (add ? base[row + column] : 0.0f);
                }
        }
}

// The parts of a split k: `parts` of them, in groups of `group` consecutive parts (the last
// group may be smaller), this block's being `part`.
struct SplitK {
    int parts, group, part;
    __device__ int groups() const { return (parts + group - 1) / group; }
};

// What a GEMM's end adds besides its tile (backward-weight's bias gradient), at each step of
// tc_finish, into slots of its own partials like the tile's; nothing here.
struct NoSideSums {
    __device__ void part(int) const {}
    __device__ void group(int, int, int) const {}
    __device__ void total(int, int) const {}
    __device__ void whole() const {}
};

// The end of a GEMM: with one part, the accumulators and bias go to y; else to this part's
// partial output, slot `part` of `partial` (slots of `size` elements, the size of y), and then,
// with one group, the last block to finish adds the parts in order into y, with the bias; with
// several (two levels), the last block of each group to finish adds the group's partials in
// order into slot parts + group (a slot no block wrote before), and the last group's adds those
// slots in order into y. `add`: to what y holds (a gradient accumulated in place). `counters`:
// the tile's groups + 1 counters (last_block). side: the same steps for other sums (NoSideSums).
// Returns whether this block finished the tile. Every thread of the block must call it.
template <class T, bool M_PERMUTED, class Out, class Side = NoSideSums>
__device__ __forceinline__ bool tc_finish(const Out& out, float* y, float* partial, int size, const SplitK& split,
                                          unsigned* counters, int m0, int n0, const float* bias, bool add,
                                          const float (&acc)[T::MI][T::NI][4], const Side& side = Side()) {
    if (split.parts == 1) {
        tc_store<T, M_PERMUTED>(out, y, m0, n0, bias, add, acc);
        side.whole();
        return true;
    }
    tc_store<T, M_PERMUTED>(out, partial + split.part * size, m0, n0, nullptr, false, acc);
    side.part(split.part);
    // the tile's elements, one per thread at a time, along the output's contiguous side
    const auto element = [&](int idx, int& row, int& column, int& n) {
        const int m = m0 + (Out::M_CONTIGUOUS ? idx % T::BM : idx / T::BN);
        n = n0 + (Out::M_CONTIGUOUS ? idx / T::BM : idx % T::BN);
        row = out.row(m);
        column = out.column(n);
        return row >= 0 && column >= 0;
    };
    int terms = split.parts, first_term = 0;   // the slots that the tile's last block adds
    const int groups = split.groups();
    if (groups > 1) {
        const int group = split.part / split.group, first = group * split.group;
        const int members = min(split.group, split.parts - first);
        if (!last_block(counters + 1 + group, members)) return false;
        float* sums = partial + (split.parts + group) * size;
        for (int idx = int(threadIdx.x); idx < T::BM * T::BN; idx += TC_THREADS) {
            int row, column, n;
            if (element(idx, row, column, n))
                sums[row + column] = added_partials(partial + first * size + row + column, members, size);
        }
        side.group(split.parts + group, first, members);
        terms = groups;
        first_term = split.parts;
    }
    if (!last_block(counters, terms)) return false;
    for (int idx = int(threadIdx.x); idx < T::BM * T::BN; idx += TC_THREADS) {
        int row, column, n;
        if (element(idx, row, column, n))
            y[row + column] = added_partials(partial + first_term * size + row + column, terms, size) +
                              (bias ? bias[n] : 0.0f) + (add ? y[row + column] : 0.0f);
    }
    side.total(first_term, terms);
    return true;
}

// The counters (of the backend's, see last_block) of this block's output tile, in phase `phase`:
// groups + 1 of them per tile (tc_finish).
__device__ __forceinline__ unsigned* tile_counters(unsigned* counters, int phase, const SplitK& split) {
    return counters + ((phase * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (split.groups() + 1);
}

// ---- the copies' addresses with divisions (ALIGN = 4) -------------------------------------

// A Source's chunks: chunk c of a stage at source.offset(row0 + row(c), k0 + k(c)) from base,
// with the divisions that the Source does; none past k_end.
template <int W, bool K_MAJOR, class Source>
struct Gathered {
    const float* base;
    Source source;
    int row0, k0, k_end;
    __device__ bool at(int c, int& offset) const {
        const int k = k0 + TcCopy<W, K_MAJOR>::k(c);
        offset = k < k_end ? source.offset(row0 + TcCopy<W, K_MAJOR>::row(c), k) : -1;
        return offset >= 0;
    }
    __device__ void next() { k0 += TC_BK; }
};

// The im2col element of the NHWC image x for the output pixel (img, p, q) and the column (r, s, ci):
// the offset of x[img, p*sh - ph + r, q*sw - pw + s, ci], or -1 in the padding.
__device__ __forceinline__ int im2col_offset(const Geometry<0, 0>& g, int pixel, int column) {
    const int img = pixel / g.out_plane(), pq = pixel - img * g.out_plane(), p = pq / g.ow, q = pq - p * g.ow;
    const int tap = column / g.c, ci = column - tap * g.c, r = tap / g.kw(), s = tap - r * g.kw();
    const int hh = p * g.sh - g.ph + r, ww = q * g.sw - g.pw + s;
    if (unsigned(hh) >= unsigned(g.h) || unsigned(ww) >= unsigned(g.w)) return -1;
    return ((img * g.h + hh) * g.w + ww) * g.c + ci;
}

// The Sources below give the offset of an operand's element (row, k) in its array, or -1 where it
// is zero.

// im2col(x) for the output pixel `row` and the column k = (r, s, ci) (the forward's A).
struct ImageRows {
    Geometry<0, 0> g;
    __device__ int offset(int row, int k) const { return row < g.n * g.out_plane() ? im2col_offset(g, row, k) : -1; }
};

// Row `row` of a row-major (rows x ld) matrix, read along k (the forward's B).
struct MatrixRows {
    int rows, ld;
    __device__ int offset(int row, int k) const { return row < rows ? row * ld + k : -1; }
};

// dy[img, t_h + u - i, t_w + v - j, co] for the phase's cell `row` = (img, u, v) and
// k = (i, j, co), none where that falls outside the output (backward-data's A).
struct GradientRows {
    Geometry<0, 0> g;
    Phase f;
    __device__ int offset(int row, int k) const {
        if (row >= g.n * f.cells()) return -1;
        const int img = row / f.cells(), uv = row - img * f.cells(), u = uv / f.cols, v = uv - u * f.cols;
        const int tap = k / g.o, co = k - tap * g.o, i = tap / f.taps_w, j = tap - i * f.taps_w;
        const int p = f.t_h + u - i, q = f.t_w + v - j;
        if (unsigned(p) >= unsigned(g.oh) || unsigned(q) >= unsigned(g.ow)) return -1;
        return ((img * g.oh + p) * g.ow + q) * g.o + co;
    }
};

// w_krsc[co, a + sh*i, b + sw*j, ci] for the input channel `row` = ci and k = (i, j, co), read
// along the channels: the weights as the forward reads them, no copy in another order
// (backward-data's B).
struct WeightRows {
    Geometry<0, 0> g;
    Phase f;
    __device__ int offset(int ci, int k) const {
        if (ci >= g.c) return -1;
        const int tap = k / g.o, co = k - tap * g.o, i = tap / f.taps_w, j = tap - i * f.taps_w;
        return ((co * g.kh() + f.a + g.sh * i) * g.kw() + f.b + g.sw * j) * g.c + ci;
    }
};

// im2col(x) for the column `row` = (r, s, ci) and the pixel k (backward-weight's A).
struct ImageColumns {
    Geometry<0, 0> g;
    __device__ int offset(int row, int k) const { return row < g.taps() * g.c ? im2col_offset(g, k, row) : -1; }
};

// dy[k, row]: the output channel `row` of the pixel k (backward-weight's B).
struct ChannelsOfPixels {
    int channels;
    __device__ int offset(int row, int k) const { return row < channels ? k * channels + row : -1; }
};

// ---- the copies' addresses worked out before the loop (ALIGN = 16) --------------------------

// The forward's A: im2col(x) for the output pixels m (the thread's rows) and k = (r, s, ci), C a
// multiple of 16, at most 32 taps. Per row, the offset of its window's first element and a bit per
// tap inside the image; per stage, the tap and the offset of (r, s, ci) from the window's start.
template <int W>
struct ImageRowsAligned {
    using Copy = TcCopy<W, true>;
    const float* base;   // x
    int offset[Copy::CHUNKS];
    unsigned inside[Copy::CHUNKS];   // bit r * KW + s: the tap (r, s) of the row is in the image
    int tap, s, ci, shift;           // the stage's tap (r, s) and channel; shift = (r * W + s) * C + ci
    int c, kw, row_skip;             // row_skip = (W - KW) * C

    __device__ ImageRowsAligned(const Geometry<0, 0>& g, const float* x, int m0, int k_begin)
        : base(x), c(g.c), kw(g.kw()), row_skip((g.w - g.kw()) * g.c) {
#pragma unroll
        for (int i = 0; i < Copy::CHUNKS; ++i) {
            const int m = m0 + Copy::row(i);
            const int img = m / g.out_plane(), pq = m - img * g.out_plane(), p = pq / g.ow, q = pq - p * g.ow;
            const int h0 = p * g.sh - g.ph, w0 = q * g.sw - g.pw;
            offset[i] = ((img * g.h + h0) * g.w + w0) * g.c + Copy::k(i);
            unsigned bits = 0;
            for (int r = 0; r < g.kh(); ++r)
                for (int t = 0; t < g.kw(); ++t)
                    if (unsigned(h0 + r) < unsigned(g.h) && unsigned(w0 + t) < unsigned(g.w)) bits |= 1u << (r * kw + t);
            inside[i] = m < g.n * g.out_plane() ? bits : 0u;
        }
        tap = k_begin / c;
        ci = k_begin - tap * c;
        const int r = tap / kw;
        s = tap - r * kw;
        shift = (r * g.w + s) * c + ci;
    }
    __device__ bool at(int i, int& at_offset) const {
        at_offset = offset[i] + shift;
        return inside[i] >> tap & 1u;
    }
    __device__ void next() {
        shift += TC_BK;   // the next channels, or the first of the next tap along the row
        ci += TC_BK;
        if (ci == c) {
            ci = 0;
            ++tap;
            if (++s == kw) {
                s = 0;
                shift += row_skip;
            }
        }
    }
};

// The forward's B: rows of a row-major (rows x ld) matrix read along k, ld a multiple of 16.
template <int W>
struct MatrixRowsAligned {
    using Copy = TcCopy<W, true>;
    const float* base;   // the matrix
    int first, ld32;     // the offset of the thread's chunk 0 in the current stage; chunk i is 32 i rows further
    unsigned inside;     // bit i: chunk i's row is in the matrix
    __device__ MatrixRowsAligned(const float* matrix, int rows, int ld, int n0, int k_begin)
        : base(matrix), first((n0 + Copy::row(0)) * ld + k_begin + Copy::k(0)), ld32(ld * (TC_THREADS / 4)), inside(0) {
#pragma unroll
        for (int i = 0; i < Copy::CHUNKS; ++i) inside |= unsigned(n0 + Copy::row(i) < rows) << i;
    }
    __device__ bool at(int i, int& offset) const {
        offset = first + i * ld32;
        return inside >> i & 1u;
    }
    __device__ void next() { first += TC_BK; }
};

// Backward-data's A: dy gathered for the phase's cells m (the thread's rows) and k = (i, j, co),
// O a multiple of 16, at most 32 taps in the phase. Per row, the offset of dy at (t_h + u, t_w + v)
// and a bit per tap (i, j) whose output (t_h + u - i, t_w + v - j) exists; per stage, the offset
// -(i * OW + j) * O + co.
template <int W>
struct GradientRowsAligned {
    using Copy = TcCopy<W, true>;
    const float* base;   // dy
    int offset[Copy::CHUNKS];
    unsigned inside[Copy::CHUNKS];   // bit i * taps_w + j
    int tap, j, co, shift, o, taps_w, row_skip;   // row_skip = (OW - taps_w) * O

    __device__ GradientRowsAligned(const Geometry<0, 0>& g, const Phase& f, const float* dy, int m0, int k_begin)
        : base(dy), o(g.o), taps_w(f.taps_w), row_skip((g.ow - f.taps_w) * g.o) {
#pragma unroll
        for (int r = 0; r < Copy::CHUNKS; ++r) {
            const int m = m0 + Copy::row(r);
            const int img = m / f.cells(), uv = m - img * f.cells(), u = uv / f.cols, v = uv - u * f.cols;
            const int p0 = f.t_h + u, q0 = f.t_w + v;
            offset[r] = ((img * g.oh + p0) * g.ow + q0) * g.o + Copy::k(r);
            unsigned bits = 0;
            for (int i = 0; i < f.taps_h; ++i)
                for (int t = 0; t < f.taps_w; ++t)
                    if (unsigned(p0 - i) < unsigned(g.oh) && unsigned(q0 - t) < unsigned(g.ow)) bits |= 1u << (i * taps_w + t);
            inside[r] = m < g.n * f.cells() ? bits : 0u;
        }
        tap = k_begin / o;
        co = k_begin - tap * o;
        const int i = taps_w ? tap / taps_w : 0;   // a phase no tap reaches has no stage
        j = tap - i * taps_w;
        shift = co - (i * g.ow + j) * o;
    }
    __device__ bool at(int r, int& at_offset) const {
        at_offset = offset[r] + shift;
        return inside[r] >> tap & 1u;
    }
    __device__ void next() {
        shift += TC_BK;
        co += TC_BK;
        if (co == o) {   // the next tap: one output column to the left, or the row above
            co = 0;
            ++tap;
            shift -= 2 * o;
            if (++j == taps_w) {
                j = 0;
                shift -= row_skip;
            }
        }
    }
};

// Backward-data's B: w_krsc[co, a + sh*i, b + sw*j, ci] for the line k = (i, j, co) of the stage
// (the thread's one) and the input channels ci (its chunks), O a multiple of 16: a stage's 16 k
// are 16 consecutive co of one tap, KH*KW*C apart.
template <int W>
struct WeightRowsAligned {
    using Copy = TcCopy<W, false>;
    const float* base;   // w_krsc
    int first;           // the offset of chunk 0 of the current stage; chunk c is 32 c channels further
    unsigned inside;     // bit c: chunk c's channels exist
    int co, j, o, taps_w, co_step, co_wrap, tap_step, row_step;

    __device__ WeightRowsAligned(const Geometry<0, 0>& g, const Phase& f, const float* w_krsc, int n0, int k_begin)
        : base(w_krsc), inside(0), o(g.o), taps_w(f.taps_w) {
        const int per_co = g.taps() * g.c;   // between consecutive co
        const int tap = k_begin / o, i = taps_w ? tap / taps_w : 0;   // a phase no tap reaches has no stage
        co = k_begin - tap * o;
        j = tap - i * taps_w;
        first = (co + Copy::k(0)) * per_co + ((f.a + g.sh * i) * g.kw() + f.b + g.sw * j) * g.c + n0 + Copy::row(0);
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) inside |= unsigned(n0 + Copy::row(c) < g.c) << c;
        co_step = TC_BK * per_co;
        co_wrap = o * per_co;        // back to co = 0
        tap_step = g.sw * g.c;       // the next j
        row_step = g.sh * g.kw() * g.c - taps_w * g.sw * g.c;   // the next i, j = 0
    }
    __device__ bool at(int c, int& offset) const {
        offset = first + 32 * c;
        return inside >> c & 1u;
    }
    __device__ void next() {
        first += co_step;
        co += TC_BK;
        if (co == o) {
            co = 0;
            first += tap_step - co_wrap;
            if (++j == taps_w) {
                j = 0;
                first += row_step;
            }
        }
    }
};

// Backward-weight's A: im2col(x) for the columns m = (r, s, ci) (the thread's chunks, fixed) and
// the pixel k of the stage's line (the thread's one), C a multiple of 16 so that a chunk's 4
// columns share their tap. Per chunk, its tap and the offset of (r, s, ci) from a window's start;
// per stage, the pixel's image, row and column by FastDivmod (by OH*OW and by OW) and its
// window's offset.
template <int W>
struct ImageColumnsAligned {
    using Copy = TcCopy<W, false>;
    Geometry<0, 0> g;
    const float* base;   // x
    FastDivmod plane, width;
    int column[Copy::CHUNKS], r[Copy::CHUNKS], s[Copy::CHUNKS];
    unsigned inside;   // bit c: chunk c's columns exist
    int pixel, k_end, window, h0, w0;

    __device__ ImageColumnsAligned(const Geometry<0, 0>& g_, const float* x, const FastDivmod& plane_,
                                   const FastDivmod& width_, int m0, int k_begin, int k_end_)
        : g(g_), base(x), plane(plane_), width(width_), inside(0), pixel(k_begin + Copy::k(0)), k_end(k_end_) {
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) {
            const int m = m0 + Copy::row(c), tap = m / g.c, ci = m - tap * g.c;
            r[c] = tap / g.kw();
            s[c] = tap - r[c] * g.kw();
            column[c] = (r[c] * g.w + s[c]) * g.c + ci;
            inside |= unsigned(m < g.taps() * g.c) << c;
        }
        locate();
    }
    __device__ void locate() {
        const int img = plane.div(pixel), pq = plane.mod(pixel, img), p = width.div(pq), q = width.mod(pq, p);
        h0 = p * g.sh - g.ph;
        w0 = q * g.sw - g.pw;
        window = ((img * g.h + h0) * g.w + w0) * g.c;
    }
    __device__ bool at(int c, int& offset) const {
        offset = window + column[c];
        return pixel < k_end && (inside >> c & 1u) && unsigned(h0 + r[c]) < unsigned(g.h) &&
               unsigned(w0 + s[c]) < unsigned(g.w);
    }
    __device__ void next() {
        pixel += TC_BK;
        locate();
    }
};

// Backward-weight's B: dy[k, n] for the pixel k of the stage's line (the thread's one) and the
// output channels n (its chunks), O a multiple of 4.
template <int W>
struct PixelChannelsAligned {
    using Copy = TcCopy<W, false>;
    const float* base;   // dy
    int first;           // the offset of chunk 0 of the current stage; chunk c is 32 c channels further
    int pixel, k_end, step;
    unsigned inside;     // bit c: chunk c's channels exist
    __device__ PixelChannelsAligned(const float* dy, int channels, int n0, int k_begin, int k_end_)
        : base(dy), first((k_begin + Copy::k(0)) * channels + n0 + Copy::row(0)), pixel(k_begin + Copy::k(0)),
          k_end(k_end_), step(TC_BK * channels), inside(0) {
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) inside |= unsigned(n0 + Copy::row(c) < channels) << c;
    }
    __device__ bool at(int c, int& offset) const {
        offset = first + 32 * c;
        return pixel < k_end && (inside >> c & 1u);
    }
    __device__ void next() {
        first += step;
        pixel += TC_BK;
    }
};

// ---- the kernels ----------------------------------------------------------------------------

// The elements of a row-major (rows x columns) matrix.
struct RowsOut {
    static constexpr bool M_CONTIGUOUS = false;
    int rows, columns;
    __device__ int row(int m) const { return m < rows ? m * columns : -1; }
    __device__ int column(int n) const { return n < columns ? n : -1; }
};

// y (N*OH*OW x O, NHWC) = im2col(x) . w_krsc^T + bias (bias may be null): block (x, y, z) computes
// output pixels [x * BM, ...) by channels [y * BN, ...) over k in [z * k_chunk, (z + 1) * k_chunk)
// (split-K over the gridDim.z parts, in groups of `group`, see tc_finish).
template <class T, int ALIGN>
__global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)
conv_tc_forward(const float* __restrict__ x, const float* __restrict__ w_krsc, const float* __restrict__ bias,
                float* __restrict__ y, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, depth = g.taps() * g.c, pixels = g.n * g.out_plane();
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, depth);
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;
    float acc[T::MI][T::NI][4];
    if constexpr (ALIGN == 16)
        tc_gemm<T, true, true>(ImageRowsAligned<T::BM>(g, x, m0, k_begin),
                               MatrixRowsAligned<T::BN>(w_krsc, g.o, depth, n0, k_begin), tiles, acc);
    else
        tc_gemm<T, true, true>(Gathered<T::BM, true, ImageRows>{x, {g}, m0, k_begin, k_end},
                               Gathered<T::BN, true, MatrixRows>{w_krsc, {g.o, depth}, n0, k_begin, k_end}, tiles, acc);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    tc_finish<T, false>(RowsOut{pixels, g.o}, y, partial, pixels * g.o, split, tile_counters(counters, 0, split),
                               m0, n0, bias, false, acc);
}

// The dx rows (NHWC) of the phase's cells.
struct PhaseRowsOut {
    static constexpr bool M_CONTIGUOUS = false;
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
// [x * BM, ...) by input channels [y * BN, ...) over k in [part * k_chunk, ...) (split-K in groups
// of `group`, see tc_finish), added to what dx holds when `add` is set. Blocks past the phase's
// cells (phases differ in size by a row or column) leave at once; a phase, or a part of one, that
// no tap reaches gets zeros.
template <class T, int ALIGN>
__global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)
conv_tc_dgrad(const float* __restrict__ dy, const float* __restrict__ w_krsc, float* __restrict__ dx, int add,
              float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int splits = gridDim.z / (g.sh * g.sw), part = blockIdx.z % splits;
    const int phase = blockIdx.z / splits;
    const Phase f = stride_phase(g, phase);
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;
    if (m0 >= g.n * f.cells()) return;  // the same for the whole block
    const int k_begin = part * k_chunk, k_end = min(k_begin + k_chunk, f.taps() * g.o);
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;
    float acc[T::MI][T::NI][4];
    if constexpr (ALIGN == 16)
        tc_gemm<T, true, false>(GradientRowsAligned<T::BM>(g, f, dy, m0, k_begin),
                                WeightRowsAligned<T::BN>(g, f, w_krsc, n0, k_begin), tiles, acc);
    else
        tc_gemm<T, true, false>(Gathered<T::BM, true, GradientRows>{dy, {g, f}, m0, k_begin, k_end},
                                Gathered<T::BN, false, WeightRows>{w_krsc, {g, f}, n0, k_begin, k_end}, tiles, acc);
    const SplitK split{splits, group, part};
    tc_finish<T, false>(PhaseRowsOut{g, f}, dx, partial, g.n * g.h * g.w * g.c, split,
                              tile_counters(counters, phase, split), m0, n0, nullptr, add, acc);
}

// The elements of dw for the GEMM's rows m = (r, s, ci) and columns n = o: in (O, KH, KW, C) order
// (krsc: the model's weights channels-last, as the parameters of a flat buffer are), else in
// (O, C, KH, KW) order.
struct WeightsOut {
    static constexpr bool M_CONTIGUOUS = true;
    Geometry<0, 0> g;
    int krsc;
    __device__ int row(int m) const {
        if (m >= g.taps() * g.c) return -1;
        const int tap = m / g.c;
        return krsc ? m : (m - tap * g.c) * g.taps() + tap;
    }
    __device__ int column(int n) const { return n < g.o ? n * g.c * g.taps() : -1; }
};

// The bias gradient of backward-weight's blocks of the first row of tiles (x = 0): db[n] = the sum
// of dy[k, n] over the pixels k. Each thread adds the raw values of its chunks of dy as they land
// (its line, one pixel of each stage, and its 4 x CHUNKS channels), in k order; then the block
// adds the 16 threads of each channel in a fixed order (a butterfly within the warp, the warps in
// order). With several parts each writes its slot of db_partial (slots of O), which tc_finish's
// steps add in order, like the tile's.
template <class T>
struct BiasSums {
    using Copy = TcCopy<T::BN, false>;
    float* db;
    float* db_partial;
    int o, n0;
    bool active;
    float sum[Copy::CHUNKS][4];
    float* block_sums;   // [BN] in shared memory: the block's sums, after reduce()

    __device__ void add(int c, const float4& v) {
        if (!active) return;
        sum[c][0] += v.x;
        sum[c][1] += v.y;
        sum[c][2] += v.z;
        sum[c][3] += v.w;
    }
    // every thread of the block calls it
    __device__ void reduce(float (&warps)[4][T::BN]) {
        if (!active) return;   // the same for the whole block
        const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = sum[c][e];   // the lanes lane % 8 + 8i hold the same channels
                v += __shfl_xor_sync(kFullMask, v, 8);
                v += __shfl_xor_sync(kFullMask, v, 16);
                if (lane < 8) warps[warp][Copy::row(c) + e] = v;
            }
        __syncthreads();
        block_sums = warps[0];
        if (threadIdx.x < T::BN)
            block_sums[threadIdx.x] = ((warps[0][threadIdx.x] + warps[1][threadIdx.x]) + warps[2][threadIdx.x]) +
                                      warps[3][threadIdx.x];
    }
    __device__ int channel() const { return n0 + int(threadIdx.x); }
    __device__ bool mine() const { return active && int(threadIdx.x) < T::BN && channel() < o; }
    __device__ void whole() const {
        if (mine()) db[channel()] = block_sums[threadIdx.x];
    }
    __device__ void part(int part) const {
        if (mine()) db_partial[part * o + channel()] = block_sums[threadIdx.x];
    }
    __device__ void group(int slot, int first, int members) const {
        if (mine()) db_partial[slot * o + channel()] = added_partials(db_partial + first * o + channel(), members, o);
    }
    __device__ void total(int first, int terms) const {
        if (mine()) db[channel()] = added_partials(db_partial + first * o + channel(), terms, o);
    }
};

// dw (see WeightsOut) = the sum over the pixels k of im2col(x)[k, m] dy[k, n]: block (x, y, z)
// computes the columns m = (r, s, ci) [x * BM, ...) by output channels [y * BN, ...) over the pixels
// [z * k_chunk, (z + 1) * k_chunk) (split-K in groups of `group`, see tc_finish). And, unless db
// is null, the bias gradient (BiasSums). plane_..., width_...: the FastDivmod multipliers and
// shifts of OH*OW and OW.
template <class T, int ALIGN>
__global__ void __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)
conv_tc_wgrad(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ dw, int krsc,
              float* __restrict__ db, float* partial, float* db_partial, unsigned* counters, CONV_PARAMS,
              int k_chunk, int group, unsigned plane_multiplier, unsigned plane_shift, unsigned width_multiplier,
              unsigned width_shift) {
    __shared__ float warp_sums[4][T::BN];
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, columns = g.taps() * g.c;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;
    BiasSums<T> bias{db, db_partial, g.o, n0, db && blockIdx.x == 0, {}, nullptr};
    const auto sums = [&](int c, const float4& v) { bias.add(c, v); };
    float acc[T::MI][T::NI][4];
    if constexpr (ALIGN == 16)
        tc_gemm<T, false, false>(ImageColumnsAligned<T::BM>(g, x, FastDivmod{g.out_plane(), plane_multiplier, plane_shift},
                                                             FastDivmod{g.ow, width_multiplier, width_shift}, m0,
                                                             k_begin, k_end),
                                 PixelChannelsAligned<T::BN>(dy, g.o, n0, k_begin, k_end), tiles, acc, sums);
    else
        tc_gemm<T, false, false>(Gathered<T::BM, false, ImageColumns>{x, {g}, m0, k_begin, k_end},
                                 Gathered<T::BN, false, ChannelsOfPixels>{dy, {g.o}, n0, k_begin, k_end}, tiles, acc,
                                 sums);
    bias.reduce(warp_sums);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    tc_finish<T, true>(WeightsOut{g, krsc}, dw, partial, g.o * columns, split, tile_counters(counters, 0, split),
                             m0, n0, nullptr, false, acc, bias);
}
