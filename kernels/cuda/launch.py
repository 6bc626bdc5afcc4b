"""What every launcher of the CUDA backend shares: argument checks, grid sizes, the typed
launch, and the fixed-order final pass over per-block partial sums.

The backend object ``be`` (kernels/cuda/__init__.py) gives the array module ``be.xp``
(CuPy, or NumPy under the emulator) and the compiled kernels ``be.function(family, name)``.
Nothing here synchronises with the device: sizes come from shapes, never from values.
"""
import ctypes
import functools

import numpy as np

from kernels import bfloat16

THREADS = 256            # threads per block of every 1-D kernel
ELEMENTWISE_BLOCKS = 4096  # grid-stride kernels: at most this many blocks, each loops
# Reductions over long axes are split into per-block partials. How many depends on the shapes
# alone, never on the device, so that the order of the additions, and hence the bits of the
# result, is the same on every run: enough blocks to fill a large GPU (132 SMs) a few times,
# but no split shorter than MIN_SPLIT_LENGTH elements.
TARGET_BLOCKS = 512
MIN_SPLIT_LENGTH = 4096
_INT_LIMIT = 2**31  # kernels take their sizes as int
# ... and index with int: a grid-stride loop's index reaches the last element plus one stride of
# ELEMENTWISE_BLOCKS * THREADS, which must still fit
ELEMENT_LIMIT = _INT_LIMIT - ELEMENTWISE_BLOCKS * THREADS   # an array's elements at most (a run's configuration
                                                            # is checked against it too)

C_TYPES = {np.dtype(np.uint8): "unsigned char", np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
# The storage of activations and their gradients (kernels.storage_dtype()): the C type a kernel's
# template takes for each (bf16.cuh's bf16 for NumPy's bfloat16).
STORAGE_TYPES = {np.dtype(np.float32): "float", bfloat16: "bf16"}


def cdiv(a, b):
    return -(-a // b)


def blocks(count, limit=ELEMENTWISE_BLOCKS):
    """1-D grid for `count` threads' worth of work at THREADS per block, capped at `limit`
    blocks (the kernel loops over the rest)."""
    return (max(1, min(cdiv(count, THREADS), limit)),)


def split(length, parallel, multiple=1):
    """(splits, chunk) for reducing `length` elements in each of `parallel` independent
    reductions: chunk is a multiple of `multiple`, splits * chunk >= length."""
    splits = max(1, min(cdiv(TARGET_BLOCKS, max(parallel, 1)), length // MIN_SPLIT_LENGTH))
    chunk = cdiv(cdiv(max(length, 1), splits), multiple) * multiple
    return cdiv(max(length, 1), chunk), chunk


def float32(be, op, *arrays):
    """The arrays (None passes through) as C-contiguous float32 arrays of the backend's array
    module; TypeError for another dtype or array type, since the CUDA kernels are float32."""
    return tuple(None if a is None else typed(be, op, a, np.float32) for a in arrays)


# ---- layouts: NCHW, or channels-last (an NCHW view of NHWC memory, as PyTorch's channels_last) --

def device_property(be, name):
    """Property `name` of the current GPU (CUDA's cudaDeviceProp, as CuPy's getDeviceProperties names it), read once a
    device (and compute capability: a simulated GPU's may change); None on the emulator's own backend, which has no
    GPU."""
    if be.xp is np:
        return None
    device = be.xp.cuda.Device()
    return _device_properties(be.xp, device.id, device.compute_capability).get(name)


@functools.lru_cache(maxsize=None)
def _device_properties(xp, device, capability):
    return xp.cuda.runtime.getDeviceProperties(device)


def is_channels_last(a):
    """Whether a 4-D array is an NCHW view of dense NHWC memory and not C-contiguous too (with one
    channel, or one pixel, the two layouts are the same memory)."""
    if a.ndim != 4 or a.flags.c_contiguous:
        return False
    (n, c, h, w), (sn, sc, sh, sw), item = a.shape, a.strides, a.itemsize
    return (n == 1 or sn == h * w * c * item) and (c == 1 or sc == item) and (h == 1 or sh == w * c * item) and \
        (w == 1 or sw == c * item)


def to_channels_last(be, a):
    """A channels-last copy of a 4-D array, or the array when it is one already."""
    if is_channels_last(a):
        return a
    return be.xp.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def dense(be, op, a):
    """An activation or its gradient, float32 or bfloat16 (STORAGE_TYPES), as it is when its memory is
    dense (C-contiguous or channels-last), else a C-contiguous copy; TypeError for another dtype."""
    if a is None:
        return None
    dtype = a.dtype if getattr(a, "dtype", None) in STORAGE_TYPES else np.float32
    if isinstance(a, be.xp.ndarray) and a.dtype == dtype and is_channels_last(a):
        _check_size(op, a)
        return a
    return typed(be, op, a, dtype)


def storage(op, *arrays):
    """The C type (STORAGE_TYPES) of arrays that share one storage dtype, for a kernel's template;
    TypeError when they differ."""
    dtypes = {a.dtype for a in arrays if a is not None}
    if len(dtypes) != 1:
        raise TypeError(f"{op}: takes activations of one dtype, float32 or bfloat16, got "
                        f"{', '.join(sorted(map(str, dtypes)))}")
    return STORAGE_TYPES[dtypes.pop()]


def like(be, op, reference, *arrays):
    """The activations (dense()) in the memory layout of `reference` (a dense array), copied if need be."""
    out = []
    for a in arrays:
        a = dense(be, op, a)
        if a is not None and is_channels_last(reference) != is_channels_last(a):
            a = to_channels_last(be, a) if is_channels_last(reference) else be.xp.ascontiguousarray(a)
        out.append(a)
    return tuple(out)


def memory(a):
    """The C-contiguous view of a dense array's memory, what a kernel's pointer walks: the array
    itself, or the NHWC view of a channels-last one (launch() passes every array so)."""
    return a.transpose(0, 2, 3, 1) if is_channels_last(a) else a


def aligned(a, alignment=16):
    """`a` (C-contiguous) when its first element's address is a multiple of `alignment` bytes, else
    an aligned copy: a view at an odd offset (a parameter of a flat buffer, say) cannot feed 16-byte
    copies. Allocations of CuPy (256 bytes), of the simulated GPUs and of NumPy (16) are aligned."""
    return a if _address(a) % alignment == 0 else a.copy()


def _address(a):
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def storage_argument(t):
    """The last template argument of a kernel's name expression for storage type `t` (STORAGE_TYPES): none
    for float, the default of the kernels that were templates (on VEC) before bfloat16, whose float32
    instantiations keep their names; ", bf16" for bfloat16."""
    return "" if t == "float" else f", {t}"


def vector_width(total, *arrays):
    """4 when the element-wise kernels may move 4 values at a time (16-byte loads and stores of
    float32, 8-byte ones of bfloat16): the count a multiple of 4, every array (None aside) at an
    address that is a multiple of 4 of its elements, and the grid's last step still within an int;
    else 1. Checked, not assumed: a view into a flat buffer may start anywhere."""
    fits = total % 4 == 0 and total < ELEMENT_LIMIT - 3 * ELEMENTWISE_BLOCKS * THREADS
    return 4 if fits and all(a is None or _address(a) % (4 * a.itemsize) == 0 for a in arrays) else 1


def gradient_outputs(be, op, out, shapes):
    """The arrays a backward writes its parameters' gradients into (out= of conv2d_backward,
    linear_backward, batch_norm_backward): those of `out`, checked against `shapes` (float32,
    dense: C-contiguous, or a channels-last weight gradient; any may be None, for a new array),
    or all None when `out` is None."""
    if out is None:
        return (None,) * len(shapes)
    out = in_place(be, op, *out)
    for a, shape in zip(out, shapes):
        if a is not None and a.shape != tuple(shape):
            raise ValueError(f"{op}: gradient output of shape {a.shape} where {tuple(shape)} is due")
    return out


def integers(be, op, a):
    """An integer array (labels) as a C-contiguous array of a dtype the kernels are built for."""
    if not isinstance(a, be.xp.ndarray) or a.dtype not in C_TYPES:
        raise TypeError(f"{op}: expects an integer array of {', '.join(map(str, C_TYPES))} on the "
                        f"{be.name} backend, got {_describe(a)}")
    return _contiguous(be, op, a)


def in_place(be, op, *arrays, dtype=np.float32):
    """Arrays that a kernel updates or writes in place: of `dtype` (float32 unless said) and dense
    already (C-contiguous, or channels-last, whose memory the kernel walks; a copy would leave the
    caller's array unchanged), or an error that says so."""
    for a in arrays:
        if a is None:
            continue
        if not isinstance(a, be.xp.ndarray) or a.dtype != dtype:
            raise _type_error(be, op, a, dtype)
        _check_size(op, a)
        if not (a.flags.c_contiguous or is_channels_last(a)):
            raise ValueError(f"{op}: updates its arguments in place and needs dense arrays (C-contiguous or "
                             f"channels-last), got strides {a.strides} for shape {a.shape}")
    return arrays


def typed(be, op, a, dtype):
    """`a` as a C-contiguous array of the backend's array module, or TypeError unless it has
    that `dtype`: the kernels take one dtype each and convert nothing."""
    if not isinstance(a, be.xp.ndarray) or a.dtype != dtype:
        raise _type_error(be, op, a, dtype)
    return _contiguous(be, op, a)


def _type_error(be, op, a, dtype):
    return TypeError(f"{op}: the {be.name} backend takes {np.dtype(dtype)} {be.xp.__name__} arrays here, got "
                     f"{_describe(a)}")


def _contiguous(be, op, a):
    _check_size(op, a)
    return a if a.flags.c_contiguous else be.xp.ascontiguousarray(a)


def _check_size(op, a):
    if a.size > ELEMENT_LIMIT:
        fits = f"; a batch of at most {ELEMENT_LIMIT // (a.size // a.shape[0])} fits" if a.ndim == 4 else ""
        raise ValueError(f"{op}: arrays of more than {ELEMENT_LIMIT} (2**31 - 2**20) elements are not supported "
                         f"(the kernels index with int), got shape {a.shape} of {a.size} elements{fits}")


def _describe(a):
    dtype = getattr(a, "dtype", None)
    return f"{type(a).__module__}.{type(a).__name__}" + (f" of {dtype}" if dtype is not None else "")


def tile_of(kernel):
    """The first template argument of a kernel's name expression (a tensor-core GEMM's tile): "Bf128x128" of
    "conv_bf16_forward<Bf128x128, 32>"; "" without one."""
    return kernel.partition("<")[2].split(",")[0].removesuffix(">").strip()


def launch(be, family, kernel, grid, args, block=(THREADS,), shared_mem=0):
    """Launch `kernel` of `family` with Python ints passed as int32 and Python floats as
    float32, which is what every kernel of the project declares; CuPy and the emulator would
    otherwise pass them as 64-bit values. Every array, the outputs the launchers made included,
    must have few enough elements for the kernels' int indices (_check_size). shared_mem: the
    bytes of dynamic shared memory a block gets (Backend.function allows the kernel as many)."""
    typed = tuple([_typed(a, kernel) for a in args])   # checked before the kernel is looked up (or compiled)
    if shared_mem:
        be.function(family, kernel, shared_mem)(grid, block, typed, shared_mem=shared_mem)
    else:
        be.function(family, kernel)(grid, block, typed)


_INT32 = {}   # the ints kernels were given (sizes, geometry: a few hundred), as int32 scalars


def _typed(arg, kernel="a kernel"):
    kind = type(arg)   # the common kinds first: this runs for every argument of every launch
    if kind is int:
        typed = _INT32.get(arg)
        if typed is None:
            if not -_INT_LIMIT <= arg < _INT_LIMIT:
                raise ValueError(f"kernel argument {arg} does not fit in an int")
            typed = np.int32(arg)
            if len(_INT32) < 65536:
                _INT32[arg] = typed
        return typed
    if kind is float:
        return np.float32(arg)
    if arg is None:
        return arg
    if isinstance(arg, (bool, np.bool_)):
        raise TypeError("kernels take int flags, not bool")
    if isinstance(arg, int):
        return _typed(int(arg))
    if getattr(arg, "size", 0) > ELEMENT_LIMIT:
        _check_size(kernel, arg)
    if getattr(arg, "ndim", 0) == 4 and not arg.flags.c_contiguous:
        # the launchers pass dense arrays (dense(), like()): this is a channels-last one, whose memory's
        # own view (memory()) the kernel gets the pointer of
        nhwc = arg.transpose(0, 2, 3, 1)
        if not nhwc.flags.c_contiguous:
            raise ValueError(f"kernels take dense arrays, got strides {arg.strides} for shape {arg.shape}")
        return nhwc
    return arg


def sum_partials(be, family, partial, splits, out, scale=1.0):
    """out (flat, `rows` elements) = scale * the sum over the leading axis of `partial`
    (splits, rows), added in split order by common.cuh's sum_partials compiled in `family`."""
    rows = out.size
    launch(be, family, "sum_partials", (cdiv(rows, THREADS),), (partial, splits, rows, float(scale), out))


# ---- tensor maps: what the tensor memory accelerator (TMA) of sm_90 copies (kernels/cuda/sm90.cuh) ------------

# cuda.h's CUtensorMapDataType of the arrays' dtypes, and CUtensorMapSwizzle of the swizzles (bytes)
_TENSOR_MAP_TYPES = {np.dtype(np.float32): 7, bfloat16: 9}
_SWIZZLES = {0: 0, 128: 3}
_L2_PROMOTION_128B = 2


def tensor_map(be, array, box, swizzle=128, nan_fill=False):
    """The tensor map of a device array (rank 2 to 5, float32 or bfloat16; C-contiguous, or a view whose innermost
    dimension is dense and whose other strides are positive multiples of 16 bytes) for a kernel's
    `const __grid_constant__ TensorMap` parameter (sm90.cuh): TMA copies boxes of `box` elements (in the array's
    axis order, outermost first) at a time, `swizzle` 128 (bytes: 16-byte chunk j of each 128-byte row at
    j ^ (row % 8)) or 0, the elements past the array zeros, or NaN with `nan_fill` (where a kernel applies a batch
    norm and relu to what lands: max(NaN * scale + shift, 0) is 0, the padding). On a GPU, the 128 bytes that the
    driver's cuTensorMapEncodeTiled writes, as a NumPy
    array of one element that CuPy passes by value; on the emulator (and the simulated GPUs), its own record of
    the same map (kernels.emu.TensorMap)."""
    if be.xp is np:
        from kernels import emu
        return emu.TensorMap(array, box, swizzle, nan_fill)
    simulated = getattr(be.xp, "tensor_map", None)
    if simulated is not None:
        return simulated(array, box, swizzle, nan_fill)
    return _encode_tiled(array, tuple(box), swizzle, nan_fill)


@functools.lru_cache(maxsize=None)
def _cu_tensor_map_encode_tiled():
    """The driver's cuTensorMapEncodeTiled (CUDA 12.0 and later), through ctypes: CuPy does not bind it."""
    function = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32, u64 = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    function.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64, u64, u32, u32,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def _encode_tiled(array, box, swizzle, nan_fill):
    from kernels.emu.tensor_map import byte_strides   # (the emulator's map: the same rules for the strides)
    strides = byte_strides(array)
    if array.dtype not in _TENSOR_MAP_TYPES or not 2 <= array.ndim <= 5 or len(box) != array.ndim or \
            swizzle not in _SWIZZLES or strides[-1] != array.dtype.itemsize or \
            any(stride <= 0 or stride % 16 for stride in strides[:-1]):
        raise ValueError(f"tensor_map: takes a float32 or bfloat16 array of rank 2 to 5 whose innermost dimension is "
                         f"dense and other strides positive multiples of 16 bytes, a box of its rank and a swizzle "
                         f"of 0 or 128 bytes, got {array.dtype} {array.shape} of strides {array.strides}, box {box}, "
                         f"swizzle {swizzle}")
    rank = array.ndim
    # cuda.h's order: innermost first; the strides of all but the innermost dimension, in bytes
    dims = (ctypes.c_uint64 * rank)(*reversed(array.shape))
    strides = (ctypes.c_uint64 * (rank - 1))(*reversed(strides[:-1]))
    boxes = (ctypes.c_uint32 * rank)(*reversed(box))
    element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
    # CUtensorMap is 64-byte aligned: written into an aligned place of a larger buffer, passed as a view of it
    buffer = np.zeros(128 + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    encoded = buffer[start:start + 128]
    status = _cu_tensor_map_encode_tiled()(encoded.ctypes.data, _TENSOR_MAP_TYPES[array.dtype], rank,
                                           array.data.ptr, dims, strides, boxes, element_strides, 0,
                                           _SWIZZLES[swizzle], _L2_PROMOTION_128B, int(nan_fill))
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the map of a {array.dtype} array of shape "
                           f"{array.shape} with box {box} and swizzle {swizzle}: CUresult {status}")
    encoded = encoded.view(np.dtype((np.void, 128))).view(_TensorMapBytes)
    encoded.tensor = array   # what the map points at lives as long as it (a CUDA graph keeps its kernels' arguments)
    return encoded


class _TensorMapBytes(np.ndarray):
    """A tensor map's 128 bytes (one element, which CuPy passes to a kernel by value), holding on to its tensor."""
