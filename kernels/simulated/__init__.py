"""Simulated GPUs: a test instrument, not a backend.

``KERNELS_SIMULATED_GPUS=N`` in the environment makes a machine without a GPU look like one
with N GPUs to this project's code, as JAX's ``--xla_force_host_platform_device_count`` does for
JAX: ``kernels.cupy_module()`` then returns this package instead of CuPy, and everything above
it runs unchanged (the ``--gpus N`` launcher and its worker processes, the NCCL communicator,
streams, events, device selection, ``model.to("cuda")``, the CUDA launchers). Only this bottom
layer is simulated, and only the part of CuPy 14.2 that the project uses, with CuPy's
signatures (tests/test_simulated_gpus.py checks them against the installed CuPy):

- ``arrays``: device arrays, typed views of raw device memory that remember their device;
  ``RawModule`` runs the kernels on the CPU emulator (kernels/emu); ``tensor_map(array, box, swizzle=128)``
  (not CuPy's) is the tensor map of a device array that a Hopper kernel's TMA loads read (kernels/cuda/sm90.cuh).
- ``cuda``: devices, streams, events, stream capture and graphs, ``runtime``, ``nvtx``;
  ``CUDA_VISIBLE_DEVICES`` applies.
- ``timeline``: the order CUDA guarantees between the work of streams, and what each piece of
  work reads and writes.
- ``nccl``: the collectives between the worker processes, through files.

It refuses what a GPU punishes, with an error naming the call: an array of another device than
the current one in a kernel or operation, a buffer of another device than the communicator's,
an event recorded on another device's stream, a host NumPy array where a device array is
needed, an NCCL call that differs between ranks (a collective replayed in a graph on some ranks
and eager on others included), two ranks on one GPU, an all-reduce whose buffers overlap without
being the same, a collective waiting for a rank that has left the communicator (after a
time-out: GPUs hang); two streams touching the same elements, one of them writing, with no event
or synchronize ordering them (a copy between devices is asynchronous on its stream, each host
thread has its own per-thread default stream, a query is not a wait, the launches of one graph
are ordered, and host threads are ordered by start and join), and memory that CuPy's pool hands
to a new array while another stream's use of it is not ordered before the new array's work;
``get_elapsed_time`` before its events completed; what CUDA refuses during a stream capture
(copies to and from the host on the capturing stream, or on any while a capture in global mode
runs, synchronizing, queries, the legacy stream beside a capturing blocking stream, a wait across
the capture's boundary or between two captures, a fork not joined back into the origin stream);
and a graph replay that reaches memory freed since its capture. What it cannot show: speed, real
overlap (work runs when it is queued, checked against the order CUDA guarantees), the real NCCL
transport, and the GPU's rounding (the emulator's is the CPU's, with subnormals flushed as
``-ftz=true`` does).
"""
from . import cuda, nccl
from .arrays import (RawModule, __version__, arange, asarray, ascontiguousarray, asnumpy, empty, empty_like,
                     ndarray, ones, ones_like, tensor_map, zeros, zeros_like)

cuda.nccl = nccl
get_default_memory_pool = cuda.get_default_memory_pool

__all__ = ["ndarray", "asarray", "ascontiguousarray", "asnumpy", "empty", "empty_like", "zeros", "zeros_like", "ones",
           "ones_like", "arange", "RawModule", "cuda", "get_default_memory_pool", "__version__"]
# tensor_map is the simulated GPUs' own (CuPy has none): in the namespace, not in __all__, CuPy's names
