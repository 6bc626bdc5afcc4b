// conv_sm90.cu: 2-D convolution on Hopper's tensor cores (sm_90a): warpgroup MMA (wgmma) fed by the tensor
// memory accelerator (TMA), for the bf16 and TF32 precisions. Launched by
// kernels/cuda/conv_sm90.py, chosen on GPUs of compute capability 9.0; checked by tests/test_conv_sm90.py against
// float64 of the bfloat16 inputs (of the TF32-rounded ones), on the CPU
// emulator (which runs sm90.cuh's instructions exactly and refuses their misuse) in CI and on a GPU under
// `pytest -m gpu`. Channel counts multiples of 64, stride 1 or 2:
//
//   conv_sm90_forward   y (N*OH*OW x O) = im2col(x) (N*OH*OW x KH*KW*C) . w_krsc^T (KH*KW*C x O) + b; ADD: added
//                       to what y holds, rounded once. Backward-data is this forward of dy by the weights mirrored
//                       (conv_geometry.cuh's mirrored_weights<bf16>); at stride 2, a GEMM a phase of dx (its pixels
//                       of one parity of row and column) over the taps that reach it (Sm90Taps).
//   conv_sm90_wgrad     dw (O x KH*KW*C), float32, a tap a block: dy^T (O x pixels) . x moved by the tap (pixels x
//                       C), split over the pixels into parts whose partials sum_partials adds in order;
//                       conv_sm90_wgrad_tf32 TF32's, its stages transposed by the consumers as they land
//
// The implicit GEMMs without an im2col: the pixels a tile takes are a box of the image batch, box_i images by
// box_h rows by box_w columns (128 pixels: the forward's rows; 64: backward-weight's k of a stage), chosen per
// layer by the launcher to waste the fewest past the images' edges, and for each filter tap (r, s) the operand of
// x is the same box moved by (r - ph, s - pw): one 4-D TMA load of x (N, H, W, C), whose coordinates past the
// image give zeros, the padding, for free. At stride 2, x's pixels of each parity of row and column are a tensor
// map of their own (a strided view of x), where the tap's box is a box again (Sm90Tap). The forward's B is a line of
// k by BN filters of w (O, KH*KW*C), a 2-D TMA load. Everything lands 128-byte swizzled (a line of 64 bf16 or 32
// float = 128 bytes, chunk j of line l at j ^ (l % 8)), the layout wgmma reads from a descriptor (sm90.cuh's
// wgmma_descriptor_sw128): K-major in the forward (a pixel's channels along k), MN-major in bf16's backward-weight (a
// pixel's channels along m or n, the pixels along k); wgmma transposes no TF32 operand, so TF32's backward-weight
// writes each stage transposed, K-major, into a copy that its wgmmas read (conv_sm90_wgrad_tf32).
//
// The pieces, named as CUTLASS 3 names them:
//   Sm90Tile            the tile: CONSUMERS warpgroups of 64 rows (BM), BN columns, BK = 64, STAGES deep
//   Sm90Pipeline        the mainloop collective: a ring of STAGES stages of shared memory, each with a `full`
//                       mbarrier (the producer's arrive with the stage's expected bytes, completed by TMA) and an
//                       `empty` one (one arrival per consumer warpgroup, once its wgmmas of the stage retired);
//                       the producer (warpgroup 0, its first thread) issues the loads, the consumers (64 rows of
//                       the tile each) wait for a stage, issue 4 wgmma m64nBNk16 on it, commit, and release the
//                       stage before (wgmma_wait<1>: one group in flight while the next lands)
//   Sm90Tiles           the forward's tile scheduler: persistent, a block an SM taking tiles (phase, filters, box)
//                       in turn, their steps following each other through the ring, so that the producer loads the
//                       next tile while the consumers finish the one before (Sm90ForwardTile: a tile's pieces)
//   Sm90Box             the map from a box's index and a row of it to its pixel (Sm90Phase: of which output)
//   the epilogues       each consumer thread's accumulators (mma.sync's m16n8 layout, BN / 8 of them a warp):
//                       the forward's plus the bias (or what y holds: ADD), rounded to bf16 once, stored as pairs
//                       of neighbouring channels; backward-weight's float32 pairs into its part's slot. Then, in the
//                       forward, the batch norm's statistics of y (sm90_batch_stats), or in backward-data the sums
//                       of the norm whose dy dx is (bn_tile_sums), merged across the boxes as the mma.sync kernels
//                       merge their tiles' (bn_stats.cuh), in a scratch of their own, the consumers meeting at a
//                       named barrier (Tile::ConsumerSync) while the producer loads on
//
// Registers: 128 (1 + CONSUMERS) threads a block; setmaxnreg gives the producer's warpgroup 40 registers a thread
// and the consumers the rest (a consumer holds BN / 2 accumulators): 232 a thread with one block an SM (the
// forward's ring of 128-144 KB, backward-weight's 128 x 128 tile), 216 with two (backward-weight's 64 x 64, 100 KB).
#include "common.cuh"
#include "sm90.cuh"
#include "bf16.cuh"
#include "conv_geometry.cuh"
#include "bn_stats.cuh"
#include "tf32.cuh"

// A tile: CONSUMERS warpgroups of 64 rows each (BM = 64 CONSUMERS) by BN columns, of elements E (bf16; float for
// TF32), BK of k a stage (a 128-byte line: 64 bf16, 32 float), STAGES deep; a block is its consumers and a producer
// warpgroup, MIN_BLOCKS of them an SM. A stage holds BM / 64 blocks of A and BN / 64 of B, each 64 lines of 128
// bytes, 8 KB: a TMA box apiece, 4 wgmmas (32 bytes of each line: k16 of bf16, k8 of TF32). Registers: the SM's
// 65536 shared by the blocks, the producer's warpgroup keeping 40 a thread, the consumers the rest (setmaxnreg:
// multiples of 8). COPIES: stages of the ring's size past its STAGES that no TMA load fills, where the consumers
// write what they multiply (TF32's backward-weight: its operands transposed, conv_sm90_wgrad_tf32).
template <int CONSUMERS_, int BN_, int STAGES_, int MIN_BLOCKS_ = 1, class E = bf16, int COPIES_ = 0>
struct Sm90Tile {
    using Element = E;
    static constexpr int CONSUMERS = CONSUMERS_, BM = 64 * CONSUMERS, BN = BN_, BK = 128 / int(sizeof(E));
    static constexpr int STAGES = STAGES_, COPIES = COPIES_, MMAS = 4;
    static constexpr int MIN_BLOCKS = MIN_BLOCKS_, THREADS = 128 * (1 + CONSUMERS), BLOCK_BYTES = 64 * 128;
    static constexpr int PRODUCER_REGISTERS = 40;
    static constexpr int CONSUMER_REGISTERS = (65536 / MIN_BLOCKS - 128 * PRODUCER_REGISTERS) / (128 * CONSUMERS) / 8 * 8;
    static constexpr int A_BYTES = BM * 128, B_BYTES = BN * 128, STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int RING_BYTES = (STAGES + COPIES) * STAGE_BYTES;
    // the epilogues' scratch: the batch norm's moments of each consumer warp's rows by column (12 bytes each),
    // which is more than its sums take (8 bytes a consumer thread)
    static constexpr int SCRATCH_BYTES = 12 * 4 * CONSUMERS * BN;
    // the ring (and the copies) from the first 1024-byte aligned address of the dynamic shared memory (1024 bytes
    // of slack), then the full and empty barriers, then the scratch
    static constexpr int SHARED_BYTES = 1024 + RING_BYTES + 2 * STAGES * 8 + SCRATCH_BYTES;
    using ConsumerSync = NamedSync<128 * CONSUMERS>;   // the consumers' barrier: the producer loads on
    static_assert(BN % 64 == 0 && STAGE_BYTES % 1024 == 0, "whole 8 KB blocks, 1024-byte aligned (the swizzle)");
};
struct Sm90x128 : Sm90Tile<2, 128, 4> {};      // the forward's: 128 KB of ring
struct Sm90x64 : Sm90Tile<2, 64, 6> {};        // 144 KB
struct Sm90Tf32x128 : Sm90Tile<2, 128, 4, 1, float> {};   // TF32's: the same bytes, half the k a stage
struct Sm90Tf32x64 : Sm90Tile<2, 64, 6, 1, float> {};
struct Sm90Wgrad128 : Sm90Tile<2, 128, 4> {};  // backward-weight's, 128 output channels by 128 input channels
struct Sm90Wgrad64 : Sm90Tile<1, 64, 6, 2> {}; // 64 by 64 (100 KB: 2 blocks an SM)
// TF32's backward-weight: 3 stages as TMA lands them and 3 copies transposed (205 KB); 64 by 64, one consumer
// warpgroup: 4 stages and 2 copies (100 KB, 2 blocks an SM)
struct Sm90Tf32Wgrad128 : Sm90Tile<2, 128, 3, 1, float, 3> {};
struct Sm90Tf32Wgrad64 : Sm90Tile<1, 64, 4, 2, float, 2> {};

// A wgmma of a tile's element type: wgmma_bf16, or wgmma_tf32 for float.
template <class E>
struct Sm90Wgmma {
    template <int N>
    __device__ static void run(float (&d)[N / 2], unsigned long long a, unsigned long long b, int accumulate) {
        wgmma_bf16<N>(d, a, b, accumulate);
    }
};
template <>
struct Sm90Wgmma<float> {
    template <int N>
    __device__ static void run(float (&d)[N / 2], unsigned long long a, unsigned long long b, int accumulate) {
        wgmma_tf32<N>(d, a, b, accumulate);
    }
};

// The output pixels of a forward tile: the GEMM's rows are the pixels (i, u, v) of an (N, P, Q) grid, pixel (i, S u +
// a, S v + b) of the (N, H, W) output: the forward's y (S 1, P x Q = H x W; `phase` 0), or, in backward-data of a
// stride-2 convolution (`phases` 4), phase (a, b) = (phase / 2, phase % 2) of dx: its pixels of row parity a and
// column parity b.
struct Sm90Phase {
    int a, b, step, p, q, height, width;
    __device__ Sm90Phase(int phases, int phase, int height_, int width_) : height(height_), width(width_) {
        step = phases == 4 ? 2 : 1;
        a = phase / 2;
        b = phase % 2;
        p = (height - a + step - 1) / step;
        q = (width - b + step - 1) / step;
    }
    __device__ int pixel(int i, int u, int v) const { return (i * height + step * u + a) * width + step * v + b; }
};

// The box of a tile's pixels: rows t = (i box_h + h) box_w + w of the box are the pixel (n0 + i, p0 + h, q0 + w) of an
// (N, P, Q) image batch, the box the `index`-th in (N, P, Q) order.
struct Sm90Box {
    int box_w, box_h, box_i, n0, p0, q0;
    __device__ Sm90Box(int index, int box_w_, int box_h_, int box_i_, int p, int q)
        : box_w(box_w_), box_h(box_h_), box_i(box_i_) {
        const int boxes_w = (q + box_w - 1) / box_w, boxes_h = (p + box_h - 1) / box_h;
        q0 = index % boxes_w * box_w;
        p0 = index / boxes_w % boxes_h * box_h;
        n0 = index / (boxes_w * boxes_h) * box_i;
    }
    // the index of the output's pixel of row `row` (`out`: the batch of n images a phase of the output), or -1 past
    // the batch's edges
    __device__ int pixel(int row, int n, const Sm90Phase& out) const {
        const int img = n0 + row / (box_h * box_w), y = p0 + row / box_w % box_h, x = q0 + row % box_w;
        return img < n && y < out.p && x < out.q ? out.pixel(img, y, x) : -1;
    }
    // how many of its pixels lie inside the batch
    __device__ int pixels(int n, int p, int q) const {
        return (min(n, n0 + box_i) - n0) * (min(p, p0 + box_h) - p0) * (min(q, q0 + box_w) - q0);
    }
};

// The epilogue's view of the boxes for the batch norm's sums across tiles (bn_stats.cuh): the pixels of `count`
// boxes from `first` (bn_tile_merge's values_of), of the `boxes` of the (N, P, Q) batch.
struct Sm90BoxValues {
    int box_w, box_h, box_i, n, p, q, boxes;
    __device__ float operator()(int first, int count) const {
        float values = 0.0f;
        for (int index = first; index < min(first + count, boxes); ++index)
            values += float(Sm90Box(index, box_w, box_h, box_i, p, q).pixels(n, p, q));
        return values;
    }
};

// Where row r of a tile and channel c lie in an NHWC output of `channels` channels (bn_tile_sums's Out): the
// box's pixel r, -1 past the batch.
struct Sm90BoxRows {
    Sm90Box box;
    int n;
    Sm90Phase out;
    int channels;
    __device__ int row(int r) const {
        const int pixel = box.pixel(r, n, out);
        return pixel < 0 ? -1 : pixel * channels;
    }
    __device__ int column(int c) const { return c < channels ? c : -1; }
};

// Where a filter tap finds its operand of x, in a convolution of stride S (1 or 2): x's pixels of row parity a and
// column parity b (modulo S), x[:, a::S, b::S, :], are the tensor map x_maps[S a + b] (with S = 1, x itself); the tap
// (r, s) moves a box of output pixels (p, q) to x's (S p + r - ph, S q + s - pw): in the map of the parities of
// r - ph and s - pw, the box moved by floor((r - ph) / S) rows and floor((s - pw) / S) columns. TMA's zeros past the
// map are the padding, whichever it is.
struct Sm90Tap {
    int map, rows, columns;
    __device__ Sm90Tap(int tap, int kw, int ph, int pw, int stride) {
        const int dr = tap / kw - ph, ds = tap % kw - pw;
        const int a = (dr % stride + stride) % stride, b = (ds % stride + stride) % stride;
        map = stride * a + b;
        rows = (dr - a) / stride;
        columns = (ds - b) / stride;
    }
};

// The filter taps a forward block steps through (count), and for the i-th (move) where A finds its operand (map, box
// offsets) and B's column of filters. The forward (`phased` false): every tap (r, s) in order, Sm90Tap's move.
// Backward-data of a stride-2 convolution (phased; the GEMM's input dy, its weights mirrored, (C, KH, KW, O)): phase
// (a, b) of dx takes the taps with r = a + ph and s = b + pw modulo 2, dy's row u + (a + ph - r) / 2 for dx's 2u + a
// (and so the columns), B's column the tap mirrored (mirrored_weights). A phase no tap reaches has none.
struct Sm90Taps {
    struct Move {
        int map, rows, columns, filter;
    };
    int kh, kw, ph, pw, stride, a, b, r0, s0, rows, columns;
    bool phased;
    __device__ Sm90Taps(int kh_, int kw_, int ph_, int pw_, int stride_, const Sm90Phase& out, bool phased_)
        : kh(kh_), kw(kw_), ph(ph_), pw(pw_), stride(stride_), a(out.a), b(out.b), phased(phased_) {
        r0 = phased ? (a + ph) % 2 : 0;
        s0 = phased ? (b + pw) % 2 : 0;
        rows = phased ? (kh - r0 + 1) / 2 : kh;
        columns = phased ? (kw - s0 + 1) / 2 : kw;
    }
    __device__ int count() const { return rows * columns; }
    __device__ Move move(int i) const {
        const int r = r0 + (phased ? 2 : 1) * (i / columns), s = s0 + (phased ? 2 : 1) * (i % columns);
        if (!phased) {
            const Sm90Tap tap(r * kw + s, kw, ph, pw, stride);
            return {tap.map, tap.rows, tap.columns, r * kw + s};
        }
        return {0, (a + ph - r) / 2, (b + pw - s) / 2, (kh - 1 - r) * kw + kw - 1 - s};
    }
};

// The four tensor maps of x (Sm90Tap), kernel parameters; sm90_x_map(i, ...) the i-th.
#define SM90_X_MAPS                                                                                             \
    const __grid_constant__ TensorMap x_map0, const __grid_constant__ TensorMap x_map1,                       \
        const __grid_constant__ TensorMap x_map2, const __grid_constant__ TensorMap x_map3
__device__ __forceinline__ const TensorMap& sm90_x_map(int i, const TensorMap& m0, const TensorMap& m1,
                                                       const TensorMap& m2, const TensorMap& m3) {
    return i == 0 ? m0 : i == 1 ? m1 : i == 2 ? m2 : m3;
}

// The mainloop's pipeline: a ring of STAGES stages, each with a `full` mbarrier (the producer's arrival with the
// stage's expected bytes, completed by its TMA loads) and an `empty` one (an arrival per consumer warpgroup, once
// its wgmmas of the stage retired). The producer's thread acquires step k's stage once its previous use was released
// (the empty barrier's phase of the pass before: a fresh barrier's parity-1 wait returns at once); the consumers
// wait for it to land, issue their wgmmas on it (`mma`), commit, and release the stage of the step before
// (wgmma_wait<1>: one group in flight while the next lands).
template <class Tile>
struct Sm90Pipeline {
    unsigned char* ring;
    unsigned long long *full, *empty;
    unsigned char* scratch;   // the epilogues' (Tile::SCRATCH_BYTES)

    __device__ explicit Sm90Pipeline(unsigned char* dynamic) {
        const unsigned misalign = smem_address(dynamic) & 1023;
        ring = dynamic + (misalign ? 1024 - misalign : 0);
        full = reinterpret_cast<unsigned long long*>(ring + Tile::RING_BYTES);
        empty = full + Tile::STAGES;
        scratch = reinterpret_cast<unsigned char*>(empty + Tile::STAGES);
    }
    __device__ unsigned char* a(int stage, int block = 0) const {
        return ring + stage * Tile::STAGE_BYTES + block * Tile::BLOCK_BYTES;
    }
    __device__ unsigned char* b(int stage, int block = 0) const { return a(stage) + Tile::A_BYTES + block * Tile::BLOCK_BYTES; }
    // copy `i` (of Tile::COPIES), laid out as a stage
    __device__ unsigned char* copy(int i) const { return a(Tile::STAGES + i); }

    // by one thread, before the block's first barrier: `releases` arrivals free a stage (one per consumer warpgroup,
    // or one per consumer thread where each thread reads the stage with plain loads too)
    __device__ void init(int releases) const {
        for (int s = 0; s < Tile::STAGES; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], releases);
        }
        fence_barrier_init();
    }

    // The producer's thread: the stage of step `step`, free, its full barrier expecting the stage's bytes.
    __device__ int acquire(int step) const {
        const int stage = step % Tile::STAGES;
        mbarrier_wait(&empty[stage], (step / Tile::STAGES & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full[stage], Tile::STAGE_BYTES);
        return stage;
    }

    // A consumer warpgroup's `steps` steps into acc, the ring's steps from `first` on (a persistent block's tiles
    // follow each other through it): mma(stage, k) issues the wgmmas of the tile's step k (k 0: the accumulators'
    // first, which they overwrite), the accumulators fenced around them (wgmma_fence_operands); the last step's stage
    // is released too, once the wgmmas retired. `releases`: this thread arrives on the empty barriers (init's count
    // says how many do).
    template <int N, class Mma>
    __device__ void consume(float (&acc)[N], int first, int steps, bool releases, Mma mma) const {
        for (int k = 0; k < steps; ++k) {
            const int step = first + k, stage = step % Tile::STAGES;
            mbarrier_wait(&full[stage], step / Tile::STAGES & 1);
            wgmma_fence_operands(acc);
            wgmma_fence();
            mma(stage, k);
            wgmma_commit();
            wgmma_wait<1>();   // the step before retired: its stage is free
            wgmma_fence_operands(acc);
            if (k > 0 && releases) mbarrier_arrive(&empty[(step - 1) % Tile::STAGES]);
        }
        wgmma_wait<0>();
        wgmma_fence_operands(acc);
        if (steps > 0 && releases) mbarrier_arrive(&empty[(first + steps - 1) % Tile::STAGES]);
    }
};

// The start of a warp-specialised kernel: thread 0 prefetches the maps and makes the barriers (`releases` arrivals
// free a stage); then the producer warpgroup gives its registers to the consumers. Returns whether this thread is a
// consumer's.
template <class Tile>
__device__ __forceinline__ bool sm90_roles(const Sm90Pipeline<Tile>& pipeline, const TensorMap& a_map,
                                           const TensorMap& b_map, int releases = Tile::CONSUMERS) {
    if (threadIdx.x == 0) {
        tma_prefetch(a_map);
        tma_prefetch(b_map);
        pipeline.init(releases);
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        setmaxnreg_dec<Tile::PRODUCER_REGISTERS>();
        return false;
    }
    setmaxnreg_inc<Tile::CONSUMER_REGISTERS>();
    return true;
}

// ---- forward (and backward-data) ------------------------------------------------------------------------------

// The batch norm's statistics of the forward's output channels o0.. (bn_stats.cuh) from the consumers' accumulators,
// as the epilogue stored them (plus the bias, rounded to the element type): each thread's two rows of a column
// (ShiftedSums),
// merged across the 8 lanes that share the column (shuffles), then the block's 4 CONSUMERS warps in order
// (bn_block_statistics), then the boxes (Sm90BoxValues counts their pixels): this tile's box `tile` of the `tiles` of
// its filters' tile `channel_tile`. smem: the scratch (12 * 4 CONSUMERS * BN bytes). Every consumer thread must call
// it, and only they (`sync`).
template <class Tile>
__device__ __forceinline__ void sm90_batch_stats(const BnStats& s, const Sm90Box& box, const Sm90BoxValues& boxes,
                                                 const Sm90Phase& out, int o, int o0, const float* bias,
                                                 const float (&acc)[Tile::BN / 2], unsigned char* smem, int tile,
                                                 int tiles, int channel_tile, const typename Tile::ConsumerSync& sync) {
    Moments* part = reinterpret_cast<Moments*>(smem);   // [4 CONSUMERS warps][BN]
    const int thread = int(threadIdx.x) - 128, lane = thread % 32, warp = thread / 32;
    bool inside[2];
#pragma unroll
    for (int half = 0; half < 2; ++half)
        inside[half] = box.pixel(16 * warp + lane / 4 + 8 * half, boxes.n, out) >= 0;
    sync.sync();   // every consumer is done with the scratch (the tile before)
#pragma unroll
    for (int j = 0; j < Tile::BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int column = 8 * j + 2 * (lane % 4) + e;
            const float b = bias ? bias[o0 + column] : 0.0f;
            ShiftedSums sums;
#pragma unroll
            for (int half = 0; half < 2; ++half)
                if (inside[half])
                    sums.add(to_float(stored<typename Tile::Element>(acc[4 * j + 2 * half + e] + b)));
            Moments m = sums.moments();
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) m = merged(m, shuffled_xor(m, x));
            if (lane < 4) part[warp * Tile::BN + column] = m;
        }
    bn_block_statistics(s, part, 4 * Tile::CONSUMERS, Tile::BN, thread, o0, o, tile, tiles, boxes, channel_tile, sync);
}

// The tile scheduler of the persistent forward: its tiles are (phase, filters, box), outermost first, boxes x
// filter_tiles x phases of them; block b takes tiles b, b + gridDim.x, ..., so that the blocks at work at once
// share the filters and neighbouring pixels in L2, and each block's producer loads its next tile's stages while
// the consumers finish the tile before (the epilogue).
struct Sm90Tiles {
    int boxes, filter_tiles, phases;
    __device__ int count() const { return boxes * filter_tiles * phases; }
    __device__ int box(int tile) const { return tile % boxes; }
    __device__ int filters(int tile) const { return tile / boxes % filter_tiles; }
    __device__ int phase(int tile) const { return tile / (boxes * filter_tiles); }
};

// A tile of the persistent forward: its phase of the output, its box, its taps, its filters (o0), and its steps (taps
// by chunks of 64 channels; none for a box past its phase's images, a phase's boxes being fewer than the largest
// phase's, nor for a phase no tap reaches).
struct Sm90ForwardTile {
    Sm90Phase out;
    Sm90Box box;
    Sm90Taps taps;
    int o0, steps;
    __device__ Sm90ForwardTile(const Sm90Tiles& tiles, int tile, int bn, int n, int chunks, int kh, int kw, int ph,
                               int pw, int stride, int phases, int oh, int ow, int box_w, int box_h, int box_i)
        : out(phases, tiles.phase(tile), oh, ow), box(tiles.box(tile), box_w, box_h, box_i, out.p, out.q),
          taps(kh, kw, ph, pw, stride, out, phases == 4), o0(tiles.filters(tile) * bn),
          steps(box.n0 < n ? taps.count() * chunks : 0) {}
};

// x_map0..3: x (N, H, W, C) of the tile's elements by parities (Sm90Tap), box (box_i, box_h, box_w, BK), swizzled;
// w_map: w (O, KH*KW*C), box (BN, BK), swizzled. TF32: w holds TF32 values (rounded where it was made), and so does x
// where round_a is 0 (backward-data's dy); else each consumer warpgroup rounds its rows of each stage of A to TF32
// as it lands (tf32_round, as conv_tc.cu's stages), or, where fold_mean is not null, makes them relu(the batch norm
// of x) so rounded (bn_stats.cuh's bn_relu_tf32, of the norm's mean, invstd, gamma and beta: x's maps then fill NaN
// past the image, which that makes the padding's 0), before the warpgroup's wgmmas read them (fence_proxy_async, the
// warpgroup's named barrier). Persistent: the blocks take the tiles as Sm90Tiles says, `boxes` of them a
// phase and BN filters (the output's largest phase's boxes), their steps following each other through the ring. A
// tile's step k: tap (r, s), channels c0..c0+63: A is the output box moved by the tap in x (Sm90Taps; K-major: a
// pixel's 64 channels a line), B those k of the BN filters (K-major). After the tile is stored, the consumers compute
// from it, unless the pointer that asks is null: the statistics of the batch norm that follows the forward
// (stats_partial, sm90_batch_stats), or the backward sums of the norm whose dy this backward-data's dx is
// (sums_partial, bn_tile_sums: of y as stored, after the add), among themselves (their named barrier), in the
// scratch.
template <class Tile, bool ADD>
__global__ void __launch_bounds__(Tile::THREADS, Tile::MIN_BLOCKS)
conv_sm90_forward(SM90_X_MAPS, const __grid_constant__ TensorMap w_map, const float* __restrict__ bias,
                  typename Tile::Element* __restrict__ y, int n, int c, int o, int kh, int kw, int ph, int pw,
                  int stride, int phases, int oh, int ow, int box_w, int box_h, int box_i, int boxes, int round_a,
                  const float* __restrict__ fold_mean, const float* __restrict__ fold_invstd,
                  const float* __restrict__ fold_gamma, const float* __restrict__ fold_beta, BN_STATS_PARAMS,
                  BN_SUMS_PARAMS(typename Tile::Element)) {
    using E = typename Tile::Element;
    extern __shared__ __align__(1024) unsigned char sm90_dynamic[];
    const Sm90Pipeline<Tile> pipeline(sm90_dynamic);
    const Sm90Tiles tiles{boxes, o / Tile::BN, phases};
    const int chunks = c / Tile::BK, t = threadIdx.x;
    const auto tile_at = [&](int tile) {
        return Sm90ForwardTile(tiles, tile, Tile::BN, n, chunks, kh, kw, ph, pw, stride, phases, oh, ow, box_w, box_h,
                               box_i);
    };
    if (!sm90_roles(pipeline, x_map0, w_map)) {
        if (t == 0)
            for (int tile = blockIdx.x, step = 0; tile < tiles.count(); tile += gridDim.x) {
                const Sm90ForwardTile at = tile_at(tile);
                for (int k = 0; k < at.steps; ++k, ++step) {
                    const int stage = pipeline.acquire(step), c0 = k % chunks * Tile::BK;
                    const Sm90Taps::Move move = at.taps.move(k / chunks);
                    tma_load_4d(pipeline.a(stage), sm90_x_map(move.map, x_map0, x_map1, x_map2, x_map3),
                                &pipeline.full[stage], c0, at.box.q0 + move.columns, at.box.p0 + move.rows,
                                at.box.n0);
                    tma_load_2d(pipeline.b(stage), w_map, &pipeline.full[stage], move.filter * c + c0, at.o0);
                }
            }
        return;
    }
    const int group = t / 128 - 1, lane = t % 32, warp = t % 128 / 32;
    const typename Tile::ConsumerSync sync;
    for (int tile = blockIdx.x, first = 0; tile < tiles.count(); tile += gridDim.x) {
        const Sm90ForwardTile at = tile_at(tile);
        float acc[Tile::BN / 2];
        if (at.steps == 0)   // no product: the sum of no terms
#pragma unroll
            for (int i = 0; i < Tile::BN / 2; ++i) acc[i] = 0.0f;
        pipeline.consume(acc, first, at.steps, t % 128 == 0, [&](int stage, int step) {
            if (sizeof(E) == 4 && (round_a || fold_mean)) {   // TF32: the warpgroup's 64 lines of A, 16 bytes at a time
                float4* lines = reinterpret_cast<float4*>(pipeline.a(stage, group));
                // a thread's chunks: physical chunk t % 8 of lines t % 128 / 8 + 16 m, its 4 channels chunk j of the
                // line (the swizzle: j ^ line % 8), the same in each
                float4 scale, shift;
                if (fold_mean)
                    bn_coefficients(fold_mean, fold_invstd, fold_gamma, fold_beta,
                                    step % chunks * Tile::BK + 4 * ((t % 8) ^ (t % 128 / 8 % 8)), scale, shift);
#pragma unroll
                for (int i = t % 128; i < Tile::BLOCK_BYTES / 16; i += 128) {
                    const float4 v = lines[i];
                    lines[i] = fold_mean ? bn_relu_tf32(v, scale, shift) : tf32_round4(v);
                }
                fence_proxy_async();
                named_barrier_sync(2 + group, 128);
            }
#pragma unroll
            for (int k = 0; k < Tile::MMAS; ++k)   // 32 bytes along each K-major line a wgmma
                Sm90Wgmma<E>::template run<Tile::BN>(acc, wgmma_descriptor_sw128(pipeline.a(stage, group) + 32 * k),
                                                     wgmma_descriptor_sw128(pipeline.b(stage) + 32 * k),
                                                     step > 0 || k > 0);
        });
        first += at.steps;
        // the epilogue: d[4j + i] is row 16 warp + lane / 4 + 8 (i / 2), column 8 j + 2 (lane % 4) + i % 2
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int pixel = at.box.pixel(group * 64 + warp * 16 + lane / 4 + 8 * half, n, at.out);
            if (pixel < 0) continue;
            E* row = y + size_t(pixel) * o + at.o0;
#pragma unroll
            for (int j = 0; j < Tile::BN / 8; ++j) {
                const int column = 8 * j + 2 * (lane % 4);
                float lo = acc[4 * j + 2 * half], hi = acc[4 * j + 2 * half + 1];
                if (bias) {
                    lo += bias[at.o0 + column];
                    hi += bias[at.o0 + column + 1];
                }
                if constexpr (sizeof(E) == 2) {   // bf16: a pair of neighbours, rounded once
                    unsigned* pair = reinterpret_cast<unsigned*>(row + column);
                    if (ADD) {
                        lo += bf16x2_low(*pair);
                        hi += bf16x2_high(*pair);
                    }
                    *pair = bf16x2_round(lo, hi);
                } else {
                    float2* pair = reinterpret_cast<float2*>(row + column);
                    if (ADD) {
                        lo += pair->x;
                        hi += pair->y;
                    }
                    *pair = make_float2(lo, hi);
                }
            }
        }
        if (stats_partial)   // (the forward: one phase)
            sm90_batch_stats<Tile>(BnStats BN_STATS, at.box, Sm90BoxValues{box_w, box_h, box_i, n, oh, ow, boxes},
                                   at.out, o, at.o0, bias, acc, pipeline.scratch, tiles.box(tile), boxes,
                                   tiles.filters(tile), sync);
        if (sums_partial)   // over the boxes of every phase
            bn_tile_sums<Tile, 128 * Tile::CONSUMERS, 128>(
                BnSums<E> BN_SUMS, Sm90BoxRows{at.box, n, at.out, o}, o, y,
                reinterpret_cast<float*>(pipeline.scratch), 0, at.o0, tiles.phase(tile) * boxes + tiles.box(tile),
                phases * boxes, tiles.filters(tile), sync);
    }
}

// ---- backward-weight ------------------------------------------------------------------------------------------

// dw[o][tap][c] = the sum over the pixels (n, p, q) of dy[n, p, q, o] x[n, S p + r - ph, S q + s - pw, c], for one
// tap (r, s) a block: M = the output channels o, N = the input channels c, k = the pixels, BK a step (64 of bf16,
// 32 of TF32: a 128-byte line of channels): a box of dy's pixels (dy_map: dy (N, OH, OW, O), box (box_i, box_h,
// box_w, BK)) and the same box moved by the tap in x (Sm90Tap: x_map0..3, the same box), each a line a pixel of BK
// channels. Block (blockIdx.x, blockIdx.y): BN input channels by BM output channels; blockIdx.z = tap + taps part:
// part `part` of the boxes of dy, `boxes` of them a part, its sums to slot `part` of `out` (float32 (parts, O, taps,
// C)): with one part, dw ((O, KH, KW, C), float32). The bias gradient, dy summed per output channel, by the blocks
// of the first tap and input channels when `bias_out` is not null (slot `part` of (parts, O); db with one part).

// The boxes and tap of a backward-weight block.
struct Sm90WgradBlock {
    int c0, o0, tap, part, first, steps;
    template <class Tile>
    __device__ static Sm90WgradBlock of(int taps, int n, int oh, int ow, int box_w, int box_h, int box_i, int boxes) {
        const int all = ((n + box_i - 1) / box_i) * ((oh + box_h - 1) / box_h) * ((ow + box_w - 1) / box_w);
        const int part = blockIdx.z / taps, first = part * boxes;
        return {int(blockIdx.x) * Tile::BN, int(blockIdx.y) * Tile::BM, int(blockIdx.z) % taps, part, first,
                min(boxes, all - first)};
    }
};

// The producer's thread: step k's stage is box first + k of dy, BM / BK lines of BK output channels, and that box
// moved by the tap in x, BN / BK lines of BK input channels, each load 64 (bf16) or 32 (TF32) pixels by 128 bytes.
template <class Tile>
__device__ __forceinline__ void sm90_wgrad_loads(const Sm90Pipeline<Tile>& pipeline, const Sm90WgradBlock& at,
                                                 const TensorMap& dy_map, const TensorMap& x_map, const Sm90Tap& move,
                                                 int oh, int ow, int box_w, int box_h, int box_i) {
    constexpr int LOAD_BYTES = Tile::BK * 128;
    for (int step = 0; step < at.steps; ++step) {
        const int stage = pipeline.acquire(step);
        const Sm90Box box(at.first + step, box_w, box_h, box_i, oh, ow);
#pragma unroll
        for (int j = 0; j < Tile::BM / Tile::BK; ++j)
            tma_load_4d(pipeline.a(stage) + LOAD_BYTES * j, dy_map, &pipeline.full[stage], at.o0 + Tile::BK * j,
                        box.q0, box.p0, box.n0);
#pragma unroll
        for (int j = 0; j < Tile::BN / Tile::BK; ++j)
            tma_load_4d(pipeline.b(stage) + LOAD_BYTES * j, x_map, &pipeline.full[stage], at.c0 + Tile::BK * j,
                        box.q0 + move.columns, box.p0 + move.rows, box.n0);
    }
}

// The epilogue: row (output channel) 64 group + 16 warp + lane / 4 + 8 (i / 2), column (input channel)
// 8 j + 2 (lane % 4) + i % 2 of a consumer's accumulators; the partials of a part in (O, taps, C) like dw.
template <class Tile>
__device__ __forceinline__ void sm90_wgrad_store(const float (&acc)[Tile::BN / 2], const Sm90WgradBlock& at,
                                                 float* __restrict__ out, int o, int taps, int c) {
    const int t = threadIdx.x, group = t / 128 - 1, lane = t % 32, warp = t % 128 / 32;
    float* slot = out + size_t(at.part) * o * taps * c;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = at.o0 + 64 * group + 16 * warp + lane / 4 + 8 * half;
        if (row >= o) continue;
        float* line = slot + (size_t(row) * taps + at.tap) * c + at.c0;
#pragma unroll
        for (int j = 0; j < Tile::BN / 8; ++j) {
            const int column = 8 * j + 2 * (lane % 4);
            if (at.c0 + column < c)
                *reinterpret_cast<float2*>(line + column) = make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
        }
    }
}

// bf16: the stages are MN-major operands (wgmma's transposed A and B: 64 channels a 128-byte line, lines 8 pixels a
// 1024-byte swizzle atom, the next 64 channels an 8 KB block further). The bias: a consumer's first 64 threads each
// add up one output channel's column of the stage's A as it lands, in order.
template <class Tile>
__global__ void __launch_bounds__(Tile::THREADS, Tile::MIN_BLOCKS)
conv_sm90_wgrad(const __grid_constant__ TensorMap dy_map, SM90_X_MAPS, float* __restrict__ out,
                float* __restrict__ bias_out, int n, int c, int o, int kw, int taps, int ph, int pw, int stride, int oh,
                int ow, int box_w, int box_h, int box_i, int boxes) {
    extern __shared__ __align__(1024) unsigned char sm90_dynamic[];
    const Sm90Pipeline<Tile> pipeline(sm90_dynamic);
    const Sm90WgradBlock at = Sm90WgradBlock::of<Tile>(taps, n, oh, ow, box_w, box_h, box_i, boxes);
    const int t = threadIdx.x;
    // the blocks that sum the bias read each stage with plain loads too: every consumer thread releases it
    const bool bias_block = bias_out && at.tap == 0 && blockIdx.x == 0;
    if (!sm90_roles(pipeline, dy_map, x_map0, bias_block ? 128 * Tile::CONSUMERS : Tile::CONSUMERS)) {
        const Sm90Tap move(at.tap, kw, ph, pw, stride);
        if (t == 0)
            sm90_wgrad_loads(pipeline, at, dy_map, sm90_x_map(move.map, x_map0, x_map1, x_map2, x_map3), move, oh, ow,
                             box_w, box_h, box_i);
        return;
    }
    const int group = t / 128 - 1;
    const bool sums_bias = bias_block && t % 128 < 64;
    float acc[Tile::BN / 2], bias = 0.f;
    pipeline.consume(acc, 0, at.steps, bias_block || t % 128 == 0, [&](int stage, int step) {
        const unsigned char* a = pipeline.a(stage, group);
#pragma unroll
        for (int k = 0; k < Tile::MMAS; ++k)   // k16 a wgmma: 16 lines (pixels), 2048 bytes
            wgmma_bf16<Tile::BN, true>(acc, wgmma_descriptor_sw128(a + 2048 * k, Tile::BLOCK_BYTES),
                                       wgmma_descriptor_sw128(pipeline.b(stage) + 2048 * k, Tile::BLOCK_BYTES),
                                       step > 0 || k > 0);
        if (sums_bias) {   // channel m = t % 64 of line l: chunk (m / 8) ^ (l % 8) of the line, element m % 8
            const int m = t % 64;
            for (int l = 0; l < Tile::BK; ++l)
                bias += bf16_float(*reinterpret_cast<const bf16*>(a + 128 * l + 16 * ((m / 8) ^ (l % 8)) + 2 * (m % 8)));
        }
    });
    if (sums_bias && at.o0 + 64 * group + t % 64 < o) bias_out[size_t(at.part) * o + at.o0 + 64 * group + t % 64] = bias;
    sm90_wgrad_store<Tile>(acc, at, out, o, taps, c);
}

// A consumer thread's part of a TF32 stage transposed: of the 32 pixels by 64 channels that warpgroup `group`
// takes (channels 64 group.., in 4 KB loads of 32 channels, as TMA landed them: pixel l's line, chunk j of its 4
// channels at j ^ (l % 8)), thread t (of 128) reads the 4 pixels 4 (t % 8).. of the 4 channels 4 (t / 8)..,
// f(chunk) makes each what is multiplied, and it writes them K-major into `copy` (row = channel 64 group + 4 (t /
// 8) + e, a 128-byte line of the 32 pixels, chunk t % 8 at (t % 8) ^ (row % 8)): a line a channel, which wgmma reads
// K-major, as it reads TF32 alone. A warp's 8 lanes of a channel write a line's 8 chunks.
template <class F>
__device__ __forceinline__ void sm90_transposed(const unsigned char* stage, unsigned char* copy, int group, F f) {
    const int t = threadIdx.x % 128, channels = t / 8, pixels = t % 8;
    const unsigned char* block = stage + 4096 * (2 * group + channels / 8);
    float4 v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int line = 4 * pixels + i;
        v[i] = f(*reinterpret_cast<const float4*>(block + 128 * line + 16 * ((channels % 8) ^ (line % 8))));
    }
    const auto row = [&](int e) {
        return reinterpret_cast<float4*>(copy + 128 * (64 * group + 4 * channels + e) +
                                         16 * (pixels ^ ((4 * channels + e) % 8)));
    };
    *row(0) = make_float4(v[0].x, v[1].x, v[2].x, v[3].x);
    *row(1) = make_float4(v[0].y, v[1].y, v[2].y, v[3].y);
    *row(2) = make_float4(v[0].z, v[1].z, v[2].z, v[3].z);
    *row(3) = make_float4(v[0].w, v[1].w, v[2].w, v[3].w);
}

// TF32: wgmma reads TF32 operands K-major alone, and both of backward-weight's are MN-major in memory (k, the pixels,
// outermost), so each stage lands as the loads give it (32 pixels by 128-byte lines of 32 channels) and the
// consumers write it transposed into a copy (sm90_transposed: a warpgroup its 64 rows of A, dy's output channels, and
// 64 of B's, x's input channels; BN = BM), rounding dy's values to TF32 and x's (or making x relu(the batch norm of
// x) so rounded where fold_mean is not null: x's maps then fill NaN past the image, which that makes the padding's
// 0), release the stage (every consumer thread reads it), and meet (fence_proxy_async, their named barrier) before
// their wgmmas m64nBNk8 read the copy. The copies are COPIES deep: with two consumer warpgroups, 3: the copy of step
// k is written again at k + 3, after the barrier of k + 2, which every warpgroup reaches once its wgmmas of k retired
// (wgmma_wait<1> after k + 1's), while a warpgroup's wgmmas of k + 1 may still read its copy (of two copies, the
// other warpgroup's wgmmas of k may still read the one k + 2 writes: the emulator refuses it); with one, 2 (its own
// wgmma_wait<1> retired k before it writes k + 2). dy is as given:
// the bias gradient sums it as it lands, before the rounding, each thread its 4 channels' 4 pixels a step, then the
// 8 lanes of a channel (shuffles), in order.
template <class Tile>
__global__ void __launch_bounds__(Tile::THREADS, Tile::MIN_BLOCKS)
conv_sm90_wgrad_tf32(const __grid_constant__ TensorMap dy_map, SM90_X_MAPS, float* __restrict__ out,
                     float* __restrict__ bias_out, int n, int c, int o, int kw, int taps, int ph, int pw, int stride,
                     int oh, int ow, int box_w, int box_h, int box_i, int boxes, const float* __restrict__ fold_mean,
                     const float* __restrict__ fold_invstd, const float* __restrict__ fold_gamma,
                     const float* __restrict__ fold_beta) {
    static_assert(Tile::BN == Tile::BM, "a warpgroup transposes 64 channels of A and of B");
    static_assert(Tile::COPIES == (Tile::CONSUMERS == 1 ? 2 : 3), "a copy written once its wgmmas retired");
    extern __shared__ __align__(1024) unsigned char sm90_dynamic[];
    const Sm90Pipeline<Tile> pipeline(sm90_dynamic);
    const Sm90WgradBlock at = Sm90WgradBlock::of<Tile>(taps, n, oh, ow, box_w, box_h, box_i, boxes);
    const int t = threadIdx.x;
    if (!sm90_roles(pipeline, dy_map, x_map0, 128 * Tile::CONSUMERS)) {
        const Sm90Tap move(at.tap, kw, ph, pw, stride);
        if (t == 0)
            sm90_wgrad_loads(pipeline, at, dy_map, sm90_x_map(move.map, x_map0, x_map1, x_map2, x_map3), move, oh, ow,
                             box_w, box_h, box_i);
        return;
    }
    const int group = t / 128 - 1, channels = 64 * group + 4 * (t % 128 / 8);   // this thread's 4 of A and of B
    const bool bias_block = bias_out && at.tap == 0 && blockIdx.x == 0;
    float4 scale, shift, bias = make_float4(0.f, 0.f, 0.f, 0.f);
    if (fold_mean) bn_coefficients(fold_mean, fold_invstd, fold_gamma, fold_beta, at.c0 + channels, scale, shift);
    const typename Tile::ConsumerSync sync;
    float acc[Tile::BN / 2];
    for (int step = 0; step < at.steps; ++step) {
        const int stage = step % Tile::STAGES;
        unsigned char* copy = pipeline.copy(step % Tile::COPIES);
        mbarrier_wait(&pipeline.full[stage], step / Tile::STAGES & 1);
        sm90_transposed(pipeline.a(stage), copy, group, [&](float4 v) {
            if (bias_block) bias = make_float4(bias.x + v.x, bias.y + v.y, bias.z + v.z, bias.w + v.w);
            return tf32_round4(v);
        });
        sm90_transposed(pipeline.b(stage), copy + Tile::A_BYTES, group,
                        [&](float4 v) { return fold_mean ? bn_relu_tf32(v, scale, shift) : tf32_round4(v); });
        mbarrier_arrive(&pipeline.empty[stage]);
        fence_proxy_async();
        sync.sync();   // every warpgroup's rows of the copy written
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < Tile::MMAS; ++k)   // k8 a wgmma: 32 bytes along each K-major line
            wgmma_tf32<Tile::BN>(acc, wgmma_descriptor_sw128(copy + Tile::BLOCK_BYTES * group + 32 * k),
                                 wgmma_descriptor_sw128(copy + Tile::A_BYTES + 32 * k), step > 0 || k > 0);
        wgmma_commit();
        wgmma_wait<1>();
        wgmma_fence_operands(acc);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    if (bias_block) {
        float sums[4] = {bias.x, bias.y, bias.z, bias.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
            for (int x = 1; x < 8; x <<= 1) sums[e] += __shfl_xor_sync(0xffffffffu, sums[e], x);
            if (t % 8 == 0 && at.o0 + channels + e < o) bias_out[size_t(at.part) * o + at.o0 + channels + e] = sums[e];
        }
    }
    sm90_wgrad_store<Tile>(acc, at, out, o, taps, c);
}
