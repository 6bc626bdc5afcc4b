"""Ops on arrays with one signature on every backend.

``backend_of(x)`` is the one place that decides which backend runs an op on an
array: a CuPy array goes to ``cuda``; a NumPy array goes to ``cpu``, or to ``emu``
(the CUDA kernels on the CPU emulator) inside ``with emulate():``, as tests ask.
Nothing else in the project asks what kind of array it holds; it asks
``get_array_module(x)`` for allocation and ``backend_of`` for arithmetic.

``cupy_module()`` is the one place that imports CuPy: every GPU path gets CuPy from it, which
is how ``KERNELS_SIMULATED_GPUS=N`` puts simulated GPUs (kernels/simulated) under all of them.
Device selection never happens as a side effect: ``array_module_for('cuda')`` leaves the
current GPU as it is, and ``local_gpu`` says which GPU a rank takes.
"""
import contextlib
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from . import cpu

_emulating = False
_device_backends = {}


def cache_folder(name):
    """The project's cache `name` ("emu": the emulator's builds; "cubin": NVRTC's CUBINs of the Hopper families) under
    $XDG_CACHE_HOME, else ~/.cache: resnet-cuda-from-scratch/<name>. Delete it freely."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "resnet-cuda-from-scratch" / name


def get_array_module(x):
    """CuPy (``cupy_module()``) for a device array; numpy for anything else."""
    return cupy_module() if _is_device_array(x) else np


def _is_device_array(x):
    module = type(x).__module__
    return (module.startswith("cupy") or module.startswith(f"{__name__}.simulated")) and \
        isinstance(x, cupy_module().ndarray)


@contextlib.contextmanager
def emulate():
    """Run the ops on NumPy arrays through the CUDA kernels on the CPU emulator."""
    global _emulating
    previous, _emulating = _emulating, True
    try:
        yield
    finally:
        _emulating = previous


PRECISIONS = ("tf32", "bf16", "fp32")
_precision = "tf32"
bfloat16 = np.dtype(ml_dtypes.bfloat16)   # NumPy's bfloat16 (ml_dtypes), which CuPy 14 takes too


def precision():
    """The precision of the CUDA backend's convolutions and linear layers: "tf32" (the default, as
    PyTorch's for convolutions): float32 in and out, the products on TF32 tensor cores (inputs
    rounded to 10 mantissa bits, sums in float32); "bf16": mixed precision as PyTorch's autocast to
    bfloat16, the activations and their gradients stored as bfloat16 between kernels (storage_dtype),
    the convolutions on BF16 tensor cores with float32 sums, every statistic, the loss, the linear
    layer, the weights the optimizer updates and the gradients it reads in float32; "fp32": float32
    FMA throughout. The NumPy backend computes in float32 whatever the precision."""
    return _precision


def storage_dtype():
    """The dtype of the activations and their gradients between the CUDA backend's kernels:
    bfloat16 under the bf16 precision, else float32."""
    return bfloat16 if _precision == "bf16" else np.dtype(np.float32)


def channels_last():
    """Whether the CUDA backend's activations are channels-last (NCHW views of NHWC memory, as the
    tensor-core convolutions read and write them): under tf32 and bf16; NCHW under fp32."""
    return _precision != "fp32"


def set_precision(name):
    """Make `name` (one of PRECISIONS) the precision of the CUDA backend's products from now on."""
    global _precision
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)}")
    _precision = name


@contextlib.contextmanager
def use_precision(name):
    """set_precision(name) for the duration of the block."""
    previous = _precision
    set_precision(name)
    try:
        yield
    finally:
        set_precision(previous)


class DeviceError(RuntimeError):
    """The requested device cannot be used: no CuPy, a CuPy too old, no GPU, or too few GPUs."""


SIMULATED_GPUS = "KERNELS_SIMULATED_GPUS"
MINIMUM_CUPY = (14, 2)  # 13.x passes None kernel arguments as garbage, not null pointers (cupy#9046)


def cupy_module():
    """CuPy, through which every GPU path of the project reaches the GPU; under
    ``KERNELS_SIMULATED_GPUS=N``, the simulated GPUs' stand-in for it (kernels/simulated).
    DeviceError when CuPy is missing or older than 14.2."""
    simulated_gpus = os.environ.get(SIMULATED_GPUS)
    if simulated_gpus:
        if not simulated_gpus.strip().isdigit():
            raise DeviceError(f"{SIMULATED_GPUS}={simulated_gpus!r}: give the number of GPUs to simulate, e.g. "
                              f"{SIMULATED_GPUS}=2")
        from . import simulated
        return simulated
    try:
        import cupy
    except ImportError:
        raise DeviceError("CuPy is not installed: pip install -e '.[cuda13]' (or '.[cuda12]')") from None
    version = tuple(int(v) for v in re.findall(r"\d+", cupy.__version__)[:2])
    if version < MINIMUM_CUPY:
        raise DeviceError(f"CuPy {cupy.__version__} is installed; this project needs CuPy "
                          f"{'.'.join(map(str, MINIMUM_CUPY))} or newer (older ones pass None kernel arguments "
                          f"as garbage, not as null pointers): pip install -e '.[cuda13]' (or '.[cuda12]')")
    return cupy


def nccl_module():
    """cupy.cuda.nccl (or the simulated GPUs' own); its ``available`` says whether NCCL loads."""
    cupy = cupy_module()
    if cupy.__name__ != "cupy":
        return cupy.cuda.nccl
    from cupy.cuda import nccl
    return nccl


def gpu_count():
    """GPUs that CuPy sees; 0 when CuPy or a driver is missing, or CuPy is too old."""
    try:
        return cupy_module().cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device: all mean no GPU here
        return 0


TENSOR_CORES = (8, 0)   # the compute capability of mma.sync on TF32 and BF16, and of cp.async: Ampere's


def gpu_description(device):
    """(name, (major, minor) compute capability) of GPU ``device``, as cudaGetDeviceProperties gives
    them (which makes no CUDA context: the parent of --gpus N workers may ask)."""
    properties = cupy_module().cuda.runtime.getDeviceProperties(device)
    name = properties["name"]
    return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)), (properties["major"],
                                                                                       properties["minor"])


def precision_for(devices, asked=None):
    """The precision of a step on the GPUs ``devices``: ``asked``, or tf32 where every one of them has the
    tensor cores of TF32 (compute capability 8.0, Ampere, and later), else fp32 (a T4, 7.5; a V100, 7.0,
    whose kernels of tf32 and bf16 do not compile). (precision, a line saying why when fp32 was chosen
    for want of tensor cores, else None); DeviceError when ``asked`` is tf32 or bf16 and a GPU lacks them."""
    lacking = [(device, *gpu_description(device)) for device in devices]
    lacking = [(device, name, capability) for device, name, capability in lacking if capability < TENSOR_CORES]
    if not lacking or asked == "fp32":
        return asked or "tf32", None
    device, name, (major, minor) = lacking[0]
    said = f"GPU {device} ({name}) is of compute capability {major}.{minor}"
    if asked is not None:
        raise DeviceError(f"--precision {asked} multiplies on the tensor cores of compute capability 8.0 and later "
                          f"(Ampere): {said}; use --precision fp32 there")
    return "fp32", f"{said}, without TF32 tensor cores: the step computes in fp32"


def local_gpu(local_rank, local_size):
    """The GPU of the rank ``local_rank`` of ``local_size`` ranks on this machine: the one of its
    index when the rank sees them all, the only one when the scheduler made one GPU visible per rank
    (CUDA_VISIBLE_DEVICES, as Slurm does); DeviceError otherwise."""
    visible = gpu_count()
    if visible >= local_size:
        return local_rank
    if visible == 1:
        return 0
    raise DeviceError(f"local rank {local_rank} of {local_size} sees {visible} GPU(s): each rank needs its own GPU "
                      f"(all of the machine's, or exactly one of them through CUDA_VISIBLE_DEVICES)")


def array_module_for(device):
    """numpy for 'cpu'; CuPy (``cupy_module()``) for 'cuda', which leaves the current GPU as it
    is, or for 'cuda:N', which makes GPU N the current one (kernels run on the current GPU)."""
    if device == "cpu":
        return np
    if not device.startswith("cuda"):
        raise DeviceError(f"unknown device {device!r}: use 'cpu' or 'cuda[:N]'")
    cupy = cupy_module()
    index = int(device.partition(":")[2] or 0)
    if index >= gpu_count():
        raise DeviceError(f"{device} asked for, but this machine has {gpu_count()} GPU(s) visible to CuPy")
    if device != "cuda":
        cupy.cuda.Device(index).use()
    return cupy


def _device_backend(name):
    """The CUDA launchers bound to CuPy (``cuda``) or to NumPy and the emulator (``emu``). Where the
    emulator runs the kernels (``emu``, simulated GPUs), one for modules built with the sanitizer's
    instrumentation and one for modules built without it (CUDA_EMU_SANITIZE=off, emu.sanitizer("off")):
    a backend keeps the modules it compiled, and a module built without it runs unchecked, so that
    otherwise the first user of a family in a process would decide for every later one."""
    from .emu import build
    simulated = os.environ.get(SIMULATED_GPUS) if name == "cuda" else None
    key = (name, simulated, build.sanitizing() if name == "emu" or simulated else None)
    if key not in _device_backends:
        from . import cuda
        _device_backends[key] = cuda.make_backend(name)
    return _device_backends[key]


def backend_of(x):
    """The backend whose kernels run ops on arrays like ``x``."""
    if isinstance(x, np.ndarray):
        return _device_backend("emu") if _emulating else cpu
    if _is_device_array(x):
        return _device_backend("cuda")
    raise TypeError(f"no backend for arrays of type {type(x).__name__}")
