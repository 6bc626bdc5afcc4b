"""Kernel arguments: CuPy's conversion of Python values, the check against the kernel's
declared parameters, and the guarded copies of the arrays that the kernel works on.

CuPy's rules, as of CuPy 14.2, the oldest the project accepts (kernels.MINIMUM_CUPY;
cupy/cuda/function.pyx, cupy/_core/_scalar.pyx): None is a null pointer (13.x passed garbage); a
device array is its data pointer (here a NumPy array stands for the device array); a NumPy
scalar goes by its dtype; a Python bool as bool, a float as double (8 bytes), an int as int64
(uint64 from 2**63). A GPU reads each parameter's declared size from what it was given, so
an int64 holding a small value works for an ``int`` parameter, but a double for a ``float``
parameter is garbage: this module accepts the first when the value fits and refuses the second.
"""
import ctypes
from dataclasses import dataclass

import numpy as np

from .errors import LaunchError
from .native import runtime

# Bytes of canary on each side of an array; beyond them the memory is not accessible.
GUARD_BYTES = 4096
_PAGE = 4096
# 0x7ff4 at every even position: a NaN as float16, float32 and float64 (the buffer is
# page-aligned), so that a read just outside an array also tends to show in the result.
# Long enough for the longest zone (GUARD_BYTES + 255 before, GUARD_BYTES + a page after).
_CANARY = np.tile(np.array([0xF4, 0x7F], np.uint8), GUARD_BYTES + _PAGE + 1)


def _canary(position, length):
    """The canary bytes for buffer positions position..position+length."""
    return _CANARY[position % 2:position % 2 + length]


_CTYPES = {("i", 1): ctypes.c_int8, ("i", 2): ctypes.c_int16, ("i", 4): ctypes.c_int32,
           ("i", 8): ctypes.c_int64, ("u", 1): ctypes.c_uint8, ("u", 2): ctypes.c_uint16,
           ("u", 4): ctypes.c_uint32, ("u", 8): ctypes.c_uint64, ("c", 1): ctypes.c_int8,
           ("f", 4): ctypes.c_float, ("f", 8): ctypes.c_double, ("b", 1): ctypes.c_bool}
_C_NAMES = {("i", 1): "signed char", ("i", 2): "short", ("i", 4): "int", ("i", 8): "long long",
            ("u", 1): "unsigned char", ("u", 2): "unsigned short", ("u", 4): "unsigned int",
            ("u", 8): "unsigned long long", ("c", 1): "char", ("f", 4): "float", ("f", 8): "double",
            ("b", 1): "bool", ("v", 0): "void", ("B", 2): "bf16"}
_VECTOR_PREFIX = {("i", 1): "char", ("u", 1): "uchar", ("i", 2): "short", ("u", 2): "ushort",
                  ("i", 4): "int", ("u", 4): "uint", ("i", 8): "longlong", ("u", 8): "ulonglong",
                  ("f", 4): "float", ("f", 8): "double"}


def c_type_name(p):
    """A C spelling of a parameter as the runtime describes it (used when the source's own
    declaration is not known)."""
    key = (p["kind"], p["size"])
    if p["count"] > 1:
        base = f"{_VECTOR_PREFIX.get(key, '?')}{p['count']}"
    else:
        base = _C_NAMES.get(key, f"struct of {p['size']} bytes")
    if not p["pointer"]:
        return base
    return f"{'const ' if p['const'] else ''}{base}*"


@dataclass
class Parameter:
    index: int
    kernel: str
    spec: dict
    declaration: str

    def name(self):
        return f"argument {self.index} ({self.declaration})"

    def label(self):
        return f"kernel '{self.kernel}' {self.name()}"


def _python_scalar(value):
    """CuPy's dtype for a Python scalar (cupy._core._scalar.numpy_dtype_from_pyscalar)."""
    if type(value) is bool:
        return np.bool_(value)
    if type(value) is float:
        return np.float64(value)
    if type(value) is complex:
        return np.complex128(value)
    if type(value) is int:
        return np.uint64(value) if value >= 2**63 else np.int64(value)
    return None


def _dtype_fits(dtype, p):
    """Whether an array of `dtype` may be passed for a pointer parameter `p`."""
    kind = p["kind"]
    if kind == "v" or kind == "s":
        return True
    if kind == "c":
        return dtype in (np.int8, np.uint8)
    if kind == "B":   # bf16.cuh's bf16
        return dtype.name == "bfloat16"
    return dtype.kind == kind and dtype.itemsize == p["size"]


def convert_array(param, value):
    p = param.spec
    if not p["pointer"]:
        raise LaunchError(f"{param.label()}: got an array of shape {value.shape}; the parameter is not a pointer")
    if not value.flags.c_contiguous:
        raise LaunchError(f"{param.label()}: the array of shape {value.shape} and strides {value.strides} is not "
                          "C-contiguous; a kernel sees only a pointer (pass numpy.ascontiguousarray(...))")
    if not _dtype_fits(value.dtype, p):
        raise LaunchError(f"{param.label()}: got an array of {value.dtype}")
    address = value.__array_interface__["data"][0]
    if value.size and address % p["align"]:
        raise LaunchError(f"{param.label()}: the array's address is not a multiple of {p['align']} bytes, "
                          "which the pointed-to type needs (a misaligned address on a GPU)")


def convert_scalar(param, value):
    """The ctypes value for a scalar argument, or a LaunchError explaining why it is wrong."""
    p = param.spec
    if p["pointer"]:
        raise LaunchError(f"{param.label()}: got {type(value).__name__} {value!r}; the parameter is a pointer: "
                          "pass an array (or None for a null pointer)")
    scalar = _python_scalar(value)
    if scalar is None:
        if not isinstance(value, np.generic):
            raise LaunchError(f"{param.label()}: unsupported argument type {type(value).__name__}")
        scalar = value
    passed = f"{type(value).__name__} {value}" + (
        f", which CuPy passes as {scalar.dtype}" if not isinstance(value, np.generic) else "")
    declared = (p["kind"], p["size"])
    if declared == ("s", 128):
        raise LaunchError(f"{param.label()}: got {type(value).__name__} {value!r}; a tensor map parameter takes an "
                          "emu.TensorMap")
    if declared not in _CTYPES or p["count"] != 1:
        raise LaunchError(f"{param.label()}: a parameter of this type cannot be passed from Python")
    kind = scalar.dtype.kind
    size = scalar.dtype.itemsize
    if (kind, size) == declared or (p["kind"] == "c" and kind in "iu" and size == 1):
        return _CTYPES[declared](scalar.item())
    if kind in "iu" and p["kind"] in "iuc" and size >= p["size"]:
        # The GPU reads the low bytes of what it was given: right when the value fits.
        ctype = _CTYPES[declared]
        if ctype(int(scalar)).value == int(scalar):
            return ctype(int(scalar))
        raise LaunchError(f"{param.label()}: got {passed}; {int(scalar)} does not fit")
    if size < p["size"]:
        hint = f"the kernel would read {p['size']} bytes from a {size}-byte value"
    elif kind == "f" and p["kind"] == "f":
        hint = "the kernel would read the first bytes of a double as a float: pass numpy.float32(...)"
    else:
        hint = f"the kernel would read the bytes of a {scalar.dtype} as a {c_type_name(p)}"
    raise LaunchError(f"{param.label()}: got {passed}; {hint}")


class Region:
    """One guarded copy of the memory of one or more overlapping array arguments: canary
    zones before and after the data, inaccessible pages beyond."""

    def __init__(self, start, end, arrays):
        self.start, self.size, self.arrays = start, end - start, arrays  # arrays: [(param, array, address)]
        self.offset = GUARD_BYTES + start % 256  # keeps the address's alignment modulo 256
        self.usable = (self.offset + self.size + GUARD_BYTES + _PAGE - 1) // _PAGE * _PAGE
        self.address = runtime().emu_fenced_alloc(self.usable)
        if not self.address:
            raise MemoryError(f"cannot allocate {self.usable} bytes for a kernel argument")
        self.buffer = np.ctypeslib.as_array((ctypes.c_uint8 * self.usable).from_address(self.address))
        self.buffer[:self.offset] = _canary(0, self.offset)
        after = self.offset + self.size
        self.buffer[after:] = _canary(after, self.usable - after)
        for _, array, address in arrays:
            at = self.offset + address - start
            self.buffer[at:at + array.nbytes] = _bytes_of(array)

    def pointer(self, address):
        return self.address + self.offset + address - self.start

    def data(self):
        return self.buffer[self.offset:self.offset + self.size]

    def guard_damage(self):
        """(first, last) damaged byte offsets relative to the data's start, else None."""
        after = self.offset + self.size
        before = np.flatnonzero(self.buffer[:self.offset] != _canary(0, self.offset))
        past = np.flatnonzero(self.buffer[after:] != _canary(after, self.usable - after))
        damaged = np.concatenate([before - self.offset, past + self.size])
        if damaged.size == 0:
            return None
        return int(damaged[0]), int(damaged[-1])

    def free(self):
        runtime().emu_fenced_free(self.address, self.usable)
        self.buffer = None


def _bytes_of(array):
    return array.reshape(-1).view(np.uint8)


def _describe_place(region, first, last=None):
    """Where the bytes first..last (offsets relative to a region's start, outside it) lie, in
    terms of the region's array nearest to them."""
    nearest = region.arrays[0] if first < 0 else max(region.arrays, key=lambda a: a[2] + a[1].nbytes)
    param, array, address = nearest
    relative = first - (address - region.start)
    itemsize = array.dtype.itemsize
    elements = f"element {relative // itemsize}"
    if last is not None and (last - (address - region.start)) // itemsize != relative // itemsize:
        elements = f"elements {relative // itemsize} to {(last - (address - region.start)) // itemsize}"
    if 0 <= relative < array.nbytes:   # inside it (a misaligned access)
        side = f"byte {relative % itemsize} of it" if relative % itemsize else "its first byte"
    else:
        side = (f"{-relative} bytes before its start" if relative < 0
                else f"{relative - array.nbytes} bytes past its end")
    return f"{param.name()} of {array.size} elements: {elements}, {side}"


class StagedArguments:
    """The launch's copies of its array arguments, in guarded regions; after the launch,
    ``finish`` checks the guards and copies what the kernel wrote back into the arrays."""

    def __init__(self, arrays):
        spans = sorted(((a.__array_interface__["data"][0], p, a) for p, a in arrays),
                       key=lambda span: (span[0], span[1].index))
        groups = []
        for start, param, array in spans:
            end = start + array.nbytes
            if groups and start < groups[-1][1]:
                groups[-1][1] = max(groups[-1][1], end)
                groups[-1][2].append((param, array, start))
            else:
                groups.append([start, end, [(param, array, start)]])
        self.regions = []
        try:
            for start, end, members in groups:
                self.regions.append(Region(start, end, members))
        except BaseException:
            self.free()
            raise
        self.pointers = {}
        for region in self.regions:
            for param, _, address in region.arrays:
                self.pointers[param.index] = region.pointer(address)

    def ranges(self):
        """[start, end, start, end, ...] of the argument buffers as the kernel sees them: the global
        memory it may read (canaries and fences left out)."""
        return [bound for region in self.regions
                for bound in (region.address + region.offset, region.address + region.offset + region.size)]

    def region_near(self, address):
        """Describes an address that faulted in terms of the nearest argument."""
        best = None
        for region in self.regions:
            relative = address - (region.address + region.offset)
            distance = 0 if 0 <= relative < region.size else min(abs(relative), abs(relative - region.size))
            if best is None or distance < best[0]:
                best = (distance, region, relative)
        if best is None or best[0] > (1 << 20):
            return ""
        return f" ({_describe_place(best[1], best[2])})"

    def finish(self):
        """Check the guards and copy back what the kernel wrote; returns what went wrong,
        each a phrase that follows the kernel's name."""
        problems = []
        for region in self.regions:
            damage = region.guard_damage()
            if damage:
                problems.append(f"wrote outside its arrays: {_describe_place(region, *damage)}")
            problems += self._copy_back(region)
        return problems

    @staticmethod
    def _copy_back(region):
        def written(array, address):
            return region.data()[address - region.start:address - region.start + array.nbytes]

        changed = [(param, array, address) for param, array, address in region.arrays
                   if not np.array_equal(_bytes_of(array), written(array, address))]
        if not changed:
            return []
        if all(param.spec["const"] for param, _, _ in region.arrays):
            return [f"wrote through a pointer to const: {changed[0][0].name()}"]
        problems = [f"wrote to a read-only array: {param.name()}"
                    for param, array, _ in changed if not array.flags.writeable]
        for _, array, address in changed:
            if array.flags.writeable:
                _bytes_of(array)[:] = written(array, address)
        return problems

    def free(self):
        for region in self.regions:
            region.free()
        self.regions = []

