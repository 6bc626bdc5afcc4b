// timer.cuh: the GPU's global timer, nanoseconds of wall time (PTX's %globaltimer), the same on every
// SM; under the CPU emulator (__CUDA_EMU__), the host's steady clock. Its resolution is a
// microsecond or so on current GPUs: it times microseconds and more, not instructions.
//
//   global_timer_ns()    nanoseconds since some origin of the device's
#pragma once

#ifdef __CUDA_EMU__
#include <chrono>
inline unsigned long long global_timer_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}
#else
__device__ __forceinline__ unsigned long long global_timer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#endif
