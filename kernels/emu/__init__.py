"""The CPU emulator for this project's CUDA C kernels (see README.md in this folder).

``RawModule`` and ``RawKernel`` mirror cupy's, with NumPy arrays in place of CuPy arrays: the
very same ``.cu`` source is compiled by g++ against ``cuda_emu.h`` and run with CUDA's
execution semantics (threads of a block as fibers, barriers, warps of 32 lanes, shared
memory per block). ``thread_order("descending")`` runs the threads of the launches inside it
in the other order, which exposes a missing ``__syncthreads()``.
"""
from .errors import CompileError, EmuError, KernelError, LaunchError
from .raw import ORDERS, RawKernel, RawModule, thread_order

__all__ = ["RawModule", "RawKernel", "thread_order", "ORDERS", "EmuError", "CompileError", "LaunchError",
           "KernelError"]
