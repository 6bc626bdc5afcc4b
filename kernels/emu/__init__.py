"""The CPU emulator for this project's CUDA C kernels (see README.md in this folder).

``RawModule`` and ``RawKernel`` mirror cupy's, with NumPy arrays in place of CuPy arrays: the
very same ``.cu`` source is compiled by g++ against ``cuda_emu.h`` and run with CUDA's
execution semantics (threads of a block as fibers, barriers, warps of 32 lanes, shared
memory per block). ``thread_order("descending")`` runs the threads of the launches inside it
in the other order. Modules are compiled for the sanitizer, which refuses each out-of-bounds
or misaligned access, race, uninitialised read, divergent barrier and use of an undefined shuffle value
where it happens (README.md);
``sanitizer(level)`` sets its level ("full", "memcheck" or "off") for what is made and launched inside it.
``TensorMap(array, box, swizzle=128)`` is a tensor map for the TMA loads of kernels/cuda/sm90.cuh, the argument of
a kernel's ``const __grid_constant__ TensorMap`` parameter.
``traffic()`` counts the global loads of the launches inside it as a GPU's memory system sees them: requests,
32-byte sectors and bytes per kernel (``Traffic``), of arrays aligned as CuPy's (``aligned_empty``).
"""
from .build import sanitizer
from .errors import CacheError, CompileError, EmuError, KernelError, LaunchError
from .raw import (ORDERS, SHARED_BYTES_WITHOUT_OPT_IN, RawKernel, RawModule, Traffic, aligned_empty, thread_order,
                  traffic)
from .tensor_map import TensorMap

__all__ = ["RawModule", "RawKernel", "thread_order", "sanitizer", "traffic", "Traffic", "aligned_empty", "TensorMap",
           "ORDERS",
           "SHARED_BYTES_WITHOUT_OPT_IN", "EmuError", "CacheError", "CompileError", "LaunchError", "KernelError"]
