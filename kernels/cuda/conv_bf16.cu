// conv_bf16.cu: 2-D convolution on BF16 tensor cores, as implicit GEMMs on channels-last (NHWC)
// bfloat16 activations, summed in float32: the convolutions of the bf16 precision whose channel
// counts are multiples of 8. Launched by kernels/cuda/conv_tc.py; checked by tests/test_conv_bf16.py
// against float64 of the bfloat16 inputs, on the CPU emulator in CI and on a GPU under `pytest -m gpu`.
//
//   conv_bf16_forward  y (N*OH*OW x O)  = im2col(x) (N*OH*OW x KH*KW*C) . w_krsc^T (KH*KW*C x O) + b
//   conv_bf16_dgrad    dx (cells x C)   = dy gathered (cells x taps*O) . w (taps*O x C), one GEMM per
//                                         stride phase of the input cells (conv_geometry.cuh)
//   conv_bf16_wgrad    dw^T (KH*KW*C x O) = im2col(x)^T (KH*KW*C x N*OH*OW) . dy (N*OH*OW x O), float32,
//                                         in (O, KH, KW, C) or (O, C, KH, KW) order, and the bias
//                                         gradient, the per-channel sums of dy, in the same pass
//   conv_bf16_forward_halo, conv_bf16_dgrad_halo: the forward and backward-data of 3x3, stride-1
//                                         convolutions of 64 columns or fewer from windows of the image,
//                                         each input pixel loaded once for its nine taps (see below)
//   conv_bf16_wgrad_halo                  their backward-weight (64 output channels or fewer) from
//                                         windows of x, a tile of all nine taps of 32 channels (below)
//
// The GEMMs are conv_tc.cu's (tc_conv.cuh holds what they share: the copy iterators, the outputs,
// split-K with its parts added in a fixed order in the same launch, the bias gradient's totals); what
// differs is the element, the tile and the main loop. A block of 2 x WARPS_N warps computes a BM x BN
// tile, each warp (BM/2) x (BN/WARPS_N) as m16n8k16 mma.sync tiles (tensor_core.cuh's mma_bf16): 128 x
// 128 by 8 warps (2 x 4, 256 threads) of 64 x 32 warp tiles, whose operands a block loads per k step,
// (128 + 128) x 2 bytes a k, carry 64 FLOPs a byte, k advancing 32 at a time through a 3-stage ring (48
// KB of shared memory, the static limit), at most 128 registers a thread (64 accumulators) so that 2
// blocks, 16 warps, share an SM of an A100, an RTX 3090 or 4090 or an L4 (their 64 K registers; 96 KB
// of shared memory of the 100 that sm_86's and sm_89's SMs have); 128 x 64 (for 64 columns: ResNet-18's
// first stage) by 4 warps (2 x 2) of 64 x 32, in a 2-stage ring of 64 k. The rings are filled by 16-byte cp.async copies and unrolled,
// as in conv_tc.cu. Nothing is rounded in the loop: the operands are bfloat16 already, and every
// fragment is one ldmatrix.x4 of b16 (the instruction's own element): transposed (.trans) where the
// operand's rows run along m or n (backward-weight's two, whose k is the pixel, and backward-data's
// weights), as it lies otherwise. Shared memory is swizzled by 16-byte chunks rather than padded, so
// that the 8 rows an ldmatrix matrix reads, and a warp's copies, fall in distinct banks (BfStage).
// Each lane's ldmatrix addresses are worked out before the loop; in it they are a register plus a
// constant. Backward-weight's bias gradient is summed from the B fragments (BiasFragments), by the
// first row of tiles alone, in a main loop of its own.
//
// ALIGN = the tile's k (every channel count a multiple of it, at most 32 filter taps): the copies'
// addresses as tc_conv.cuh's aligned iterators work them out, before the loop. ALIGN = 8 (multiples
// of 8): every chunk's address from its (row, k) with divisions. Results are deterministic, and the
// output is rounded to bfloat16 once, where it is stored (float32 for the weight gradient).
#include "tc_conv.cuh"

// Registers for 2 blocks an SM: 128 a thread for the 8 warps of the 128 x 128 tile (64 accumulators, 24
// fragment registers), 255 for the 4 of the others.
constexpr int BF_MIN_BLOCKS = 2;

// A block's tile (tc_conv.cuh's TcTile) with the k of its stages and their number: the large tile
// 3 stages of 32 (48 KB, the most static shared memory a block may have); the 128 x 64 tile, half the
// mma of a stage for the copies of three quarters, 2 stages of 64, so that a stage's copies and its
// loop's fixed costs are shared by twice the mma (bench/tc_plan.py counts the instructions).
template <int BM, int BN, int BK_, int STAGES_, int WARPS_N = 2>
struct BfTile : TcTile<BM, BN, WARPS_N> {
    static constexpr int BK = BK_, STAGES = STAGES_;
};
struct Bf128x128 : BfTile<128, 128, 32, 3, 4> {};
struct Bf128x64 : BfTile<128, 64, 64, 2> {};

// One stage of one operand, W rows (m or n) by BK k of bf16, swizzled by 16-byte chunks of 8 (see the
// header): the element offset of chunk `chunk` of line `line` (the row if K_MAJOR, else the k). A
// K_MAJOR row of BK = 32 is 64 bytes, two to the 128 of a bank cycle: chunk c ^ ((row / 2) % 4); of
// BK = 64, 128 bytes: c ^ (row % 8). A k line: c ^ (k % 8).
template <int W, bool K_MAJOR, int BK>
struct BfStage {
    static constexpr int SIZE = W * BK;
    __device__ static int offset(int line, int chunk) {
        if (!K_MAJOR) return line * W + (chunk ^ (line & 7)) * 8;
        return line * BK + (chunk ^ (BK == 32 ? line >> 1 & 3 : line & 7)) * 8;
    }
};

// The 16-byte chunks (8 elements along the rows or along k) of a stage that this thread copies
// (tc_conv.cuh's Copy map), LANES = BK / 8 threads to a K_MAJOR row or to a k line of 32 chunks:
// K_MAJOR, rows 128 c / LANES + t / LANES, its chunk t % LANES of each, so that a warp's copy
// instruction reads whole rows; else line k = t / (128 / BK), its chunks t % (128 / BK) + (128 / BK) c,
// rows 8 that apart: 64 (BK = 32) or 32 (BK = 64) contiguous bytes of each of a warp's lines, whole
// sectors, an instruction, and a thread's chunks share their k (backward-weight's pixel).
template <int W, bool K_MAJOR, int BK_, int THREADS = TC_THREADS>
struct BfCopy {
    using Element = bf16;
    using Stage = BfStage<W, K_MAJOR, BK_>;
    static constexpr int BK = BK_, ELEMENTS = 8;
    static constexpr int ROW_LANES = BK / 8, LINE_THREADS = THREADS / BK;   // threads to a row, to a k line
    static constexpr int ROW_STEP = K_MAJOR ? THREADS / ROW_LANES : 8 * LINE_THREADS;
    static constexpr int CHUNKS = W * BK / 8 / THREADS;
    static_assert(CHUNKS * 8 * THREADS == W * BK, "whole chunks per thread");
    __device__ static int row(int c) {
        return K_MAJOR ? ROW_STEP * c + int(threadIdx.x) / ROW_LANES : 8 * (int(threadIdx.x) % LINE_THREADS) + ROW_STEP * c;
    }
    __device__ static int k(int c) {
        return K_MAJOR ? 8 * (int(threadIdx.x) % ROW_LANES) : int(threadIdx.x) / LINE_THREADS;
    }
    __device__ static int offset(int c) {
        return K_MAJOR ? Stage::offset(row(c), int(threadIdx.x) % ROW_LANES) : Stage::offset(k(c), row(c) / 8);
    }
};

// Where this lane's ldmatrix.x4 reads an operand's fragments in a stage: for mma tile `i` of the
// warp (A: rows 16 i.., B: columns 16 i.., two n8 tiles) and the k16 step `half` of the stage,
// at(i, half) elements from the stage's start. K_MAJOR stages: matrices (rows 0-7, k 0-7),
// (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) for A, (0-7, 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
// for B, as they lie; else the same matrices transposed (.trans), from [k][W]. The swizzle of a
// K_MAJOR row depends on the lane alone: one offset per k16 step; that of a k line too (k % 8 is the
// lane's), and the tiles differ by 2 chunks XOR it: one offset per tile.
template <int W, bool K_MAJOR, bool IS_A, int TILES, int BK>
struct BfFragments {
    using Stage = BfStage<W, K_MAJOR, BK>;
    int base[K_MAJOR ? BK / 16 : TILES];

    __device__ explicit BfFragments(int w0) {   // w0: the warp's first row (m or n) in the tile
        const int l = int(threadIdx.x) % 32, lo = l % 8, mid = l / 8 % 2, hi = l / 16;
        if constexpr (K_MAJOR) {
            const int row = w0 + lo + 8 * (IS_A ? mid : hi), chunk = IS_A ? hi : mid;
#pragma unroll
            for (int half = 0; half < BK / 16; ++half) base[half] = Stage::offset(row, chunk + 2 * half);
        } else {
            const int k = lo + 8 * (IS_A ? hi : mid), chunk = IS_A ? mid : hi;
#pragma unroll
            for (int i = 0; i < TILES; ++i) base[i] = Stage::offset(k, w0 / 8 + 2 * i + chunk);
        }
    }
    __device__ int at(int i, int half) const {
        return K_MAJOR ? base[half] + i * 16 * BK : base[i] + half * 16 * W;
    }
    __device__ void load(unsigned (&r)[4], const bf16* stage, int i, int half) const {
        if constexpr (K_MAJOR)
            ldmatrix_x4(r, stage + at(i, half));
        else
            ldmatrix_x4_trans(r, stage + at(i, half));
    }
};

// acc += A (m0.., k) . B (k, n0..) over `tiles` stages of k for this warp's part of the block's
// tile: acc[i][j] is mma tile (i, j) of the warp, in tensor_core.cuh's C layout. The iterators a and
// b give the places of the thread's chunks of the current stage (at(c, offset), see tc_load_stage)
// and move to the next (next()). on_chunk_b.b_fragments(fb), when on_chunk_b.active, sees each k16
// step's B fragments of the warp (BiasFragments). Every thread of the block must call it (it
// synchronises the block). smem: the stages, BfShared<T> (the caller's, so that its epilogue may use
// it once every thread has returned: a barrier).
// acc += the warp's k16 step: A fragments fa[i] (rows 16 i..) by B fragments fb[j / 2] (columns 8 j..,
// each ldmatrix.x4 holding two n8 tiles: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15))
template <class T>
__device__ __forceinline__ void bf_mma_warp(float (&acc)[T::MI][T::NI][4], const unsigned (&fa)[T::MI][4],
                                            const unsigned (&fb)[T::NI / 2][4]) {
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int j = 0; j < T::NI; ++j) {
            const unsigned b[2] = {fb[j / 2][2 * (j % 2)], fb[j / 2][2 * (j % 2) + 1]};
            mma_bf16(acc[i][j], fa[i], b, acc[i][j]);
        }
}

template <class T>
struct BfShared {
    static constexpr int SIZE = T::STAGES * (T::BM + T::BN) * T::BK;
};

template <class T, bool A_K_MAJOR, bool B_K_MAJOR, class IteratorA, class IteratorB, class OnChunk = NoChunkWork>
__device__ __forceinline__ void bf_gemm(bf16* smem, IteratorA a, IteratorB b, int tiles, float (&acc)[T::MI][T::NI][4],
                                        OnChunk&& on_chunk_b = OnChunk()) {
    constexpr int BK = T::BK, STAGES = T::STAGES;
    using CopyA = BfCopy<T::BM, A_K_MAJOR, BK, T::THREADS>;
    using CopyB = BfCopy<T::BN, B_K_MAJOR, BK, T::THREADS>;
    constexpr int SIZE_A = CopyA::Stage::SIZE, SIZE_B = CopyB::Stage::SIZE;
    static_assert(STAGES * (SIZE_A + SIZE_B) == BfShared<T>::SIZE, "the stages fill the shared memory");
    bf16* const As = smem;
    bf16* const Bs = smem + STAGES * SIZE_A;
    const int warp = int(threadIdx.x) / 32;
    const BfFragments<T::BM, A_K_MAJOR, true, T::MI, BK> fragments_a((warp / T::WARPS_N) * T::WARP_M);
    const BfFragments<T::BN, B_K_MAJOR, false, T::NI / 2, BK> fragments_b((warp % T::WARPS_N) * T::WARP_N);
    tc_clear<T>(acc);
    const auto load = [&](int tile, int stage) {
        if (tile < tiles) {
            tc_load_stage<CopyA>(As + stage * SIZE_A, a);
            tc_load_stage<CopyB>(Bs + stage * SIZE_B, b);
            a.next();
            b.next();
        }
        cp_async_commit();  // one group per tile, empty past the end, so that the waits count tiles
    };
    // one stage of the loop: tile `tile` from stage `stage` while tile + STAGES - 1 goes into the
    // stage of tile - 1
    const auto step = [&](int tile, int stage) {
        const bf16* as = As + stage * SIZE_A;
        const bf16* bs = Bs + stage * SIZE_B;
        cp_async_wait<STAGES - 2>();  // this thread's copies of `tile` have landed
        __syncthreads();                 // everyone's have landed, and everyone is done with tile - 1
        load(tile + STAGES - 1, (stage + STAGES - 1) % STAGES);
#pragma unroll
        for (int half = 0; half < BK / 16; ++half) {
            unsigned fa[T::MI][4], fb[T::NI / 2][4];
#pragma unroll
            for (int i = 0; i < T::MI; ++i) fragments_a.load(fa[i], as, i, half);
#pragma unroll
            for (int j = 0; j < T::NI / 2; ++j) fragments_b.load(fb[j], bs, j, half);
            if (on_chunk_b.active) on_chunk_b.b_fragments(fb);
            bf_mma_warp<T>(acc, fa, fb);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load(s, s);
    // the loop unrolled over the ring, so that each stage's shared-memory addresses are constants
    for (int tile = 0; tile < tiles; tile += STAGES)
#pragma unroll
        for (int s = 0; s < STAGES; ++s)
            if (tile + s < tiles) step(tile + s, s);
    cp_async_wait<0>();  // the empty groups: nothing may be pending when the thread exits
}

// ---- 3x3 convolutions of stride 1 from one window of the image (the halo) ----------------------
//
// A 3x3, stride-1, padding-1 convolution's im2col holds each input pixel nine times, once per tap, and
// the tiles above load every one of them from L2: with 64 columns (ResNet-18's first stage) that caps
// a block at 42.7 FLOPs per byte. Here a block of 128 output pixels loads, per 32 channels, the window
// of the (zero-padded) image that their taps reach, once, and each tap's A fragments from it: ldmatrix
// takes a row address per lane, and a lane's row is its pixel's slot shifted by the tap. The window
// runs over the padded rows L = image (H + 2) + row + 1 and columns 0..W + 1 of the block's pixels,
// from the first pixel's row above to the last pixel's row below, across an image boundary if the
// block straddles one (two rows of padding between the images); a slot is 32 channels and 8 of
// padding (80 bytes: 8 consecutive slots fall in distinct banks). The k steps run over the channel
// chunks and, inside each, the nine taps, B (the weights of the tap) through a 3-stage ring as the
// other kernels' operands; at each new chunk the block waits for its window. Backward-data of such a
// convolution is one too, of dy with the taps mirrored and the weights read along their input channels.

constexpr int HALO_PITCH = HaloSlot<bf16>::PITCH;   // a slot's elements (tc_conv.cuh)
struct Halo128x64 : BfTile<128, 64, 32, 3> {};

template <class T>
struct HaloShared {
    static constexpr int SIZE = HALO_SLOTS * HALO_PITCH + T::STAGES * T::BN * T::BK;
};

// acc += the 3x3 convolution (stride 1, padding 1) of `image` (N, H, W, channels; dy for backward-data)
// for the block's 128 output pixels from m0, by the weights b gives (HaloWeights), as the header says.
// Every thread of the block must call it.
template <class T, bool B_K_MAJOR, class IteratorB>
__device__ __forceinline__ void halo_gemm(bf16* smem, const bf16* __restrict__ image, const Geometry<0, 0>& g,
                                          int channels, int m0, IteratorB b, float (&acc)[T::MI][T::NI][4]) {
    static_assert(T::THREADS == TC_THREADS, "the window copies are 2 x 2 warps'");
    constexpr int BK = T::BK, STAGES = T::STAGES;
    using CopyB = BfCopy<T::BN, B_K_MAJOR, BK>;
    constexpr int SIZE_B = CopyB::Stage::SIZE;
    bf16* const window = smem;
    bf16* const Bs = smem + HALO_SLOTS * HALO_PITCH;
    const int width = g.w + 2, warp = int(threadIdx.x) / 32;
    const int wm = (warp / 2) * T::WARP_M, wn = (warp % 2) * T::WARP_N;
    const HaloPlace<T, bf16> place(g, m0, wm);
    const BfFragments<T::BN, B_K_MAJOR, false, T::NI / 2, BK> fragments_b(wn);
    tc_clear<T>(acc);
    const int stages = channels / BK * 9;
    const auto load_b = [&](int stage, int ring) {
        if (stage < stages) {
            tc_load_stage<CopyB>(Bs + ring * SIZE_B, b);
            b.next();
        }
        cp_async_commit();
    };
    // a k step: tap `tap` of the current chunk's window, B from ring slot `ring`, while B of the stage
    // STAGES - 1 later goes into the slot of the one before
    const auto step = [&](int stage, int tap, int ring) {
        cp_async_wait<STAGES - 2>();   // this thread's copies of the stage's B (and of the window) have landed
        __syncthreads();
        load_b(stage + STAGES - 1, (ring + STAGES - 1) % STAGES);
        const bf16* bs = Bs + ring * SIZE_B;
        const int shift = (tap / 3 * width + tap % 3) * HALO_PITCH;   // the tap's slots: rows below, columns right
        int row[T::MI];
#pragma unroll
        for (int i = 0; i < T::MI; ++i) row[i] = place.slot[i] + shift;
#pragma unroll
        for (int half = 0; half < BK / 16; ++half) {
            unsigned fa[T::MI][4], fb[T::NI / 2][4];
#pragma unroll
            for (int i = 0; i < T::MI; ++i) ldmatrix_x4(fa[i], window + row[i] + 16 * half);
#pragma unroll
            for (int j = 0; j < T::NI / 2; ++j) fragments_b.load(fb[j], bs, j, half);
            bf_mma_warp<T>(acc, fa, fb);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load_b(s, s);
    static_assert(9 % STAGES == 0, "a chunk's taps fill the ring whole: each tap's slot is a constant");
    // per chunk of channels: its window, once every warp is done with the last one, then its nine taps
    for (int stage = 0; stage < stages; stage += 9) {
        __syncthreads();
        halo_load_window(window, image, g, channels, stage / 9 * BK, place.img, place.pp, place.rows);
        cp_async_commit();
        cp_async_wait<0>();
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) step(stage + tap, tap, tap % STAGES);
    }
    cp_async_wait<0>();
}

// ---- backward-weight of the same convolutions from windows of x ----------------------------------
//
// dw[o][tap][ci] = the sum over the output pixels p of x[p + tap][ci] dy[p][o]: k is the pixel, and a
// tile of the usual kind (rows (tap, ci), columns o) loads each pixel of x once per tap, 42.7 FLOPs a
// byte with 64 columns. Here a block's tile is all nine taps of 32 input channels c0.. by 64 output
// channels: 288 rows, which the 2 x 2 warps split as 16 channels (the warp's row) by 32 output
// channels (its column), each warp all nine taps of them (9 x 4 mma tiles, 144 accumulators a thread).
// A stage is WG_PIXELS = 48 pixels of the part's k: the window of x their taps reach (halo_load_window:
// 32 channels a slot) and dy's 48 x 64, the two in a 2-stage ring. Each k16 step loads a warp's B
// fragments (dy) once for the nine taps and each tap's A fragments from the window, transposed (a
// slot holds the channels, m, along a row of shared memory): a lane's row is its pixel's slot shifted by
// the tap, each pixel's slot worked out once a stage, by one thread as it loads the stage, into a table
// beside it (as TF32's halo backward-weight). The window of 48 pixels and a block's 288 x 64 outputs read
// per k, with the window's other rows, about 121 FLOPs per L2 byte at 28 x 28 (bench/tc_plan.py). The
// tile's rows m' = 144 h + 16 tap + i are the channels c0 + 16 h + i of the tap (HaloWeightsOut), so that
// tc_conv.cuh's split-K end takes it as it is.

constexpr int WG_PIXELS = 48, WG_SLOTS = 224;   // a stage's pixels; its window's slots (17.5 KB)
struct Halo288x64 : TcTile<288, 64> {
    static constexpr int BK = WG_PIXELS, STAGES = 2;
};

template <class T>
struct WgradHaloShared {   // a stage of the ring, in bf16: the window, dy, the pixels' slots (an int each)
    static constexpr int WINDOW = WG_SLOTS * HALO_PITCH, SLOTS = WINDOW + T::BK * T::BN, STAGE = SLOTS + 2 * T::BK;
    static constexpr int SIZE = T::STAGES * STAGE;
};

// acc += the block's tile over the pixels [k_begin, k_end) of x (N, H, W, C) and dy (N, H, W, O), as
// above; on_chunk_b.b_fragments sees each k16 step's B fragments (BiasFragments). plane, width: FastDivmod
// by H*W and by W. Every thread of the block must call it.
template <class T, class OnChunk>
__device__ __forceinline__ void halo_wgrad_gemm(bf16* smem, const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                                const Geometry<0, 0>& g, const FastDivmod& plane,
                                                const FastDivmod& width_div, int c0, int n0, int k_begin, int k_end,
                                                float (&acc)[T::MI][T::NI][4], OnChunk& on_chunk_b) {
    static_assert(T::THREADS == TC_THREADS, "the window copies are 2 x 2 warps'");
    using Shared = WgradHaloShared<T>;
    constexpr int BK = T::BK;
    const int width = g.w + 2, lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
    const HaloPixels pixels{plane, width_div, g.h};
    const int stages = (max(k_end - k_begin, 0) + BK - 1) / BK;
    // the window of the stage's pixels and their dy: 8 threads to a pixel's 64 output channels
    const auto load = [&](int stage, int ring) {
        if (stage < stages) {
            bf16* const window = smem + ring * Shared::STAGE;
            const int p0 = k_begin + stage * BK, last = min(p0 + BK, k_end) - 1;
            const HaloPixels::Place first = pixels.place(p0);
            const int first_row = pixels.padded_row(first);   // the window's first row
            halo_load_window(window, x, g, g.c, c0, first.img, first.p,
                             pixels.padded_row(pixels.place(last)) - first_row + 3);
#pragma unroll
            for (int c = 0; c < BK * T::BN / 8 / TC_THREADS; ++c) {
                const int q = int(threadIdx.x) + TC_THREADS * c, line = q / 8, chunk = q % 8;
                const bool data = p0 + line < k_end && n0 + 8 * chunk < g.o;
                cp_async_cg(window + Shared::WINDOW + BfStage<T::BN, false, BK>::offset(line, chunk),
                            dy + unsigned(data ? (p0 + line) * g.o + n0 + 8 * chunk : 0), data ? 16 : 0);
            }
            if (int(threadIdx.x) < BK)   // the pixel's slot
                reinterpret_cast<int*>(window + Shared::SLOTS)[threadIdx.x] =
                    pixels.slot(p0 + int(threadIdx.x), k_end, first_row, width, HALO_PITCH);
        }
        cp_async_commit();
    };
    const BfFragments<T::BN, false, false, T::NI / 2, BK> fragments_b((warp % 2) * T::WARP_N);
    // this lane's A rows: k = its pixel lane % 8 + 8 (lane / 16) of each k16 step, channels 8 (lane / 8 % 2)..
    // of the warp's 16
    const int channel = 16 * (warp / 2) + 8 * (lane / 8 % 2), pixel = lane % 8 + 8 * (lane / 16);
    tc_clear<T>(acc);
    const auto step = [&](int stage, int ring) {
        cp_async_wait<0>();   // this thread's copies of the stage have landed
        __syncthreads();      // everyone's have, and everyone is done with the stage before
        load(stage + 1, ring ^ 1);
        const bf16* const window = smem + ring * Shared::STAGE;
#pragma unroll
        for (int half = 0; half < BK / 16; ++half) {
            const int row = reinterpret_cast<const int*>(window + Shared::SLOTS)[16 * half + pixel] + channel;
            unsigned fb[T::NI / 2][4];
#pragma unroll
            for (int j = 0; j < T::NI / 2; ++j) fragments_b.load(fb[j], window + Shared::WINDOW, j, half);
            if (on_chunk_b.active) on_chunk_b.b_fragments(fb);
#pragma unroll
            for (int tap = 0; tap < 9; ++tap) {   // the tap's slots: rows below, columns right
                unsigned fa[4];
                ldmatrix_x4_trans(fa, window + row + (tap / 3 * width + tap % 3) * HALO_PITCH);
#pragma unroll
                for (int j = 0; j < T::NI; ++j) {
                    const unsigned b[2] = {fb[j / 2][2 * (j % 2)], fb[j / 2][2 * (j % 2) + 1]};
                    mma_bf16(acc[tap][j], fa, b, acc[tap][j]);
                }
            }
        }
    };
    load(0, 0);
    // unrolled over the ring, so that each stage's shared-memory offsets are constants
    for (int stage = 0; stage < stages; stage += 2) {
        step(stage, 0);
        if (stage + 1 < stages) step(stage + 1, 1);
    }
    cp_async_wait<0>();
}

// ---- the kernels ----------------------------------------------------------------------------

// y (N*OH*OW x O, NHWC) = im2col(x) . w_krsc^T + bias (bias may be null): block (x, y, z) computes
// output pixels [x * BM, ...) by channels [y * BN, ...) over k in [z * k_chunk, (z + 1) * k_chunk)
// (split-K over the gridDim.z parts, in groups of `group`, see tc_finish); and, unless stats_partial is
// null, the statistics of y's columns for the batch norm that follows (tc_batch_stats).
template <class T, int ALIGN>
__global__ void __launch_bounds__(T::THREADS, BF_MIN_BLOCKS)
conv_bf16_forward(const bf16* __restrict__ x, const bf16* __restrict__ w_krsc, const float* __restrict__ bias,
                  bf16* __restrict__ y, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group,
                  BN_STATS_PARAMS) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, depth = g.taps() * g.c, pixels = g.n * g.out_plane();
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, depth);
    const int tiles = (max(k_end - k_begin, 0) + T::BK - 1) / T::BK;
    using CopyA = BfCopy<T::BM, true, T::BK, T::THREADS>;
    using CopyB = BfCopy<T::BN, true, T::BK, T::THREADS>;
    __shared__ __align__(128) bf16 smem[BfShared<T>::SIZE];
    float acc[T::MI][T::NI][4];
    if constexpr (ALIGN == T::BK)
        bf_gemm<T, true, true>(smem, ImageRowsAligned<CopyA>(g, x, m0, k_begin),
                               MatrixRowsAligned<CopyB>(w_krsc, g.o, depth, n0, k_begin), tiles, acc);
    else
        bf_gemm<T, true, true>(smem, Gathered<CopyA, ImageRows>{x, {g}, m0, k_begin, k_end},
                               Gathered<CopyB, MatrixRows>{w_krsc, {g.o, depth}, n0, k_begin, k_end}, tiles, acc);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    const bool finished = tc_finish<T, false>(RowsOut{pixels, g.o}, y, partial, pixels * g.o, split,
                                              tile_counters(counters, 0, split), m0, n0, bias, false, acc);
    if (finished && stats_partial)
        tc_batch_stats<T, false>(BnStats BN_STATS, RowsOut{pixels, g.o}, y, reinterpret_cast<float*>(smem), m0,
                                 n0, bias, split.parts == 1, acc);
}

// dx (N*H*W x C, NHWC): blockIdx.z = phase * splits + part, for the sh*sw stride phases and the
// splits = gridDim.z / (sh*sw) parts of each phase's k; block (x, y, z) computes the phase's cells
// [x * BM, ...) by input channels [y * BN, ...) over k in [part * k_chunk, ...) (split-K in groups
// of `group`, see tc_finish), added to what dx holds when `add` is set. Blocks past the phase's
// cells (phases differ in size by a row or column) leave at once; a phase, or a part of one, that
// no tap reaches gets zeros. Unless sums_partial is null, the backward sums of the batch norm whose
// dy dx is (bn_tile_sums, over the tiles of every phase: a block past its phase's cells merges zeros).
template <class T, int ALIGN>
__global__ void __launch_bounds__(T::THREADS, BF_MIN_BLOCKS)
conv_bf16_dgrad(const bf16* __restrict__ dy, const bf16* __restrict__ w_krsc, bf16* __restrict__ dx, int add,
                float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group, BN_SUMS_PARAMS(bf16)) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int splits = gridDim.z / (g.sh * g.sw), part = blockIdx.z % splits;
    const int phase = blockIdx.z / splits;
    const Phase f = stride_phase(g, phase);
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;
    const int tile = phase * gridDim.x + blockIdx.x, sums_tiles = g.sh * g.sw * gridDim.x;   // of the norm's sums
    __shared__ __align__(128) bf16 smem[BfShared<T>::SIZE];
    if (m0 >= g.n * f.cells()) {   // the same for the whole block
        if (sums_partial && part == 0)
            bn_tile_sums<T, T::THREADS>(BnSums<bf16> BN_SUMS, PhaseRowsOut{g, f}, g.c, dx,
                                        reinterpret_cast<float*>(smem), m0, n0, tile, sums_tiles,
                                        int(blockIdx.y));
        return;
    }
    const int k_begin = part * k_chunk, k_end = min(k_begin + k_chunk, f.taps() * g.o);
    const int tiles = (max(k_end - k_begin, 0) + T::BK - 1) / T::BK;
    using CopyA = BfCopy<T::BM, true, T::BK, T::THREADS>;
    using CopyB = BfCopy<T::BN, false, T::BK, T::THREADS>;
    float acc[T::MI][T::NI][4];
    if constexpr (ALIGN == T::BK)
        bf_gemm<T, true, false>(smem, GradientRowsAligned<CopyA>(g, f, dy, m0, k_begin),
                                WeightRowsAligned<CopyB>(g, f, w_krsc, n0, k_begin), tiles, acc);
    else
        bf_gemm<T, true, false>(smem, Gathered<CopyA, GradientRows>{dy, {g, f}, m0, k_begin, k_end},
                                Gathered<CopyB, WeightRows>{w_krsc, {g, f}, n0, k_begin, k_end}, tiles, acc);
    const SplitK split{splits, group, part};
    const bool finished = tc_finish<T, false>(PhaseRowsOut{g, f}, dx, partial, g.n * g.h * g.w * g.c, split,
                                              tile_counters(counters, phase, split), m0, n0, nullptr, add, acc);
    if (finished && sums_partial)
        bn_tile_sums<T, T::THREADS>(BnSums<bf16> BN_SUMS, PhaseRowsOut{g, f}, g.c, dx, reinterpret_cast<float*>(smem),
                                    m0, n0, tile, sums_tiles, int(blockIdx.y));
}

// The bias gradient (tc_conv.cuh's BiasTotals) from the B fragments: the warps of the first row of the
// block's warps (their warp tiles cover its BN columns) add up, in float32, the 4 values of dy each of their
// lanes holds of a column of each n8 tile, every k16 step (lane l: column l / 4, k 2 (l % 4).. and 8 more);
// at the end the 4 lanes of a column add theirs (shuffles). A register an n8 tile: the 2 x 4 warps' tile
// fits 128 registers so, where a tile of sums by an mma of ones took 4.
template <class T>
struct BiasFragments : BiasTotals<T> {
    float sums[T::NI];

    __device__ void b_fragments(const unsigned (&fb)[T::NI / 2][4]) {
        if (int(threadIdx.x) / (32 * T::WARPS_N) != 0) return;   // the warps of the first row (warp-uniform)
#pragma unroll
        for (int j = 0; j < T::NI; ++j) {
            const unsigned lo = fb[j / 2][2 * (j % 2)], hi = fb[j / 2][2 * (j % 2) + 1];
            sums[j] = sums[j] + bf16x2_low(lo) + bf16x2_high(lo) + bf16x2_low(hi) + bf16x2_high(hi);
        }
    }
    // every thread of the block calls it; smem: the main loop's, which it is done with
    __device__ void reduce(bf16* smem) {
        if (!this->active) return;   // the same for the whole block
        __syncthreads();
        this->block_sums = reinterpret_cast<float*>(smem);
        const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
        if (warp < T::WARPS_N)
#pragma unroll
            for (int j = 0; j < T::NI; ++j) {
                float total = sums[j];
                total += __shfl_xor_sync(0xffffffffu, total, 1);
                total += __shfl_xor_sync(0xffffffffu, total, 2);
                if (lane % 4 == 0) this->block_sums[warp * T::WARP_N + 8 * j + lane / 4] = total;
            }
        __syncthreads();
    }
};

// dw (see WeightsOut), float32, = the sum over the pixels k of im2col(x)[k, m] dy[k, n]: block
// (x, y, z) computes the columns m = (r, s, ci) [x * BM, ...) by output channels [y * BN, ...) over
// the pixels [z * k_chunk, (z + 1) * k_chunk) (split-K in groups of `group`, see tc_finish). And,
// unless db is null, the bias gradient (BiasSums), its block sums in the stages' shared memory.
// plane_..., width_...: the FastDivmod multipliers and shifts of OH*OW and OW.
template <class T, int ALIGN>
__global__ void __launch_bounds__(T::THREADS, BF_MIN_BLOCKS)
conv_bf16_wgrad(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* __restrict__ dw, int krsc,
                float* __restrict__ db, float* partial, float* db_partial, unsigned* counters, CONV_PARAMS,
                int k_chunk, int group, unsigned plane_multiplier, unsigned plane_shift, unsigned width_multiplier,
                unsigned width_shift) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, columns = g.taps() * g.c;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    const int tiles = (max(k_end - k_begin, 0) + T::BK - 1) / T::BK;
    using CopyA = BfCopy<T::BM, false, T::BK, T::THREADS>;
    using CopyB = BfCopy<T::BN, false, T::BK, T::THREADS>;
    __shared__ __align__(128) bf16 smem[BfShared<T>::SIZE];
    BiasFragments<T> bias{{db, db_partial, g.o, n0, db && blockIdx.x == 0, nullptr}, {}};
    float acc[T::MI][T::NI][4];
    // one main loop for the blocks that also sum the bias (the first row of tiles), one for the others
    const auto gemm = [&](auto&& on_chunk_b) {
        if constexpr (ALIGN == T::BK) {
            constexpr int RUN = run_of<CopyA, ALIGN>();
            bf_gemm<T, false, false>(
                smem, ImageColumnsAligned<CopyA, RUN>(g, x, FastDivmod{g.out_plane(), plane_multiplier, plane_shift},
                                                      FastDivmod{g.ow, width_multiplier, width_shift}, m0, k_begin,
                                                      k_end),
                PixelChannelsAligned<CopyB>(dy, g.o, n0, k_begin, k_end), tiles, acc, on_chunk_b);
        } else {
            bf_gemm<T, false, false>(smem, Gathered<CopyA, ImageColumns>{x, {g}, m0, k_begin, k_end},
                                     Gathered<CopyB, ChannelsOfPixels>{dy, {g.o}, n0, k_begin, k_end}, tiles, acc,
                                     on_chunk_b);
        }
    };
    if (bias.active)
        gemm(bias);
    else
        gemm(NoChunkWork());
    bias.reduce(smem);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    tc_finish<T, false>(WeightsOut{g, krsc}, dw, partial, g.o * columns, split, tile_counters(counters, 0, split),
                        m0, n0, nullptr, false, acc, bias);
}


// y (N*H*W x O, NHWC) = the 3x3 convolution, stride 1, padding 1, of x + bias, from windows of x
// (halo_gemm): block (x, y) computes output pixels [x * BM, ...) by channels [y * BN, ...), no split of k
// (k_chunk, group and the partials unused: the launch's parameters are conv_bf16_forward's), and the
// batch norm's statistics as that kernel.
template <class T>
__global__ void __launch_bounds__(TC_THREADS, BF_MIN_BLOCKS)
conv_bf16_forward_halo(const bf16* __restrict__ x, const bf16* __restrict__ w_krsc, const float* __restrict__ bias,
                       bf16* __restrict__ y, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group,
                       BN_STATS_PARAMS) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, pixels = g.n * g.out_plane();
    __shared__ __align__(128) bf16 smem[HaloShared<T>::SIZE];
    float acc[T::MI][T::NI][4];
    halo_gemm<T, true>(smem, x, g, g.c, m0, HaloWeights<BfCopy<T::BN, true, T::BK>, true>(w_krsc, g, n0, g.o), acc);
    tc_finish<T, false>(RowsOut{pixels, g.o}, y, partial, pixels * g.o, SplitK{1, 1, 0}, counters, m0, n0, bias,
                        false, acc);
    if (stats_partial)
        tc_batch_stats<T, false>(BnStats BN_STATS, RowsOut{pixels, g.o}, y, reinterpret_cast<float*>(smem), m0,
                                 n0, bias, true, acc);
}

// dx (N*H*W x C, NHWC) of the same convolution, from windows of dy and the weights mirrored, added to
// what dx holds when `add` is set; and the batch norm's backward sums as conv_bf16_dgrad.
template <class T>
__global__ void __launch_bounds__(TC_THREADS, BF_MIN_BLOCKS)
conv_bf16_dgrad_halo(const bf16* __restrict__ dy, const bf16* __restrict__ w_krsc, bf16* __restrict__ dx, int add,
                     float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group, BN_SUMS_PARAMS(bf16)) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, pixels = g.n * g.h * g.w;
    __shared__ __align__(128) bf16 smem[HaloShared<T>::SIZE];
    float acc[T::MI][T::NI][4];
    halo_gemm<T, false>(smem, dy, g, g.o, m0, HaloWeights<BfCopy<T::BN, false, T::BK>, false>(w_krsc, g, n0, g.c),
                        acc);
    tc_finish<T, false>(RowsOut{pixels, g.c}, dx, partial, pixels * g.c, SplitK{1, 1, 0}, counters, m0, n0, nullptr,
                        add, acc);
    if (sums_partial)
        bn_tile_sums<T, TC_THREADS>(BnSums<bf16> BN_SUMS, RowsOut{pixels, g.c}, g.c, dx, reinterpret_cast<float*>(smem),
                                    m0, n0, int(blockIdx.x), int(gridDim.x), int(blockIdx.y));
}


// dw (see WeightsOut), float32, of the 3x3, stride-1 convolution from windows of x (halo_wgrad_gemm):
// block (x, y, z) computes the nine taps of input channels [32 x, ...) by output channels [64 y, ...)
// over the pixels [z * k_chunk, ...) (split-K in groups of `group`, see tc_finish); and, unless db is
// null, the bias gradient, as conv_bf16_wgrad, whose parameters it takes.
template <class T>
__global__ void __launch_bounds__(TC_THREADS, BF_MIN_BLOCKS)
conv_bf16_wgrad_halo(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* __restrict__ dw, int krsc,
                     float* __restrict__ db, float* partial, float* db_partial, unsigned* counters, CONV_PARAMS,
                     int k_chunk, int group, unsigned plane_multiplier, unsigned plane_shift,
                     unsigned width_multiplier, unsigned width_shift) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int c0 = blockIdx.x * 32, n0 = blockIdx.y * T::BN;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    __shared__ __align__(128) bf16 smem[WgradHaloShared<T>::SIZE];
    BiasFragments<T> bias{{db, db_partial, g.o, n0, db && blockIdx.x == 0, nullptr}, {}};
    float acc[T::MI][T::NI][4];
    const FastDivmod plane{g.out_plane(), plane_multiplier, plane_shift}, width{g.ow, width_multiplier, width_shift};
    if (bias.active)   // one main loop for the blocks that also sum the bias (the first channels), one for the others
        halo_wgrad_gemm<T>(smem, x, dy, g, plane, width, c0, n0, k_begin, k_end, acc, bias);
    else {
        NoChunkWork none;
        halo_wgrad_gemm<T>(smem, x, dy, g, plane, width, c0, n0, k_begin, k_end, acc, none);
    }
    bias.reduce(smem);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    tc_finish<T, false>(HaloWeightsOut{WeightsOut{g, krsc}, c0}, dw, partial, g.o * g.taps() * g.c, split,
                        tile_counters(counters, 0, split), 0, n0, nullptr, false, acc, bias);
}
