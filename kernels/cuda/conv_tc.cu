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
//   conv_tc_projection_backward  both backward GEMMs of a 1x1 convolution of 64 -> 128 channels, and its bias
//                                gradient, from one read of dy (see its section)
//
// Each GEMM may split its K over grid.z into parts (split-K: a small grid's blocks then fill the
// GPU): each part writes its partial tile and the tile's parts are added in a fixed order in the
// same launch, in two levels when there are many: the last part of each group of `group`
// consecutive parts to finish adds the group's parts, and the last group to finish adds the
// groups (tc_finish). Backward-data's grid.z also runs over the phases.
//
// dy, too, comes holding TF32 values (rounded where it was made: batch norm's backward, or the launcher's
// round_tf32), and backward-weight's bias gradient sums it as the caller gave it (see conv_tc_wgrad). The
// weights come as w_krsc (O, KH, KW, C), the memory of channels-last weights (a flat buffer's
// parameters are; the launcher copies others), holding TF32 values already (tf32.cuh's tf32_value: the
// flat buffer's TF32 copy, which the optimizer writes with each update, or the launcher's round_tf32 of
// another weight): the forward reads them along k, backward-data along its n (the input channels).
//
// A block of 2 x WARPS_N warps (2 x 2; 2 x 4 for 128 x 128) computes a BM x BN tile of the output, each
// warp (BM/2) x (BN/WARPS_N) as m16n8k8 mma.sync tiles (tensor_core.cuh). K advances BK = 16 at a time through a STAGES-deep
// ring of shared-memory tiles filled by 16-byte cp.async copies: while stage s is multiplied, the
// copies of the next STAGES - 1 stages are in flight; the loop is unrolled over the ring, so that
// each stage's shared-memory addresses are constants. Each thread rounds the chunks it copied of an
// activation to TF32 (tf32.cuh's tf32_round) once they land, before the barrier that hands
// the stage to the warps, so that the product is that of the TF32-rounded inputs, summed in float32, and
// each element is rounded once, not once per warp that reads it; the weights and dy land rounded (but in the
// blocks that sum the bias gradient, see conv_tc_wgrad).
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
// The copies' addresses (tc_conv.cuh's iterators, which conv_bf16.cu shares): ALIGN = 16 (every
// channel count a multiple of 16, at most 32 filter taps) keeps the 16 k of a stage in one filter
// tap, and each thread's iterators (the ...Aligned structs) work out the image, row and column of
// their rows once, before the loop; a stage then adds a constant to an offset and tests a
// precomputed bit of the tap's padding mask (CUTLASS's "optimized" convolution iterators work the
// same way). Backward-weight's k is the pixel: a thread's chunks of im2col share one pixel, split
// into image, row and column by FastDivmod once per stage; on the square tile, ALIGN = 64 or 128 (both
// channel counts multiples of it) puts 2 or 4 of a thread's chunks in one tap, copied from one address
// (run_of). ALIGN = 4 (channel counts multiples of
// 4) computes every chunk's address from its (row, k) with divisions (Gathered). Results are
// deterministic: every output element is one thread's sum in a fixed order, and split-K partials
// are added in a fixed order; so is the bias gradient (BiasSums).
#include "tc_conv.cuh"

constexpr int TC_BK = 16;

// A block's tile (tc_conv.cuh's TcTile) with the number of its stages and the blocks an SM that its
// registers are bounded for. 128 x 64 and 64 x 64: 2 x 2 warps, 3 stages, 3 blocks (170 registers a thread:
// at the 128 that 4 blocks allow, ptxas recomputes the threads' shared-memory offsets and the loop's bound in
// every iteration of the main loop; bench/tc_plan.py counts the instructions). 128 x 128 (32 FLOPs per byte
// of operands a block loads, against 21.3): 2 x 4 warps (256 threads) of 64 x 32 warp tiles (64
// accumulators), 3 stages (51 to 60 KB, in dynamic shared memory: tc_stages), 2 blocks, 16 warps, an SM of
// an A100 or an H100 (at most 128 registers a thread; 2 x 64 KB of their 164 and 228 KB of shared memory).
// An RTX 3090 or 4090 or an L4 (100 KB an SM) would hold one such block: they run Tc128x128Ring2, the same tile
// in a ring of 2 stages (35 to 40 KB, static), 2 blocks an SM.
template <int BM, int BN, int STAGES_, int MIN_BLOCKS_, int WARPS_N = 2>
struct TcConfig : TcTile<BM, BN, WARPS_N> {
    static constexpr int STAGES = STAGES_, MIN_BLOCKS = MIN_BLOCKS_;
};
struct Tc128x128 : TcConfig<128, 128, 3, 2, 4> {};
struct Tc128x128Ring2 : TcConfig<128, 128, 2, 2, 4> {};   // for SMs of 100 KB of shared memory (conv_tc.py's RING2)
struct Tc128x64 : TcConfig<128, 64, 3, 3> {};
struct Tc64x64 : TcConfig<64, 64, 3, 3> {};

// One stage of one operand in shared memory, W rows (m or n) by TC_BK k; K_MAJOR: [W][BK + 4],
// else [BK][W + 8] (see the header); or another PITCH_ between its lines (the projection backward's stages,
// whose k runs past a stage's).
template <int W, bool K_MAJOR, int PITCH_ = K_MAJOR ? TC_BK + 4 : W + 8>
struct TcStage {
    static constexpr int PITCH = PITCH_;
    static constexpr int SIZE = (K_MAJOR ? W : TC_BK) * PITCH;
    __device__ static int offset(int row, int k) { return K_MAJOR ? row * PITCH + k : k * PITCH + row; }
};

// The 16-byte chunks (4 consecutive elements along the rows or along k) of a stage that this
// thread, of THREADS, copies and rounds: CHUNKS of them, chunk c at (row(c), k(c)) of the stage. K_MAJOR
// (lines of 4 chunks along k): 4 threads per line, rows ROW_STEP c + t / 4, so that a warp's copy
// instruction reads whole 64-byte lines. Else (16 lines along k): LINE_THREADS (THREADS / 16) threads per
// line, line t / LINE_THREADS, rows 4 (LINE_THREADS c + t % LINE_THREADS): a warp's instruction reads 128
// (or 256) contiguous bytes of each of its 4 (or 2) lines, and a thread's chunks share their k
// (backward-weight's pixel).
template <int W_, bool K_MAJOR_, int THREADS = TC_THREADS>
struct TcCopy {
    using Element = float;
    static constexpr int W = W_;
    static constexpr bool K_MAJOR = K_MAJOR_;
    static constexpr int BK = TC_BK, ELEMENTS = 4, LINE_THREADS = THREADS / TC_BK;
    static constexpr int ROW_STEP = K_MAJOR ? THREADS / 4 : 4 * LINE_THREADS;
    static constexpr int CHUNKS = W * TC_BK / 4 / THREADS;
    static_assert(CHUNKS * 4 * THREADS == W * TC_BK, "whole chunks per thread");
    __device__ static int row(int c) {
        return K_MAJOR ? c * ROW_STEP + int(threadIdx.x) / 4 : (c * LINE_THREADS + int(threadIdx.x) % LINE_THREADS) * 4;
    }
    __device__ static int k(int c) { return K_MAJOR ? int(threadIdx.x) % 4 * 4 : int(threadIdx.x) / LINE_THREADS; }
    __device__ static int offset(int c) { return TcStage<W, K_MAJOR>::offset(row(c), k(c)); }
};

// on_chunk.add(c, values) sees each of this thread's chunks (Copy's) of a landed stage; ROUND: then rounds
// them to TF32 in place. (Neither: nothing, the loads unused.)
template <class Copy, bool ROUND, class OnChunk>
__device__ __forceinline__ void tc_land_stage(float* tile, OnChunk& on_chunk) {
#pragma unroll
    for (int c = 0; c < Copy::CHUNKS; ++c) {
        float4* chunk = reinterpret_cast<float4*>(tile + Copy::offset(c));
        const float4 v = *chunk;
        on_chunk.add(c, Floats<4>{{v.x, v.y, v.z, v.w}});
        if constexpr (ROUND) *chunk = tf32_round4(v);
    }
}

// What the main loop does to each landed stage of A (this thread's chunks of it, Copy's) before the warps read
// it (land), and where A's zero chunks come from (PADDED: from pad, see tc_load_stage): TcRound rounds it to TF32 (tc_land_stage), the
// zero chunks zero-filled.
struct TcRound {
    static constexpr bool PADDED = false;
    static constexpr const float* pad = nullptr;
    template <class Copy>
    __device__ void land(float* tile) {
        NoChunkWork none;
        tc_land_stage<Copy, true>(tile, none);
    }
};

// A stage of A that holds TF32 values already (backward-data's dy, rounded by its producer: batch norm's
// backward, or the launcher's round_tf32): read as it lands.
struct TcAsIs {
    static constexpr bool PADDED = false;
    static constexpr const float* pad = nullptr;
    template <class Copy>
    __device__ void land(float*) {}
};

// A training batch norm with its relu applied as its output is loaded (TcNormRows, TcNormColumns): the
// convolution reads relu(bn(x)) from x, the norm's input, so that the normalised activation is never
// stored. pad: 4 NaN (the zero chunks are copied from it: fmaxf(NaN, 0) is the padding's zero); the
// norm's batch mean and invstd, gamma and beta.
#define TC_FOLD_PARAMS                                                                                \
    const float *__restrict__ fold_pad, const float *__restrict__ fold_mean,                           \
        const float *__restrict__ fold_invstd, const float *__restrict__ fold_gamma, const float *__restrict__ fold_beta
struct TcFold {
    const float *pad, *mean, *invstd, *gamma, *beta;
};
#define TC_FOLD \
    { fold_pad, fold_mean, fold_invstd, fold_gamma, fold_beta }

// The forward's A (K_MAJOR, the 16 k of a stage 16 channels of one tap): a thread's chunks of a stage share
// their 4 channels, ci.., whose scale and shift it computes as the stage lands.
struct TcNormRows {
    static constexpr bool PADDED = true;
    const float *pad, *mean, *invstd, *gamma, *beta;
    int channels, ci;
    __device__ TcNormRows(const TcFold& f, int channels_, int k_begin)
        : pad(f.pad), mean(f.mean), invstd(f.invstd), gamma(f.gamma), beta(f.beta), channels(channels_),
          ci(k_begin % channels_ + int(threadIdx.x) % 4 * 4) {}
    template <class Copy>
    __device__ void land(float* tile) {
        static_assert(Copy::K_MAJOR, "the forward's A runs along k");
        float4 scale, shift;
        bn_coefficients(mean, invstd, gamma, beta, ci, scale, shift);
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) {
            float4* chunk = reinterpret_cast<float4*>(tile + Copy::offset(c));
            *chunk = bn_relu_tf32(*chunk, scale, shift);
        }
        ci += TC_BK;   // the next stage's channels: of this tap, or the first of the next
        if (ci >= channels) ci -= channels;
    }
};

// Backward-weight's A (rows m = (tap, ci), fixed for the thread: 4 channels a chunk): the block's rows'
// scale and shift, worked out once into `table` (2 x BM floats of shared memory; the constructor, which
// every thread of the block must call, synchronises it), read as each stage lands.
template <int BM>
struct TcNormColumns {
    static constexpr bool PADDED = true;
    const float* table;
    const float* pad;
    __device__ TcNormColumns(float* table_, const TcFold& f, int channels, int m0) : table(table_), pad(f.pad) {
        if (int(threadIdx.x) < BM) {
            const int c = (m0 + int(threadIdx.x)) % channels;
            const float scale = bn_scale(f.invstd[c], f.gamma[c]);
            table_[threadIdx.x] = scale;
            table_[BM + threadIdx.x] = bn_shift(f.mean[c], scale, f.beta[c]);
        }
        __syncthreads();
    }
    template <class Copy>
    __device__ void land(float* tile) {
        static_assert(!Copy::K_MAJOR && Copy::W == BM, "backward-weight's A runs along its rows");
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c) {
            const int row = Copy::row(c);
            float4* chunk = reinterpret_cast<float4*>(tile + Copy::offset(c));
            *chunk = bn_relu_tf32(*chunk, *reinterpret_cast<const float4*>(table + row),
                                  *reinterpret_cast<const float4*>(table + BM + row));
        }
    }
};

// The A fragment of mma tile (row0.., k..k+7) for this lane (tensor_core.cuh's layout); rows in
// the permuted order when the stage is not K_MAJOR (see the header). PITCH: TcStage's.
template <int W, bool K_MAJOR, int PITCH = TcStage<W, K_MAJOR>::PITCH>
__device__ __forceinline__ void tc_fragment_a(unsigned (&a)[4], const float* tile, int row0, int k) {
    using Stage = TcStage<W, K_MAJOR, PITCH>;
    const int lane = int(threadIdx.x) % 32;
    if (K_MAJOR) {
        // matrices: rows 0-7 and 8-15 at k..k+3, then at k+4..k+7
        ldmatrix_x4(a, tile + Stage::offset(row0 + lane % 8 + (lane / 8 % 2) * 8, k + lane / 16 * 4));
    } else {   // rows g and g + 8 of the mma are the tile's rows 2g and 2g + 1: a[0], a[1] and a[2], a[3]
        const int g = lane / 4, t = lane % 4;
        *reinterpret_cast<uint2*>(&a[0]) = *reinterpret_cast<const uint2*>(tile + Stage::offset(row0 + 2 * g, k + t));
        *reinterpret_cast<uint2*>(&a[2]) =
            *reinterpret_cast<const uint2*>(tile + Stage::offset(row0 + 2 * g, k + t + 4));
    }
}

// The B fragments of two mma tiles side by side, columns col0..col0+7 and col0+8..col0+15. PITCH: TcStage's.
template <int W, bool K_MAJOR, int PITCH = TcStage<W, K_MAJOR>::PITCH>
__device__ __forceinline__ void tc_fragments_b(unsigned (&b)[2][2], const float* tile, int col0, int k) {
    using Stage = TcStage<W, K_MAJOR, PITCH>;
    const int lane = int(threadIdx.x) % 32;
    if (K_MAJOR) {
        // matrices: columns 0-7 at k..k+3 and k+4..k+7, then columns 8-15
        unsigned r[4];
        ldmatrix_x4(r, tile + Stage::offset(col0 + lane % 8 + lane / 16 * 8, k + (lane / 8 % 2) * 4));
        b[0][0] = r[0];
        b[0][1] = r[1];
        b[1][0] = r[2];
        b[1][1] = r[3];
    } else {   // a word per lane: the two words of a fragment lie 4 k apart
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            b[j][0] = __float_as_uint(tile[Stage::offset(col0 + 8 * j + g, k + t)]);
            b[j][1] = __float_as_uint(tile[Stage::offset(col0 + 8 * j + g, k + t + 4)]);
        }
    }
}

// acc += the warp's A fragments fa (its mma tiles' rows, k..k+7) . B (k..k+7, its columns from wn) of the
// landed stage bs.
template <class T, bool B_K_MAJOR>
__device__ __forceinline__ void tc_multiply(float (&acc)[T::MI][T::NI][4], const unsigned (&fa)[T::MI][4],
                                            const float* bs, int wn, int k) {
    unsigned fb[T::NI / 2][2][2];
#pragma unroll
    for (int j = 0; j < T::NI / 2; ++j) tc_fragments_b<T::BN, B_K_MAJOR>(fb[j], bs, wn + 16 * j, k);
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int j = 0; j < T::NI; ++j) mma_tf32(acc[i][j], fa[i], fb[j / 2][j % 2], acc[i][j]);
}

// The ring of stages of A and B in shared memory: one for each tile and layout, which the main loops of a
// kernel share (backward-weight's two, conv_tc_wgrad). In static shared memory where it fits the 48 KB a block
// may have of it with room to spare (TC_STATIC_RING); else (the 128 x 128 tile's 3 stages, 51 to 60 KB) in
// dynamic shared memory, whose bytes the launcher gives (conv_tc.py's ring_bytes: the emulator's sanitizer
// refuses an access past them).
constexpr int TC_STATIC_RING = 46 * 1024;
template <class T, bool A_K_MAJOR, bool B_K_MAJOR>
struct TcStages {
    float a[T::STAGES][TcStage<T::BM, A_K_MAJOR>::SIZE];
    float b[T::STAGES][TcStage<T::BN, B_K_MAJOR>::SIZE];
};
template <class T, bool A_K_MAJOR, bool B_K_MAJOR>
__device__ __forceinline__ TcStages<T, A_K_MAJOR, B_K_MAJOR>& tc_stages() {
    using Stages = TcStages<T, A_K_MAJOR, B_K_MAJOR>;
    if constexpr (sizeof(Stages) <= TC_STATIC_RING) {
        __shared__ __align__(16) Stages stages;
        return stages;
    } else {
        extern __shared__ __align__(16) float tc_ring[];
        return *reinterpret_cast<Stages*>(tc_ring);
    }
}

// acc += A (m0.., k) . B (k, n0..) over `tiles` stages of k for this warp's part of the block's
// tile: acc[i][j] is mma tile (i, j) of the warp, in the C layout of tensor_core.cuh (rows and
// columns permuted where an operand is not K_MAJOR: tc_store knows how). The iterators a and b
// give the places of the thread's chunks of the current stage (at(c, offset), see tc_load_stage)
// and move to the next (next()). Every thread of the block must call it (it synchronises the block).
// B_ROUNDED: B holds TF32 values (the weights, dy) and is read as it lands; else each landed stage of B is
// rounded. Either way on_chunk_b.add(c, values) sees the values of each of this thread's B chunks as they
// landed (zero past the matrix); land_a makes each landed stage of A what the warps read (TcRound, or with a batch
// norm applied: TcNormRows, TcNormColumns).
template <class T, bool A_K_MAJOR, bool B_K_MAJOR, bool B_ROUNDED, class IteratorA, class IteratorB,
          class OnChunk = NoChunkWork, class LandA = TcRound>
__device__ __forceinline__ void tc_gemm(IteratorA a, IteratorB b, int tiles, float (&acc)[T::MI][T::NI][4],
                                        OnChunk&& on_chunk_b = OnChunk(), LandA land_a = LandA()) {
    using CopyA = TcCopy<T::BM, A_K_MAJOR, T::THREADS>;
    using CopyB = TcCopy<T::BN, B_K_MAJOR, T::THREADS>;
    auto& As = tc_stages<T, A_K_MAJOR, B_K_MAJOR>().a;
    auto& Bs = tc_stages<T, A_K_MAJOR, B_K_MAJOR>().b;
    const int warp = int(threadIdx.x) / 32, wm = (warp / T::WARPS_N) * T::WARP_M, wn = (warp % T::WARPS_N) * T::WARP_N;
    tc_clear<T>(acc);
    const auto load = [&](int tile, int stage) {
        if (tile < tiles) {
            tc_load_stage<CopyA, LandA::PADDED>(As[stage], a, land_a.pad);
            tc_load_stage<CopyB>(Bs[stage], b);
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
        cp_async_wait<T::STAGES - 2>();  // this thread's copies of `tile` have landed
        land_a.template land<CopyA>(as);
        tc_land_stage<CopyB, !B_ROUNDED>(bs, on_chunk_b);
        __syncthreads();                 // everyone's have landed, and everyone is done with tile - 1
        load(tile + T::STAGES - 1, (stage + T::STAGES - 1) % T::STAGES);
#pragma unroll
        for (int k = 0; k < TC_BK; k += 8) {
            unsigned fa[T::MI][4];
#pragma unroll
            for (int i = 0; i < T::MI; ++i) tc_fragment_a<T::BM, A_K_MAJOR>(fa[i], as, wm + 16 * i, k);
            tc_multiply<T, B_K_MAJOR>(acc, fa, bs, wn, k);
        }
    };
#pragma unroll
    for (int s = 0; s < T::STAGES - 1; ++s) load(s, s);
    // the loop unrolled over the ring, so that each stage's shared-memory addresses are constants
    for (int tile = 0; tile < tiles; tile += T::STAGES)
#pragma unroll
        for (int s = 0; s < T::STAGES; ++s)
            if (tile + s < tiles) step(tile + s, s);
    cp_async_wait<0>();  // the empty groups: nothing may be pending when the thread exits
}

// ---- 3x3 convolutions of stride 1 from one window of the image (the halo) ----------------------
//
// As conv_bf16.cu's halo kernels (tc_conv.cuh): a block of 128 output pixels by 64 columns loads, per 16
// channels, the window of the (zero-padded) image that their taps reach, once, makes it what the warps read
// once (rounded to TF32, HaloRound; or a batch norm's relu(bn(x)), HaloNorm; backward-data's dy comes
// rounded, HaloAsIs), and takes each tap's A fragments from it by ldmatrix, a lane's row its pixel's slot
// shifted by the tap; B, the tap's weights, goes through a 3-stage ring as tc_gemm's, holding TF32 values as
// every TF32 GEMM's weights do. A window of 16 float channels is the 80-byte slots of BF16's 32, 25.6 KB:
// with the ring, 41 KB of shared memory. With 64 columns a block then reads about 47 FLOPs per L2 byte at
// 28 x 28 where the 128 x 64 tile reads 21.3 (bench/tc_plan.py), and the window's rounding is shared by nine
// taps.
// Backward-data of such a convolution is the forward convolution of dy by the weights mirrored and
// transposed (mirrored_weights), which this GEMM reads as the forward's.
struct TcHalo128x64 : TcConfig<128, 64, 3, 3> {};

// What the halo kernels make of each landed chunk of their window (LAND): TF32 (HaloRound), or relu(bn(x))
// of it for the window's channels c0 + 4 (t % 4).. of thread t (HaloNorm: TcNormRows's, the padding copied
// from pad); nothing where it holds TF32 values already (HaloAsIs: backward-data's dy, as TcAsIs).
struct HaloAsIs {
    static constexpr bool PADDED = false, LAND = false;
    static constexpr const float* pad = nullptr;
};
struct HaloRound {
    static constexpr bool PADDED = false, LAND = true;
    static constexpr const float* pad = nullptr;
    __device__ void channels(int) {}
    __device__ float4 chunk(float4 v) const { return tf32_round4(v); }
};
struct HaloNorm {
    static constexpr bool PADDED = true, LAND = true;
    const float *pad, *mean, *invstd, *gamma, *beta;
    float4 scale, shift;
    __device__ explicit HaloNorm(const TcFold& f)
        : pad(f.pad), mean(f.mean), invstd(f.invstd), gamma(f.gamma), beta(f.beta) {}
    __device__ void channels(int c0) {
        bn_coefficients(mean, invstd, gamma, beta, c0 + HaloSlot<float>::CHUNK * (int(threadIdx.x) % 4), scale, shift);
    }
    __device__ float4 chunk(float4 v) const { return bn_relu_tf32(v, scale, shift); }
};

// What a halo kernel makes of its window: HaloNorm with a batch norm applied (NORM), else HaloRound.
template <bool NORM>
__device__ __forceinline__ auto halo_land(const TcFold& f) {
    if constexpr (NORM)
        return HaloNorm(f);
    else
        return HaloRound();
}

// acc += the 3x3 convolution (stride 1, padding 1) of `image` (N, H, W, channels; dy for backward-data)
// for the block's 128 output pixels from m0, by the weights b gives (HaloWeights), as above; `land`
// makes each window what the warps read; B comes rounded to TF32. Every thread of the block
// must call it.
template <class T, class IteratorB, class LandWindow>
__device__ __forceinline__ void tc_halo_gemm(const float* __restrict__ image, const Geometry<0, 0>& g, int channels,
                                             int m0, IteratorB b, float (&acc)[T::MI][T::NI][4], LandWindow land) {
    static_assert(T::THREADS == TC_THREADS, "the window copies are 2 x 2 warps'");
    using Slot = HaloSlot<float>;
    using StageB = TcStage<T::BN, true>;
    constexpr int STAGES = T::STAGES;
    static_assert(Slot::CHANNELS == TC_BK, "a window's channels are a stage's k");
    static_assert(9 % STAGES == 0, "a chunk's taps fill the ring whole: each tap's slot is a constant");
    __shared__ __align__(16) float window[HALO_SLOTS * Slot::PITCH];
    __shared__ __align__(16) float Bs[STAGES][StageB::SIZE];
    const int width = g.w + 2, warp = int(threadIdx.x) / 32;
    const int wm = (warp / 2) * T::WARP_M, wn = (warp % 2) * T::WARP_N;
    const HaloPlace<T, float> place(g, m0, wm);
    tc_clear<T>(acc);
    const int stages = channels / TC_BK * 9;
    const auto load_b = [&](int stage, int ring) {
        if (stage < stages) {
            tc_load_stage<TcCopy<T::BN, true>>(Bs[ring], b);
            b.next();
        }
        cp_async_commit();
    };
    // a k step: tap `tap` of the current chunk's window, B from ring slot `ring`, while B of the stage
    // STAGES - 1 later goes into the slot of the one before
    const auto step = [&](int stage, int tap, int ring) {
        cp_async_wait<STAGES - 2>();   // this thread's copies of the stage's B have landed
        __syncthreads();               // everyone's have, and everyone is done with the stage before
        load_b(stage + STAGES - 1, (ring + STAGES - 1) % STAGES);
        const float* bs = Bs[ring];
        const int shift = (tap / 3 * width + tap % 3) * Slot::PITCH;   // the tap's slots: rows below, columns right
#pragma unroll
        for (int k = 0; k < TC_BK; k += 8) {
            unsigned fa[T::MI][4];
#pragma unroll
            for (int i = 0; i < T::MI; ++i) ldmatrix_x4(fa[i], window + place.slot[i] + shift + k);
            tc_multiply<T, true>(acc, fa, bs, wn, k);
        }
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) load_b(s, s);
    // per chunk of channels: its window, once every warp is done with the last one, made what the warps
    // read by the threads that copied it, then its nine taps (whose first barrier publishes it)
    for (int stage = 0; stage < stages; stage += 9) {
        const int c0 = stage / 9 * TC_BK;
        __syncthreads();
        halo_load_window<LandWindow::PADDED>(window, image, g, channels, c0, place.img, place.pp, place.rows,
                                             land.pad);
        cp_async_commit();
        cp_async_wait<0>();
        if constexpr (LandWindow::LAND) {
            land.channels(c0);
            halo_window_chunks(image, g, channels, place.img, place.pp, place.rows, [&](int slot, const float*, bool) {
                float4* chunk = reinterpret_cast<float4*>(window + slot);
                *chunk = land.chunk(*chunk);
            });
        }
#pragma unroll
        for (int tap = 0; tap < 9; ++tap) step(stage + tap, tap, tap % STAGES);
    }
    cp_async_wait<0>();
}

// ---- the kernels ----------------------------------------------------------------------------

// y (N*OH*OW x O, NHWC) = im2col(x) . w_krsc^T + bias (bias may be null): block (x, y, z) computes
// output pixels [x * BM, ...) by channels [y * BN, ...) over k in [z * k_chunk, (z + 1) * k_chunk)
// (split-K over the gridDim.z parts, in groups of `group`, see tc_finish); and, unless stats_partial is
// null, the statistics of y's columns for the batch norm that follows (tc_batch_stats). NORM: x is a
// training batch norm's input, and the convolution's input relu(bn(x)), applied as each stage lands
// (TcNormRows, the fold_ parameters; the plain kernels ignore them).
template <class T, int ALIGN, bool NORM = false>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
conv_tc_forward(const float* __restrict__ x, const float* __restrict__ w_krsc, const float* __restrict__ bias,
                float* __restrict__ y, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group,
                BN_STATS_PARAMS, TC_FOLD_PARAMS) {
    static_assert(ALIGN == 16 || !NORM, "a norm applied as x lands takes the aligned copies");
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, depth = g.taps() * g.c, pixels = g.n * g.out_plane();
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, depth);
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;
    float acc[T::MI][T::NI][4];
    if constexpr (NORM)
        tc_gemm<T, true, true, true>(ImageRowsAligned<TcCopy<T::BM, true, T::THREADS>>(g, x, m0, k_begin),
                                     MatrixRowsAligned<TcCopy<T::BN, true, T::THREADS>>(w_krsc, g.o, depth, n0, k_begin), tiles,
                                     acc, NoChunkWork(), TcNormRows(TcFold TC_FOLD, g.c, k_begin));
    else if constexpr (ALIGN == 16)
        tc_gemm<T, true, true, true>(ImageRowsAligned<TcCopy<T::BM, true, T::THREADS>>(g, x, m0, k_begin),
                                     MatrixRowsAligned<TcCopy<T::BN, true, T::THREADS>>(w_krsc, g.o, depth, n0, k_begin), tiles,
                                     acc);
    else
        tc_gemm<T, true, true, true>(
            Gathered<TcCopy<T::BM, true, T::THREADS>, ImageRows>{x, {g}, m0, k_begin, k_end},
            Gathered<TcCopy<T::BN, true, T::THREADS>, MatrixRows>{w_krsc, {g.o, depth}, n0, k_begin, k_end}, tiles, acc);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    const bool finished = tc_finish<T, false>(RowsOut{pixels, g.o}, y, partial, pixels * g.o, split,
                                              tile_counters(counters, 0, split), m0, n0, bias, false, acc);
    __shared__ float stats_smem[2 * 3 * T::BN];
    if (finished && stats_partial)
        tc_batch_stats<T, false>(BnStats BN_STATS, RowsOut{pixels, g.o}, y, stats_smem, m0, n0, bias,
                                 split.parts == 1, acc);
}

// dx (N*H*W x C, NHWC): blockIdx.z = phase * splits + part, for the sh*sw stride phases and the
// splits = gridDim.z / (sh*sw) parts of each phase's k; block (x, y, z) computes the phase's cells
// [x * BM, ...) by input channels [y * BN, ...) over k in [part * k_chunk, ...) (split-K in groups
// of `group`, see tc_finish), added to what dx holds when `add` is set; dy and w_krsc hold TF32 values (see
// the header). Blocks past the phase's cells (phases differ in size by a row or column) leave at once; a
// phase, or a part of one, that no tap reaches gets zeros. Unless sums_partial is null, the backward sums
// of the batch norm whose dy dx is (bn_tile_sums, over the tiles of every phase: a block past its phase's
// cells merges zeros).
template <class T, int ALIGN>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
conv_tc_dgrad(const float* __restrict__ dy, const float* __restrict__ w_krsc, float* __restrict__ dx, int add,
              float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group, BN_SUMS_PARAMS(float)) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int splits = gridDim.z / (g.sh * g.sw), part = blockIdx.z % splits;
    const int phase = blockIdx.z / splits;
    const Phase f = stride_phase(g, phase);
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;
    const int tile = phase * gridDim.x + blockIdx.x, sums_tiles = g.sh * g.sw * gridDim.x;   // of the norm's sums
    __shared__ float sums_smem[2 * T::THREADS];
    if (m0 >= g.n * f.cells()) {   // the same for the whole block
        if (sums_partial && part == 0)
            bn_tile_sums<T, T::THREADS>(BnSums<float> BN_SUMS, PhaseRowsOut{g, f}, g.c, dx, sums_smem, m0, n0, tile,
                                        sums_tiles, int(blockIdx.y));
        return;
    }
    const int k_begin = part * k_chunk, k_end = min(k_begin + k_chunk, f.taps() * g.o);
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;
    float acc[T::MI][T::NI][4];
    if constexpr (ALIGN == 16)
        tc_gemm<T, true, false, true>(GradientRowsAligned<TcCopy<T::BM, true, T::THREADS>>(g, f, dy, m0, k_begin),
                                      WeightRowsAligned<TcCopy<T::BN, false, T::THREADS>>(g, f, w_krsc, n0, k_begin), tiles, acc,
                                      NoChunkWork(), TcAsIs());
    else
        tc_gemm<T, true, false, true>(Gathered<TcCopy<T::BM, true, T::THREADS>, GradientRows>{dy, {g, f}, m0, k_begin, k_end},
                                      Gathered<TcCopy<T::BN, false, T::THREADS>, WeightRows>{w_krsc, {g, f}, n0, k_begin, k_end},
                                      tiles, acc, NoChunkWork(), TcAsIs());
    const SplitK split{splits, group, part};
    const bool finished = tc_finish<T, false>(PhaseRowsOut{g, f}, dx, partial, g.n * g.h * g.w * g.c, split,
                                              tile_counters(counters, phase, split), m0, n0, nullptr, add, acc);
    if (finished && sums_partial)
        bn_tile_sums<T, T::THREADS>(BnSums<float> BN_SUMS, PhaseRowsOut{g, f}, g.c, dx, sums_smem, m0, n0, tile,
                                    sums_tiles, int(blockIdx.y));
}

// The bias gradient (tc_conv.cuh's BiasTotals) summed from the raw values of this thread's chunks of
// dy as they land (its line, one pixel of each stage, and its 4 x CHUNKS channels), in k order; then
// the block adds the threads of each channel in a fixed order (a butterfly within the warp over the
// lanes that share the channels, the warps in order).
template <class T, class Copy>
struct BiasSums : BiasTotals<T> {
    float sum[Copy::CHUNKS][Copy::ELEMENTS];

    __device__ void add(int c, const Floats<Copy::ELEMENTS>& v) {
        if (!this->active) return;
#pragma unroll
        for (int e = 0; e < Copy::ELEMENTS; ++e) sum[c][e] += v.v[e];
    }
    // every thread of the block calls it
    __device__ void reduce(float (&warps)[T::THREADS / 32][T::BN]) {
        if (!this->active) return;   // the same for the whole block
        const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
#pragma unroll
        for (int c = 0; c < Copy::CHUNKS; ++c)
#pragma unroll
            for (int e = 0; e < Copy::ELEMENTS; ++e) {
                float v = sum[c][e];   // the lanes lane % LINE_THREADS + LINE_THREADS i hold the same channels
#pragma unroll
                for (int offset = Copy::LINE_THREADS; offset < 32; offset *= 2)
                    v += __shfl_xor_sync(kFullMask, v, offset);
                if (lane < Copy::LINE_THREADS) warps[warp][Copy::row(c) + e] = v;
            }
        __syncthreads();
        this->block_sums = warps[0];
        if (threadIdx.x < T::BN)
            this->block_sums[threadIdx.x] = warps_in_order<T::THREADS / 32>(&warps[0][threadIdx.x], T::BN);
    }
};

// A bool as a type, which a generic lambda's argument carries into its body as a constant.
template <bool V>
struct Flag {
    static constexpr bool value = V;
};

// dw (see WeightsOut) = the sum over the pixels k of im2col(x)[k, m] dy[k, n]: block (x, y, z)
// computes the columns m = (r, s, ci) [x * BM, ...) by output channels [y * BN, ...) over the pixels
// [z * k_chunk, (z + 1) * k_chunk) (split-K in groups of `group`, see tc_finish). And, unless db
// is null, the bias gradient (BiasSums) of dy_raw, dy as the caller gave it, which dy is rounded to TF32
// (the same array where it holds TF32 values already). The blocks of the first row of tiles, which sum
// it, run a main loop of their own: on dy_raw, rounding each stage as it lands, or, where dy_raw is dy,
// on dy's values as they land; the others read dy as it is and sum nothing. plane_..., width_...: the
// FastDivmod multipliers and shifts of OH*OW and OW. NORM: x is a training batch norm's input, and the
// convolution's input relu(bn(x)) (TcNormColumns), as conv_tc_forward's. ALIGN: 4 (the gathered copies), 16
// (the aligned ones), or 64 or 128 (the square tile's, conv_tc.py's WGRAD_SQUARE_ALIGNS: C and O multiples of it,
// so that a thread's chunks of x and of dy go in runs of 2 or 4, run_of, each one address and one test).
template <class T, int ALIGN, bool NORM = false>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
conv_tc_wgrad(const float* __restrict__ dy, const float* __restrict__ dy_raw, const float* __restrict__ x,
              float* __restrict__ dw, int krsc, float* __restrict__ db, float* partial, float* db_partial,
              unsigned* counters, CONV_PARAMS, int k_chunk, int group, unsigned plane_multiplier,
              unsigned plane_shift, unsigned width_multiplier, unsigned width_shift, TC_FOLD_PARAMS) {
    static_assert(ALIGN % 16 == 0 || !NORM, "a norm applied as x lands takes the aligned copies");
    __shared__ float warp_sums[T::THREADS / 32][T::BN];
    __shared__ __align__(16) float norm_table[NORM ? 2 * T::BM : 1];
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, columns = g.taps() * g.c;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    const int tiles = (max(k_end - k_begin, 0) + TC_BK - 1) / TC_BK;
    using CopyA = TcCopy<T::BM, false, T::THREADS>;
    using CopyB = TcCopy<T::BN, false, T::THREADS>;
    constexpr int RUN_A = run_of<CopyA, ALIGN>(), RUN_B = run_of<CopyB, ALIGN>();
    BiasSums<T, CopyB> bias{{db, db_partial, g.o, n0, db && blockIdx.x == 0, nullptr}, {}};
    float acc[T::MI][T::NI][4];
    // the main loop on B from b_source, B_ROUNDED.value: read as it is, else rounded as it lands
    const auto gemm = [&](auto b_rounded, const float* b_source, auto&& on_chunk_b, auto land_a) {
        constexpr bool B_ROUNDED = decltype(b_rounded)::value;
        if constexpr (ALIGN % 16 == 0)
            tc_gemm<T, false, false, B_ROUNDED>(
                ImageColumnsAligned<CopyA, RUN_A>(g, x, FastDivmod{g.out_plane(), plane_multiplier, plane_shift},
                                                  FastDivmod{g.ow, width_multiplier, width_shift}, m0, k_begin, k_end),
                PixelChannelsAligned<CopyB, RUN_B>(b_source, g.o, n0, k_begin, k_end), tiles, acc, on_chunk_b, land_a);
        else
            tc_gemm<T, false, false, B_ROUNDED>(Gathered<CopyA, ImageColumns>{x, {g}, m0, k_begin, k_end},
                                                Gathered<CopyB, ChannelsOfPixels>{b_source, {g.o}, n0, k_begin, k_end},
                                                tiles, acc, on_chunk_b, land_a);
    };
    const auto loops = [&](auto land_a) {
        if (!bias.active)
            gemm(Flag<true>(), dy, NoChunkWork(), land_a);
        else if (dy_raw == dy)   // TF32 values as given: summed as they land, not rounded again
            gemm(Flag<true>(), dy, bias, land_a);
        else
            gemm(Flag<false>(), dy_raw, bias, land_a);
    };
    if constexpr (NORM)
        loops(TcNormColumns<T::BM>(norm_table, TcFold TC_FOLD, g.c, m0));
    else
        loops(TcRound());
    bias.reduce(warp_sums);
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    tc_finish<T, true>(WeightsOut{g, krsc}, dw, partial, g.o * columns, split, tile_counters(counters, 0, split),
                             m0, n0, nullptr, false, acc, bias);
}

// ---- backward-weight of 3x3, stride-1 convolutions from windows of x --------------------------------
//
// dw[o][tap][ci] = the sum over the output pixels p of x[p + tap][ci] dy[p][o]: the tiles above load each
// pixel of x once per tap, 21.3 FLOPs per L2 byte with 64 output channels (ResNet-18's first stage). As
// conv_bf16.cu's halo backward-weight (tc_conv.cuh's HaloWeightsOut: the nine taps of 32 input channels by
// 64 output channels; here 2 x 4 warps of 9 x 2 mma tiles, a warp's row h the channels c0 + 16 h..), a stage of
// pixels (TcHalo288x64: 56, two rows of the first stage's 28 x 28 images) loads the window of x that their
// taps reach and their dy, each once, into a 2-stage ring: two windows of 16 float channels (HaloSlot<float>),
// one per warp row, so that the ring (TcWgradHaloShared, 96 KB) lives in dynamic shared memory, past the 48 KB
// of static shared memory a block may have (the launcher asks for it). A slot holds the channels (m) along a
// row of shared memory, the pixels (k) run across slots: a lane's A fragment of a tap is two LDS.64
// (tc_fragment_a's permuted rows: the mma's rows g and g + 8 are the channels 2g and 2g + 1) at its pixels'
// slots shifted by the tap. The 8 pixels of a k8 step go in the order 0, 2, 4, 6, 1, 3, 5, 7 (k t is the
// step's pixel 2t, k t + 4 its pixel 2t + 1), so that the lanes of each half of the warp read slots two
// apart, 40 words, 8 banks, and dy's pitch of 68 words puts its rows 2t at banks 8t: both without bank
// conflicts where a step's pixels share a row of the image. Each pixel's slot is worked out once a stage, by
// one thread as it loads the stage, into a table beside it. The window lands rounded to TF32 (HaloRound) or
// as relu(bn(x)) (HaloNorm, NORM), made so by the threads that copied it; dy holds TF32 values (the launcher
// takes conv_tc_wgrad for a bias gradient of another dy than the one the GEMM reads), and the blocks of the
// first 32 input channels sum the bias gradient from it as it lands (BiasSums), in a main loop of their own.
// Nothing lies in static shared memory (the warps' bias sums go in the ring once the loop is done), so that
// the ring's addresses are constants. At 28 x 28 a block reads 73 FLOPs per L2 byte (bench/tc_plan.py); the
// launcher's WGRAD_HALO gives the ring's bytes (the emulator's sanitizer refuses an access past what a
// launch asked for).
// Resident blocks an SM: one, of 8 warps (2 x 4: a warp's row h the channels c0 + 16 h.., its 16 output channels of
// the 64), whose ring of 96 KB fits an A100's, an RTX 3090's or 4090's or an L4's SM once (4 warps an SM, with 2 x
// 2 warps); at the 128 registers that two blocks would leave (an H100's SM holds two rings), the kernel spills.
constexpr int TC_WGRAD_HALO_BLOCKS = 1;
struct TcHalo288x64 : TcTile<288, 64, 4> {
    static constexpr int BK = 56, STAGES = 2, SLOTS = 210;   // a stage's pixels; its windows' slots
};
template <class T>
struct TcWgradHaloShared {   // a stage of the ring, in floats: the two windows, dy, the pixels' slots
    static constexpr int WINDOW = T::SLOTS * HaloSlot<float>::PITCH, DY_PITCH = T::BN + 4;
    static constexpr int DY = 2 * WINDOW, SLOTS = DY + T::BK * DY_PITCH, STAGE = SLOTS + T::BK;
    static constexpr int BYTES = T::STAGES * STAGE * int(sizeof(float));
};
// This thread's chunks of 16 pixels of a stage's dy (rows of DY_PITCH): TcCopy's.
template <class T>
struct TcWgradHaloDy : TcCopy<T::BN, false, T::THREADS> {
    using Copy = TcCopy<T::BN, false, T::THREADS>;
    __device__ static int offset(int c) { return Copy::k(c) * TcWgradHaloShared<T>::DY_PITCH + Copy::row(c); }
};

// dw (see WeightsOut) of the 3x3, stride-1 convolution from windows of x, as above: block (x, y, z) computes the
// nine taps of input channels [32 x, ...) by output channels [64 y, ...) over the pixels [z * k_chunk, ...)
// (split-K in groups of `group`, see tc_finish); and, unless db is null, the bias gradient, dy's per-channel
// sums. plane_..., width_...: as conv_tc_wgrad's; NORM: x is a training batch norm's input, and the
// convolution's input relu(bn(x)) (HaloNorm). The launch gives TcWgradHaloShared<T>::BYTES of dynamic shared
// memory.
template <class T, bool NORM = false>
__global__ void __launch_bounds__(T::THREADS, TC_WGRAD_HALO_BLOCKS)
conv_tc_wgrad_halo(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ dw, int krsc,
                   float* __restrict__ db, float* partial, float* db_partial, unsigned* counters, CONV_PARAMS,
                   int k_chunk, int group, unsigned plane_multiplier, unsigned plane_shift, unsigned width_multiplier,
                   unsigned width_shift, TC_FOLD_PARAMS) {
    using Shared = TcWgradHaloShared<T>;
    using CopyB = TcWgradHaloDy<T>;   // dy's chunks of each 16 pixels of a stage
    constexpr int BK = T::BK, PITCH = HaloSlot<float>::PITCH, HALF = HaloSlot<float>::CHANNELS;
    constexpr int DY_PARTS = (BK + TC_BK - 1) / TC_BK;
    static_assert(BK % 8 == 0 && BK <= T::THREADS, "whole k8 steps; a thread for each pixel's slot");
    extern __shared__ __align__(16) float smem[];
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int c0 = blockIdx.x * 2 * HALF, n0 = blockIdx.y * T::BN;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(k_begin + k_chunk, g.n * g.out_plane());
    const int stages = (max(k_end - k_begin, 0) + BK - 1) / BK;
    const FastDivmod plane{g.out_plane(), plane_multiplier, plane_shift}, width_div{g.ow, width_multiplier, width_shift};
    BiasSums<T, CopyB> bias{{db, db_partial, g.o, n0, db && blockIdx.x == 0, nullptr}, {}};
    const TcFold fold TC_FOLD;
    using Land = decltype(halo_land<NORM>(fold));
    Land land[2] = {halo_land<NORM>(fold), halo_land<NORM>(fold)};   // of each window's channels, the block's
#pragma unroll
    for (int h = 0; h < 2; ++h) land[h].channels(c0 + HALF * h);
    const int width = g.w + 2, lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
    const HaloPixels pixels{plane, width_div, g.h};
    // the window of the stage's pixels: from the padded row pp of image img, `rows` of them, the first `first`
    struct Window {
        int img, pp, rows, first;
    };
    const auto window_of = [&](int stage) {
        const int p0 = k_begin + stage * BK;
        const HaloPixels::Place first = pixels.place(p0);
        const int first_row = pixels.padded_row(first);
        return Window{first.img, first.p, pixels.padded_row(pixels.place(min(p0 + BK, k_end) - 1)) - first_row + 3,
                      first_row};
    };
    Window windows[2];   // of the stage in each slot of the ring
    const auto dy_line = [](int part) { return TC_BK * part + CopyB::k(0) < BK; };   // this thread's is the stage's
    const auto load = [&](int stage, int ring) {
        if (stage < stages) {
            float* const s = smem + ring * Shared::STAGE;
            const Window w = windows[ring] = window_of(stage);
            halo_window_chunks<T::THREADS>(x + c0, g, g.c, w.img, w.pp, w.rows, [&](int slot, const float* at,
                                                                                     bool data) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {   // the two windows' chunks of the slot
                    if constexpr (Land::PADDED)
                        cp_async_cg(s + h * Shared::WINDOW + slot, data ? at + HALF * h : land[h].pad, 16);
                    else
                        cp_async_cg(s + h * Shared::WINDOW + slot, data ? at + HALF * h : x, data ? 16 : 0);
                }
            });
            const int p0 = k_begin + stage * BK;
            PixelChannelsAligned<CopyB> b(dy, g.o, n0, p0, k_end);
#pragma unroll
            for (int part = 0; part < DY_PARTS; ++part) {   // dy's 16 pixels at a time, the last part's first BK % 16
                if (dy_line(part)) tc_load_stage<CopyB>(s + Shared::DY + TC_BK * part * Shared::DY_PITCH, b);
                b.next();
            }
            if (int(threadIdx.x) < BK)   // the pixel's slot
                reinterpret_cast<int*>(s + Shared::SLOTS)[threadIdx.x] =
                    pixels.slot(p0 + int(threadIdx.x), k_end, w.first, width, PITCH);
        }
        cp_async_commit();
    };
    // this thread's chunks of the landed stage made what the warps read (see the header); SUMS: and its chunks of
    // dy summed for the bias gradient
    const auto land_stage = [&](int ring, auto sums) {
        float* const s = smem + ring * Shared::STAGE;
        const Window w = windows[ring];
        halo_window_chunks<T::THREADS>(x + c0, g, g.c, w.img, w.pp, w.rows, [&](int slot, const float*, bool) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float4* chunk = reinterpret_cast<float4*>(s + h * Shared::WINDOW + slot);
                *chunk = land[h].chunk(*chunk);
            }
        });
        if constexpr (decltype(sums)::value) {
#pragma unroll
            for (int part = 0; part < DY_PARTS; ++part)
#pragma unroll
                for (int c = 0; c < CopyB::CHUNKS; ++c)
                    if (dy_line(part)) {
                        const float4 v = *reinterpret_cast<const float4*>(s + Shared::DY + TC_BK * part * Shared::DY_PITCH +
                                                                          CopyB::offset(c));
                        bias.add(c, Floats<4>{{v.x, v.y, v.z, v.w}});
                    }
        }
    };
    float acc[T::MI][T::NI][4];
    tc_clear<T>(acc);
    const int grp = lane / 4, t = lane % 4, h = warp / T::WARPS_N, wn = (warp % T::WARPS_N) * T::WARP_N;
    const int row_shift = width * PITCH;
    // the stage in ring slot `ring`, while the next one loads; SUMS: the bias gradient's sums too
    const auto step = [&](int stage, int ring, auto sums) {
        cp_async_wait<0>();   // this thread's copies of the stage have landed
        land_stage(ring, sums);
        __syncthreads();      // everyone's have, and everyone is done with the stage before
        load(stage + 1, ring ^ 1);
        const float* const s = smem + ring * Shared::STAGE;
        const float* const window = s + h * Shared::WINDOW + 2 * grp;   // the channels 2g, 2g + 1 of the warp's 16
        const float* const dys = s + Shared::DY + 2 * t * Shared::DY_PITCH + wn + grp;
        const int* const slots = reinterpret_cast<const int*>(s + Shared::SLOTS) + 2 * t;
#pragma unroll
        for (int k = 0; k < BK; k += 8) {
            const int2 at = *reinterpret_cast<const int2*>(slots + k);   // the slots of pixels k + 2t, k + 2t + 1
            unsigned fb[T::NI][2];
#pragma unroll
            for (int j = 0; j < T::NI; ++j) {
                fb[j][0] = __float_as_uint(dys[k * Shared::DY_PITCH + 8 * j]);
                fb[j][1] = __float_as_uint(dys[(k + 1) * Shared::DY_PITCH + 8 * j]);
            }
#pragma unroll
            for (int tap = 0; tap < 9; ++tap) {   // the tap's slots: rows below, columns right
                const int shift = tap / 3 * row_shift + tap % 3 * PITCH;
                unsigned fa[4];
                *reinterpret_cast<uint2*>(&fa[0]) = *reinterpret_cast<const uint2*>(window + at.x + shift);
                *reinterpret_cast<uint2*>(&fa[2]) = *reinterpret_cast<const uint2*>(window + at.y + shift);
#pragma unroll
                for (int j = 0; j < T::NI; ++j) mma_tf32(acc[tap][j], fa, fb[j], acc[tap][j]);
            }
        }
    };
    // unrolled over the ring, so that each stage's shared-memory offsets are constants
    const auto loop = [&](auto sums) {
        for (int stage = 0; stage < stages; stage += 2) {
            step(stage, 0, sums);
            if (stage + 1 < stages) step(stage + 1, 1, sums);
        }
    };
    load(0, 0);
    if (bias.active) {   // the same for the whole block
        loop(Flag<true>());
        __syncthreads();   // every warp is done with the ring, where the warps' sums go (no static shared memory:
    } else {               // the ring's addresses are then constants)
        loop(Flag<false>());
    }
    cp_async_wait<0>();
    bias.reduce(*reinterpret_cast<float(*)[T::THREADS / 32][T::BN]>(smem));
    const SplitK split{int(gridDim.z), group, int(blockIdx.z)};
    tc_finish<T, true>(HaloWeightsOut{WeightsOut{g, krsc}, c0}, dw, partial, g.o * g.taps() * g.c, split,
                       tile_counters(counters, 0, split), 0, n0, nullptr, false, acc, bias);
}


// y (N*H*W x O, NHWC) = the 3x3 convolution, stride 1, padding 1, of x + bias, from windows of x
// (tc_halo_gemm) by w_krsc: block (x, y) computes output pixels [x * BM, ...) by channels
// [y * BN, ...), no split of k (k_chunk, group and the partials unused: the launch's parameters are
// conv_tc_forward's), and the batch norm's statistics and the norm applied to x (NORM) as that kernel.
template <class T, bool NORM = false>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
conv_tc_forward_halo(const float* __restrict__ x, const float* __restrict__ w_krsc, const float* __restrict__ bias,
                     float* __restrict__ y, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group,
                     BN_STATS_PARAMS, TC_FOLD_PARAMS) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, pixels = g.n * g.out_plane();
    const HaloWeights<TcCopy<T::BN, true>, true> w(w_krsc, g, n0, g.o);
    float acc[T::MI][T::NI][4];
    if constexpr (NORM)
        tc_halo_gemm<T>(x, g, g.c, m0, w, acc, HaloNorm(TcFold TC_FOLD));
    else
        tc_halo_gemm<T>(x, g, g.c, m0, w, acc, HaloRound());
    tc_finish<T, false>(RowsOut{pixels, g.o}, y, partial, pixels * g.o, SplitK{1, 1, 0}, counters, m0, n0, bias,
                        false, acc);
    __shared__ float stats_smem[2 * 3 * T::BN];
    if (stats_partial)
        tc_batch_stats<T, false>(BnStats BN_STATS, RowsOut{pixels, g.o}, y, stats_smem, m0, n0, bias, true, acc);
}

// dx (N*H*W x C, NHWC) of the same convolution, from windows of dy, by the forward halo kernel's GEMM with
// the weights mirrored (mirrored_weights), added to what dx holds when `add` is set; and the batch
// norm's backward sums as conv_tc_dgrad.
template <class T>
__global__ void __launch_bounds__(T::THREADS, T::MIN_BLOCKS)
conv_tc_dgrad_halo(const float* __restrict__ dy, const float* __restrict__ w_mirrored, float* __restrict__ dx, int add,
                   float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group, BN_SUMS_PARAMS(float)) {
    const Geometry<0, 0> g CONV_GEOMETRY;
    Geometry<0, 0> mirrored = g;   // the forward convolution of dy: O channels in (the weights' k), C out
    mirrored.c = g.o;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN, pixels = g.n * g.h * g.w;
    float acc[T::MI][T::NI][4];
    tc_halo_gemm<T>(dy, g, g.o, m0, HaloWeights<TcCopy<T::BN, true>, true>(w_mirrored, mirrored, n0, g.c), acc,
                    HaloAsIs());
    tc_finish<T, false>(RowsOut{pixels, g.c}, dx, partial, pixels * g.c, SplitK{1, 1, 0}, counters, m0, n0, nullptr,
                        add, acc);
    __shared__ float sums_smem[2 * TC_THREADS];
    if (sums_partial)
        bn_tile_sums<T, TC_THREADS>(BnSums<float> BN_SUMS, RowsOut{pixels, g.c}, g.c, dx, sums_smem, m0, n0,
                                    int(blockIdx.x), int(gridDim.x), int(blockIdx.y));
}

// ---- the backward of a 1x1 projection in one pass over dy -------------------------------------------
//
// A 1x1, padding-0 convolution of 64 input and 128 output channels (ResNet-18's first projection, at stride 2):
// its backward-data, dx (cells x 64) = dy (cells x 128) . w (128 x 64) at the pixels of x that the output
// cells read, and its backward-weight, dw (128 x 64) = dy^T . x (those pixels), read the same dy. Apart, each
// GEMM has 64 columns on one side, and a tile of BM rows by 64 columns of 4-byte operands reads 32 BM / (BM +
// 64) FLOPs per L2 byte, under 32 for every BM (21.3 at 128). Here a block takes TC_PROJECTION_CELLS cells and
// loads their dy and x once, and w once, for both GEMMs: 4 cells C O FLOPs over 4 (cells O + cells C + O C)
// bytes, 32.0 at 128 cells.
//
// The cells go in stages of TC_PROJECTION_STAGE through a ring of 2 in dynamic shared memory
// (TcProjectionShared), beside w and each cell's pixel. dy's stage is [cell][o], rows of 132 floats:
// backward-data reads it along o by ldmatrix (its A, K_MAJOR: rows 4 banks apart, no bank conflict), and
// backward-weight along the cells (its A, the permuted rows of tc_fragment_a, pairs of words: 2-way bank
// conflicts at this pitch). x's stage is [cell][c], rows of 72 floats, backward-weight's B (tc_fragments_b).
// w lies transposed, [c][o], rows of 132 floats, so that backward-data's B is one ldmatrix a k8 step for two
// mma tiles; the threads transpose it as they load it, two to an output channel. 8 warps (256 threads):
// backward-weight's tile is the whole dw, 2 x 4 warps of 64 x 16 (TcProjection), summed over the block's
// stages; the blocks are the parts of its split k, added in a fixed order (tc_finish). Backward-data's tile is
// a stage's cells by the 64 columns, warp w the cells 16 (w / 4).. by the columns 16 (w % 4).. (1 x 2 mma
// tiles), written (ADD: added to dx) at the end of each
// stage; else (ADD: false) the block also writes zeros to the pixels of its cells that no cell reads (a stride
// above 1). dy and w_krsc hold TF32 values (the launcher takes the separate kernels for a raw dy); x is rounded
// to TF32 as it lands. The bias gradient, unless db is null, sums dy: each thread its 4 channels of its stages'
// cells in order, then the warps in order. At most 128 registers: an H100's SM holds two blocks (16 warps), an
// A100's one (8; the 2 x 2 warps at 186-220 registers left it 4).
constexpr int TC_PROJECTION_CELLS = 128, TC_PROJECTION_STAGE = 32, TC_PROJECTION_BLOCKS = 2;
constexpr int TC_PROJECTION_C = 64, TC_PROJECTION_O = 128;
struct TcProjection : TcTile<TC_PROJECTION_O, TC_PROJECTION_C, 4> {};   // dw
struct TcProjectionShared {   // in floats
    static constexpr int W_PITCH = TC_PROJECTION_O + 4, DY_PITCH = TC_PROJECTION_O + 4, X_PITCH = TC_PROJECTION_C + 8;
    static constexpr int DY = TC_PROJECTION_STAGE * DY_PITCH, STAGE = DY + TC_PROJECTION_STAGE * X_PITCH;
    static constexpr int RING = TC_PROJECTION_C * W_PITCH, PIXELS = RING + 2 * STAGE;
    static constexpr int SUMS = PIXELS + 3 * TC_PROJECTION_CELLS;
    static constexpr int BYTES = (SUMS + TcProjection::THREADS / 32 * TC_PROJECTION_O) * 4;
};

// The bias gradient's channels of a projection: the rows of dw (BiasTotals' columns).
struct TcProjectionBias {
    static constexpr int BN = TC_PROJECTION_O;
};

template <bool ADD>
__global__ void __launch_bounds__(TcProjection::THREADS, TC_PROJECTION_BLOCKS)
conv_tc_projection_backward(const float* __restrict__ dy, const float* __restrict__ x,
                            const float* __restrict__ w_krsc, float* __restrict__ dx, float* __restrict__ dw,
                            float* __restrict__ db, float* partial, float* db_partial, unsigned* counters,
                            CONV_PARAMS, int group, unsigned plane_multiplier, unsigned plane_shift,
                            unsigned width_multiplier, unsigned width_shift) {
    using S = TcProjectionShared;
    using T = TcProjection;
    constexpr int STAGE = TC_PROJECTION_STAGE, C = TC_PROJECTION_C, O = TC_PROJECTION_O;
    constexpr int CELLS = TC_PROJECTION_CELLS, THREADS = T::THREADS, WARPS = THREADS / 32;
    constexpr int DY_CHUNKS = STAGE * O / 4 / THREADS, X_CHUNKS = STAGE * C / 4 / THREADS;
    static_assert(THREADS == 2 * CELLS && THREADS == 2 * O, "a thread a cell, two an output channel");
    extern __shared__ __align__(16) float smem[];
    int* const pixel = reinterpret_cast<int*>(smem + S::PIXELS);   // each cell's offset in x (and dx), row, column
    const Geometry<0, 0> g CONV_GEOMETRY;
    const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32, gl = lane / 4, t = lane % 4;
    const int cells = g.n * g.out_plane(), m0 = int(blockIdx.x) * CELLS;
    const int stages = (min(CELLS, cells - m0) + STAGE - 1) / STAGE;
    if (tid < CELLS) {   // one thread a cell (past the cells: x's first pixel, which no copy reads)
        const FastDivmod plane{g.out_plane(), plane_multiplier, plane_shift}, width{g.ow, width_multiplier, width_shift};
        const int cell = min(m0 + tid, cells - 1), img = plane.div(cell), pq = plane.mod(cell, img), p = width.div(pq);
        const int row = p * g.sh, column = (pq - p * g.ow) * g.sw;
        pixel[tid] = m0 + tid < cells ? ((img * g.h + row) * g.w + column) * C : 0;
        pixel[CELLS + tid] = row;
        pixel[2 * CELLS + tid] = column;
    }
    {   // two threads an output channel of w, o = tid % O: its channels 32 (tid / O).., transposed
        const int o = tid % O, first = tid / O * (C / 8);
#pragma unroll
        for (int q = first; q < first + C / 8; ++q) {   // w[o][4q..]
            const float4 v = *reinterpret_cast<const float4*>(w_krsc + o * C + 4 * q);
            smem[(4 * q) * S::W_PITCH + o] = v.x;
            smem[(4 * q + 1) * S::W_PITCH + o] = v.y;
            smem[(4 * q + 2) * S::W_PITCH + o] = v.z;
            smem[(4 * q + 3) * S::W_PITCH + o] = v.w;
        }
    }
    __syncthreads();
    // this thread's chunks of a stage: of dy, cells WARPS c + warp, channels 4 lane..; of x, cells X_CHUNKS (tid / 16)
    // + c, channels 4 (tid % 16)... A chunk past the cells copies nothing from dy's first chunk, or x's (the pixel
    // of a cell past the end), addresses within the operand.
    const int quad = tid % 16, x_cell = X_CHUNKS * (tid / 16);
    const unsigned dy_first = (m0 + warp) * O + 4 * lane;
    const auto load = [&](int stage, int ring) {
        float* const s = smem + S::RING + ring * S::STAGE;
        const int dy_left = cells - m0 - stage * STAGE - warp, x_left = cells - m0 - stage * STAGE - x_cell;
#pragma unroll
        for (int c = 0; c < DY_CHUNKS; ++c) {
            const bool data = WARPS * c < dy_left;
            cp_async_cg(s + (WARPS * c + warp) * S::DY_PITCH + 4 * lane,
                        dy + (data ? dy_first + unsigned(stage * STAGE + WARPS * c) * O : 0u), data ? 16 : 0);
        }
#pragma unroll
        for (int c = 0; c < X_CHUNKS; ++c)
            cp_async_cg(s + S::DY + (x_cell + c) * S::X_PITCH + 4 * quad,
                        x + unsigned(pixel[stage * STAGE + x_cell + c] + 4 * quad), c < x_left ? 16 : 0);
    };
    load(0, 0);
    cp_async_commit();
    float acc[T::MI][T::NI][4], bias[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    tc_clear<T>(acc);
    const int wm = (warp / T::WARPS_N) * T::WARP_M, wn = (warp % T::WARPS_N) * T::WARP_N;
    const int half = warp / 4, columns = 16 * (warp % 4);   // backward-data's cells 16 half.., its columns
    float* const dx_thread = dx + columns + 2 * t;
    const auto step = [&](int stage, int ring) {
        float* const dys = smem + S::RING + ring * S::STAGE;
        float* const xs = dys + S::DY;
        cp_async_wait<0>();   // this thread's copies of the stage have landed
#pragma unroll
        for (int c = 0; c < DY_CHUNKS; ++c) {
            const float4 v = *reinterpret_cast<const float4*>(dys + (WARPS * c + warp) * S::DY_PITCH + 4 * lane);
            bias[0] += v.x;
            bias[1] += v.y;
            bias[2] += v.z;
            bias[3] += v.w;
        }
#pragma unroll
        for (int c = 0; c < X_CHUNKS; ++c) {
            float4* chunk = reinterpret_cast<float4*>(xs + (x_cell + c) * S::X_PITCH + 4 * quad);
            *chunk = tf32_round4(*chunk);
        }
        __syncthreads();   // everyone's have landed, and everyone is done with the previous stage
        if (stage + 1 < stages) {
            load(stage + 1, ring ^ 1);
            cp_async_commit();
        }
        // backward-data: this warp's 16 cells of the stage by its 16 columns, over the 128 channels of dy
        float d[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) d[j][e] = 0.0f;
#pragma unroll
        for (int k = 0; k < O; k += 8) {
            unsigned fa[4], fb[2][2];
            tc_fragment_a<STAGE, true, S::DY_PITCH>(fa, dys, 16 * half, k);
            tc_fragments_b<C, true, S::W_PITCH>(fb, smem, columns, k);
#pragma unroll
            for (int j = 0; j < 2; ++j) mma_tf32(d[j], fa, fb[j], d[j]);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {   // the accumulator rows g + 8h: the stage's cells 16 half + g + 8 h
            const int local = stage * STAGE + 16 * half + gl + 8 * h;
            if (m0 + local >= cells) continue;
            float* const out = dx_thread + unsigned(pixel[local]);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float2 v = {d[j][2 * h], d[j][2 * h + 1]};
                if constexpr (ADD) {
                    const float2 was = *reinterpret_cast<const float2*>(out + 8 * j);
                    v.x += was.x;
                    v.y += was.y;
                }
                *reinterpret_cast<float2*>(out + 8 * j) = v;
            }
        }
        // backward-weight: dw += dy^T . x over the stage's cells
#pragma unroll
        for (int k = 0; k < STAGE; k += 8) {
            unsigned fa[T::MI][4];
#pragma unroll
            for (int i = 0; i < T::MI; ++i) tc_fragment_a<O, false, S::DY_PITCH>(fa[i], dys, wm + 16 * i, k);
            tc_multiply<T, false>(acc, fa, xs, wn, k);
        }
    };
    // the loop unrolled over the ring, so that each stage's shared-memory addresses are constants
    for (int stage = 0; stage < stages; stage += 2) {
        step(stage, 0);
        if (stage + 1 < stages) step(stage + 1, 1);
    }
    cp_async_wait<0>();
    // the pixels of the block's cells that no cell reads (a stride above 1): zeros, unless dx is added to (ADD)
    if (!ADD && g.sh * g.sw > 1) {
        const int per_cell = g.sh * g.sw * (C / 4);
        for (int e = tid; e < CELLS * per_cell; e += THREADS) {
            const int local = e / per_cell, sub = e % per_cell / (C / 4), q = e % (C / 4), a = sub / g.sw, b = sub % g.sw;
            if (sub > 0 && m0 + local < cells && pixel[CELLS + local] + a < g.h && pixel[2 * CELLS + local] + b < g.w)
                *reinterpret_cast<float4*>(dx + pixel[local] + (a * g.w + b) * C + 4 * q) = {0.0f, 0.0f, 0.0f, 0.0f};
        }
    }
    // the bias gradient: each warp's sums of the channels (a lane's 4), then the warps in order
    float* const warp_sums = smem + S::SUMS;
    if (db) {   // the same for the whole block
#pragma unroll
        for (int e = 0; e < 4; ++e) warp_sums[warp * O + 4 * lane + e] = bias[e];
        __syncthreads();
        // thread tid's channel: the last warp's slot, which it alone reads, takes the total
        if (tid < O) warp_sums[(WARPS - 1) * O + tid] = warps_in_order<WARPS>(warp_sums + tid, O);
    }
    const BiasTotals<TcProjectionBias> totals{db, db_partial, O, 0, db != nullptr, warp_sums + (WARPS - 1) * O};
    const SplitK split{int(gridDim.x), group, int(blockIdx.x)};
    tc_finish<T, true>(RowsOut{O, C}, dw, partial, O * C, split, counters, 0, 0, nullptr, false, acc, totals);
}

// ---- backward-data of a 3x3, stride-2 convolution from windows of dy --------------------------------
//
// dx of a 3x3, stride-2, padding-1 convolution (ResNet-18's first of each stage past the first) runs as four
// GEMMs, one per stride phase of dx's cells, each over the taps that reach it (1, 2, 2 and 4: conv_geometry.cuh's
// Phase), its A dy shifted by the tap. With 64 columns (C) a tile of BM rows reads 32 BM / (BM + 64) FLOPs per
// L2 byte, under 32 for every BM. Where H and W are even, a phase's cells are dy's pixels (OH x OW), and the
// phase is a convolution of dy, padding 1, stride 1, by the taps' weights, whose taps shift dy by 0 or 1 row and
// column: the halo kernels' taps (1, 1), (1, 2), (2, 1), (2, 2). A block of TcPhase192x64's 192 cells of one
// phase loads, per 16 channels of dy, the window of dy their taps reach (tc_conv.cuh's halo_load_window, the
// halo forward's: rows of OW + 2 slots; each thread's chunks of it, and where they come from, worked out once,
// since every stage's window has the same place), once for the phase's taps (the 1-tap phase, whose tap reads dy
// at the cell itself, its cells' rows of dy alone, as tc_gemm's A), and the taps' weights (mirrored_weights'
// (C, 3, 3, O), read along O as the halo backward-data reads them), each stage both, through a ring of 2 in
// dynamic shared memory (TcPhaseShared); over the four phases at 14 x 14, 38 FLOPs per L2 byte
// (bench/tc_plan.py). dy and the weights hold TF32 values. The epilogue is conv_tc_dgrad's: dx written or
// added (`add`), and the norm's backward sums over the tiles of every phase. 2 x 4 warps of 96 x 16 (6 x 2 mma
// tiles), at most 128 registers: an H100's SM holds two blocks, 16 warps; an A100's one (its 164 KB), 8 warps,
// where the 2 x 2 warps of 96 x 32 at 212 registers left it 4.
struct TcPhase192x64 : TcTile<192, 64, 4> {};
constexpr int TC_PHASE_SLOTS = 304, TC_PHASE_BLOCKS = 2;   // a window's slots; resident blocks an SM
struct TcPhaseShared {   // a stage of the ring, in floats: the window, then each tap's weights
    static constexpr int WINDOW = TC_PHASE_SLOTS * HaloSlot<float>::PITCH, B = TcStage<64, true>::SIZE;
    static constexpr int STAGE = WINDOW + 4 * B, BYTES = 2 * STAGE * int(sizeof(float));
};

// acc += the phase f's GEMM for the block's cells from m0, over TAPS taps (f.taps()), as above: `image` is dy's
// geometry as the halo's (O channels, OH x OW pixels).
template <class T, int TAPS>
__device__ __forceinline__ void tc_phase_gemm(const float* __restrict__ dy, const float* __restrict__ w_mirrored,
                                              const Geometry<0, 0>& g, const Geometry<0, 0>& image, const Phase& f,
                                              int m0, float* smem, float (&acc)[T::MI][T::NI][4]) {
    using S = TcPhaseShared;
    using Copy = TcCopy<T::BN, true, T::THREADS>;
    using CopyA = TcCopy<T::BM, true, T::THREADS>;   // the 1-tap phase's rows of dy, [cell][16 + 4] (K_MAJOR A)
    static_assert(TcStage<T::BM, true>::SIZE <= S::WINDOW, "the 1-tap phase's rows fit the window's place");
    constexpr int PITCH = HaloSlot<float>::PITCH, WINDOW_CHUNKS = (4 * TC_PHASE_SLOTS + T::THREADS - 1) / T::THREADS;
    constexpr int SLOT_STEP = T::THREADS / 4;   // the slots between a thread's chunks of a window
    const int width = image.w + 2, warp = int(threadIdx.x) / 32;
    const int wm = (warp / T::WARPS_N) * T::WARP_M, wn = (warp % T::WARPS_N) * T::WARP_N;
    const HaloPlace<T, float> place(image, m0, wm);
    // the taps (i, j) of the phase: dy's row u + t_h - i and column v + t_w - j for the cell (u, v), the halo's tap
    // (t_h - i + 1, t_w - j + 1); the kernel's tap (a + 2i, b + 2j), mirrored_weights' 8 minus it
    int shift[TAPS], weights[TAPS];
#pragma unroll
    for (int q = 0; q < TAPS; ++q) {
        const int i = q / f.taps_w, j = q % f.taps_w;
        shift[q] = ((f.t_h - i + 1) * width + f.t_w - j + 1) * PITCH;
        weights[q] = (8 - ((f.a + 2 * i) * 3 + f.b + 2 * j)) * g.o;
    }
    // this thread's chunks of a window: slot tid / 4 + SLOT_STEP i, its 16 bytes 4 (tid % 4).. (HaloSlot's), the slots
    // row-major in rows of `width` from the padded row pp of image img (halo_window_chunks' window); where each
    // lies in dy (channel 0), or -1 for zeros (padding, past the window's rows or the last image), worked out once
    int from[WINDOW_CHUNKS];
#pragma unroll
    for (int i = 0; i < WINDOW_CHUNKS; ++i) {
        const int slot = int(threadIdx.x) / 4 + SLOT_STEP * i, row = slot / width, col = slot - row * width;
        const int padded = place.img * (image.h + 2) + place.pp + row, img = padded / (image.h + 2);
        const int p = padded - img * (image.h + 2);
        const bool data = row < place.rows && img < image.n && unsigned(p - 1) < unsigned(image.h) &&
                          unsigned(col - 1) < unsigned(image.w);
        from[i] = data ? ((img * image.h + p - 1) * image.w + col - 1) * g.o + 4 * (int(threadIdx.x) % 4) : -1;
    }
    unsigned inside = 0;   // bit c: this thread's chunk c of the weights lies in a row (input channel) of dx
#pragma unroll
    for (int c = 0; c < Copy::CHUNKS; ++c) inside |= unsigned(Copy::row(c) < g.c) << c;
    const int chunks = g.o / TC_BK, cells = image.n * image.h * image.w;
    const auto load = [&](int chunk, int ring) {
        float* const s = smem + ring * S::STAGE;
        const int c0 = chunk * TC_BK;
        if constexpr (TAPS == 1) {   // the phase whose tap is dy at the cell itself: its rows, no window
#pragma unroll
            for (int c = 0; c < CopyA::CHUNKS; ++c) {
                const bool data = m0 + CopyA::row(c) < cells;
                cp_async_cg(s + CopyA::offset(c),
                            dy + (data ? unsigned(m0 + CopyA::row(c)) * g.o + c0 + CopyA::k(0) : 0u), data ? 16 : 0);
            }
        } else {
#pragma unroll
            for (int i = 0; i < WINDOW_CHUNKS; ++i) {
                const int slot = int(threadIdx.x) / 4 + SLOT_STEP * i;
                if (SLOT_STEP * (i + 1) <= TC_PHASE_SLOTS || slot < TC_PHASE_SLOTS) {   // the last row of chunks: a part
                    const bool data = from[i] >= 0;
                    cp_async_cg(s + slot * PITCH + 4 * (int(threadIdx.x) % 4), dy + (data ? unsigned(from[i] + c0) : 0u),
                                data ? 16 : 0);
                }
            }
        }
#pragma unroll
        for (int q = 0; q < TAPS; ++q)
#pragma unroll
            for (int c = 0; c < Copy::CHUNKS; ++c) {
                const bool data = inside >> c & 1u;
                cp_async_cg(s + S::WINDOW + q * S::B + Copy::offset(c),
                            w_mirrored + (data ? Copy::row(c) * 9 * g.o + weights[q] + c0 + Copy::k(0) : 0),
                            data ? 16 : 0);
            }
        cp_async_commit();
    };
    tc_clear<T>(acc);
    load(0, 0);
    const auto step = [&](int chunk, int ring) {
        cp_async_wait<0>();   // this thread's copies of the stage have landed
        __syncthreads();      // everyone's have, and everyone is done with the stage before
        if (chunk + 1 < chunks) load(chunk + 1, ring ^ 1);
        const float* const window = smem + ring * S::STAGE;
#pragma unroll
        for (int q = 0; q < TAPS; ++q)
#pragma unroll
            for (int k = 0; k < TC_BK; k += 8) {
                unsigned fa[T::MI][4];
#pragma unroll
                for (int i = 0; i < T::MI; ++i) {
                    if constexpr (TAPS == 1)
                        tc_fragment_a<T::BM, true>(fa[i], window, wm + 16 * i, k);
                    else
                        ldmatrix_x4(fa[i], window + place.slot[i] + shift[q] + k);
                }
                tc_multiply<T, true>(acc, fa, window + S::WINDOW + q * S::B, wn, k);
            }
    };
    // the loop unrolled over the ring, so that each stage's shared-memory addresses are constants
    for (int chunk = 0; chunk < chunks; chunk += 2) {
        step(chunk, 0);
        if (chunk + 1 < chunks) step(chunk + 1, 1);
    }
}

// dx (N*H*W x C, NHWC) of a 3x3, stride-2, padding-1 convolution of even H and W and at most 64 input channels
// from windows of dy, as above: block (x, 0, z) computes the cells [x * BM, ...) of phase z by the C columns;
// the parameters are conv_tc_dgrad's (no split of k: k_chunk and group unused, the partial null), its
// counters the norm's sums'. The launch gives TcPhaseShared::BYTES of dynamic shared memory.
template <class T>
__global__ void __launch_bounds__(T::THREADS, TC_PHASE_BLOCKS)
conv_tc_dgrad_phases(const float* __restrict__ dy, const float* __restrict__ w_mirrored, float* __restrict__ dx,
                     int add, float* partial, unsigned* counters, CONV_PARAMS, int k_chunk, int group,
                     BN_SUMS_PARAMS(float)) {
    extern __shared__ __align__(16) float smem[];
    const Geometry<0, 0> g CONV_GEOMETRY;
    Geometry<0, 0> image = g;   // dy's, as the halo's image
    image.c = g.o;
    image.h = g.oh;
    image.w = g.ow;
    const Phase f = stride_phase(g, int(blockIdx.z));
    const int m0 = int(blockIdx.x) * T::BM, tile = int(blockIdx.z * gridDim.x + blockIdx.x);
    float acc[T::MI][T::NI][4];
    if (f.taps() == 4)
        tc_phase_gemm<T, 4>(dy, w_mirrored, g, image, f, m0, smem, acc);
    else if (f.taps() == 2)
        tc_phase_gemm<T, 2>(dy, w_mirrored, g, image, f, m0, smem, acc);
    else
        tc_phase_gemm<T, 1>(dy, w_mirrored, g, image, f, m0, smem, acc);
    tc_finish<T, false>(PhaseRowsOut{g, f}, dx, partial, g.n * g.h * g.w * g.c, SplitK{1, 1, 0}, counters, m0, 0,
                        nullptr, add, acc);
    if (sums_partial)
        bn_tile_sums<T, T::THREADS>(BnSums<float> BN_SUMS, PhaseRowsOut{g, f}, g.c, dx, smem, m0, 0, tile,
                                    int(g.sh * g.sw * gridDim.x), int(blockIdx.y));
}
