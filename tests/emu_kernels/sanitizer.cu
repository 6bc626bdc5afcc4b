// sanitizer.cu: kernels that each hold one bug a GPU punishes, and correct kernels beside them that
// do nearly the same and must run clean, for tests/test_sanitizer.py. Each bug is one that
// compute-sanitizer reports on a GPU (memcheck, racecheck, synccheck, initcheck), but the race of
// two plain stores to one global word (one update is lost) and the use of an undefined value a shuffle
// read outside its mask, which no tool reports there.
#include "common.cuh"
#include "tensor_core.cuh"

// ---- memcheck -----------------------------------------------------------------------------------

extern "C" __global__ void read_past_end(const float* x, float* y, int n) {
    const int i = threadIdx.x;
    if (i < n) y[i] = x[i + 1];   // the last thread reads one past the end
}

extern "C" __global__ void read_before_start(const float* x, float* y, int n) {
    const int i = threadIdx.x;
    if (i < n) y[i] = i > n / 2 ? x[i] : x[i - 1];   // thread 0 reads x[-1]
}

extern "C" __global__ void read_a_row_too_far(const float* x, float* y, int rows, int columns) {
    const int r = threadIdx.y, c = threadIdx.x;
    if (r < rows && c < columns) y[r * columns + c] = x[(r + 1) * columns + c] - x[r * columns + c];
}

extern "C" __global__ void static_shared_written_past_its_end(float* y) {
    __shared__ float tile[32];
    tile[threadIdx.x] = float(threadIdx.x);   // launched with 33 threads
    __syncthreads();
    if (threadIdx.x < 32) y[threadIdx.x] = tile[threadIdx.x];
}

extern "C" __global__ void static_shared_read_past_its_end(float* y) {
    __shared__ float tile[32];
    tile[threadIdx.x] = float(threadIdx.x);
    __syncthreads();
    y[threadIdx.x] = tile[threadIdx.x + 1];   // thread 31 reads tile[32]
}

extern "C" __global__ void dynamic_shared_past_what_was_asked(float* y) {
    extern __shared__ float dynamic[];
    dynamic[threadIdx.x] = float(threadIdx.x);
    __syncthreads();
    y[threadIdx.x] = dynamic[threadIdx.x + 1];   // launched with 32 floats: thread 31 reads the 33rd
}

extern "C" __global__ void misaligned_float4_load(const float* x, float* y) {
    const float4 v = *reinterpret_cast<const float4*>(x + 4 * threadIdx.x + 1);   // 4 bytes off
    y[threadIdx.x] = v.x + v.y + v.z + v.w;
}

extern "C" __global__ void misaligned_shared_float2(float* y) {
    __shared__ __align__(16) float s[64];
    s[threadIdx.x] = float(threadIdx.x);   // 64 threads
    __syncthreads();
    if (threadIdx.x < 31) {
        const float2 v = *reinterpret_cast<const float2*>(s + 2 * threadIdx.x + 1);   // 4 bytes off
        y[threadIdx.x] = v.x + v.y;
    }
}

extern "C" __global__ void memcpy_past_end(const float* x, float* y, int n) {
    if (threadIdx.x == 0) memcpy(y, x, (n + 1) * sizeof(float));   // one float too many
}

extern "C" __global__ void atomic_past_end(unsigned* count, int n) {
    atomicAdd(count + n, 1u);   // one past the end
}

__device__ float device_scale = 2.0f;

extern "C" __global__ void scaled_by_a_device_variable(const float* x, float* y) {   // correct
    y[threadIdx.x] = device_scale * x[threadIdx.x];
}

// ---- synccheck ----------------------------------------------------------------------------------

extern "C" __global__ void barrier_in_divergent_code(const float* x, float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = x[t];
    if (t < 32) {
        __syncthreads();   // half the block waits here, the other half at the barrier below
        s[t] += s[t + 32];
    }
    __syncthreads();
    y[t] = s[t % 32];
}

// A helper that holds one barrier, which every thread reaches, guarding its loads alone.
__device__ __noinline__ float staged_neighbour(float* s, const float* x, int i, int n) {
    if (i < n) s[i] = x[i];
    __syncthreads();
    return i + 1 < n ? s[i + 1] : 0.0f;
}

// Correct: one call of the helper, which g++ copies into the two sides of the kernel's `if (i < n)`;
// on a GPU it is one barrier.
extern "C" __global__ void barrier_in_a_helper_called_once(const float* x, float* y, int n) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    float v = 0.0f;
    if (i < n) v = x[i];
    const float next = staged_neighbour(s, x, i, n);
    if (i < n) y[i] = v + next;
}

// The helper called from the two sides of a divergent branch: two barriers of the source.
extern "C" __global__ void barrier_in_a_helper_called_from_both_sides(const float* x, float* y, int n) {
    __shared__ float s[64];
    const int i = threadIdx.x;
    float v;
    if (i < n) v = 2.0f * staged_neighbour(s, x, i, n);
    else v = staged_neighbour(s, x, i, n);
    if (i < n) y[i] = v;
}

__device__ __noinline__ void mma_step(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                      const float (&c)[4]) {
    mma_tf32(d, a, b, c);
}

// Both halves of the warp call one helper, from two calls: the same source line of mma_tf32, but
// not the same instruction.
extern "C" __global__ void mma_by_two_halves_through_one_helper(float* out) {
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float d[4];
    if (threadIdx.x < 16) {
        const float c[4] = {1, 1, 1, 1};
        mma_step(d, a, b, c);
    } else {
        const float c[4] = {2, 2, 2, 2};
        mma_step(d, a, b, c);
    }
    out[threadIdx.x] = d[0];
}

extern "C" __global__ void mma_through_one_helper(float* out) {   // correct: one call
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    const float c[4] = {float(threadIdx.x), 1, 1, 1};
    float d[4];
    mma_step(d, a, b, c);
    out[threadIdx.x] = d[0];
}

// ---- shuffles ----------------------------------------------------------------------------------

// A warp's sum by shuffles in a block of 48 threads: the mask of the last warp names lanes 16-31,
// which do not exist, and lane 0 reads lane 16 at the first step.
extern "C" __global__ void warp_sum_in_a_partial_warp(const float* x, float* y) {
    float v = x[threadIdx.x];
    for (int k = 16; k > 0; k >>= 1) v += __shfl_down_sync(0xffffffffu, v, k);
    if (threadIdx.x % 32 == 0) y[threadIdx.x / 32] = v;
}

// Correct: the last warp's 16 lanes exchange among themselves (width 16, a mask of those lanes).
extern "C" __global__ void warp_sum_of_the_lanes_there(const float* x, float* y) {
    const unsigned lanes = threadIdx.x < 32 ? 0xffffffffu : 0x0000ffffu;
    const int width = threadIdx.x < 32 ? 32 : 16;
    float v = x[threadIdx.x];
    for (int k = width / 2; k > 0; k >>= 1) v += __shfl_xor_sync(lanes, v, k, width);
    if (threadIdx.x % 32 == 0) y[threadIdx.x / 32] = v;
}

// Lanes 16-31 return; lanes 0-15 then read them, with a mask of themselves, and store what they read.
extern "C" __global__ void shuffle_reads_lanes_that_returned(const float* x, float* y) {
    if (threadIdx.x >= 16) return;
    y[threadIdx.x] = __shfl_sync(0x0000ffffu, x[threadIdx.x], int(threadIdx.x) + 16);
}

// ---- undefined shuffle values -------------------------------------------------------------------
// Launched with 48 threads: the second warp has 16 lanes, and its shuffles name them alone. Where a lane
// reads lane + k past them, outside the mask, it gets an undefined value: no error while it is discarded,
// an error where it is used (stored, compared, branched on, an address, an atomic's operand).

// The lanes there in the calling thread's warp, and the mask of them.
__device__ int lanes_there() { return min(32, int(blockDim.x - threadIdx.x / 32 * 32)); }
__device__ unsigned mask_of_lanes_there() { return lanes_there() == 32 ? 0xffffffffu : (1u << lanes_there()) - 1; }

// Correct: a lane adds what it read from lane + k only if that lane is there; every lane stores its sum.
template <class T>
__device__ void partial_warp_sums(const T* x, T* y) {
    const int lane = threadIdx.x % 32, lanes = lanes_there();
    T v = x[threadIdx.x];
    for (int k = 16; k > 0; k >>= 1) {
        const T other = __shfl_down_sync(mask_of_lanes_there(), v, k);   // guarded sum
        if (lane + k < lanes) v += other;
    }
    y[threadIdx.x] = v;
}
extern "C" __global__ void partial_warp_sums_float(const float* x, float* y) { partial_warp_sums(x, y); }
extern "C" __global__ void partial_warp_sums_int(const int* x, int* y) { partial_warp_sums(x, y); }
extern "C" __global__ void partial_warp_sums_double(const double* x, double* y) { partial_warp_sums(x, y); }

// Correct: the sum from half the lanes there, without the guard: lanes 8-15 of the partial warp add undefined
// values, and lanes 4-7, 2-3 and 1 what those lanes then hold, but lane 0, which alone stores, adds lanes 0-15.
extern "C" __global__ void partial_warp_sum_stored_by_lane_0(const float* x, float* y) {
    float v = x[threadIdx.x];
    for (int k = lanes_there() / 2; k > 0; k >>= 1) v += __shfl_down_sync(mask_of_lanes_there(), v, k);
    if (threadIdx.x % 32 == 0) y[threadIdx.x / 32] = v;
}

// Stored: the sum without the guard, stored by every lane: from k = 16 on, every lane of the partial warp adds
// an undefined value and stores what it computed from it (float, double).
template <class T>
__device__ void partial_warp_sums_unguarded(const T* x, T* y) {
    T v = x[threadIdx.x];
    for (int k = 16; k > 0; k >>= 1) v += __shfl_down_sync(mask_of_lanes_there(), v, k);   // unguarded sum
    y[threadIdx.x] = v;   // every lane, unguarded
}
extern "C" __global__ void partial_warp_sums_unguarded_float(const float* x, float* y) {
    partial_warp_sums_unguarded(x, y);
}
extern "C" __global__ void partial_warp_sums_unguarded_double(const double* x, double* y) {
    partial_warp_sums_unguarded(x, y);
}

// Stored: each lane puts its next lane's value into shared memory; the partial warp's lane 15 has none.
extern "C" __global__ void next_lane_into_shared_memory(const int* x, int* y) {
    __shared__ int s[48];
    s[threadIdx.x] = __shfl_down_sync(mask_of_lanes_there(), x[threadIdx.x], 1);   // shared store
    __syncthreads();
    y[threadIdx.x] = s[threadIdx.x];
}

// Stored by an atomic: each lane adds its next lane's value to the total; the partial warp's lane 15 has none.
extern "C" __global__ void next_lane_added_atomically(const int* x, int* total) {
    atomicAdd(total, __shfl_down_sync(mask_of_lanes_there(), x[threadIdx.x], 1));   // atomic operand
}

// Correct, and compared without the guard: each warp's maximum.
extern "C" __global__ void partial_warp_max(const float* x, float* y, int guarded) {
    const int lane = threadIdx.x % 32, lanes = lanes_there();
    float v = x[threadIdx.x];
    for (int k = 16; k > 0; k >>= 1) {
        const float other = __shfl_down_sync(mask_of_lanes_there(), v, k);   // max
        if ((!guarded || lane + k < lanes) && other > v) v = other;
    }
    if (lane == 0) y[threadIdx.x / 32] = v;
}

// Correct, and branched on without the guard: what each lane does depends on its next lane's value.
extern "C" __global__ void by_the_next_lane(const int* x, int* y, int guarded) {
    const int t = threadIdx.x, lane = t % 32;
    const int next = __shfl_down_sync(mask_of_lanes_there(), x[t], 1);   // branched on
    if (guarded && lane + 1 >= lanes_there()) {
        y[t] = -1;
        return;
    }
    switch (next) {
        case 0: y[t] = x[t]; break;
        case 1: y[t] = -x[t]; break;
        case 2: y[t] = 2 * x[t]; break;
        default: y[t] = 7; break;
    }
}

// Correct, and an address without the guard: each lane looks its next lane's index up in a table, in an
// argument (place 0), in shared memory (1), in a __device__ array (2) or in an array of its own (3).
__device__ float device_table[48];

extern "C" __global__ void look_up_the_next_lane(const float* table, const int* index, float* y, int guarded,
                                                 int place) {
    __shared__ float s[48];
    float own[48];
    const int t = threadIdx.x, lane = t % 32;
    s[t] = table[t];
    device_table[t] = table[t];
    for (int k = 0; k < 48; ++k) own[k] = table[k];
    __syncthreads();
    const int next = __shfl_down_sync(mask_of_lanes_there(), index[t], 1);   // index
    const float* in = place == 0 ? table : place == 1 ? s : place == 2 ? device_table : own;
    y[t] = !guarded || lane + 1 < lanes_there() ? in[next] : -1.0f;   // looked up
}

// Correct, and an operand of a warp operation or a barrier without the guard: each lane's next lane's value
// as the source lane of a shuffle (use 0), a barrier's predicate (1) or the mask of a __syncwarp() (2).
extern "C" __global__ void next_lane_as_an_operand(const int* x, int* y, int use, int guarded) {
    const int t = threadIdx.x, lane = t % 32;
    const int next = __shfl_down_sync(mask_of_lanes_there(), x[t], 1);   // operand
    const bool there = !guarded || lane + 1 < lanes_there();
    if (use == 0) y[t] = __shfl_sync(mask_of_lanes_there(), x[t], there ? next : lane);   // source lane
    if (use == 1) y[t] = __syncthreads_count(there ? next : 0);   // predicate
    if (use == 2) {
        __syncwarp(there ? unsigned(next) : mask_of_lanes_there());   // mask
        y[t] = lane;
    }
}

// ---- racecheck ------------------------------------------------------------------------------------

extern "C" __global__ void every_thread_writes_one_shared_word(float* y) {
    __shared__ float s[1];
    s[0] = float(threadIdx.x);
    __syncthreads();
    y[threadIdx.x] = s[0];
}

extern "C" __global__ void one_thread_writes_a_slot_the_others_read_without_a_barrier(float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = float(t);
    __syncthreads();
    if (t == 0) s[32] = -1.0f;
    y[t] = s[32];   // written by thread 0 in this phase: which value a thread reads depends on the timing
}

extern "C" __global__ void overwrites_a_slot_before_its_reader_is_done(float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = float(t);
    __syncthreads();
    const float next = s[(t + 1) % 64];
    s[t] = 2.0f * next;   // thread t - 1 may not have read s[t] yet
    y[t] = next;
}

// A warp's sum through shared memory: each step needs a __syncwarp() (lanes of a warp do not run in
// lockstep since Volta), which `with_syncwarp` has.
extern "C" __global__ void warp_sum_without_syncwarp(const float* x, float* y) {
    __shared__ float s[32];
    const int t = threadIdx.x;
    s[t] = x[t];
    __syncwarp();
    for (int k = 16; k > 0; k >>= 1)
        if (t < k) s[t] += s[t + k];
    if (t == 0) y[0] = s[0];
}

extern "C" __global__ void warp_sum_with_syncwarp(const float* x, float* y) {   // correct
    __shared__ float s[32];
    const int t = threadIdx.x;
    s[t] = x[t];
    __syncwarp();
    for (int k = 16; k > 0; k >>= 1) {
        const float other = t < k ? s[t + k] : 0.0f;
        __syncwarp();
        if (t < k) s[t] += other;
        __syncwarp();
    }
    if (t == 0) y[0] = s[0];
}

extern "C" __global__ void every_thread_writes_one_global_word(float* y) {
    y[0] = float(threadIdx.x);
}

extern "C" __global__ void every_block_adds_to_one_global_word(float* y) {
    if (threadIdx.x == 0) y[0] += 1.0f;   // a plain read-modify-write: the blocks' updates are lost
}

extern "C" __global__ void every_block_adds_atomically(unsigned* count) {   // correct
    if (threadIdx.x == 0) atomicAdd(count, 1u);
}

// The project's split reduction (common.cuh): every block writes its partial, the last to finish
// adds them all after an atomic counter and a fence. Correct: no block writes another's partial.
extern "C" __global__ void split_sum_finished_by_the_last_block(const float* x, float* partial, unsigned* counter,
                                                                float* total) {
    __shared__ float scratch[32];
    const float sum = block_sum(x[blockIdx.x * blockDim.x + threadIdx.x], scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
    if (last_block(counter, gridDim.x) && threadIdx.x == 0) *total = added_partials(partial, gridDim.x, 1);
}

// Correct: the threads that see a negative value set one flag, all to the same value; nothing is lost.
extern "C" __global__ void threads_set_one_flag(const float* x, int* found) {
    if (x[blockIdx.x * blockDim.x + threadIdx.x] < 0.0f) *found = 1;
}

// The running sums of the blocks' sums, in place: each block writes its sum, the last to finish
// overwrites every block's slot with the running sum.
__device__ __forceinline__ void running_sums(float* partial, unsigned blocks) {
    volatile float* p = partial;
    float running = 0.0f;
    for (unsigned b = 0; b < blocks; ++b) {
        running += p[b];
        p[b] = running;
    }
}

// Correct: the slots are handed to the last block by last_block's fence and counter.
extern "C" __global__ void last_block_reuses_the_partials(const float* x, float* partial, unsigned* counter) {
    __shared__ float scratch[32];
    const float sum = block_sum(x[blockIdx.x * blockDim.x + threadIdx.x], scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
    if (last_block(counter, gridDim.x) && threadIdx.x == 0) running_sums(partial, gridDim.x);
}

// Each block writes its sum after it has counted itself: the last block may overwrite a slot before
// its block's store lands, which then overwrites the running sum.
extern "C" __global__ void partial_written_after_counting(const float* x, float* partial, unsigned* counter) {
    __shared__ float scratch[32];
    const float sum = block_sum(x[blockIdx.x * blockDim.x + threadIdx.x], scratch);
    const bool last = last_block(counter, gridDim.x);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
    if (last && threadIdx.x == 0) running_sums(partial, gridDim.x);
}

// ---- initcheck ------------------------------------------------------------------------------------

extern "C" __global__ void reads_unwritten_shared_behind_fmaxf(const float* x, float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    if (t % 2 == 0) s[t] = x[t];
    __syncthreads();
    y[t] = fmaxf(s[t | 1], 0.0f);   // the odd slots, never written: a NaN that fmaxf hides
}

extern "C" __global__ void compares_a_cp_async_destination_before_its_wait(const float* x, float* y) {
    __shared__ __align__(16) float s[4 * 32];
    const int t = threadIdx.x;
    cp_async_ca<16>(s + 4 * t, x + 4 * t, 16);
    cp_async_commit();
    const bool positive = s[4 * t] > 0.0f;   // before the wait: NaN, which the comparison hides
    cp_async_wait<0>();
    y[t] = positive ? s[4 * t] : 0.0f;
}

extern "C" __global__ void reads_a_cp_async_destination_after_its_wait(const float* x, float* y) {   // correct
    __shared__ __align__(16) float s[4 * 32];
    const int t = threadIdx.x;
    cp_async_ca<16>(s + 4 * t, x + 4 * t, 16);
    cp_async_commit();
    cp_async_wait<0>();
    y[t] = s[4 * t] > 0.0f ? s[4 * t] : 0.0f;
}

extern "C" __global__ void reads_dynamic_shared_nobody_wrote(float* y) {
    extern __shared__ float dynamic[];
    y[threadIdx.x] = dynamic[threadIdx.x] > 0.0f ? 1.0f : 0.0f;
}

// ---- ldmatrix loads the rows at the instruction ---------------------------------------------------

// Correct only because ldmatrix reads the warp's rows when all 32 lanes are there: lane 0 overwrites
// row 7 right after it, which lane 7 gave and the lanes that hold its elements have read by then.
extern "C" __global__ void overwrites_a_row_right_after_ldmatrix(const unsigned short* m, unsigned* out) {
    __shared__ __align__(16) unsigned short rows[8 * 8];
    const int lane = threadIdx.x;
    if (lane < 8)
        for (int c = 0; c < 8; ++c) rows[lane * 8 + c] = m[lane * 8 + c];
    __syncwarp();
    unsigned r[1];
    ldmatrix_x1(r, rows + 8 * (lane % 8));
    if (lane == 0)
        for (int c = 0; c < 8; ++c) rows[7 * 8 + c] = 0xffff;
    out[lane] = r[0];
}
