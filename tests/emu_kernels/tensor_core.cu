// The wrappers of kernels/cuda/tensor_core.cuh, one kernel each, for tests/test_tensor_core.py:
// the same kernels run on the emulator against NumPy models of the fragment layouts and, marked
// gpu, on a GPU against the emulator. Then kernels that break what the hardware assumes.
#include "tensor_core.cuh"
#include "bf16.cuh"

extern "C" __global__ void round_tf32(const float* x, unsigned* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = tf32_round(x[i]);
}

// One warp: lane l holds a[4l..4l+3], b[2l..2l+1], c[4l..4l+3] and writes d[4l..4l+3].
extern "C" __global__ void mma_fragments(const unsigned* a, const unsigned* b, const float* c, float* d) {
    const int l = threadIdx.x;
    const unsigned fa[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
    const unsigned fb[2] = {b[2 * l], b[2 * l + 1]};
    const float fc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    float fd[4];
    mma_tf32(fd, fa, fb, fc);
    for (int i = 0; i < 4; ++i) d[4 * l + i] = fd[i];
}

// One warp: as mma_fragments, on bfloat16 pairs.
extern "C" __global__ void mma_bf16_fragments(const unsigned* a, const unsigned* b, const float* c, float* d) {
    const int l = threadIdx.x;
    const unsigned fa[4] = {a[4 * l], a[4 * l + 1], a[4 * l + 2], a[4 * l + 3]};
    const unsigned fb[2] = {b[2 * l], b[2 * l + 1]};
    const float fc[4] = {c[4 * l], c[4 * l + 1], c[4 * l + 2], c[4 * l + 3]};
    float fd[4];
    mma_bf16(fd, fa, fb, fc);
    for (int i = 0; i < 4; ++i) d[4 * l + i] = fd[i];
}

// x rounded to bfloat16: one at a time into single[], two at a time (x[2i] low, x[2i+1] high) into
// pairs[], and widened back into wide[].
extern "C" __global__ void round_bf16(const float* x, bf16* single, unsigned* pairs, float* wide, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    single[i] = bf16_round(x[i]);
    wide[i] = bf16_float(single[i]);
    if (i % 2 == 0 && i + 1 < n) pairs[i / 2] = bf16x2_round(x[i], x[i + 1]);
}

// Up to four 8x8 b16 matrices m[j][r][c] go to shared memory row by row, row (j, r) to the
// 16-byte slot slot[8j + r], so that every lane's address is its own; then ldmatrix of `count`
// matrices (1, 2, 4), transposed or not: out[4l + j] is register j of lane l.
extern "C" __global__ void ldmatrix_fragments(const unsigned short* m, const int* slot, unsigned* out, int count,
                                              int trans) {
    __shared__ __align__(16) unsigned short rows[32 * 8];
    const int l = threadIdx.x;
    for (int c = 0; c < 8; ++c) rows[slot[l] * 8 + c] = m[l * 8 + c];
    __syncwarp();
    const unsigned short* row = rows + slot[l] * 8;
    unsigned r[4] = {0, 0, 0, 0};
    if (count == 1) {
        unsigned one[1];
        trans ? ldmatrix_x1_trans(one, row) : ldmatrix_x1(one, row);
        r[0] = one[0];
    } else if (count == 2) {
        unsigned two[2];
        trans ? ldmatrix_x2_trans(two, row) : ldmatrix_x2(two, row);
        r[0] = two[0];
        r[1] = two[1];
    } else {
        trans ? ldmatrix_x4_trans(r, row) : ldmatrix_x4(r, row);
    }
    for (int j = 0; j < 4; ++j) out[4 * l + j] = r[j];
}

// cp.async of `bytes`-byte chunks (thread t the chunk t) of src into shared memory, of which
// the first `src_bytes` come from src and the rest are zero; the chunks of the first half of
// the threads in one group, of the second half in a later one. Before any wait, early[] gets
// what shared memory holds; after cp.async.wait_group 1 (the first group landed), middle[];
// after wait_group 0, late[].
template <int BYTES>
__device__ void copy_chunk(float* dst, const float* src, int src_bytes, int cg) {
    if (cg)
        cp_async_cg(dst, src, src_bytes);
    else
        cp_async_ca<BYTES>(dst, src, src_bytes);
}

extern "C" __global__ void cp_async_groups(const float* src, float* early, float* middle, float* late, int bytes,
                                           int src_bytes, int cg) {
    __shared__ __align__(16) float tile[64 * 4];
    const int t = threadIdx.x, per = bytes / 4, half = blockDim.x / 2;
    for (int group = 0; group < 2; ++group) {
        if ((t < half) == (group == 0)) {
            if (bytes == 4) copy_chunk<4>(tile + t, src + t, src_bytes, cg);
            if (bytes == 8) copy_chunk<8>(tile + 2 * t, src + 2 * t, src_bytes, cg);
            if (bytes == 16) copy_chunk<16>(tile + 4 * t, src + 4 * t, src_bytes, cg);
        }
        cp_async_commit();
    }
    for (int i = 0; i < per; ++i) early[per * t + i] = tile[per * t + i];
    cp_async_wait<1>();
    for (int i = 0; i < per; ++i) middle[per * t + i] = tile[per * t + i];
    cp_async_wait<0>();
    for (int i = 0; i < per; ++i) late[per * t + i] = tile[per * t + i];
}

// ---- what the hardware punishes ----------------------------------------------------------

extern "C" __global__ void divergent_mma_bf16(float* d) {
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    const float c[4] = {1, 1, 1, 1};
    float r[4];
    if (threadIdx.x % 2)
        mma_bf16(r, a, b, c);
    else
        mma_bf16(r, a, b, c);
    d[threadIdx.x] = r[0];
}

extern "C" __global__ void divergent_mma(float* d) {
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    const float c[4] = {1, 1, 1, 1};
    float r[4];
    if (threadIdx.x < 16)
        mma_tf32(r, a, b, c);
    else
        mma_tf32(r, a, b, c);
    d[threadIdx.x] = r[0];
}

extern "C" __global__ void mma_after_half_the_warp_returned(float* d) {
    if (threadIdx.x >= 16) return;
    const unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    const float c[4] = {1, 1, 1, 1};
    float r[4];
    mma_tf32(r, a, b, c);
    d[threadIdx.x] = r[0];
}

extern "C" __global__ void misaligned_ldmatrix(unsigned* out) {
    __shared__ __align__(16) unsigned short rows[33 * 8];
    for (int c = 0; c < 8; ++c) rows[threadIdx.x * 8 + c] = 0;
    __syncwarp();
    unsigned r[4];
    ldmatrix_x4(r, rows + threadIdx.x * 8 + 2);   // 4 bytes past a 16-byte boundary
    out[threadIdx.x] = r[0];
}

extern "C" __global__ void ldmatrix_from_global(const unsigned short* m, unsigned* out) {
    unsigned r[1];
    ldmatrix_x1(r, m + 8 * (threadIdx.x % 8));
    out[threadIdx.x] = r[0];
}

extern "C" __global__ void cp_async_past_the_end(const float* src, float* dst, int n) {
    __shared__ __align__(16) float tile[4];
    cp_async_ca<8>(tile, src + n - 1, 8);   // the last float and the 4 bytes after it (n odd: aligned)
    cp_async_commit();
    cp_async_wait<0>();
    dst[0] = tile[0];
}

extern "C" __global__ void cp_async_never_waited(const float* src, float* dst) {
    __shared__ __align__(16) float tile[4];
    cp_async_ca<16>(tile, src, 16);
    cp_async_commit();
    dst[0] = 1.0f;
}
