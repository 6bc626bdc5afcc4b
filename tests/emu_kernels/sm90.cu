// The wrappers of kernels/cuda/sm90.cuh (Hopper's mbarrier, TMA, wgmma, setmaxnreg) on the emulator, for
// tests/test_sm90_emu.py: kernels whose results a NumPy model checks, and kernels that plant each misuse the
// emulator refuses, a `mode` (or a count) choosing the misuse or its correct twin.
//
// For the emulator, and for sm_90a with kernels/cuda on the include path; elsewhere empty: tests/test_emu.py
// compiles every file here with NVRTC for sm_80 and sm_90 without options, where wgmma and setmaxnreg do not exist
// (they need sm_90a) and sm90.cuh is not found.
#if defined(__CUDA_EMU__) || (defined(__CUDA_ARCH_FEAT_SM90_ALL) && __has_include("sm90.cuh"))
#include "sm90.cuh"

extern __shared__ __align__(1024) unsigned char sm90_smem[];

// The block's 128 threads store a's a_bytes and then b's b_bytes to the dynamic shared memory as they are given (the
// operands' layouts the caller's), fence them for the async proxy (unless `fenced` is false: planted) and meet.
__device__ void store_operands(const uint4* a, int a_bytes, const uint4* b, int b_bytes, bool fenced = true) {
    for (int i = threadIdx.x; i < a_bytes / 16; i += 128) reinterpret_cast<uint4*>(sm90_smem)[i] = a[i];
    for (int i = threadIdx.x; i < b_bytes / 16; i += 128) reinterpret_cast<uint4*>(sm90_smem + a_bytes)[i] = b[i];
    if (fenced) fence_proxy_async();
    __syncthreads();
}

// ---- wgmma on operands the threads stored ----------------------------------------------------------------
// One warpgroup. a: `tiles` tiles of 64 rows x 64 k bf16 (32 k float32: TF32), b: of N rows x 64 (32) k, each already
// in the 128-byte swizzled
// layout (1024-byte aligned, a row 128 bytes, chunk j of row r at j ^ (r % 8)), copied to shared memory as they are;
// then 4 tiles wgmma m64nNk16, chained, k advancing 32 bytes a step. out: each thread's N / 2 accumulators.
// mode: 0 correct; 1 an accumulator stored to out early; 2 one overwritten early; 3 no wgmma_fence; 4 one compared
// early (early: before the wgmma_wait); 5 the operands' stores not followed by fence_proxy_async; 6 an operand
// overwritten early.
template <int N, bool TF32 = false>
__device__ void wgmma_stored(const uint4* a, const uint4* b, float* out, int tiles, int mode) {
    const int t = threadIdx.x;
    unsigned char* sa = sm90_smem;
    unsigned char* sb = sm90_smem + tiles * 64 * 128;
    store_operands(a, tiles * 64 * 128, b, tiles * N * 128, mode != 5);
    float acc[N / 2];
    if (mode != 3) wgmma_fence();
    for (int tile = 0; tile < tiles; ++tile)
        for (int k = 0; k < 4; ++k)
            if constexpr (TF32)
                wgmma_tf32<N>(acc, wgmma_descriptor_sw128(sa + tile * 64 * 128 + 32 * k),
                              wgmma_descriptor_sw128(sb + tile * N * 128 + 32 * k), tile > 0 || k > 0);
            else
                wgmma_bf16<N>(acc, wgmma_descriptor_sw128(sa + tile * 64 * 128 + 32 * k),   // the wgmma of wgmma_stored
                              wgmma_descriptor_sw128(sb + tile * N * 128 + 32 * k), tile > 0 || k > 0);
    wgmma_commit();
    if (mode == 1) out[t] = acc[0];                  // used before the wait
    if (mode == 2) acc[1] = 0.0f;                    // written before the wait
    if (mode == 4 && acc[2] > 1.0f) out[0] = 1.0f;   // compared before the wait
    if (mode == 6 && t == 3) sb[48] = 0;             // an operand stored to before the wait
    wgmma_wait<0>();
    for (int i = 0; i < N / 2; ++i) out[t * (N / 2) + i] = acc[i];
}

extern "C" __global__ void wgmma_n64(const uint4* a, const uint4* b, float* out, int tiles, int mode) {
    wgmma_stored<64>(a, b, out, tiles, mode);
}

extern "C" __global__ void wgmma_n128(const uint4* a, const uint4* b, float* out, int tiles, int mode) {
    wgmma_stored<128>(a, b, out, tiles, mode);
}

// The same of TF32 operands: a tile 32 k of float32 (a row 128 bytes), 4 tiles wgmma m64nNk8.
extern "C" __global__ void wgmma_tf32_n64(const uint4* a, const uint4* b, float* out, int tiles, int mode) {
    wgmma_stored<64, true>(a, b, out, tiles, mode);
}

extern "C" __global__ void wgmma_tf32_n128(const uint4* a, const uint4* b, float* out, int tiles, int mode) {
    wgmma_stored<128, true>(a, b, out, tiles, mode);
}

// One wgmma m64n64k16 of operands the threads store as they are given (a's a_bytes, then b's, both 1024-byte
// aligned), read through descriptors of layout `mode` (0 no swizzle, 1 the 128-byte swizzle, 2 the 64-byte one,
// 3 the 32-byte one) with these leading and stride byte offsets.
extern "C" __global__ void wgmma_layout(const uint4* a, const uint4* b, float* out, int a_bytes, int b_bytes, int mode,
                                        int lbo, int sbo) {
    const int t = threadIdx.x;
    store_operands(a, a_bytes, b, b_bytes);
    const unsigned long long layout = (unsigned long long)(lbo >> 4) << 16 | (unsigned long long)(sbo >> 4) << 32 |
                                      (unsigned long long)mode << 62;
    float acc[32];
    wgmma_fence();
    wgmma_bf16<64>(acc, smem_address(sm90_smem) >> 4 | layout, smem_address(sm90_smem + a_bytes) >> 4 | layout, 0);
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 32; ++i) out[t * 32 + i] = acc[i];
}

// One wgmma m64n128k16 of MN-major operands (wgmma_bf16<128, true>: both transposed) that the threads store as they
// are given (a's a_bytes, then b's, 1024-byte aligned), read through 128-byte-swizzled descriptors with these leading
// (from 64 rows to the next) and stride (from 8 k to the next) byte offsets.
extern "C" __global__ void wgmma_mn_major(const uint4* a, const uint4* b, float* out, int a_bytes, int b_bytes,
                                          int lbo, int sbo) {
    const int t = threadIdx.x;
    store_operands(a, a_bytes, b, b_bytes);
    const unsigned long long layout = (unsigned long long)(lbo >> 4) << 16 | (unsigned long long)(sbo >> 4) << 32 |
                                      1ull << 62;
    float acc[64];
    wgmma_fence();
    wgmma_bf16<128, true>(acc, smem_address(sm90_smem) >> 4 | layout, smem_address(sm90_smem + a_bytes) >> 4 | layout,
                          0);
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 64; ++i) out[t * 64 + i] = acc[i];
}

// One warpgroup whose threads reach a wgmma: at one call (diverged 0), at two calls (warp 1 at another, 1),
// or with thread 5 returned before it (2).
extern "C" __global__ void wgmma_diverged(const uint4* a, const uint4* b, float* out, int diverged) {
    const int t = threadIdx.x;
    if (diverged == 2 && t == 5) return;
    store_operands(a, 8192, b, 8192);
    float acc[32];
    wgmma_fence();
    const unsigned long long da = wgmma_descriptor_sw128(sm90_smem), db = wgmma_descriptor_sw128(sm90_smem + 8192);
    if (diverged == 1 && t / 32 == 1)
        wgmma_bf16<64>(acc, da, db, 0);   // warp 1's wgmma
    else
        wgmma_bf16<64>(acc, da, db, 0);   // the others' wgmma
    wgmma_commit();
    wgmma_wait<0>();
    for (int i = 0; i < 32; ++i) out[t * 32 + i] = acc[i];
}

// Two warpgroups giving up and taking registers: split 0 each at one call; split 1 warp 1 at another.
extern "C" __global__ void setmaxnreg_split(int* out, int split) {
    const int t = threadIdx.x;
    if (t < 128 && split && t / 32 == 1)
        setmaxnreg_dec<40>();   // warp 1's setmaxnreg
    else if (t < 128)
        setmaxnreg_dec<40>();   // the producers' setmaxnreg
    else
        setmaxnreg_inc<232>();
    out[t] = 1;
}

// A wgmma whose thread returns without retiring it: never committed (mode 1), committed but not waited for (2).
extern "C" __global__ void wgmma_unretired(const uint4* a, const uint4* b, float* out, int mode) {
    const int t = threadIdx.x;
    store_operands(a, 8192, b, 8192);
    float acc[32];
    wgmma_fence();
    wgmma_bf16<64>(acc, wgmma_descriptor_sw128(sm90_smem), wgmma_descriptor_sw128(sm90_smem + 8192), 0);
    if (mode == 1) return;
    wgmma_commit();
    if (mode == 2) return;
    wgmma_wait<0>();
    out[t] = acc[0];
}

// ---- TMA ---------------------------------------------------------------------------------------------------
// One box of `map` at the coordinates (innermost first) into the dynamic shared memory, `extent` bytes of which
// (the box, or its 128-byte rows) the threads then copy to out. wait: 1 each thread waits for the barrier's phase
// (correct), 0 only a __syncthreads() after the load (planted); offset: bytes past the shared memory's start to
// put the box at.
__device__ void tma_box(const TensorMap& map, unsigned char* out, int bytes, int extent, const int* c, int rank,
                        int wait, int offset) {
    __shared__ unsigned long long bar;
    const int t = threadIdx.x;
    if (t == 0) {
        mbarrier_init(&bar, 1);
        fence_barrier_init();
    }
    __syncthreads();
    if (t == 0) {
        mbarrier_arrive_expect_tx(&bar, bytes);
        if (rank == 2)
            tma_load_2d(sm90_smem + offset, map, &bar, c[0], c[1]);   // the 2-D load
        else
            tma_load_4d(sm90_smem + offset, map, &bar, c[0], c[1], c[2], c[3]);   // the 4-D load
    }
    if (wait)
        mbarrier_wait(&bar, 0);
    else
        __syncthreads();
    for (int i = t; i < extent / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(sm90_smem + offset)[i];   // the box read
}

extern "C" __global__ void tma_2d(const __grid_constant__ TensorMap map, unsigned char* out, int bytes, int extent,
                                  int c0, int c1, int wait, int offset) {
    const int c[2] = {c0, c1};
    tma_box(map, out, bytes, extent, c, 2, wait, offset);
}

extern "C" __global__ void tma_4d(const __grid_constant__ TensorMap map, unsigned char* out, int bytes, int extent,
                                  int c0, int c1, int c2, int c3) {
    const int c[4] = {c0, c1, c2, c3};
    tma_box(map, out, bytes, extent, c, 4, 1, 0);
}

// A ring's barriers, by thread 0 then seen by every thread: `full` awaits the producer's one arrival (and its bytes),
// `empty` the consumers' `releases`.
__device__ void init_ring(unsigned long long* full, unsigned long long* empty, int stages, unsigned releases) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], releases);
        }
        fence_barrier_init();
    }
    __syncthreads();
}

// ---- a pipeline of plain loads ----------------------------------------------------------------------------------
// x (steps, 64) float: a producer thread (thread 0 of warp 0) loads row `step` into stage step % 3 (full barrier:
// its bytes; empty: the 64 consumers' arrivals); each consumer (warps 1 and 2) adds its element of every row into
// out. mode: 0 correct; 1 the consumers arrive on `empty` before they read the stage (planted).
extern "C" __global__ void pipeline_sum(const __grid_constant__ TensorMap x, float* out, int steps, int mode) {
    constexpr int STAGES = 3;
    __shared__ unsigned long long full[STAGES], empty[STAGES];
    const int t = threadIdx.x;
    init_ring(full, empty, STAGES, 64);
    const float* stages = reinterpret_cast<const float*>(sm90_smem);
    if (t < 32) {
        if (t == 0)
            for (int step = 0; step < steps; ++step) {
                const int stage = step % STAGES;
                mbarrier_wait(&empty[stage], (step / STAGES & 1) ^ 1);
                mbarrier_arrive_expect_tx(&full[stage], 256);
                tma_load_2d(sm90_smem + stage * 256, x, &full[stage], 0, step);   // the producer's load
            }
        return;
    }
    const int c = t - 32;
    float sum = 0.0f;
    for (int step = 0; step < steps; ++step) {
        const int stage = step % STAGES;
        mbarrier_wait(&full[stage], step / STAGES & 1);
        if (mode == 1) mbarrier_arrive(&empty[stage]);
        sum += stages[stage * 64 + c];   // the consumer's read
        if (mode == 0) mbarrier_arrive(&empty[stage]);
    }
    out[c] = sum;
}

// ---- a warp-specialised GEMM, as kernels/cuda/conv_sm90.cu's ---------------------------------------------------
// c (128, N) = a (128, 64 steps) b (N, 64 steps)^T: warpgroup 0's thread 0 loads, for each k step, a's 128 x 64 box
// and b's N x 64 into a ring of 4 stages (swizzled; full barriers: the bytes, empty: one arrival per consumer
// warpgroup); warpgroups 1 and 2 each multiply 64 rows by 4 wgmma m64nNk16 a step. mode: 0 retire the step
// (wgmma_wait<0>), then release its stage; 1 keep one group in flight (wgmma_wait<1>) and release the stage before;
// 2 release the stage, then retire (planted: the producer's next load into the stage races with the wgmmas); 3 as 1,
// then the ring the consumers' scratch (conv_sm90's epilogues): each thread's accumulators stored to it and loaded
// back, once a __syncthreads() follows every consumer's last wgmma_wait; 4 as 3 with no __syncthreads() (planted:
// the stores race with the other warpgroup's wgmmas).
template <int N>
__device__ void gemm_pipeline(const TensorMap& a_map, const TensorMap& b_map, float* c, int steps, int mode) {
    constexpr int STAGES = 4, A_BYTES = 128 * 64 * 2, STAGE_BYTES = A_BYTES + N * 64 * 2;
    __shared__ unsigned long long full[STAGES], empty[STAGES];
    const int t = threadIdx.x;
    init_ring(full, empty, STAGES, 2);
    if (t < 128) {
        setmaxnreg_dec<40>();
        if (t == 0)
            for (int step = 0; step < steps; ++step) {
                const int stage = step % STAGES;
                unsigned char* a = sm90_smem + stage * STAGE_BYTES;
                mbarrier_wait(&empty[stage], (step / STAGES & 1) ^ 1);
                mbarrier_arrive_expect_tx(&full[stage], STAGE_BYTES);
                tma_load_2d(a, a_map, &full[stage], 64 * step, 0);             // the producer's load of a
                tma_load_2d(a + A_BYTES, b_map, &full[stage], 64 * step, 0);   // the producer's load of b
            }
        return;
    }
    setmaxnreg_inc<232>();
    const int group = t / 128 - 1, u = t % 128;
    float acc[N / 2];
    for (int step = 0; step < steps; ++step) {
        const int stage = step % STAGES;
        const unsigned char* a = sm90_smem + stage * STAGE_BYTES;
        mbarrier_wait(&full[stage], step / STAGES & 1);
        wgmma_fence();
        for (int k = 0; k < 4; ++k)
            wgmma_bf16<N>(acc, wgmma_descriptor_sw128(a + group * 64 * 128 + 32 * k),   // the consumers' wgmma
                          wgmma_descriptor_sw128(a + A_BYTES + 32 * k), step > 0 || k > 0);
        wgmma_commit();
        if (mode == 0) {
            wgmma_wait<0>();
            if (u == 0) mbarrier_arrive(&empty[stage]);
        } else if (mode == 2) {
            if (u == 0) mbarrier_arrive(&empty[stage]);   // released before its wgmmas retired
            wgmma_wait<0>();
        } else {
            wgmma_wait<1>();
            if (u == 0 && step > 0) mbarrier_arrive(&empty[(step - 1) % STAGES]);
        }
    }
    wgmma_wait<0>();
    if (mode >= 3) {
        if (mode == 3) __syncthreads();   // the producer has returned: the consumers' threads
        float* scratch = reinterpret_cast<float*>(sm90_smem) + (t - 128) * (N / 2);
        for (int i = 0; i < N / 2; ++i) scratch[i] = acc[i];   // the scratch's store
        for (int i = 0; i < N / 2; ++i) acc[i] = scratch[i];
    }
    const int w = u / 32, l = u % 32;
    for (int j = 0; j < N / 8; ++j)
        for (int i = 0; i < 4; ++i)
            c[(group * 64 + 16 * w + l / 4 + 8 * (i / 2)) * N + 8 * j + 2 * (l % 4) + i % 2] = acc[4 * j + i];
}

extern "C" __global__ void gemm_n128(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
                                     float* c, int steps, int mode) {
    gemm_pipeline<128>(a_map, b_map, c, steps, mode);
}

extern "C" __global__ void gemm_n64(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
                                    float* c, int steps, int mode) {
    gemm_pipeline<64>(a_map, b_map, c, steps, mode);
}

// ---- named barriers --------------------------------------------------------------------------------------------
// Warp 0 waits elsewhere (a producer that takes no part: at barrier 3, until warp 1 is done); warps 1-3 (96 threads)
// write exchange[t], meet at named barrier 1, and read another warp's value. mode: 0 correct; 1 warp 3 asks for 128 threads, the others 96; 2 warp 1
// and lanes 0-15 of warps 2 and 3 meet at 1 for 64 threads, their lanes 16-31 at 2 for 32; 3 all ask for 128, which
// never come; 4 no barrier (the read races with the write); 5 as 0, then named_barrier_any(2, 96, t == 100) into out.
extern "C" __global__ void named_barrier(int* out, int mode) {
    __shared__ int exchange[128];
    const int t = threadIdx.x;
    if (t < 32) {
        named_barrier_sync(3, 64);
        return;
    }
    exchange[t] = 7 * t;
    if (mode == 1)
        named_barrier_sync(1, t >= 96 ? 128 : 96);
    else if (mode == 2)
        named_barrier_sync(t < 64 || t % 32 < 16 ? 1 : 2, t < 64 || t % 32 < 16 ? 64 : 32);
    else if (mode == 3)
        named_barrier_sync(1, 128);
    else if (mode != 4)
        named_barrier_sync(1, 96);
    out[t] = exchange[32 + (t - 32 + 32) % 96];   // the exchange's read
    if (mode == 5) out[t] = named_barrier_any(2, 96, t == 100);
    if (t < 64) named_barrier_sync(3, 64);
}

// ---- mbarrier misuse ------------------------------------------------------------------------------------------
// Every thread waits for phase 0 of a barrier of `count` arrivals, to which thread 0 arrives once: count 1 runs,
// count 2 never completes.
extern "C" __global__ void mbarrier_phase(int* out, int count) {
    __shared__ unsigned long long bar;
    const int t = threadIdx.x;
    if (t == 0) {
        mbarrier_init(&bar, count);
        fence_barrier_init();
    }
    __syncthreads();
    if (t == 0) mbarrier_arrive(&bar);
    mbarrier_wait(&bar, 0);   // the wait for phase 0
    out[t] = 1;
}

// mode: 0 correct; 1 an arrival on a barrier never initialised; 2 an arrival beyond the count (its phase awaits
// transaction bytes); 3 an init while a phase is in progress; 4 transaction bytes left pending at the block's end;
// 5 a plain store to a barrier; 6 a use of a barrier with no __syncthreads() after its init; 7 a plain load of one.
extern "C" __global__ void mbarrier_misuse(int* out, int mode) {
    __shared__ unsigned long long bars[2];
    const int t = threadIdx.x;
    if (t == 0) {
        mbarrier_init(&bars[0], 2);
        if (mode != 1) mbarrier_init(&bars[1], mode == 3 ? 2 : 1);
        fence_barrier_init();
    }
    if (mode != 6) __syncthreads();
    mbarrier_wait(&bars[0], 1);   // a fresh barrier's phase of parity 1: done at once
    if (mode != 6) __syncthreads();
    if (t < 2) mbarrier_arrive(&bars[0]);   // the arrivals of phase 0
    if (t == 0) {
        if (mode == 1) mbarrier_arrive(&bars[1]);                               // the arrival on bars[1]
        if (mode == 2 || mode == 4) mbarrier_arrive_expect_tx(&bars[1], 64);    // bytes no load brings
        if (mode == 2) mbarrier_arrive(&bars[1]);                               // the arrival beyond the count
        if (mode == 3) mbarrier_arrive(&bars[1]);
        if (mode == 3) mbarrier_init(&bars[1], 2);                              // the second init
        if (mode == 5) bars[0] = 0;                                             // the store to the barrier
        if (mode == 7) out[1] = int(bars[0] & 1);                               // the load of the barrier
    }
    mbarrier_wait(&bars[0], 0);
    if (t == 0) out[0] = 1;
}
#endif
