"""Arrays of the simulated GPUs: CuPy's ``ndarray``, its creation functions and ``RawModule``.

An array is a typed view of device memory (raw bytes in host memory, registered with timeline.py)
and the device it lives on: the current device when it was made, as with CuPy; views share both.
What runs a kernel on a GPU (an element-wise operation, a reduction, a gather, a copy, a
``RawModule`` launch) is queued on the current stream as one piece of work that names what it
reads and writes (cuda.enqueue): it runs at once, its accesses checked against the other streams',
or, in a stream capture, it is recorded for the graph's replays (an operation that makes a new
array then gets the array now, NaN until a replay computes it). It takes its arrays from the
current device only, and a host NumPy array where a device array is needed is refused, as CuPy
refuses it: the simulated machine has no peer access, so an array of another device is an error
naming the call, not a slow success. As CuPy's, a copy of host memory (``asarray``) is in C order
(Fortran order where the host array is only that) and a copy to the host (``get``, ``asnumpy``) in the
order asked, C by default, whatever the strides of the array copied. A copy to the host (``get``,
``asnumpy``, ``float()``, ``item()``, ...) waits for its stream, and is refused during a capture.
``RawModule`` is the CPU emulator's (kernels/emu); ``empty`` fills new memory with NaN (integers:
their minimum), so that an element a kernel forgets to write shows.
"""
import math
import os

import numpy as np

from .. import emu
from . import cuda, timeline

__version__ = "14.2.0"  # the CuPy whose behaviour this simulates


def _device_error(call, device):
    return ValueError(f"The device where the array resides ({device}) is different from the current device "
                      f"({cuda.getDevice()}). Peer access is unavailable between these devices. "
                      f"(simulated GPUs: {call})")


def _host_error(call, value):
    return TypeError(f"Unsupported type {type(value)} (simulated GPUs: {call} takes device arrays; a host "
                     f"NumPy array must be copied with cupy.asarray first)")


def _operand(call, value):
    """The NumPy view of a device array on the current device, or a scalar; an error otherwise."""
    if isinstance(value, ndarray):
        if value._device != cuda.getDevice():
            raise _device_error(call, value._device)
        return value._array
    if isinstance(value, np.ndarray):
        raise _host_error(call, value)
    return value


def _poison(array):
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        array.fill(np.nan)
    elif array.dtype.kind in "iu":
        array.fill(np.iinfo(array.dtype).min)
    return array


def _allocate(shape, dtype, like=None, order="C"):
    """New device memory on the current device, poisoned, as an array of ``shape`` and ``dtype``
    in the memory layout of ``like`` (a NumPy array that owns its memory, so that its strides are a
    permutation of a dense layout), or of ``order``; it belongs to the pool of using_allocator, if any."""
    device, dtype = cuda.getDevice(), np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    cuda.ledger["allocations"][device] += 1
    if like is not None and like.flags.owndata and all(s >= 0 for s in like.strides):
        strides = like.strides
    else:
        strides = None if order == "C" else np.empty(shape, dtype, order=order).strides
    raw = np.empty(max(math.prod(shape) * dtype.itemsize, 1), np.uint8)
    array = np.ndarray(shape, dtype, buffer=raw, strides=strides)
    pool = cuda.current_pool()
    if pool is not None:
        pool._blocks.append(raw)
    timeline.register(raw, device, cuda.get_current_stream().key(), array.shape, dtype, pooled=pool is not None)
    return ndarray._wrap(_poison(array), device)


def _new(values):
    """A device array of new memory on the current device holding ``values`` (a NumPy array, or
    what np.asarray takes), in its layout; no work is queued: the caller queues what writes it."""
    values = np.asarray(values)
    out = _allocate(values.shape, values.dtype, like=values)
    out._array[...] = values
    return out


def _count(name, written):
    """Count one array operation (a kernel, memset or copy on a GPU) that writes ``written`` (an array),
    for bench/launches.py."""
    cuda.ledger["operations"][name] += 1
    cuda.ledger["operation_bytes"][name] += written.nbytes
    return written


def _queue(name, function, inputs, out=None, order="K"):
    """``function(*inputs)`` as one operation on the current stream, its value written into ``out``
    (a device array) or into a new array of its shape and dtype (in ``order``); returns the array.
    The device arrays among ``inputs`` are read (those of another device refused, unless the
    operation is a ``copy``, which CuPy makes between devices as an asynchronous copy on the
    current stream, ordered after nothing of the other device's streams); other inputs pass as they
    are."""
    stream = cuda.get_current_stream()
    slots = [i for i, v in enumerate(inputs) if isinstance(v, ndarray)]
    arrays = [v._array if name == "copy" and isinstance(v, ndarray) else _operand(f"cupy {name}", v) for v in inputs]
    template = [None if i in slots else v for i, v in enumerate(arrays)]

    def value(views):
        filled = list(template)
        for i, view in zip(slots, views):
            filled[i] = view
        return function(*filled)

    capturing = stream._capture is not None
    if out is None:
        if capturing:   # the shape, dtype and layout of what a replay will write; the values are not computed yet
            shaped = np.array(function(*arrays), order=order)
            out = _allocate(shaped.shape, shaped.dtype, like=shaped)
        else:
            out = _new(np.array(function(*arrays), order=order))
        fresh = not capturing   # already holds the value: the work only accesses it
    else:
        _operand(f"cupy {name}", out)
        fresh = False

    def run(views):
        views[-1][...] = value(views[:-1])
    operands = [(timeline.Span(arrays[i]), False, f"operand {i}") for i in slots]
    operands.append((timeline.Span(out._array), True, "its output"))
    cuda.enqueue(stream, timeline.Work(f"the array operation '{name}'", operands, None if fresh else run))
    return _count(name, out)


_SLOT = object()   # where an operand is an array: its view, when the work runs


class _MapSlot:
    """Where an operand is a tensor map: the map of the view of its array when the work runs (a captured launch
    holds no array)."""

    def __init__(self, box, swizzle):
        self.box, self.swizzle = box, swizzle

    def map(self, view):
        return emu.TensorMap(view, self.box, self.swizzle)


def sanitize_level():
    """The emulator's sanitizer for the kernels of whole networks that the simulated GPUs run: memcheck
    (bounds, alignment, divergent barriers), unless CUDA_EMU_SANITIZE says otherwise; each kernel's
    own tests run every check (kernels/emu/README.md)."""
    return os.environ.get("CUDA_EMU_SANITIZE") or "memcheck"


def _scalar(value):
    """A fill value: a Python scalar, or the value of a 0-d array (read on the host)."""
    return value._to_host("ndarray.fill")[()] if isinstance(value, ndarray) else value


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
        """``result`` of a NumPy shape operation on this array: a view of its memory stays on its device;
        a copy (reshaping a non-contiguous array) is an operation on the current device."""
        if np.may_share_memory(result, self._array):
            return ndarray._wrap(result, self._device)
        shape = result.shape
        return _queue(call, lambda a: a.reshape(shape), [self], order="C")

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
        if self._pointer is None:   # an array's memory never moves
            self._pointer = MemoryPointer(self)
        return self._pointer
    T = property(lambda self: self.transpose())

    # ---- to the host ----------------------------------------------------------------------------
    def _to_host(self, call, stream=None, out=None, blocking=True):
        """A copy of the array in host memory (into ``out``), made on ``stream`` (the current one; as
        CuPy, on the array's device: the null stream is then that device's) after the work queued
        there; the host waits for it unless ``blocking`` is false."""
        stream = cuda.get_current_stream() if stream is None else stream
        cuda.refuse_during_capture(f"{call} (a copy to the host)", stream)
        host = np.empty(self.shape, self.dtype) if out is None else out

        def run(views):
            host[...] = views[0]
        with cuda.Device(self._device):
            cuda.enqueue(stream, timeline.Work(f"{call} (a copy to the host)",
                                               [(timeline.Span(self._array), False, "the array")], run))
            if blocking:
                stream.synchronize()
        _count("copy to the host", self)
        return host

    def get(self, stream=None, order="C", out=None, blocking=True):
        """As CuPy's: a new host array in ``order`` (C, F, or A: F for a Fortran-contiguous array, else C),
        whatever the device array's layout; or ``out``, which must match its dtype and shape, and be C- or
        F-contiguous."""
        if out is None:
            order = order.upper()
            if order == "A":
                order = "F" if self.flags.f_contiguous else "C"
            if order not in ("C", "F"):
                raise ValueError(f"unsupported order: {order}")
        elif not isinstance(out, np.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")   # sic, CuPy's message
        elif out.dtype != self.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        elif out.shape != self.shape:
            raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
        elif not (out.flags.c_contiguous or out.flags.f_contiguous):
            raise RuntimeError("`out` cannot be specified when copying to non-contiguous ndarray")
        host = self._to_host("ndarray.get", stream, out, blocking)
        return host if out is not None else np.array(host, order=order)

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def item(self):
        return self._to_host("ndarray.item").item()

    def tolist(self):
        return self._to_host("ndarray.tolist").tolist()

    def __float__(self):
        return float(self._to_host("float(ndarray)"))

    def __int__(self):
        return int(self._to_host("int(ndarray)"))

    def __bool__(self):
        return bool(self._to_host("bool(ndarray)"))

    def __len__(self):
        return len(self._array)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"array({np.array2string(self._to_host('repr(ndarray)'), separator=', ')}, device={self._device})"

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
        return _queue("copy", lambda a: a, [self], order=order)   # any device to the current one, as CuPy

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _queue("astype", lambda a: a.astype(dtype), [self], order=order)

    def fill(self, value):
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        if isinstance(value, ndarray) and value.shape != ():
            raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
        value = _scalar(value)
        memset = value == 0 and self.flags.c_contiguous  # CuPy's memset needs no kernel
        _queue("memset" if memset else "fill", lambda: value, [], out=self)

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
        template = _template(keys)
        return _queue("gather", lambda a, *i: a[_keys(template, i)], [self, *_indices(keys)])

    def __setitem__(self, slices, value):
        keys = slices if isinstance(slices, tuple) else (slices,)
        if isinstance(value, ndarray) and not _gathers(keys):
            target = self[slices]
            if value.shape == target.shape and value.dtype == target.dtype and value.flags.c_contiguous \
                    and target.flags.c_contiguous:
                _queue("copy", lambda v: v, [value], out=target)   # a plain copy, from any device, as CuPy's memcpy
                return
        if isinstance(value, np.ndarray) and value.shape != ():
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        device_value = isinstance(value, ndarray)
        inputs, fill = ([value], None) if device_value else ([], value)   # a closure holds no array
        if not _gathers(keys):
            _queue("setitem", (lambda v: v) if device_value else (lambda: fill), inputs, out=self[slices])
            return
        indices, template = _indices(keys), _template(keys)

        def scatter(target, *views):   # target[keys] = value, on the views of target, indices and value
            done = target.copy()
            done[_keys(template, views[:len(indices)])] = views[-1] if device_value else fill
            return done
        _queue("scatter", scatter, [self, *indices, *inputs], out=self)

    # ---- NumPy's ufuncs and Python's operators ----------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            return NotImplemented
        out = kwargs.pop("out", None)
        return _queue(ufunc.__name__, lambda *v: ufunc(*v, **kwargs), list(inputs),
                      out=None if out is None else out[0])


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


def _indices(keys):
    """The index arrays among ``keys``, as device arrays (a host one is copied to the device first)."""
    return [k if isinstance(k, ndarray) else asarray(k) for k in keys if isinstance(k, (ndarray, np.ndarray))]


def _template(keys):
    """``keys`` with each index array replaced by a placeholder (a recorded operation holds no array)."""
    return tuple(_SLOT if isinstance(k, (ndarray, np.ndarray)) else k for k in keys)


def _keys(template, views):
    """The keys of ``template`` with its placeholders replaced, in order, by ``views``."""
    views = iter(views)
    return tuple(next(views) if k is _SLOT else k for k in template)


def _reduce(function, a, axis, out, keepdims, **kwargs):
    return _queue(function.__name__, lambda v: function(v, axis=axis, keepdims=keepdims, **kwargs), [a], out=out)


class MemoryPointer:
    """cupy.cuda.MemoryPointer: the address of an array's first element and its device."""

    def __init__(self, array):
        self.ptr = array._array.__array_interface__["data"][0]
        self.device_id = array._device


def memory_at(pointer, nbytes, call):
    """(device, uint8 NumPy view) of the ``nbytes`` at ``pointer`` in one device array."""
    found = timeline.allocation_at(pointer, nbytes)
    if found is None:
        raise cuda.CUDARuntimeError("cudaErrorIllegalAddress", f"{call}: {nbytes} bytes at {pointer:#x} do not lie "
                                                               f"in one device array")
    allocation, offset = found
    return allocation.device, allocation.raw()[offset:offset + nbytes]


# ---- creation ---------------------------------------------------------------------------------------
def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if isinstance(a, ndarray):
        if a._device != cuda.getDevice():  # CuPy copies an array of another device to the current one
            return _queue("copy", lambda v: np.asarray(v, dtype=dtype), [a], order=order or "K")
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    cuda.refuse_during_capture("cupy.asarray of host memory (a copy from the host)", cuda.get_current_stream())
    order = (order or "K").upper()
    if order in ("K", "A"):   # as CuPy copies host memory: in Fortran order if it is only that, else in C order
        order = "F" if isinstance(a, np.ndarray) and a.flags.fnc else "C"
    values = np.array(a, dtype=dtype, order=order)
    return _queue("copy from the host", lambda: values, [])


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """A device array's ``get``; anything else through NumPy, as CuPy's."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    values = np.asarray(a, order=order)
    if out is None:
        return values
    out[...] = values
    return out


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise _host_error("cupy.ascontiguousarray", a)
    if a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return _queue("ascontiguousarray", lambda v: np.ascontiguousarray(v, dtype=dtype), [a])


def empty(shape, dtype=float, order="C"):
    return _allocate(shape, dtype, order=order)


def zeros(shape, dtype=float, order="C"):
    out = _allocate(shape, dtype, order=order)
    _queue("memset", lambda: 0, [], out=out)
    return out


def ones(shape, dtype=float, order="C"):
    out = _allocate(shape, dtype, order=order)
    _queue("fill", lambda: 1, [], out=out)
    return out


def _like(a, dtype, shape, fill=None):
    """A new array like ``a``: its shape and, as CuPy's order='K', its memory layout."""
    source = a._array if isinstance(a, ndarray) else np.asarray(a)
    dtype = source.dtype if dtype is None else dtype
    result = _allocate(shape, dtype) if shape is not None else \
        _allocate(source.shape, dtype, like=np.empty_like(source, dtype=dtype))
    if fill is not None:
        _queue("memset" if fill == 0 else "fill", lambda: fill, [], out=result)
    return result


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    return _like(prototype, dtype, shape)


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return _like(a, dtype, shape, 0)


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return _like(a, dtype, shape, 1)


def arange(start, stop=None, step=1, dtype=None):
    values = np.arange(start, stop, step, dtype=dtype) if stop is not None else np.arange(start, dtype=dtype)
    return _queue("arange", lambda: values, [])


# ---- kernels ------------------------------------------------------------------------------------------
class TensorMap(emu.TensorMap):
    """A tensor map of a device array (``tensor_map``): the emulator's, made on the array's memory, and the
    device array it describes, which a kernel that takes the map reads."""

    def __init__(self, array, box, swizzle=128, nan_fill=False):
        if not isinstance(array, ndarray):
            raise _host_error("tensor_map", array)
        super().__init__(array._array, box, swizzle, nan_fill)
        self.device_array = array


def tensor_map(array, box, swizzle=128, nan_fill=False):
    """The tensor map (sm90.cuh's TensorMap, what cuTensorMapEncodeTiled makes on a GPU) of a device array of the
    current device whose TMA loads bring ``box`` (NumPy's axis order) into shared memory, 128-byte swizzled or not
    (``swizzle`` 0), the elements past the array NaN with ``nan_fill`` (else zeros): the argument of a kernel's
    ``const __grid_constant__ TensorMap`` parameter, which reads the
    array (kernels/emu's ``TensorMap``; not CuPy's: a launcher on a GPU encodes the map through the driver)."""
    _operand("tensor_map", array)
    return TensorMap(array, box, swizzle, nan_fill)


class RawModule:
    """cupy.RawModule compiled for the CPU emulator; its kernels take device arrays of the current device."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=None):
        capability = cuda.compute_capability()   # CuPy compiles for the current GPU's architecture: below 8.0
        if capability < (8, 0):                   # the emulator is told (tensor_core.cuh)
            options = (*options, f"-DEMU_COMPUTE_CAPABILITY={10 * capability[0] + capability[1]}")
        self._module = emu.RawModule(code=code, path=path, options=options, backend=backend,
                                     translate_cucomplex=translate_cucomplex,
                                     enable_cooperative_groups=enable_cooperative_groups,
                                     name_expressions=name_expressions, jitify=bool(jitify))
        self._dynamic_shared = {}   # (kernel, device): the max_dynamic_shared_size_bytes set there

    def compile(self, log_stream=None):
        self._module.compile(log_stream)

    def get_function(self, name):
        return RawKernel(self._module.get_function(name), self._dynamic_shared)


class RawKernel:
    """A kernel of a RawModule: ``kernel(grid, block, args, shared_mem=0, stream=None)``. Its pointer
    arguments are what it reads (those to const) and may write (the others). max_dynamic_shared_size_bytes is,
    as in CUDA, an attribute of the kernel on each device apart (the module's function there): a launch that
    asks for more dynamic shared memory than the current device allows it fails, as cuLaunchKernel does."""

    def __init__(self, kernel, dynamic_shared):
        self._kernel, self._dynamic_shared = kernel, dynamic_shared

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._dynamic_shared.get((self._kernel.name, cuda.getDevice()),
                                        emu.SHARED_BYTES_WITHOUT_OPT_IN - self._kernel.shared_size_bytes)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        # the emulator's function, one for every device, checks the value and allows the most any device does
        self._kernel.max_dynamic_shared_size_bytes = max(int(value), self._kernel.max_dynamic_shared_size_bytes)
        self._dynamic_shared[(self._kernel.name, cuda.getDevice())] = int(value)

    def __call__(self, grid, block, args, **kwargs):
        stream = kwargs.pop("stream", None) or cuda.get_current_stream()
        if stream.device() != cuda.getDevice():
            raise cuda.CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                        f"kernel '{self._kernel.name}' launched on stream {stream.ptr:#x} of device "
                                        f"{stream.device()} while device {cuda.getDevice()} is current")
        if kwargs.get("shared_mem") and kwargs["shared_mem"] > self.max_dynamic_shared_size_bytes:
            raise cuda.CUDARuntimeError("cudaErrorInvalidValue",
                                        f"kernel '{self._kernel.name}' launched with shared_mem={kwargs['shared_mem']} "
                                        f"bytes of dynamic shared memory on device {cuda.getDevice()}, where its "
                                        f"max_dynamic_shared_size_bytes is {self.max_dynamic_shared_size_bytes} (an "
                                        "attribute of the kernel on each device: set it on every device that runs it)")
        kernel, device, parameters = self._kernel, cuda.getDevice(), self._kernel.parameters
        template, operands = [], []
        for index, value in enumerate(args):
            if isinstance(value, emu.TensorMap):   # read by the kernel's TMA loads: the array its operand
                label = (parameters[index].label() if index < len(parameters)
                         else f"kernel '{kernel.name}' argument {index}")
                if not isinstance(value, TensorMap):
                    raise TypeError(f"{label}: an emu.TensorMap of a host array; on the simulated GPUs a tensor map "
                                    "describes a device array: cupy.tensor_map(array, box, swizzle)")
                view = _operand(label, value.device_array)
                what = f"the tensor of {parameters[index].name()}" if index < len(parameters) else label
                operands.append((timeline.Span(view), False, what))
                template.append(_MapSlot(value.box, value.swizzle))
                continue
            converted = self._argument(index, value)
            if isinstance(value, ndarray):
                parameter = parameters[index] if index < len(parameters) else None
                writes = parameter is None or not parameter.spec["const"]
                what = parameter.name() if parameter is not None else f"argument {index}"
                operands.append((timeline.Span(converted), writes, what))
                template.append(_SLOT)
            else:
                template.append(converted)

        def run(views):
            views = iter(views)
            values = tuple(next(views) if v is _SLOT else v.map(next(views)) if isinstance(v, _MapSlot) else v
                           for v in template)
            cuda.ledger["launches"][device] += 1
            with emu.sanitizer(sanitize_level()):
                kernel(grid, block, values, **kwargs)
        cuda.enqueue(stream, timeline.Work(f"kernel '{kernel.name}'", operands, run))

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
