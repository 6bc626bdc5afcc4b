// tc_conv.cuh: what the tensor-core convolutions share whatever their precision (conv_tc.cu on
// TF32, conv_bf16.cu on BF16): the tile of a block, where each operand's 16-byte chunks come from
// in global memory (the iterators), where the outputs go, and the end of a GEMM split over k.
//
// A precision brings its own shared-memory stages, fragments and main loop, and a Copy map: which
// chunks of a stage a thread copies. A Copy map has
//   Element              float or bf16, the operand's storage
//   BK                   the k of a stage
//   ELEMENTS             elements per 16-byte chunk (4 or 8)
//   CHUNKS               chunks per thread and stage
//   LINE_THREADS         (not K_MAJOR) the threads that share a stage's line of k: the lanes t and
//                        t + LINE_THREADS hold the same rows
//   row(c), k(c)         where chunk c of this thread lies in the stage (row: m or n), consecutive
//                        chunks ROW_STEP rows apart (the iterators below assume it)
//   offset(c)            its place in the stage's shared memory, in elements
#pragma once
#include "common.cuh"
#include "conv_geometry.cuh"
#include "tensor_core.cuh"
#include "bn_stats.cuh"

constexpr int TC_THREADS = 128;   // the threads of the tiles of 2 x 2 warps (TcTile's THREADS at WARPS_N 2)

// The tile of a block: BM x BN outputs, 2 x WARPS_N warps (THREADS threads; warp w at row w / WARPS_N and
// column w % WARPS_N), each MI x NI mma tiles of 16 x 8.
template <int BM_, int BN_, int WARPS_N_ = 2>
struct TcTile {
    static constexpr int BM = BM_, BN = BN_, WARPS_N = WARPS_N_, THREADS = 64 * WARPS_N;
    static constexpr int WARP_M = BM / 2, WARP_N = BN / WARPS_N;
    static constexpr int MI = WARP_M / 16, NI = WARP_N / 8;
    static_assert(WARP_M % 16 == 0 && NI % 2 == 0, "warp tiles of whole m16 x n16 pieces");
};

// The chunks of an iterator's runs (Iterator::RUN; 1 where it has none): RUN consecutive chunks of a
// thread that hold data, or not, together, ROW_STEP elements apart in global memory.
template <class Iterator, class = void>
struct ChunkRun {
    static constexpr int value = 1;
};
template <class Iterator>
struct ChunkRun<Iterator, decltype(void(Iterator::RUN))> {
    static constexpr int value = Iterator::RUN;
};

// The runs of a thread's chunks of backward-weight's operands (x's im2col, dy) where the channel counts are
// multiples of ALIGN: chunk c lies ROW_STEP c rows (channels) past the thread's first, and a block's rows start
// at a multiple of its tile's, so that ALIGN / ROW_STEP consecutive chunks (all, at most) share x's tap, and dy's
// existence.
template <class Copy, int ALIGN>
constexpr int run_of() {
    constexpr int run = ALIGN / Copy::ROW_STEP;
    return run < 1 ? 1 : run < Copy::CHUNKS ? run : Copy::CHUNKS;
}

// Copies this thread's chunks of one stage into `tile`, a run of them (ChunkRun) at a time:
// it.at(c, offset) says whether the run of chunk c holds data, at it.base + offset in global memory for
// c and ROW_STEP elements further for each next chunk of the run, or is zero (padding, past the matrix or
// the part's k); a zero chunk copies nothing from it.base and the run's ROW_STEP steps from it (valid
// addresses, within the operand's first RUN x ROW_STEP elements, that keep the instruction well formed).
// PADDED: such a run is copied from `pad` instead (conv_tc.cu's NaN, enough of it for a run: a batch
// norm applied as the stage lands turns it into the zero of the padding). One address a run: the
// chunks after its first take it with a constant added, in the copy instruction.
template <class Copy, bool PADDED = false, class Iterator>
__device__ __forceinline__ void tc_load_stage(typename Copy::Element* tile, const Iterator& it,
                                              const typename Copy::Element* pad = nullptr) {
    constexpr int RUN = ChunkRun<Iterator>::value;
    static_assert(Copy::CHUNKS % RUN == 0, "whole runs of chunks");
    bool data = false;
    const typename Copy::Element* from = nullptr;
#pragma unroll
    for (int c = 0; c < Copy::CHUNKS; ++c) {
        if (c % RUN == 0) {   // a run's first chunk
            int offset = 0;
            data = it.at(c, offset);
            // an unsigned offset: a 64-bit address in one multiply-add, where a signed one is extended first
            from = PADDED ? (data ? it.base + unsigned(offset) : pad) : it.base + unsigned(data ? offset : 0);
        }
        cp_async_cg(tile + Copy::offset(c), from + c % RUN * Copy::ROW_STEP, PADDED || data ? 16 : 0);
    }
}

// What a main loop hands a GEMM's end besides its accumulators, as each stage of B lands (TF32's
// chunks, add) or is read (BF16's fragments, b_fragments): nothing.
struct NoChunkWork {
    static constexpr bool active = false;
    template <class V>
    __device__ void add(int, const V&) const {}
    template <class F>
    __device__ void b_fragments(const F&) {}
};

// A warp's accumulators, cleared before its GEMM's first k step (TF32's and BF16's alike).
template <class T>
__device__ __forceinline__ void tc_clear(float (&acc)[T::MI][T::NI][4]) {
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int j = 0; j < T::NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
}

// ---- where the outputs go -------------------------------------------------------------------------

// Where the GEMM's outputs go: element (m, n) at out.row(m) + out.column(n), either -1 past the
// end. The Out structs below keep the two apart so that a row's offset is computed once; their
// M_CONTIGUOUS says whether neighbouring m (else n) are neighbours in memory.
//
// Writes the warp's accumulators to base + that offset, adding bias[n] when bias is not null and
// what is there already when `add` is set, rounded once to the storage E (float, or bf16: a pair
// of columns 2t, 2t + 1 at a time, neighbours in memory since the columns of a bf16 output are n,
// a multiple of 8 of them). M_PERMUTED: the order of rows in the mma tiles is conv_tc.cu's permuted
// one (A not K_MAJOR).
template <class T, bool M_PERMUTED, class Out, class E>
__device__ __forceinline__ void tc_store(const Out& out, E* base, int m0, int n0, const float* bias, bool add,
                                         const float (&acc)[T::MI][T::NI][4]) {
    const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32, g = lane / 4, t = lane % 4;
    const int wm = m0 + (warp / T::WARPS_N) * T::WARP_M, wn = n0 + (warp % T::WARPS_N) * T::WARP_N;
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {   // the accumulator rows g + 8h of the mma tile
            const int row = out.row(wm + 16 * i + (M_PERMUTED ? 2 * g + h : g + 8 * h));
            if (row < 0) continue;
#pragma unroll
            for (int j = 0; j < T::NI; ++j) {
                if constexpr (sizeof(E) == 2) {   // the columns 2t and 2t + 1, a pair in memory
                    static_assert(!Out::M_CONTIGUOUS, "bf16 outputs run along n");
                    const int n = wn + 8 * j + 2 * t, column = out.column(n);
                    if (column < 0) continue;
                    unsigned* pair = reinterpret_cast<unsigned*>(base + row + column);
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) v[e] = acc[i][j][2 * h + e] + (bias ? bias[n + e] : 0.0f);
                    if (add) {
                        v[0] += bf16x2_low(*pair);
                        v[1] += bf16x2_high(*pair);
                    }
                    *pair = bf16x2_round(v[0], v[1]);
                } else {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {   // the columns 2t + e
                        const int n = wn + 8 * j + 2 * t + e, column = out.column(n);
                        if (column >= 0)
                            base[row + column] = acc[i][j][2 * h + e] + (bias ? bias[n] : 0.0f) +
                                                 (add ? base[row + column] : 0.0f);
                    }
                }
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
// partial output, slot `part` of `partial` (float32 slots of `size` elements, the size of y), and
// then, with one group, the last block to finish adds the parts in order into y, with the bias;
// with several (two levels), the last block of each group to finish adds the group's partials in
// order into slot parts + group (a slot no block wrote before), and the last group's adds those
// slots in order into y. `add`: to what y holds (a gradient accumulated in place). `counters`:
// the tile's groups + 1 counters (last_block). side: the same steps for other sums (NoSideSums).
// Returns whether this block finished the tile. Every thread of the block must call it.
template <class T, bool M_PERMUTED, class Out, class E, class Side = NoSideSums>
__device__ __forceinline__ bool tc_finish(const Out& out, E* y, float* partial, int size, const SplitK& split,
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
        for (int idx = int(threadIdx.x); idx < T::BM * T::BN; idx += T::THREADS) {
            int row, column, n;
            if (element(idx, row, column, n))
                sums[row + column] = added_partials(partial + first * size + row + column, members, size);
        }
        side.group(split.parts + group, first, members);
        terms = groups;
        first_term = split.parts;
    }
    if (!last_block(counters, terms)) return false;
    for (int idx = int(threadIdx.x); idx < T::BM * T::BN; idx += T::THREADS) {
        int row, column, n;
        if (element(idx, row, column, n))
            y[row + column] = stored<E>(added_partials(partial + first_term * size + row + column, terms, size) +
                                        (bias ? bias[n] : 0.0f) + (add ? to_float(y[row + column]) : 0.0f));
    }
    side.total(first_term, terms);
    return true;
}

// The counters (of the backend's, see last_block) of this block's output tile, in phase `phase`:
// groups + 1 of them per tile (tc_finish).
__device__ __forceinline__ unsigned* tile_counters(unsigned* counters, int phase, const SplitK& split) {
    return counters + ((phase * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (split.groups() + 1);
}

// The elements of a row-major (rows x columns) matrix.
struct RowsOut {
    static constexpr bool M_CONTIGUOUS = false;
    int rows, columns;
    __device__ int row(int m) const { return m < rows ? m * columns : -1; }
    __device__ int column(int n) const { return n < columns ? n : -1; }
};

// ---- batch norm's statistics in a forward's epilogue (bn_stats.cuh) --------------------------------

// The statistics of the columns (channels) of the output rows (M x columns, row-major y) of a forward
// whose block finished its tile (tc_finish returned true), for the batch norm that follows: each
// thread's values of a column (ShiftedSums), merged across the 8 lanes that share it (shuffles), the
// block's two rows of warps, then the row tiles (bn_block_statistics). from_registers: the tile's values
// are acc (+ bias) as tc_store stored them (one part of k); else (split-K) the block reads them back
// from y, each thread every READERS-th row of a column. smem: 3 * max(2, THREADS / BN) * BN
// floats the block is done with. Every thread of the block must call it.
template <class T, bool M_PERMUTED, class E>
__device__ __forceinline__ void tc_batch_stats(const BnStats& s, const RowsOut& out, const E* y, float* smem,
                                               int m0, int n0, const float* bias, bool from_registers,
                                               const float (&acc)[T::MI][T::NI][4]) {
    constexpr int READERS = T::THREADS / T::BN;   // threads to a column reading the tile back
    static_assert(T::THREADS % T::BN == 0, "whole threads to a column");
    Moments* part = reinterpret_cast<Moments*>(smem);   // [parts][BN]
    const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
    __syncthreads();   // every warp is done with the main loop's shared memory, and y's tile is stored
    int parts;
    if (from_registers) {   // per n8 tile and column of the thread, its rows; then the warp's 8 lanes of the column
        parts = 2;
        const int wm = m0 + (warp / T::WARPS_N) * T::WARP_M, wn = (warp % T::WARPS_N) * T::WARP_N, g = lane / 4;
        const int t = lane % 4;
#pragma unroll
        for (int j = 0; j < T::NI; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int column = wn + 8 * j + 2 * t + e;
                const float b = bias && n0 + column < out.columns ? bias[n0 + column] : 0.0f;
                ShiftedSums sums;
#pragma unroll
                for (int i = 0; i < T::MI; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        if (out.row(wm + 16 * i + (M_PERMUTED ? 2 * g + h : g + 8 * h)) >= 0)
                            sums.add(to_float(stored<E>(acc[i][j][2 * h + e] + b)));
                Moments m = sums.moments();
#pragma unroll
                for (int x = 4; x < 32; x <<= 1)
                    m = merged(m, shuffled_xor(m, x));
                if (g == 0) part[(warp / T::WARPS_N) * T::BN + column] = m;
            }
    } else {   // thread t: column t % BN, every READERS-th row from t / BN
        parts = READERS;
        const int column = int(threadIdx.x) % T::BN, first = int(threadIdx.x) / T::BN;
        ShiftedSums sums;
        if (out.column(n0 + column) >= 0)
            for (int r = first; r < T::BM; r += READERS) {
                const int row = out.row(m0 + r);
                if (row >= 0) sums.add(to_float(y[row + out.column(n0 + column)]));
            }
        part[first * T::BN + column] = sums.moments();
    }
    bn_block_statistics(s, part, parts, T::BN, int(threadIdx.x), n0, out.columns, int(blockIdx.x), int(gridDim.x),
                        TileRuns{T::BM, out.rows}, int(blockIdx.y));
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

// The sum of WARPS warps' sums of one channel, in warp order (a fixed order: deterministic): sums[w * pitch], w = 0..
template <int WARPS>
__device__ __forceinline__ float warps_in_order(const float* sums, int pitch) {
    float total = sums[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) total += sums[w * pitch];
    return total;
}

// The bias gradient of backward-weight's blocks of the first row of tiles (x = 0): db[n] = the sum
// of dy[k, n] over the pixels k, which each precision's main loop sums its own way (conv_tc.cu's
// BiasSums, conv_bf16.cu's BiasFragments) into block_sums, [BN] in shared memory; then, as tc_finish's
// steps call them, the block's sums go to db, or with several parts to the part's slot of
// db_partial (slots of O), which are added in order like the tile's.
template <class T>
struct BiasTotals {
    float* db;
    float* db_partial;
    int o, n0;
    bool active;
    float* block_sums;

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

// ---- the copies' addresses with divisions (any channel counts the chunks take) -------------------

// A Source's chunks: chunk c of a stage at source.offset(row0 + row(c), k0 + k(c)) from base,
// with the divisions that the Source does; none past k_end.
template <class Copy, class Source>
struct Gathered {
    const typename Copy::Element* base;
    Source source;
    int row0, k0, k_end;
    __device__ bool at(int c, int& offset) const {
        const int k = k0 + Copy::k(c);
        offset = k < k_end ? source.offset(row0 + Copy::row(c), k) : -1;
        return offset >= 0;
    }
    __device__ void next() { k0 += Copy::BK; }
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

// ---- the copies' addresses worked out before the loop (aligned channel counts) -------------------
// Every channel count a multiple of the stage's BK (a stage's k in one filter tap) and at most 32
// filter taps: each thread's iterators work out the image, row and column of their rows once, before
// the loop; a stage then adds a constant to an offset and tests a precomputed bit of the tap's padding
// mask (CUTLASS's "optimized" convolution iterators work the same way). Backward-weight's k is the
// pixel: a thread's chunks of im2col share one pixel, split into image, row and column by FastDivmod
// once per stage.

// The forward's A: im2col(x) for the output pixels m (the thread's rows) and k = (r, s, ci). Per
// row, the offset of its window's first element and a bit per tap inside the image; per stage, the
// tap and the offset of (r, s, ci) from the window's start.
template <class Copy>
struct ImageRowsAligned {
    const typename Copy::Element* base;   // x
    int offset[Copy::CHUNKS];
    unsigned inside[Copy::CHUNKS];   // bit r * KW + s: the tap (r, s) of the row is in the image
    int tap, s, ci, shift;           // the stage's tap (r, s) and channel; shift = (r * W + s) * C + ci
    int c, kw, row_skip;             // row_skip = (W - KW) * C

    __device__ ImageRowsAligned(const Geometry<0, 0>& g, const typename Copy::Element* x, int m0, int k_begin)
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
        shift += Copy::BK;   // the next channels, or the first of the next tap along the row
        ci += Copy::BK;
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

// The forward's B: rows of a row-major (rows x ld) matrix read along k, ld a multiple of BK.
template <class Copy>
struct MatrixRowsAligned {
    const typename Copy::Element* base;   // the matrix
    int first, ld_step;  // the offset of the thread's chunk 0 in the current stage; chunk i is ROW_STEP i rows further
    unsigned inside;     // bit i: chunk i's row is in the matrix
    __device__ MatrixRowsAligned(const typename Copy::Element* matrix, int rows, int ld, int n0, int k_begin)
        : base(matrix), first((n0 + Copy::row(0)) * ld + k_begin + Copy::k(0)), ld_step(ld * Copy::ROW_STEP),
          inside(0) {
#pragma unroll
        for (int i = 0; i < Copy::CHUNKS; ++i) inside |= unsigned(n0 + Copy::row(i) < rows) << i;
    }
    __device__ bool at(int i, int& offset) const {
        offset = first + i * ld_step;
        return inside >> i & 1u;
    }
    __device__ void next() { first += Copy::BK; }
};

// Backward-data's A: dy gathered for the phase's cells m (the thread's rows) and k = (i, j, co),
// at most 32 taps in the phase. Per row, the offset of dy at (t_h + u, t_w + v) and a bit per tap
// (i, j) whose output (t_h + u - i, t_w + v - j) exists; per stage, the offset -(i * OW + j) * O + co.
template <class Copy>
struct GradientRowsAligned {
    const typename Copy::Element* base;   // dy
    int offset[Copy::CHUNKS];
    unsigned inside[Copy::CHUNKS];   // bit i * taps_w + j
    int tap, j, co, shift, o, taps_w, row_skip;   // row_skip = (OW - taps_w) * O

    __device__ GradientRowsAligned(const Geometry<0, 0>& g, const Phase& f, const typename Copy::Element* dy, int m0,
                                   int k_begin)
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
        shift += Copy::BK;
        co += Copy::BK;
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
// (the thread's one) and the input channels ci (its chunks): a stage's BK k are BK consecutive co of
// one tap, KH*KW*C apart.
template <class Copy>
struct WeightRowsAligned {
    const typename Copy::Element* base;   // w_krsc
    int first;           // the offset of chunk 0 of the current stage; chunk c is ROW_STEP c channels further
    unsigned inside;     // bit c: chunk c's channels exist
    int co, j, o, taps_w, co_step, co_wrap, tap_step, row_step;

    __device__ WeightRowsAligned(const Geometry<0, 0>& g, const Phase& f, const typename Copy::Element* w_krsc, int n0,
                                 int k_begin)
        : base(w_krsc), inside(0), o(g.o), taps_w(f.taps_w) {
        const int per_co = g.taps() * g.c;   // between consecutive co
        const int tap = k_begin / o, i = taps_w ? tap / taps_w : 0;   // a phase no tap reaches has no stage
        co = k_begin - tap * o;
        j = tap - i * taps_w;
        first = (co + Copy::k(0)) * per_co + ((f.a + g.sh * i) * g.kw() + f.b + g.sw * j) * g.c + n0 + Copy::row(0);
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) inside |= unsigned(n0 + Copy::row(c) < g.c) << c;
        co_step = Copy::BK * per_co;
        co_wrap = o * per_co;        // back to co = 0
        tap_step = g.sw * g.c;       // the next j
        row_step = g.sh * g.kw() * g.c - taps_w * g.sw * g.c;   // the next i, j = 0
    }
    __device__ bool at(int c, int& offset) const {
        offset = first + Copy::ROW_STEP * c;
        return inside >> c & 1u;
    }
    __device__ void next() {
        first += co_step;
        co += Copy::BK;
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
// the pixel k of the stage's line (the thread's one), C a multiple of the chunk's elements so that a
// chunk's columns share their tap. Per chunk, its tap and the offset of (r, s, ci) from a window's
// start; per stage, the pixel's image, row and column by FastDivmod (by OH*OW and by OW) and its
// window's offset. RUN: the thread's consecutive chunks, RUN at a time, share their tap and whether
// they exist (C a multiple of RUN * ROW_STEP, the thread's rows aligned to it), so that a run tests
// whether its tap lies in the image once, and takes one address (tc_load_stage).
template <class Copy, int RUN_ = 1>
struct ImageColumnsAligned {
    static constexpr int RUN = RUN_;
    static_assert(Copy::CHUNKS % RUN == 0, "whole runs of chunks");
    Geometry<0, 0> g;
    const typename Copy::Element* base;   // x
    FastDivmod plane, width;
    int column[Copy::CHUNKS], r[Copy::CHUNKS], s[Copy::CHUNKS];
    unsigned inside;   // bit c: chunk c's columns exist
    int pixel, k_end, window, h0, w0;

    __device__ ImageColumnsAligned(const Geometry<0, 0>& g_, const typename Copy::Element* x, const FastDivmod& plane_,
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
    __device__ bool at(int c, int& offset) const {   // c: a run's first chunk
        offset = window + column[c];
        return pixel < k_end && (inside >> c & 1u) && unsigned(h0 + r[c]) < unsigned(g.h) &&
               unsigned(w0 + s[c]) < unsigned(g.w);
    }
    __device__ void next() {
        pixel += Copy::BK;
        locate();
    }
};

// Backward-weight's B: dy[k, n] for the pixel k of the stage's line (the thread's one) and the
// output channels n (its chunks). RUN: the thread's consecutive chunks, RUN at a time, exist together (O a
// multiple of RUN * ROW_STEP, the block's columns aligned to it).
template <class Copy, int RUN_ = 1>
struct PixelChannelsAligned {
    static constexpr int RUN = RUN_;
    const typename Copy::Element* base;   // dy
    int first;           // the offset of chunk 0 of the current stage; chunk c is ROW_STEP c channels further
    int pixel, k_end, step;
    unsigned inside;     // bit c: chunk c's channels exist
    __device__ PixelChannelsAligned(const typename Copy::Element* dy, int channels, int n0, int k_begin, int k_end_)
        : base(dy), first((k_begin + Copy::k(0)) * channels + n0 + Copy::row(0)), pixel(k_begin + Copy::k(0)),
          k_end(k_end_), step(Copy::BK * channels), inside(0) {
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) inside |= unsigned(n0 + Copy::row(c) < channels) << c;
    }
    __device__ bool at(int c, int& offset) const {
        offset = first + Copy::ROW_STEP * c;
        return pixel < k_end && (inside >> c & 1u);
    }
    __device__ void next() {
        first += step;
        pixel += Copy::BK;
    }
};

// ---- 3x3 convolutions of stride 1 from one window of the image (the halo kernels) -----------------
//
// A 3x3, stride-1, padding-1 convolution's im2col holds each input pixel nine times, once per tap; the
// halo kernels (conv_tc.cu's TF32, conv_bf16.cu's BF16) load a block's window of the (zero-padded) image
// once per chunk of channels and take each tap's A fragments from it (conv_bf16.cu says how). A window is
// rows of W + 2 slots, a slot one pixel's chunk of channels: 16 bytes a thread copies, four of them (32
// bfloat16, 16 floats), and 16 bytes of padding, 80 bytes, so that 8 consecutive slots fall in distinct
// banks for ldmatrix.
template <class E>
struct HaloSlot {
    static constexpr int CHUNK = 16 / int(sizeof(E)), CHANNELS = 4 * CHUNK, PITCH = 80 / int(sizeof(E));
};
constexpr int HALO_SLOTS = 320;   // a forward's or backward-data's window: 25.6 KB

// The weights of the stage's tap and channels (B; Copy::BK of them, a chunk of the window's): forward,
// w_krsc[n][tap][c0 + k] (K_MAJOR: a row n runs along its input channels); backward-data,
// w_krsc[c0 + k][8 - tap][n] (the tap mirrored, a line k along the input channels n). The tap advances
// with next(); after the ninth, the channels.
template <class Copy, bool FORWARD>
struct HaloWeights {
    const typename Copy::Element* base;
    int first, tap, tap_step, chunk_step, row_step;
    unsigned inside;   // bit c: chunk c's row (n) exists
    __device__ HaloWeights(const typename Copy::Element* w_krsc, const Geometry<0, 0>& g, int n0, int columns)
        : base(w_krsc), tap(0) {
        const int per_co = 9 * g.c;   // between consecutive output channels
        if constexpr (FORWARD) {      // offset o * 9C + tap * C + c
            first = (n0 + Copy::row(0)) * per_co + Copy::k(0);
            tap_step = g.c;
            chunk_step = Copy::BK - 8 * g.c;
            row_step = Copy::ROW_STEP * per_co;
        } else {                      // offset co * 9C + (8 - tap) * C + ci
            first = Copy::k(0) * per_co + 8 * g.c + n0 + Copy::row(0);
            tap_step = -g.c;
            chunk_step = Copy::BK * per_co + 8 * g.c;
            row_step = Copy::ROW_STEP;
        }
        inside = 0;
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) inside |= unsigned(n0 + Copy::row(c) < columns) << c;
    }
    __device__ bool at(int c, int& offset) const {
        offset = first + c * row_step;
        return inside >> c & 1u;
    }
    __device__ void next() {
        if (++tap == 9) {
            tap = 0;
            first += chunk_step;
        } else {
            first += tap_step;
        }
    }
};

// Where a halo block of T::BM output pixels from m0 (3x3, stride 1: H x W out as in) finds its window and
// this lane its A fragments in it: the window's first padded row (pp of image img; padded row L = image
// (H + 2) + row + 1) and its rows, those the pixels span and one above and below; and, for each mma tile i
// of the warp's rows from wm, the element offset of the slot of this lane's pixel's tap (0, 0) (ldmatrix.x4's
// rows: lane % 8 + 8 (lane / 8 % 2) of the tile, the second 16 bytes of k for lanes 16-31), which a tap
// shifts by rows below and columns right.
template <class T, class E>
struct HaloPlace {
    int img, pp, rows, slot[T::MI];
    __device__ HaloPlace(const Geometry<0, 0>& g, int m0, int wm) {
        const int width = g.w + 2, plane = g.h * g.w, pixels = g.n * plane, lane = int(threadIdx.x) % 32;
        const auto padded_row = [&](int m) {   // of an output pixel: its taps' row r = 0
            const int image = m / plane, p = (m - image * plane) / g.w;
            return image * (g.h + 2) + p;
        };
        const int first_row = padded_row(m0);
        rows = padded_row(min(m0 + T::BM, pixels) - 1) - first_row + 3;
        img = m0 / plane;
        pp = first_row - img * (g.h + 2);
#pragma unroll
        for (int i = 0; i < T::MI; ++i) {
            const int m = m0 + wm + 16 * i + lane % 8 + 8 * (lane / 8 % 2);
            const int at = m < pixels ? (padded_row(m) - first_row) * width + m % g.w : 0;   // past the end: any slot
            slot[i] = at * HaloSlot<E>::PITCH + HaloSlot<E>::CHUNK * (lane / 16);
        }
    }
};

// Calls chunk(slot, at, data) for each 16-byte chunk of a window of `rows` padded rows from the padded
// row pp (0..H + 1) of image img that this thread, of THREADS (a multiple of TC_THREADS), copies: thread t
// chunk t % 4 of the slots of column t % TC_THREADS / 4 (and 32 further) of every GROUPS-th row from row
// t / TC_THREADS (GROUPS = THREADS / TC_THREADS); `slot` its element offset in the window (HaloSlot<E>),
// `data` whether it holds the image's pixel (not padding, nor past the last image), at `at` in `image`
// (N, H, W, channels, from the window's first channel; any address where it does not). A column's rows in
// turn, the image, the row and the address worked out as they advance.
template <int THREADS = TC_THREADS, class E, class Chunk>
__device__ __forceinline__ void halo_window_chunks(const E* image, const Geometry<0, 0>& g, int channels, int img,
                                                   int pp, int rows, Chunk&& chunk) {
    using Slot = HaloSlot<E>;
    constexpr int GROUPS = THREADS / TC_THREADS;
    static_assert(GROUPS * TC_THREADS == THREADS, "whole groups of 128 threads");
    const int width = g.w + 2, part = int(threadIdx.x) % 4, group = int(threadIdx.x) / TC_THREADS;
#pragma unroll 1   // one column a thread at the widths that take the window (W + 2 <= 32), two past that
    for (int col = int(threadIdx.x) % TC_THREADS / 4; col < width; col += TC_THREADS / 4) {
        const bool column_inside = col >= 1 && col <= g.w;
        int i = img, p = pp, slot = col * Slot::PITCH + Slot::CHUNK * part;
        // the offset of the next row of pixels: the image's rows follow each other, across images too
        unsigned at = ((img * g.h + min(max(pp - 1, 0), g.h)) * g.w + col - 1) * channels + Slot::CHUNK * part;
#pragma unroll 1
        for (int j = 0; j < rows; ++j) {
            const bool data = unsigned(p - 1) < unsigned(g.h) && i < g.n;
            if (GROUPS == 1 || j % GROUPS == group) chunk(slot, image + at, column_inside && data);
            if (data) at += g.w * channels;
            slot += width * Slot::PITCH;
            if (++p == g.h + 2) {
                p = 0;
                ++i;
            }
        }
    }
}

// Copies the window of channels c0..c0 + HaloSlot<E>::CHANNELS - 1 of `image` (N, H, W, channels) over
// `rows` padded rows from the padded row pp of image img into `window` (halo_window_chunks): zeros in
// the padding and past the last image, or, PADDED, `pad`'s 16 bytes (as tc_load_stage's). The caller
// commits the copies.
template <bool PADDED = false, class E>
__device__ __forceinline__ void halo_load_window(E* window, const E* __restrict__ image, const Geometry<0, 0>& g,
                                                 int channels, int c0, int img, int pp, int rows,
                                                 const E* pad = nullptr) {
    halo_window_chunks(image + c0, g, channels, img, pp, rows, [&](int slot, const E* at, bool data) {
        if constexpr (PADDED)
            cp_async_cg(window + slot, data ? at : pad, 16);
        else
            cp_async_cg(window + slot, data ? at : image, data ? 16 : 0);
    });
}

// Backward-weight of such a convolution from windows of x (conv_bf16.cu's and conv_tc.cu's halo backward-weight):
// a block's tile is the nine taps of 32 input channels c0.. by 64 output channels, 288 rows m' = 144 h + 16 tap + i
// for the channel c0 + 16 h + i of the tap, which the warps split as 16 channels (the warp's row, h) by 32 output
// channels (BF16's 2 x 2 warps: 9 x 4 mma tiles) or 16 (TF32's 2 x 4: 9 x 2), each warp all nine taps of them;
// its k is the pixel, a stage of them at a
// time, whose window of x (halo_load_window) fits the kernel's slots (kernels/cuda/conv_tc.py's WGRAD_HALO).

// Where such a kernel's pixel m (its k) lies: its image, row and column (FastDivmod by H*W and by W), and the
// padded row of the row above it (halo_load_window's: image (H + 2) + row), where its window starts.
struct HaloPixels {
    struct Place {
        int img, p, q;
    };
    FastDivmod plane, width;
    int h;
    __device__ Place place(int m) const {
        const int img = plane.div(m), pq = plane.mod(m, img), p = width.div(pq);
        return {img, p, width.mod(pq, p)};
    }
    __device__ int padded_row(const Place& at) const { return at.img * (h + 2) + at.p; }
    // The slot of pixel m (its tap (0, 0)) in a window from the padded row first_row, of rows of `width` slots of
    // `pitch` elements; past k_end (dy zero there): the first.
    __device__ int slot(int m, int k_end, int first_row, int width, int pitch) const {
        if (m >= k_end) return 0;
        const Place at = place(m);
        return ((padded_row(at) - first_row) * width + at.q) * pitch;
    }
};

// dw's element of such a tile's row m' and output channel n: WeightsOut's.
struct HaloWeightsOut {
    static constexpr bool M_CONTIGUOUS = WeightsOut::M_CONTIGUOUS;
    WeightsOut out;
    int c0;
    __device__ int row(int m) const {
        const int h = m / 144, tap = (m - 144 * h) / 16, ci = c0 + 16 * h + m % 16;
        return ci < out.g.c ? out.row(tap * out.g.c + ci) : -1;
    }
    __device__ int column(int n) const { return out.column(n); }
};
