"""Arrays of the simulated GPUs: CuPy's ``ndarray``, its creation functions and ``RawModule``.

An array is host memory (a NumPy array, kept private) and the device it lives on: the current
device when it was made, as with CuPy; views share both. What runs a kernel on a GPU (an
element-wise operation, a reduction, a gather, a ``RawModule`` launch) takes its arrays from the
current device only, and a host NumPy array where a device array is needed is refused, as CuPy
refuses it: the simulated machine has no peer access, so an array of another device is an error
naming the call, not a slow success. ``RawModule`` is the CPU emulator's (kernels/emu); ``empty``
fills new memory with NaN (integers: their minimum), so that an element a kernel forgets to
write shows.
"""
import weakref

import numpy as np

from .. import emu
from . import cuda

__version__ = "14.2.0"  # the CuPy whose behaviour this simulates


def _device_error(call, device):
    return ValueError(f"The device where the array resides ({device}) is different from the current device "
                      f"({cuda.getDevice()}). Peer access is unavailable between these devices. "
                      f"(simulated GPUs: {call})")


def _host_error(call, value):
    return TypeError(f"Unsupported type {type(value)} (simulated GPUs: {call} takes device arrays; a host "
                     f"NumPy array must be copied with cupy.asarray first)")


def _operand(call, value):
    """The NumPy storage of a device array on the current device, or a scalar; an error otherwise."""
    if isinstance(value, ndarray):
        if value._device != cuda.getDevice():
            raise _device_error(call, value._device)
        return value._array
    if isinstance(value, np.ndarray):
        raise _host_error(call, value)
    return value


def _new(array):
    """A device array of new memory on the current device."""
    cuda.ledger["allocations"][cuda.getDevice()] += 1
    return ndarray._wrap(np.asarray(array), cuda.getDevice())


def _work(name, written):
    """Count one array operation (a kernel, memset or copy on a GPU) that writes `written` (an array);
    refused during a stream capture, which records kernels only."""
    cuda.refuse_during_capture(f"simulated GPUs: the array operation {name!r}")
    cuda.ledger["operations"][name] += 1
    cuda.ledger["operation_bytes"][name] += written.nbytes
    return written


def _poisoned(shape, dtype, order="C"):
    array = np.empty(shape, dtype, order=order)
    if array.dtype.kind == "f":
        array.fill(np.nan)
    elif array.dtype.kind in "iu":
        array.fill(np.iinfo(array.dtype).min)
    return array


class ndarray:  # noqa: N801  (CuPy's name)
    """cupy.ndarray: host memory that remembers its device."""
    __slots__ = ("_array", "_device", "_pointer")

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("simulated GPUs: ndarray(memptr=..., strides=...) is not simulated")
        other = empty(shape, dtype, order)
        self._array, self._device, self._pointer = other._array, other._device, None

    @classmethod
    def _wrap(cls, array, device):
        self = object.__new__(cls)
        self._array, self._device, self._pointer = array, device, None
        return self

    def _derived(self, result, call):
        """``result`` of a NumPy operation on this array: a view of its memory stays on its device;
        new memory was written by a kernel, which reads this array from the current device."""
        if isinstance(result, np.ndarray) and np.may_share_memory(result, self._array):
            return ndarray._wrap(result, self._device)
        _operand(call, self)
        return _new(result)

    # ---- attributes ---------------------------------------------------------------------------
    shape = property(lambda self: self._array.shape)
    dtype = property(lambda self: self._array.dtype)
    ndim = property(lambda self: self._array.ndim)
    size = property(lambda self: self._array.size)
    nbytes = property(lambda self: self._array.nbytes)
    itemsize = property(lambda self: self._array.itemsize)
    strides = property(lambda self: self._array.strides)
    flags = property(lambda self: self._array.flags)
    device = property(lambda self: cuda.Device(self._device))
    @property
    def data(self):
        if self._pointer is None:   # an array's memory never moves: made (and registered) once
            self._pointer = MemoryPointer(self)
        return self._pointer
    T = property(lambda self: self.transpose())

    # ---- to the host ----------------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        _work("copy to the host", self)
        if out is not None:
            out[...] = self._array
            return out
        return np.array(self._array, order=order)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def item(self):
        return self._array.item()

    def tolist(self):
        return self._array.tolist()

    def __float__(self):
        return float(self._array)

    def __int__(self):
        return int(self._array)

    def __bool__(self):
        return bool(self._array)

    def __len__(self):
        return len(self._array)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"array({np.array2string(self._array, separator=', ')}, device={self._device})"

    # ---- shape --------------------------------------------------------------------------------
    def reshape(self, *shape, order="C", copy=None):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return self._derived(self._array.reshape(shape, order=order), "ndarray.reshape")

    def ravel(self, order="C"):
        return self._derived(self._array.ravel(order), "ndarray.ravel")

    def transpose(self, *axes):
        return ndarray._wrap(self._array.transpose(*axes), self._device)

    def swapaxes(self, axis1, axis2):
        return ndarray._wrap(self._array.swapaxes(axis1, axis2), self._device)

    def view(self, dtype=None, type=None):  # noqa: A002  (CuPy's name)
        return ndarray._wrap(self._array.view() if dtype is None else self._array.view(dtype), self._device)

    # ---- kernels ----------------------------------------------------------------------------
    def copy(self, order="C"):
        return _work("copy", _new(np.array(self._array, order=order)))  # any device to the current one, as CuPy

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _work("astype", _new(_operand("ndarray.astype", self).astype(dtype, order=order)))

    def fill(self, value):
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            value = value._array[()]
        memset = value == 0 and self.flags.c_contiguous  # CuPy's memset needs no kernel
        if not memset:
            _operand("ndarray.fill", self)
        self._array.fill(value)
        _work("memset" if memset else "fill", self)

    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce(np.sum, self, axis, out, keepdims, dtype=dtype)

    def max(self, axis=None, out=None, keepdims=False):
        return _reduce(np.max, self, axis, out, keepdims)

    def __getitem__(self, slices):
        keys = slices if isinstance(slices, tuple) else (slices,)
        if not _gathers(keys):  # basic indexing: a view, 0-d where NumPy would give a scalar
            result = self._array[slices]
            if not isinstance(result, np.ndarray):
                result = self._array[(*keys, Ellipsis)]
            return ndarray._wrap(result, self._device)
        # a gather: a kernel on the current device; host index arrays are copied there first
        return _work("gather", _new(_operand("ndarray.__getitem__", self)[_index("ndarray.__getitem__", keys)]))

    def __setitem__(self, slices, value):
        keys = slices if isinstance(slices, tuple) else (slices,)
        if isinstance(value, ndarray) and not _gathers(keys):
            target = self[slices]
            if value.shape == target.shape and value.dtype == target.dtype and value.flags.c_contiguous \
                    and target.flags.c_contiguous:
                target._array[...] = value._array  # a plain copy, from any device, as CuPy's memcpy
                _work("copy", target)
                return
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        call = "ndarray.__setitem__"
        _operand(call, self)[_index(call, keys)] = _operand(call, value)
        _work("scatter" if _gathers(keys) else "setitem", self[slices] if not _gathers(keys) else self)

    # ---- NumPy's ufuncs and Python's operators ----------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            return NotImplemented
        call = f"cupy.{ufunc.__name__}"
        out = kwargs.pop("out", None)
        result = ufunc(*(_operand(call, v) for v in inputs),
                       **({} if out is None else {"out": tuple(_operand(call, o) for o in out)}), **kwargs)
        return _work(ufunc.__name__, out[0] if out is not None else _new(result))


def _operator(ufunc, reflected=False, in_place=False):
    if in_place:
        return lambda self, other: ufunc(self, other, out=(self,))
    return (lambda self, other: ufunc(other, self)) if reflected else (lambda self, other: ufunc(self, other))


for _name, _ufunc in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
                      ("floordiv", np.floor_divide), ("pow", np.power), ("matmul", np.matmul)):
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
    setattr(ndarray, f"__r{_name}__", _operator(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _operator(_ufunc, in_place=True))
for _name, _ufunc in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less), ("le", np.less_equal),
                      ("gt", np.greater), ("ge", np.greater_equal)):
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
ndarray.__neg__ = lambda self: np.negative(self)
ndarray.__abs__ = lambda self: np.absolute(self)
ndarray.__hash__ = None


def _gathers(keys):
    return any(isinstance(k, (ndarray, np.ndarray)) for k in keys)


def _index(call, keys):
    return tuple(_operand(call, k) if isinstance(k, ndarray) else k for k in keys)


def _reduce(function, a, axis, out, keepdims, **kwargs):
    call = f"ndarray.{function.__name__}"
    result = function(_operand(call, a), axis=axis, keepdims=keepdims, **kwargs)
    if out is None:
        return _work(function.__name__, _new(result))
    _operand(call, out)[...] = result
    return _work(function.__name__, out)


class MemoryPointer:
    """cupy.cuda.MemoryPointer: the address of an array's first element and its device."""

    def __init__(self, array):
        self.ptr = array._array.__array_interface__["data"][0]
        self.device_id = array._device
        _register(array._array, array._device)


# ---- the memory that raw pointers (NCCL's arguments) point into ------------------------------------
_allocations = {}  # id of the NumPy array owning the memory -> (start, end, device, weak reference)


def _register(array, device):
    while isinstance(array.base, np.ndarray):
        array = array.base
    known = _allocations.get(id(array))
    if known is None or known[3]() is not array:
        start = array.__array_interface__["data"][0]
        _allocations[id(array)] = (start, start + array.nbytes, device, weakref.ref(array))


def memory_at(pointer, nbytes, call):
    """(device, writable uint8 NumPy view) of the ``nbytes`` at ``pointer`` in one device array."""
    for key, (start, end, device, owner) in list(_allocations.items()):
        array = owner()
        if array is None:
            del _allocations[key]
        elif start <= pointer and pointer + nbytes <= end:
            return device, array.reshape(-1).view(np.uint8)[pointer - start:pointer - start + nbytes]
    raise cuda.CUDARuntimeError("cudaErrorIllegalAddress", f"{call}: {nbytes} bytes at {pointer:#x} do not lie in "
                                                           f"one device array")


# ---- creation ---------------------------------------------------------------------------------------
def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if isinstance(a, ndarray):
        if a._device != cuda.getDevice():  # CuPy copies an array of another device to the current one
            return _work("copy", _new(np.asarray(a._array, dtype=dtype, order=order).copy()))
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _work("copy from the host", _new(np.array(a, dtype=dtype, order=order)))


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise _host_error("cupy.ascontiguousarray", a)
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _work("ascontiguousarray", _new(np.ascontiguousarray(_operand("cupy.ascontiguousarray", a), dtype=dtype)))


def empty(shape, dtype=float, order="C"):
    return _new(_poisoned(shape, dtype, order))


def zeros(shape, dtype=float, order="C"):
    return _work("memset", _new(np.zeros(shape, dtype, order=order)))


def _like(a, dtype, shape, fill=None):
    """A new array like `a`: its shape and, as CuPy's order='K', its memory layout."""
    if shape is None:
        array = np.empty_like(a._array if isinstance(a, ndarray) else a, dtype=dtype)
        array[...] = _poisoned(array.shape, array.dtype) if fill is None else fill
        result = _new(array)
    else:
        result = empty(shape, a.dtype if dtype is None else dtype)
        if fill is not None:
            result._array.fill(fill)
    return result if fill is None else _work("memset" if fill == 0 else "fill", result)


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    return _like(prototype, dtype, shape)


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return _like(a, dtype, shape, 0)


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return _like(a, dtype, shape, 1)


def arange(start, stop=None, step=1, dtype=None):
    return _work("arange", _new(np.arange(start, stop, step, dtype=dtype) if stop is not None
                                else np.arange(start, dtype=dtype)))


# ---- kernels ------------------------------------------------------------------------------------------
class RawModule:
    """cupy.RawModule compiled for the CPU emulator; its kernels take device arrays of the current device."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=None):
        self._module = emu.RawModule(code=code, path=path, options=options, backend=backend,
                                     translate_cucomplex=translate_cucomplex,
                                     enable_cooperative_groups=enable_cooperative_groups,
                                     name_expressions=name_expressions, jitify=bool(jitify))

    def get_function(self, name):
        return RawKernel(self._module.get_function(name))


class RawKernel:
    """A kernel of a RawModule: ``kernel(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __call__(self, grid, block, args, **kwargs):
        stream = kwargs.pop("stream", None) or cuda.get_current_stream()
        if stream.device() != cuda.getDevice():
            raise cuda.CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                        f"kernel '{self._kernel.name}' launched on stream {stream.ptr:#x} of device "
                                        f"{stream.device()} while device {cuda.getDevice()} is current")
        values, device = tuple(self._argument(i, a) for i, a in enumerate(args)), cuda.getDevice()

        def run():
            cuda.ledger["launches"][device] += 1
            self._kernel(grid, block, values, **kwargs)
        cuda.enqueue(stream, run)

    def _argument(self, index, value):
        """As CuPy's function.pyx passes it: a device array as its pointer, None as a null pointer, a
        host array of one element by value, a scalar by its dtype."""
        label = (self._kernel.parameters[index].label() if index < len(self._kernel.parameters)
                 else f"kernel '{self._kernel.name}' argument {index}")
        if isinstance(value, ndarray):
            return _operand(label, value)
        if isinstance(value, np.ndarray):
            if value.size != 1:
                raise TypeError(f"You are trying to pass a numpy.ndarray of shape {value.shape} as a kernel "
                                f"parameter. Only numpy.ndarrays of size one can be passed by value. If you meant "
                                f"to pass a pointer to __global__ memory, you need to pass a cupy.ndarray instead. "
                                f"({label})")
            return value.reshape(-1)[0]
        return value
