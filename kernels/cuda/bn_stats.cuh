// bn_stats.cuh: batch norm's training statistics computed where the activation is produced, in the
// epilogue of the forward convolution before the norm (tc_conv.cuh's tc_batch_stats for the tensor-core
// GEMMs, conv.cu's conv2d_forward), so that no pass reads the activation again for them; and the
// running statistics' update, which batchnorm.cu's kernels share.
//
// Per channel, the count, mean and sum of squared deviations (M2) of the values as stored (rounded to
// the storage type). A thread sums its values of a channel shifted by its first (ShiftedSums: the
// squares do not cancel when the mean is far from zero), and these moments are merged pairwise (Chan,
// Golub and LeVeque, `merged`) in a fixed tree: within the block as its kernel lays the values out,
// then across the output's tiles along the reduced dimension (bn_tile_statistics): each tile's block
// writes its moments to a slot of `partial`; the last block of each group of `group` tiles to finish
// (last_block) merges the group's slots in order into a slot of its own, and the last group's merges
// the groups' into mean and invstd = 1 / sqrt(M2 / count + eps) (the biased variance, as bn_stats),
// and moves the running statistics. Every merge's order is fixed by the shapes: the same bits
// whichever block comes last.
#pragma once
#include "common.cuh"

// Batch norm's running statistics: running <- (1 - momentum) * running + momentum * batch statistic
// for channel c, the variance made unbiased by `correction` = count / (count - 1).
__device__ __forceinline__ void bn_move_running(int c, float* running_mean, float* running_var, const float* mean,
                                                const float* invstd, float momentum, float eps, float correction) {
    const float unbiased = fmaxf(1.0f / (invstd[c] * invstd[c]) - eps, 0.0f) * correction;
    running_mean[c] = running_mean[c] * (1.0f - momentum) + momentum * mean[c];
    running_var[c] = running_var[c] * (1.0f - momentum) + momentum * unbiased;
}

struct Moments {
    float n, mean, m2;   // values, their mean, the sum of their squared deviations from it
};

// The moments of two disjoint sets of values from theirs.
__device__ __forceinline__ Moments merged(const Moments& a, const Moments& b) {
    if (b.n == 0.0f) return a;
    if (a.n == 0.0f) return b;
    const float n = a.n + b.n, d = b.mean - a.mean, f = b.n / n;
    return {n, a.mean + d * f, a.m2 + b.m2 + d * d * a.n * f};
}

// The moments of the lane lane ^ lane_mask of the warp (every lane of it must call it).
__device__ __forceinline__ Moments shuffled_xor(const Moments& m, int lane_mask) {
    return {__shfl_xor_sync(kFullMask, m.n, lane_mask), __shfl_xor_sync(kFullMask, m.mean, lane_mask),
            __shfl_xor_sync(kFullMask, m.m2, lane_mask)};
}

// A thread's values of one channel, in runs of RUN: each run's sums shifted by its first value, so
// that the squares do not cancel when the mean is far from zero, and the runs' moments merged, so that
// a long sequence (a tile read back, a row per value) is not one long shifted sum, whose cancellation
// grows with its length (its first value may lie several deviations from the mean).
struct ShiftedSums {
    static constexpr float RUN = 8.0f;
    Moments done{0.0f, 0.0f, 0.0f};   // the runs before this one
    float n = 0.0f, shift = 0.0f, sum = 0.0f, squares = 0.0f;
    __device__ void add(float v) {
        if (n == RUN) {
            done = merged(done, run());
            n = sum = squares = 0.0f;
        }
        if (n == 0.0f) shift = v;
        const float d = v - shift;
        n += 1.0f;
        sum += d;
        squares = fmaf(d, d, squares);
    }
    __device__ Moments run() const {
        if (n == 0.0f) return {0.0f, 0.0f, 0.0f};
        const float centre = sum / n;
        return {n, shift + centre, fmaxf(squares - sum * centre, 0.0f)};
    }
    __device__ Moments moments() const { return merged(done, run()); }
};

// Where the statistics go (the kernels' BN_STATS_PARAMS); partial null: none are wanted.
struct BnStats {
    float* partial;       // (slots, 2, channels): per tile, then per group, the mean and M2 of each channel
    unsigned* counters;   // per tile of channels: groups + 1 (last_block)
    int group;            // tiles per group
    float *mean, *invstd, *running_mean, *running_var;   // (channels); running_mean may be null
    float eps, momentum, correction;                     // correction: values / (values - 1)
};
#define BN_STATS_PARAMS                                                                                   \
    float *stats_partial, unsigned *stats_counters, int stats_group, float *bn_mean, float *bn_invstd,   \
        float *bn_running_mean, float *bn_running_var, float bn_eps, float bn_momentum, float bn_correction
#define BN_STATS                                                                                          \
    { stats_partial, stats_counters, stats_group, bn_mean,     bn_invstd,                                 \
      bn_running_mean, bn_running_var, bn_eps, bn_momentum, bn_correction }

// Per-channel values merged across tiles (bn_tile_merge): Moments (each tile's count implied by its
// size), or the backward's sums (added). A slot of `partial` holds two floats a channel.
struct BackwardSums {
    float dgamma, dbeta;   // the sums of g * xhat and of g over a set of values
};

__device__ __forceinline__ BackwardSums merged(const BackwardSums& a, const BackwardSums& b) {
    return {a.dgamma + b.dgamma, a.dbeta + b.dbeta};
}

__device__ __forceinline__ void store_slot(float* partial, int slot, int channels, int c, const Moments& m) {
    partial[slot * 2 * channels + c] = m.mean;
    partial[(slot * 2 + 1) * channels + c] = m.m2;
}

__device__ __forceinline__ void store_slot(float* partial, int slot, int channels, int c, const BackwardSums& v) {
    partial[slot * 2 * channels + c] = v.dgamma;
    partial[(slot * 2 + 1) * channels + c] = v.dbeta;
}

// Slot `slot` of channel c, written by another block of the launch, holding `n` values.
template <class V>
__device__ __forceinline__ V load_slot(const float* partial, int slot, int channels, int c, float n) {
    const volatile float* p = partial + slot * 2 * channels + c;
    if constexpr (sizeof(V) == sizeof(Moments)) return {n, p[0], p[channels]};
    else return {p[0], p[channels]};
}

// The values of the tiles along the reduced dimension where they are consecutive runs of `per_tile` of the
// `values` in all (the last tile may hold fewer): values_of(first, count) those of `count` tiles from tile
// `first`. A tiling of another shape (conv_sm90.cu's boxes of pixels) brings its own such callable.
struct TileRuns {
    int per_tile, values;
    __device__ float operator()(int first, int count) const {
        return float(min(values, (first + count) * per_tile) - first * per_tile);
    }
};

// Merges this block's `v` of channel c (`mine`: the thread holds a channel, c < channels), over tile
// `tile` of the `tiles` along the reduced dimension (values_of(first, count): the values of `count` tiles
// from `first`, as TileRuns), with the other tiles' of the channels of tile `channel_tile`, as the header
// says: slots of `partial`, `counters` (groups + 1 per tile of channels), groups of `group` tiles.
// Returns true in the threads of the last block that hold the total of their channel, in v. Every
// thread that `sync` waits for (last_block) must call it.
template <class V, class Values, class Sync = BlockSync>
__device__ __forceinline__ bool bn_tile_merge(float* partial, unsigned* counters, int group, V& v, bool mine, int c,
                                              int channels, int tile, int tiles, const Values& values_of,
                                              int channel_tile, const Sync& sync = Sync()) {
    if (mine) store_slot(partial, tile, channels, c, v);
    const int groups = (tiles + group - 1) / group;
    counters += channel_tile * (groups + 1);
    int first_slot = 0, terms = tiles, tiles_per_slot = 1;   // the slots the last block merges
    if (groups > 1) {
        const int own = tile / group, first = own * group, members = min(group, tiles - first);
        if (!last_block(counters + 1 + own, members, sync)) return false;
        if (mine) {
            V sum = load_slot<V>(partial, first, channels, c, values_of(first, 1));
            for (int k = 1; k < members; ++k)
                sum = merged(sum, load_slot<V>(partial, first + k, channels, c, values_of(first + k, 1)));
            store_slot(partial, tiles + own, channels, c, sum);
        }
        first_slot = tiles;
        terms = groups;
        tiles_per_slot = group;
    }
    if (!last_block(counters, terms, sync) || !mine) return false;
    v = load_slot<V>(partial, first_slot, channels, c, values_of(0, tiles_per_slot));
    for (int k = 1; k < terms; ++k)
        v = merged(v, load_slot<V>(partial, first_slot + k, channels, c,
                                   values_of(k * tiles_per_slot, tiles_per_slot)));
    return true;
}

// The statistics of channel c from this block's moments `m` of it, merged across the tiles
// (bn_tile_merge's arguments): mean, invstd and the running pair.
template <class Values, class Sync = BlockSync>
__device__ __forceinline__ void bn_tile_statistics(const BnStats& s, Moments m, bool mine, int c, int channels,
                                                   int tile, int tiles, const Values& values_of, int channel_tile,
                                                   const Sync& sync = Sync()) {
    if (!bn_tile_merge(s.partial, s.counters, s.group, m, mine, c, channels, tile, tiles, values_of, channel_tile,
                       sync))
        return;
    s.mean[c] = m.mean;
    s.invstd[c] = 1.0f / sqrtf(m.m2 / m.n + s.eps);
    if (s.running_mean) bn_move_running(c, s.running_mean, s.running_var, s.mean, s.invstd, s.momentum, s.eps,
                                        s.correction);
}

// The statistics of a block's tile of channels n0.. (bn_tile_statistics's arguments), from its values' moments per
// column in `parts` parts, part[q * columns + j] in shared memory (columns: the tile's), which the block's
// threads wrote before this: each column's parts merged in order by thread j of those `sync` waits for (`thread`,
// counted from the first of them), each of which must call it.
template <class Values, class Sync = BlockSync>
__device__ __forceinline__ void bn_block_statistics(const BnStats& s, const Moments* part, int parts, int columns,
                                                    int thread, int n0, int channels, int tile, int tiles,
                                                    const Values& values_of, int channel_tile,
                                                    const Sync& sync = Sync()) {
    sync.sync();
    const int c = n0 + thread;
    const bool mine = thread < columns && c < channels;
    Moments m{0.0f, 0.0f, 0.0f};
    if (mine) {   // the tile's moments: its parts merged in order
        m = part[thread];
        for (int q = 1; q < parts; ++q) m = merged(m, part[q * columns + thread]);
    }
    bn_tile_statistics(s, m, mine, c, channels, tile, tiles, values_of, channel_tile, sync);
}

// ---- the normalisation ---------------------------------------------------------------------------------

// A training batch norm's value of x before its relu: x * scale + shift, scale = gamma * invstd and shift =
// beta - mean * scale, in two fmaf (nothing left for the compiler to contract), so that the relu's mask
// recomputed from x in the backward is bit for bit the forward's (batchnorm.cu's bn_apply), and so is the
// normalisation a convolution applies as it loads its operand (conv_tc.cu's TcNormRows, TcNormColumns).
__device__ __forceinline__ float bn_scale(float invstd, float gamma) { return gamma * invstd; }
__device__ __forceinline__ float bn_shift(float mean, float scale, float beta) { return fmaf(-mean, scale, beta); }
__device__ __forceinline__ float bn_affine(float x, float mean, float invstd, float gamma, float beta) {
    const float scale = bn_scale(invstd, gamma);
    return fmaf(x, scale, bn_shift(mean, scale, beta));
}

// relu(v * scale + shift) of a chunk's 4 values (bn_affine, bit for bit batchnorm.cu's bn_apply, but that fmaxf
// makes a NaN 0 where bn_apply keeps it: the padding a kernel loads as NaN becomes 0), rounded to TF32 as
// tf32.cuh's tf32_round does (the TF32 convolutions that apply a norm to x as it lands, conv_tc.cu's and
// conv_sm90.cu's): after fmaxf a value is finite and not negative, or +infinity (0x7f801000 reads as
// infinity), so that the rounding is its add alone.
__device__ __forceinline__ float4 bn_relu_tf32(float4 v, const float4& scale, const float4& shift) {
    const auto one = [](float x, float s, float b) {
        return __uint_as_float(__float_as_uint(fmaxf(fmaf(x, s, b), 0.0f)) + 0x1000u);
    };
    return {one(v.x, scale.x, shift.x), one(v.y, scale.y, shift.y), one(v.z, scale.z, shift.z),
            one(v.w, scale.w, shift.w)};
}

// The scale and shift of the 4 channels ci.. of a batch norm (bn_scale, bn_shift).
__device__ __forceinline__ void bn_coefficients(const float* mean, const float* invstd, const float* gamma,
                                                const float* beta, int ci, float4& scale, float4& shift) {
    const float4 m = *reinterpret_cast<const float4*>(mean + ci);
    const float4 s = *reinterpret_cast<const float4*>(invstd + ci);
    const float4 gm = *reinterpret_cast<const float4*>(gamma + ci);
    const float4 bt = *reinterpret_cast<const float4*>(beta + ci);
    scale = {bn_scale(s.x, gm.x), bn_scale(s.y, gm.y), bn_scale(s.z, gm.z), bn_scale(s.w, gm.w)};
    shift = {bn_shift(m.x, scale.x, bt.x), bn_shift(m.y, scale.y, bt.y), bn_shift(m.z, scale.z, bt.z),
             bn_shift(m.w, scale.w, bt.w)};
}

// ---- the backward's sums where dy is produced ------------------------------------------------------
//
// A batch norm with a fused relu or residual join whose output a convolution reads gets its backward's
// sums, dgamma = sum(g * xhat) and dbeta = sum(g), g = dy where its output y > 0 (else 0) and xhat = (x -
// mean) * invstd, from the backward-data of the reader that runs last, whose dx is the norm's dy: in its
// epilogue (bn_tile_sums, below), merged across tiles as the statistics are. The norm's backward
// then runs bn_backward_dx alone. With a relu alone, y > 0 is bn_affine(x) > 0, recomputed from x (gamma
// and beta given) rather than read.

// Where they go (BN_SUMS_PARAMS(T)); sums_partial null: none are wanted.
template <class T>
struct BnSums {
    const T* y;            // the norm's output: its relu's mask, when gamma and beta are null
    const T* x;            // the norm's input
    const float *mean, *invstd;
    const float *gamma, *beta;   // a relu alone: its mask recomputed from x (bn_affine), y not read
    float* partial;        // (slots, 2, channels)
    unsigned* counters;    // per tile of channels: groups + 1
    int group;
    float *dgamma, *dbeta;
};
#define BN_SUMS_PARAMS(T)                                                                                       \
    const T *norm_y, const T *norm_x, const float *norm_mean, const float *norm_invstd, const float *norm_gamma, \
        const float *norm_beta, float *sums_partial, unsigned *sums_counters, int sums_group, float *norm_dgamma, \
        float *norm_dbeta
#define BN_SUMS                                                                                                \
    {                                                                                                          \
        norm_y, norm_x, norm_mean, norm_invstd, norm_gamma, norm_beta, sums_partial, sums_counters, sums_group, \
            norm_dgamma, norm_dbeta                                                                            \
    }

// The backward sums of the batch norm whose dy is a backward-data's dx, from the tile T::BM x T::BN as
// the block that finished it stored it (in `dx`, read back: dx, and the norm's x, and y unless the mask
// is recomputed from x, at each element; out.row(m0 + r) and out.column(n0 + j): where row r and column
// j of the tile lie, -1 past dx), by the THREADS threads of the block from thread FIRST, those `sync`
// waits for: each thread every READERS-th row of a column (channel), in order, then the threads of a
// column in order, then the `tiles` tiles of rows, this one `tile` (bn_tile_merge), of the channels'
// tile `channel_tile`: with several stride phases, the tiles of every phase, each phase's rows its own
// cells of dx. A tile with no rows (past its phase's cells) merges zeros. smem: 2 * THREADS floats the
// block is done with. Each of those threads must call it.
template <class T, int THREADS, int FIRST = 0, class Out, class E, class Sync = BlockSync>
__device__ __forceinline__ void bn_tile_sums(const BnSums<E>& s, const Out& out, int columns, const E* dx,
                                             float* smem, int m0, int n0, int tile, int tiles, int channel_tile,
                                             const Sync& sync = Sync()) {
    constexpr int READERS = THREADS / T::BN;
    static_assert(THREADS % T::BN == 0, "whole threads to a column");
    BackwardSums* part = reinterpret_cast<BackwardSums*>(smem);   // [READERS][BN]
    sync.sync();   // every warp is done with the main loop's shared memory, and dx's tile is stored
    const int thread = int(threadIdx.x) - FIRST, column = thread % T::BN, c = n0 + column;
    BackwardSums sums{0.0f, 0.0f};
    if (out.column(c) >= 0) {
        const float mean = s.mean[c], invstd = s.invstd[c];
        const float gamma = s.beta ? s.gamma[c] : 0.0f, beta = s.beta ? s.beta[c] : 0.0f;
        for (int r = thread / T::BN; r < T::BM; r += READERS) {
            const int row = out.row(m0 + r);
            if (row < 0) continue;
            const int at = row + out.column(c);
            const float d = to_float(dx[at]), xv = to_float(s.x[at]);   // loaded whatever the mask: one load a warp
            const bool passed = s.beta ? bn_affine(xv, mean, invstd, gamma, beta) > 0.0f : to_float(s.y[at]) > 0.0f;
            const float g = passed ? d : 0.0f;
            sums.dgamma = fmaf(g, (xv - mean) * invstd, sums.dgamma);
            sums.dbeta += g;
        }
    }
    part[thread] = sums;
    sync.sync();
    const bool mine = thread < T::BN && c < columns;
    if (mine)
        for (int q = 1; q < READERS; ++q) sums = merged(sums, part[q * T::BN + thread]);
    // (the sums carry no count: the tiles' sizes are the merge's bookkeeping alone)
    if (bn_tile_merge(s.partial, s.counters, s.group, sums, mine, c, columns, tile, tiles,
                      TileRuns{T::BM, tiles * T::BM}, channel_tile, sync)) {
        s.dgamma[c] = sums.dgamma;
        s.dbeta[c] = sums.dbeta;
    }
}
