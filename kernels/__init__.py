"""Ops on arrays with one signature on every backend.

``backend_of(x)`` is the one place that decides which backend runs an op on an
array: a CuPy array goes to ``cuda``; a NumPy array goes to ``cpu``, or to ``emu``
(the CUDA kernels on the CPU emulator) inside ``with emulate():``, as tests ask.
Nothing else in the project asks what kind of array it holds; it asks
``get_array_module(x)`` for allocation and ``backend_of`` for arithmetic.
"""
import contextlib
import importlib

import numpy as np

from . import cpu

_emulating = False
_device_backends = {}


def get_array_module(x):
    """numpy for host arrays and scalars; for a device array, the package it came from."""
    if isinstance(x, (np.ndarray, np.generic, int, float)):
        return np
    return importlib.import_module(type(x).__module__.split(".")[0])


@contextlib.contextmanager
def emulate():
    """Run the ops on NumPy arrays through the CUDA kernels on the CPU emulator."""
    global _emulating
    previous, _emulating = _emulating, True
    try:
        yield
    finally:
        _emulating = previous


class DeviceError(RuntimeError):
    """The requested device cannot be used: no CuPy, no GPU, or too few GPUs."""


def gpu_count():
    """GPUs that CuPy sees; 0 when CuPy or a driver is missing."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device: all mean no GPU here
        return 0


def array_module_for(device):
    """numpy for 'cpu', cupy for 'cuda' (or 'cuda:N', which also selects GPU N)."""
    if device == "cpu":
        return np
    if not device.startswith("cuda"):
        raise DeviceError(f"unknown device {device!r}: use 'cpu' or 'cuda[:N]'")
    try:
        import cupy
    except ImportError:
        raise DeviceError("CuPy is not installed: pip install -e '.[cuda13]' (or '.[cuda12]')") from None
    index = int(device.partition(":")[2] or 0)
    if index >= gpu_count():
        raise DeviceError(f"{device} asked for, but this machine has {gpu_count()} GPU(s) visible to CuPy")
    cupy.cuda.Device(index).use()
    return cupy


def _device_backend(name):
    """The CUDA launchers bound to CuPy (``cuda``) or to NumPy and the emulator (``emu``)."""
    if name not in _device_backends:
        from . import cuda
        _device_backends[name] = cuda.make_backend(name)
    return _device_backends[name]


def backend_of(x):
    """The backend whose kernels run ops on arrays like ``x``."""
    if isinstance(x, np.ndarray):
        return _device_backend("emu") if _emulating else cpu
    if type(x).__module__.startswith("cupy"):
        return _device_backend("cuda")
    raise TypeError(f"no backend for arrays of type {type(x).__name__}")
