"""emu.TensorMap: a tensor map (CUDA's CUtensorMap, what cuTensorMapEncodeTiled makes on the host) for the
kernels of kernels/cuda/sm90.cuh on the emulator.

``TensorMap(array, box, swizzle=128, nan_fill=False)`` describes a tiled view of ``array`` (a NumPy array of rank 1
to 5, the tensor in global memory, its innermost dimension dense: C-contiguous, or a view such as every other row and
column of an image, conv_sm90's strided convolutions) whose TMA loads bring ``box`` (in NumPy's axis order, outermost
first) into shared memory, 128-byte swizzled or not (``swizzle`` 128 or 0), the elements past the tensor zeros, or NaN
with ``nan_fill`` (a float tensor's: CUDA's CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA). The map's dimensions
are the array's shape reversed (innermost first, CUDA's order), its strides the array's, in bytes. It refuses what
cuTensorMapEncodeTiled refuses (CUDA_ERROR_INVALID_VALUE), each with its reason: a rank outside 1..5, box dimensions
outside 1..256, an innermost box of bytes not a multiple of 16 (or, with the 128-byte swizzle, more than 128),
strides not multiples of 16 bytes (or not below 2**40), dimensions above 2**32, an address not 16-byte aligned, a NaN
fill of a tensor that is not of floats; and what the emulator does not model (the 32- and 64-byte swizzles,
interleaved layouts, element strides).

Passed as the argument of a kernel's ``const __grid_constant__ TensorMap`` parameter (a 128-byte struct by value),
the launch copies ``array`` (the bytes it spans) as it copies a read-only array argument (guarded by canaries; a
write to it is an error) and passes the 128 bytes of the emulator's record of the map (emu_abi.h's EmuTensorMap: the
copy's address, rank, dimensions, strides, box, element size, swizzle), which the kernel's TMA loads read.
"""
import struct

import numpy as np

from .errors import LaunchError

MAX_RANK = 5
MAX_BOX = 256
SWIZZLES = (0, 128)
MAGIC = 0x3170614D54756D45   # "EmuTMap1" (emu_abi.h's kEmuTensorMapMagic)
# magic, address, rank, element bytes, swizzle, NaN fill, dims[5], strides[5], box[5], padding
_RECORD = struct.Struct("<QQIIII5Q5Q5H6x")
assert _RECORD.size == 128


def byte_strides(array):
    """A tensor map's strides of `array`, in bytes, NumPy's axis order: the array's, but for a dimension of one
    element, whose stride NumPy leaves arbitrary and no load steps along, that of the dimension inside it times its
    extent (the innermost's: the element's size)."""
    strides = list(array.strides)
    for axis in reversed(range(array.ndim)):
        if array.shape[axis] == 1:
            strides[axis] = array.dtype.itemsize if axis == array.ndim - 1 else \
                strides[axis + 1] * array.shape[axis + 1]
    return tuple(strides)


def _element_fits(dtype):
    """Whether CUDA has a tensor map data type of this dtype's size and kind (integers, floats, bfloat16 and
    the 8-bit floats of ml_dtypes)."""
    if dtype.kind in "iuf":
        return dtype.itemsize in (1, 2, 4, 8)
    return dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")


class TensorMap:
    """A tensor map of ``array`` whose TMA loads bring ``box`` (NumPy axis order) into shared memory, swizzled by
    ``swizzle`` bytes (128, or 0 for none): see the module's docstring."""

    def __init__(self, array, box, swizzle=128, nan_fill=False):
        if not isinstance(array, np.ndarray):
            raise LaunchError(f"emu.TensorMap: the tensor must be a NumPy array, not {type(array).__name__}")
        if not 1 <= array.ndim <= MAX_RANK:
            raise LaunchError(f"emu.TensorMap: a tensor of rank {array.ndim}; a tensor map's rank is 1 to {MAX_RANK}")
        if array.size == 0:
            raise LaunchError(f"emu.TensorMap: the array of shape {array.shape} is empty; a tensor map's dimensions "
                              "are at least 1")
        strides = byte_strides(array)
        if strides[-1] != array.dtype.itemsize or any(stride <= 0 for stride in strides[:-1]):
            raise LaunchError(f"emu.TensorMap: the array of shape {array.shape} and strides {array.strides}: a tensor "
                              "map's innermost dimension is dense (a stride of one element) and its other strides "
                              "positive")
        if not _element_fits(array.dtype):
            raise LaunchError(f"emu.TensorMap: no tensor map data type holds {array.dtype}")
        try:
            box = tuple(int(b) for b in box)
        except TypeError:
            raise LaunchError(f"emu.TensorMap: box {box!r} is not a sequence of integers") from None
        if len(box) != array.ndim:
            raise LaunchError(f"emu.TensorMap: box {box} has {len(box)} dimensions, the tensor {array.ndim} "
                              f"(shape {array.shape})")
        if any(not 1 <= b <= MAX_BOX for b in box):
            raise LaunchError(f"emu.TensorMap: box {box}: each box dimension is 1 to {MAX_BOX}")
        if swizzle not in SWIZZLES:
            hint = (" (CUDA's 32- and 64-byte swizzles are not emulated)" if swizzle in (32, 64) else "")
            raise LaunchError(f"emu.TensorMap: swizzle {swizzle!r}: 0 (none) or 128 (bytes){hint}")
        itemsize = array.dtype.itemsize
        inner = box[-1] * itemsize
        if inner % 16:
            raise LaunchError(f"emu.TensorMap: the innermost box dimension, {box[-1]} elements of {itemsize} bytes, "
                              f"is {inner} bytes: a multiple of 16 is needed")
        if swizzle == 128 and inner > 128:
            raise LaunchError(f"emu.TensorMap: the innermost box dimension is {inner} bytes: the 128-byte swizzle "
                              "takes at most 128")
        if any(n > 2**32 for n in array.shape):
            raise LaunchError(f"emu.TensorMap: shape {array.shape}: a tensor map's dimensions are at most 2**32")
        for axis, stride in enumerate(strides[:-1]):
            if stride % 16 or stride >= 2**40:
                raise LaunchError(f"emu.TensorMap: the stride of axis {axis} (shape {array.shape}, {array.dtype}) is "
                                  f"{stride} bytes: a tensor map's strides are multiples of 16 below 2**40")
        address = array.__array_interface__["data"][0]
        if address % 16:
            raise LaunchError(f"emu.TensorMap: the array's address is not a multiple of 16 bytes (it is "
                              f"{address % 16} past one)")
        if nan_fill and array.dtype.name not in ("float32", "float16", "bfloat16"):
            raise LaunchError(f"emu.TensorMap: nan_fill for {array.dtype}: NaN fills elements of float32, float16 or "
                              "bfloat16 tensors only")
        self.array, self.box, self.swizzle, self.nan_fill = array, box, swizzle, bool(nan_fill)

    @property
    def dims(self):
        """The map's dimensions, innermost first (CUDA's order)."""
        return tuple(reversed(self.array.shape))

    def span(self):
        """The bytes the map reaches, from its first element to the end of its last, as a 1-D uint8 view of the
        array's memory (a strided view's gaps included): what the launch copies for the kernel."""
        reach = self.array.dtype.itemsize + sum((n - 1) * s for n, s in zip(self.array.shape, self.array.strides))
        return np.lib.stride_tricks.as_strided(self.array.view(np.uint8), shape=(reach,), strides=(1,),
                                               writeable=False)

    def record(self, address):
        """The 128 bytes of the emulator's record of the map, its tensor at ``address`` (the launch's copy)."""
        rank, itemsize = self.array.ndim, self.array.dtype.itemsize
        pad = (0,) * (MAX_RANK - rank)
        dims = self.dims + (1,) * (MAX_RANK - rank)
        strides = tuple(reversed(byte_strides(self.array))) + pad
        box = tuple(reversed(self.box)) + (1,) * (MAX_RANK - rank)
        return _RECORD.pack(MAGIC, address, rank, itemsize, self.swizzle, int(self.nan_fill), *dims, *strides, *box)

    def __repr__(self):
        return (f"emu.TensorMap(array of shape {self.array.shape} {self.array.dtype}, box={self.box}, "
                f"swizzle={self.swizzle})")
