// conv_sm90.cu: 2-D convolution on Hopper's tensor cores (sm_90a): warpgroup MMA (wgmma) fed by the tensor
// memory accelerator (TMA), for the bf16 precision. Launched by kernels/cuda/conv_sm90.py, chosen on GPUs of
// compute capability 9.0; checked by tests/test_conv_sm90.py against float64 of the bfloat16 inputs, on the CPU
// emulator (which runs sm90.cuh's instructions exactly and refuses their misuse) in CI and on a GPU under
// `pytest -m gpu`.
//
//   conv_sm90_forward   y (N*OH*OW x O) = im2col(x) (N*OH*OW x KH*KW*C) . w_krsc^T (KH*KW*C x O) + b, for
//                       stride 1, C and O multiples of 64 (ResNet-18's 3x3 convolutions but the stride-2 ones);
//                       ADD: added to what y holds, rounded once. Backward-data of such a convolution is this
//                       forward of dy by the weights mirrored (conv_geometry.cuh's mirrored_weights<bf16>).
//
// The implicit GEMM without an im2col: a block's 128 rows (output pixels) are a box of the output, box_i images
// by box_h rows by box_w columns (box_i box_h box_w = 128, chosen per layer by the launcher to waste the fewest
// rows past the image's edges), and for each filter tap (r, s) and 64 input channels c0.. the A operand of those
// rows is the same box of x, moved by (r - ph, s - pw): one 4-D TMA load of x (N, H, W, C), whose coordinates
// past the image give zeros, the padding, for free. B is 64 k by BN filters of w (O, KH*KW*C), a 2-D TMA
// load. Both land 128-byte swizzled (a row of 64 bf16 = 128 bytes, chunk j of row r at j ^ (r % 8)), the layout
// wgmma reads from a descriptor (sm90.cuh's wgmma_descriptor_sw128).
//
// The pieces, named as CUTLASS 3 names them:
//   Sm90Tile            the tile: BM = 128 rows, BN = 128 or 64 columns, BK = 64, STAGES deep
//   Sm90Mainloop        the mainloop collective: a ring of STAGES stages of shared memory, each with a `full`
//                       mbarrier (the producer's arrive with the stage's expected bytes, completed by TMA) and an
//                       `empty` one (one arrival per consumer warpgroup, once its wgmmas of the stage retired);
//                       the producer (warpgroup 0, its first thread) issues the loads, the consumers (warpgroups 1
//                       and 2, 64 rows of the tile each) wait for a stage, issue 4 wgmma m64nBNk16 on it, commit,
//                       and release the stage before (wgmma_wait<1>: one group in flight while the next lands)
//   Sm90BoxRows         the epilogue's map from a tile row to its output pixel (the box)
//   the epilogue        each consumer thread's accumulators (mma.sync's m16n8 layout, BN / 8 of them a warp) plus
//                       the bias (or what y holds: ADD), rounded to bf16 once, stored as pairs of neighbouring
//                       channels
//
// Registers: 384 threads a block, one block an SM (the ring's shared memory); setmaxnreg gives the producer's
// warpgroup 40 registers a thread and the consumers' 232 (a consumer holds BN / 2 accumulators).
#include "sm90.cuh"
#include "bf16.cuh"
#include "conv_geometry.cuh"

constexpr int SM90_THREADS = 384;   // a producer warpgroup and two consumer warpgroups
constexpr int SM90_PRODUCER_REGISTERS = 40, SM90_CONSUMER_REGISTERS = 232;

template <int BN_, int STAGES_>
struct Sm90Tile {
    static constexpr int BM = 128, BN = BN_, BK = 64, STAGES = STAGES_;
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
    // the ring from the first 1024-byte aligned address of the dynamic shared memory (1024 bytes of slack), then
    // the full and empty barriers
    static constexpr int SHARED_BYTES = 1024 + STAGES * STAGE_BYTES + 2 * STAGES * 8;
    static_assert(STAGE_BYTES % 1024 == 0, "every stage's operands 1024-byte aligned (the swizzle's pattern)");
};
struct Sm90x128 : Sm90Tile<128, 4> {};   // 128 KB of ring
struct Sm90x64 : Sm90Tile<64, 6> {};     // 144 KB

// The output box of a tile: rows t = (i box_h + h) box_w + w of the tile are the pixel (n0 + i, oh0 + h, ow0 + w).
struct Sm90BoxRows {
    int box_w, box_h, n0, oh0, ow0;
    __device__ Sm90BoxRows(int tile, int box_w_, int box_h_, int box_i, int oh, int ow) : box_w(box_w_), box_h(box_h_) {
        const int tiles_w = (ow + box_w - 1) / box_w, tiles_h = (oh + box_h - 1) / box_h;
        ow0 = tile % tiles_w * box_w;
        oh0 = tile / tiles_w % tiles_h * box_h;
        n0 = tile / (tiles_w * tiles_h) * box_i;
    }
    // the pixel's index in the output (N, OH, OW), or -1 past its edges
    __device__ int pixel(int row, int n, int oh, int ow) const {
        const int img = n0 + row / (box_h * box_w), p = oh0 + row / box_w % box_h, q = ow0 + row % box_w;
        return img < n && p < oh && q < ow ? (img * oh + p) * ow + q : -1;
    }
};

template <class Tile>
struct Sm90Mainloop {
    unsigned char* ring;
    unsigned long long *full, *empty;

    __device__ explicit Sm90Mainloop(unsigned char* dynamic) {
        const unsigned misalign = smem_address(dynamic) & 1023;
        ring = dynamic + (misalign ? 1024 - misalign : 0);
        full = reinterpret_cast<unsigned long long*>(ring + Tile::STAGES * Tile::STAGE_BYTES);
        empty = full + Tile::STAGES;
    }
    __device__ unsigned char* a(int stage) const { return ring + stage * Tile::STAGE_BYTES; }
    __device__ unsigned char* b(int stage) const { return a(stage) + Tile::A_BYTES; }

    // by one thread, before the block's first barrier
    __device__ void init() const {
        for (int s = 0; s < Tile::STAGES; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], 2);   // one arrival per consumer warpgroup
        }
        fence_barrier_init();
    }

    // The producer's thread: k step `step` = tap (r, s) of kw, channels c0..c0+63, into stage step % STAGES once
    // the consumers released it (its previous use: the empty barrier's phase of the pass before).
    __device__ void load(const TensorMap& x_map, const TensorMap& w_map, int steps, int c, int kw, int ph, int pw,
                         const Sm90BoxRows& box, int o0) const {
        const int chunks = c / Tile::BK;
        for (int step = 0; step < steps; ++step) {
            const int stage = step % Tile::STAGES, pass = step / Tile::STAGES;
            mbarrier_wait(&empty[stage], (pass & 1) ^ 1);
            const int tap = step / chunks, c0 = step % chunks * Tile::BK;
            mbarrier_arrive_expect_tx(&full[stage], Tile::STAGE_BYTES);
            tma_load_4d(a(stage), x_map, &full[stage], c0, box.ow0 + tap % kw - pw, box.oh0 + tap / kw - ph, box.n0);
            tma_load_2d(b(stage), w_map, &full[stage], tap * c + c0, o0);
        }
    }

    // A consumer warpgroup's GEMM of its 64 rows (`group` 0 or 1) into acc.
    __device__ void mma(float (&acc)[Tile::BN / 2], int steps, int group, bool first_thread) const {
        for (int step = 0; step < steps; ++step) {
            const int stage = step % Tile::STAGES;
            mbarrier_wait(&full[stage], (step / Tile::STAGES) & 1);
            wgmma_fence();
            const unsigned char* a_rows = a(stage) + group * 64 * 128;
#pragma unroll
            for (int k = 0; k < Tile::BK / 16; ++k)
                wgmma_bf16<Tile::BN>(acc, wgmma_descriptor_sw128(a_rows + 32 * k), wgmma_descriptor_sw128(b(stage) + 32 * k),
                                     step > 0 || k > 0);
            wgmma_commit();
            wgmma_wait<1>();   // the step before retired: its stage is free
            if (step > 0 && first_thread) mbarrier_arrive(&empty[(step - 1) % Tile::STAGES]);
        }
        wgmma_wait<0>();
    }
};

// x_map: x (N, H, W, C) bf16, box (box_i, box_h, box_w, 64), swizzled; w_map: w (O, KH*KW*C) bf16, box (BN, 64),
// swizzled. A block: the tile (blockIdx.x: its box of the output), BN filters from blockIdx.y * BN.
template <class Tile, bool ADD>
__global__ void __launch_bounds__(SM90_THREADS, 1)
conv_sm90_forward(const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap w_map,
                  const float* __restrict__ bias, bf16* __restrict__ y, int n, int c, int o, int kh, int kw, int ph,
                  int pw, int oh, int ow, int box_w, int box_h, int box_i) {
    extern __shared__ __align__(1024) unsigned char sm90_dynamic[];
    const Sm90Mainloop<Tile> mainloop(sm90_dynamic);
    const Sm90BoxRows box(blockIdx.x, box_w, box_h, box_i, oh, ow);
    const int o0 = blockIdx.y * Tile::BN, steps = kh * kw * (c / Tile::BK);
    const int t = threadIdx.x;
    if (t == 0) {
        tma_prefetch(x_map);
        tma_prefetch(w_map);
        mainloop.init();
    }
    __syncthreads();
    if (t < 128) {   // the producer
        setmaxnreg_dec<SM90_PRODUCER_REGISTERS>();
        if (t == 0) mainloop.load(x_map, w_map, steps, c, kw, ph, pw, box, o0);
        return;
    }
    setmaxnreg_inc<SM90_CONSUMER_REGISTERS>();
    const int group = t / 128 - 1, lane = t % 32, warp = t % 128 / 32;
    float acc[Tile::BN / 2];
    mainloop.mma(acc, steps, group, t % 128 == 0);
    // the epilogue: d[4j + i] is row 16 warp + lane / 4 + 8 (i / 2), column 8 j + 2 (lane % 4) + i % 2
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int pixel = box.pixel(group * 64 + warp * 16 + lane / 4 + 8 * half, n, oh, ow);
        if (pixel < 0) continue;
        bf16* row = y + size_t(pixel) * o + o0;
#pragma unroll
        for (int j = 0; j < Tile::BN / 8; ++j) {
            const int column = 8 * j + 2 * (lane % 4);
            float lo = acc[4 * j + 2 * half], hi = acc[4 * j + 2 * half + 1];
            unsigned* pair = reinterpret_cast<unsigned*>(row + column);
            if (bias) {
                lo += bias[o0 + column];
                hi += bias[o0 + column + 1];
            }
            if (ADD) {
                lo += bf16x2_low(*pair);
                hi += bf16x2_high(*pair);
            }
            *pair = bf16x2_round(lo, hi);
        }
    }
}
