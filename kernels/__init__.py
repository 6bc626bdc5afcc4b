"""Ops on arrays with one signature on every backend.

``backend_of(x)`` is the one place that decides which backend runs an op on an
array: NumPy arrays go to ``cpu``. Nothing else in the project asks what kind of
array it holds; it asks ``get_array_module(x)`` for allocation and ``backend_of``
for arithmetic.
"""
import importlib

import numpy as np

from . import cpu


def get_array_module(x):
    """numpy for host arrays and scalars; for a device array, the package it came from."""
    if isinstance(x, (np.ndarray, np.generic, int, float)):
        return np
    return importlib.import_module(type(x).__module__.split(".")[0])


def backend_of(x):
    """The backend whose kernels run ops on arrays like ``x``."""
    if isinstance(x, np.ndarray):
        return cpu
    raise TypeError(f"no backend for arrays of type {type(x).__name__}")
