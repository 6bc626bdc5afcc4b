// optim.cu: SGD with momentum and weight decay over the flat float32 parameter buffer, in
// place, PyTorch's rule (dampening 0, no Nesterov), each operation rounded as the CPU backend
// rounds it (kernels/cpu/optim.py): no fused multiply-adds, so that both give the same bits.
// Launched by kernels/cuda/optim.py; checked by tests/test_kernels_cuda.py and, with the
// bfloat16 copy, tests/test_bf16_ops.py, with the TF32 copy, tests/test_conv_tc.py.
#include "bf16.cuh"
#include "tf32.cuh"

// g = grad + weight_decay * param; velocity = momentum * velocity + g (when velocity is not
// null); param -= lr * (velocity or g); copy = param rounded to bfloat16 (when copy is not null:
// the weights the bf16 precision's forward reads, refreshed in the same pass), tf32_copy = param
// rounded to TF32 (tf32_value, when tf32_copy is not null: the tf32 precision's): one thread per
// parameter, grid-stride. The learning rate is *lr_memory when that is not null (device memory,
// which a CUDA graph's replay reads anew), else lr.
extern "C" __global__ void __launch_bounds__(256)
sgd_update(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ velocity,
           bf16* __restrict__ copy, float* __restrict__ tf32_copy, int total, const float* __restrict__ lr_memory, float lr, float momentum,
           float weight_decay) {
    if (lr_memory) lr = *lr_memory;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const float p = param[i];
        float step = weight_decay != 0.0f ? __fadd_rn(__fmul_rn(p, weight_decay), grad[i]) : grad[i];
        if (velocity) {
            step = __fadd_rn(__fmul_rn(velocity[i], momentum), step);
            velocity[i] = step;
        }
        const float updated = __fsub_rn(p, __fmul_rn(step, lr));
        param[i] = updated;
        if (copy) copy[i] = bf16_round(updated);
        if (tf32_copy) tf32_copy[i] = tf32_value(updated);
    }
}
