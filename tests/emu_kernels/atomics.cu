// Atomics from many blocks: an integer histogram, the other integer atomics on a few
// counters, and float and double sums.

extern "C" __global__ void histogram(const int* values, int n, int* counts) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        atomicAdd(&counts[values[i]], 1);
}

// counters: [max, min, exch-count, cas-count, or, and, unsigned max, unsigned inc]
extern "C" __global__ void integer_atomics(const int* values, int n, int* counters, unsigned int* ucounters) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const int v = values[i];
        atomicMax(&counters[0], v);
        atomicMin(&counters[1], v);
        atomicExch(&counters[2], 1);
        // a lock-free increment by compare-and-swap
        int old = counters[3], assumed;
        do {
            assumed = old;
            old = atomicCAS(&counters[3], assumed, assumed + 1);
        } while (old != assumed);
        atomicOr(&counters[4], 1 << (v & 31));
        atomicAnd(&counters[5], ~(1 << (v & 31)));
        atomicMax(&ucounters[0], (unsigned int)v * 2654435761u);
        atomicInc(&ucounters[1], 1000u);
    }
}

extern "C" __global__ void float_sums(const float* x, const double* y, int n, float* fsum, double* dsum) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        atomicAdd(fsum, x[i]);
        atomicAdd(dsum, y[i]);
    }
}
