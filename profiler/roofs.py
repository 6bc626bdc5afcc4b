"""The roofs of the device a profile runs on: a GPU's from NVIDIA's datasheets (PEAKS), the CPU's
measured once per process, against which each row's FLOPs and bytes are placed."""
import dataclasses
import functools
import os
import platform
import time

import numpy as np

from kernels.cuda import conv_sm90, conv_tc

# the GEMMs that multiply on the tensor cores, by the precision they multiply in: conv_tc.cu's (the tf32
# precision's convolutions) and conv_bf16.cu's (the bf16 precision's); on a Hopper conv_sm90.cu's, in the
# precision of their tile (conv_sm90.precision_of)
TENSOR_CORE_GEMMS = {"TF32": conv_tc.GEMMS, "BF16": conv_tc.BF16_GEMMS}


def on_tensor_cores(kernel_names):
    """The tensor cores' precision, "TF32" or "BF16", that one of these kernels (a row's, as the CUDA
    launchers name them) multiplies in, or None when none of them multiplies on the tensor cores: the
    convolutions launch those GEMMs under the tf32 and bf16 precisions when the tensor cores take
    their channel counts (conv_tc.supports); ResNet-18's stem runs conv.cu's FP32 kernels under tf32,
    the linear layer linear.cu's under every precision."""
    hopper = [conv_sm90.precision_of(name) for name in kernel_names if name.split("<")[0] in conv_sm90.GEMMS]
    if hopper:
        return hopper[0]
    bases = {name.split("<")[0] for name in kernel_names}
    return next((cores for cores, gemms in TENSOR_CORE_GEMMS.items() if bases & set(gemms)), None)


@dataclasses.dataclass(frozen=True)
class Peak:
    device: str
    tflops: float       # the compute roof: float32 on the CUDA cores (FMA), what the fp32 kernels and all the
    gbs: float          # others run on; a tensor-core row's roof (Peak.of) holds the tensor cores' figure here
    source: str
    tensor_tflops: float = None   # TF32 on the tensor cores, dense; None for a CPU
    bf16_tflops: float = None     # BF16 on the tensor cores (float32 sums), dense; None for a CPU
    compute: str = "FP32"         # what multiplies under the `tflops` roof: "FP32", "TF32 tensor cores", ...

    @property
    def ridge(self):
        """FLOPs per byte at which the two roofs meet."""
        return self.tflops * 1e3 / self.gbs

    def of(self, kernel_names):
        """The roofs of a row that launched these kernels: the compute roof of the tensor cores, TF32's
        or BF16's, that one of them multiplies on (on_tensor_cores), else these."""
        cores = on_tensor_cores(kernel_names)
        tflops = {"TF32": self.tensor_tflops, "BF16": self.bf16_tflops}.get(cores)
        if not tflops:
            return self
        return dataclasses.replace(self, tflops=tflops, compute=f"{cores} tensor cores")


# (name as CUDA reports it contains, fp32 TFLOP/s, GB/s, dense TF32 and dense BF16 tensor-core TFLOP/s):
# first match wins, so a specific name comes before the family's. From NVIDIA's datasheets: H200 (SXM
# 67 TFLOP/s, 494.7 TF32 and 989.4 BF16, NVL 60, 417.5 and 835.5; HBM3e 4.8 TB/s both), H100 (SXM 67,
# 494.7 and 989.4 with HBM3 3.35 TB/s, NVL 60, 417.5 and 835.5 with 3.9, PCIe 51, 378 and 756.5 with
# 2.0), A100 (19.5, 156 and 312; 40 GB 1,555 GB/s, 80 GB PCIe 1,935, 80 GB SXM 2,039). The datasheets
# quote TF32 and BF16 with sparsity, twice these.
PEAKS = (
    ("H200 NVL", 60.0, 4800.0, 417.5, 835.5), ("H200", 67.0, 4800.0, 494.7, 989.4),
    ("H100 NVL", 60.0, 3900.0, 417.5, 835.5), ("H100 PCIe", 51.0, 2000.0, 378.0, 756.5),
    ("H100", 67.0, 3350.0, 494.7, 989.4),
    ("A100 80GB PCIe", 19.5, 1935.0, 156.0, 312.0), ("A100-SXM4-80GB", 19.5, 2039.0, 156.0, 312.0),
    ("A100", 19.5, 1555.0, 156.0, 312.0),
)
MATMUL_SIZE, COPY_BYTES = 2048, 1 << 26


def gpu_peak(name):
    """The datasheet roofs of the GPU called `name`, or None for one not in PEAKS."""
    for pattern, tflops, gbs, tensor_tflops, bf16_tflops in PEAKS:
        if pattern in name:
            return Peak(name, tflops, gbs, f"NVIDIA datasheet figures for '{pattern}' (profiler/roofs.py PEAKS)",
                        tensor_tflops, bf16_tflops)
    return None


@functools.cache
def measured_cpu_peak():
    """The CPU's roofs, measured once per process: the best of a few float32 matrix products
    (NumPy's BLAS on all the cores it uses) and of a few 64 MB copies (read + write). What the
    NumPy backend can reach is what its BLAS and memory copies reach, not a datasheet figure."""
    rng = np.random.default_rng(0)
    a, b = (rng.random((MATMUL_SIZE, MATMUL_SIZE), dtype=np.float32) for _ in range(2))
    source = np.ones(COPY_BYTES // 4, np.float32)
    target = np.empty_like(source)
    product = _best_seconds(lambda: a @ b)
    copy = _best_seconds(lambda: np.copyto(target, source))
    return Peak(f"CPU {platform.machine()}, {os.cpu_count()} cores", 2 * MATMUL_SIZE**3 / product / 1e12,
                2 * COPY_BYTES / copy / 1e9,
                f"measured: float32 {MATMUL_SIZE}x{MATMUL_SIZE} matrix product and {COPY_BYTES >> 20} MB copy, "
                f"best of 3")


def _best_seconds(fn, repeats=3):
    fn()    # first touch of the memory, BLAS start-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def device_peak(xp):
    """The roofs of the device that arrays of `xp` live on; None for a GPU not in PEAKS."""
    if xp is np:
        return measured_cpu_peak()
    properties = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = properties["name"]
    return gpu_peak(name.decode() if isinstance(name, bytes) else name)
