"""RawModule and RawKernel: cupy.RawModule / cupy.RawKernel for NumPy arrays, run on the CPU; thread_order and
the traffic counter of the launches inside a block."""
import contextlib
import ctypes
import dataclasses
import os
import re
import subprocess

import numpy as np

from . import build
from .arguments import Parameter, StagedArguments, c_type_name, convert_array, convert_scalar
from .errors import KernelError, LaunchError
from .native import Module, runtime
from .tensor_map import TensorMap

# What a GPU of the project (sm_80, sm_90) accepts.
MAX_THREADS_PER_BLOCK = 1024
MAX_BLOCK_DIM = (1024, 1024, 64)
MAX_GRID_DIM = (2**31 - 1, 65535, 65535)
SHARED_BYTES_WITHOUT_OPT_IN = 48 * 1024
SHARED_BYTES_OPT_IN = 227 * 1024  # sm_90; kEmuDynamicSharedBytes in emu_abi.h holds as much

ORDERS = ("ascending", "descending")
_order = [os.environ.get("CUDA_EMU_ORDER", "ascending")]
if _order[0] not in ORDERS:
    raise ValueError(f"CUDA_EMU_ORDER must be one of {ORDERS}, not {_order[0]!r}")


@contextlib.contextmanager
def thread_order(order):
    """Run the launches inside the block in this order of the threads (and of the blocks):
    "ascending" (the default) or "descending". A kernel that misses a __syncthreads() reads
    before the write in one order or the other, so its result is wrong in at least one."""
    if order not in ORDERS:
        raise ValueError(f"thread order must be one of {ORDERS}, not {order!r}")
    _order.append(order)
    try:
        yield
    finally:
        _order.pop()


@dataclasses.dataclass
class Traffic:
    """A kernel's loads of global memory (its array arguments) as a GPU's memory system sees them (traffic()):
    `requests`, the warp-wide load instructions (the lanes of a warp executing one load for their n-th time);
    `sectors`, the distinct 32-byte sectors each request touches, and `bytes`, the distinct bytes its lanes
    asked for (a value every lane loads counts once), each added over the requests. Whole sectors, every byte
    of them used: sectors * 32 == bytes."""
    requests: int = 0
    sectors: int = 0
    bytes: int = 0

    def add(self, requests, sectors, bytes_):
        self.requests += requests
        self.sectors += sectors
        self.bytes += bytes_


_traffic = []   # the counts of the traffic() blocks open now


def aligned_empty(shape, dtype=np.float32, alignment=256):
    """np.empty(shape, dtype) at an address that is a multiple of `alignment` bytes, as CuPy's allocations are
    (NumPy's are only at 16): which sectors a load touches depends on it (traffic())."""
    dtype, count = np.dtype(dtype), int(np.prod(shape))
    raw = np.empty(count * dtype.itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


@contextlib.contextmanager
def traffic():
    """Count the global loads of the launches inside the block: yields {kernel name: Traffic}, which each
    launch adds to under the name it was fetched by (get_function). The loads are those the sanitizer's
    instrumentation reports, so a module compiled without it (CUDA_EMU_SANITIZE=off) cannot be counted, and a
    counted launch runs with at least memcheck; loads through cp.async, ldmatrix and atomics are not counted.
    Off, it costs nothing: the runtime tests for it only on the path of global accesses."""
    counts = {}
    _traffic.append(counts)
    try:
        yield counts
    finally:
        _traffic.remove(counts)


class RawModule:
    """cupy.RawModule(code=..., options=..., name_expressions=...) compiled for the emulator."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc", translate_cucomplex=False,
                 enable_cooperative_groups=False, name_expressions=None, jitify=False):
        if code is None:
            raise LaunchError("the emulator compiles sources: RawModule(code=...); it cannot load "
                              f"a compiled module from {path!r}")
        if enable_cooperative_groups or jitify:
            raise LaunchError("the emulator supports neither cooperative groups nor jitify")
        self.code, self.options = code, tuple(options)
        self.name_expressions = tuple(name_expressions or ())
        self._module = Module(build.build_module(code, self.options, self.name_expressions))

    def compile(self, log_stream=None):
        """cupy.RawModule's: compile now rather than at the first get_function. The emulator's modules
        are compiled when made: nothing left to do."""

    def get_function(self, name):
        """The kernel named by a name expression given to the constructor, or by its symbol:
        the plain name of an extern "C" kernel (as CuPy looks kernels up)."""
        entries = self._module.entries
        by_expression = [e for e in entries if e["expression"] == name and name in self.name_expressions]
        found = by_expression or [e for e in entries if e["symbol"] == name]
        if not found:
            cxx = [e["kernel"] for e in entries if e["kernel"] == name and e["symbol"].startswith("_Z")]
            hint = (f"; kernel '{name}' has C++ linkage: declare it extern \"C\" or pass it in name_expressions"
                    if cxx else "")
            known = sorted({e["symbol"] for e in entries if not e["symbol"].startswith("_Z")}
                           | set(self.name_expressions))
            raise LaunchError(f"no kernel named '{name}' in the module (named symbol not found){hint}; "
                              f"kernels: {', '.join(known) or 'none'}")
        kernel = RawKernel.__new__(RawKernel)
        kernel._bind(self, found[0], name)
        return kernel


def _declared(declaration, spec, template):
    """A parameter as the source declares it, but for a template's pointer to a scalar, whose type may name a
    template parameter (const T* __restrict__ x): spelled with the instantiation's (const float* __restrict__ x)."""
    if not (template and spec["pointer"]) or c_type_name(spec).startswith("struct"):
        return declaration
    return c_type_name(spec) + declaration[declaration.rindex("*") + 1:]


class RawKernel:
    """cupy.RawKernel(code, name, options=...), or a function of a RawModule."""

    def __init__(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False, *,
                 enable_cooperative_groups=False, jitify=False):
        module = RawModule(code=code, options=options, enable_cooperative_groups=enable_cooperative_groups,
                           jitify=jitify)
        self._bind(module, module.get_function(name)._entry, name)

    def _bind(self, module, entry, name):
        self.module, self.name, self._entry = module, name, entry
        # An attribute of the function, as in CUDA: every RawKernel of it sees a change.
        entry.setdefault("max_dynamic_shared", SHARED_BYTES_WITHOUT_OPT_IN - entry["static_shared"])
        declarations = entry["parameters"] if len(entry["parameters"]) == len(entry["signature"]) else None
        self._parameters = [Parameter(i, name, spec, _declared(declarations[i], spec, entry["template"])
                                      if declarations else c_type_name(spec))
                            for i, spec in enumerate(entry["signature"])]

    @property
    def parameters(self):
        """The kernel's parameters (arguments.Parameter), each of which can label itself in a message."""
        return tuple(self._parameters)

    @property
    def max_threads_per_block(self):
        return self._entry["launch_bounds"] or MAX_THREADS_PER_BLOCK

    @property
    def shared_size_bytes(self):
        """The static shared memory the kernel declares in its body."""
        return self._entry["static_shared"]

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._entry["max_dynamic_shared"]

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        if value + self.shared_size_bytes > SHARED_BYTES_OPT_IN:
            raise LaunchError(f"kernel '{self.name}': {value} bytes of dynamic shared memory plus its "
                              f"{self.shared_size_bytes} static bytes exceed the {SHARED_BYTES_OPT_IN} "
                              "a GPU allows")
        self._entry["max_dynamic_shared"] = int(value)

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None, enable_cooperative_groups=False):
        if enable_cooperative_groups:
            raise LaunchError(f"kernel '{self.name}': the emulator does not support cooperative launches")
        grid, block = self._launch_shape(grid, block)
        shared_mem = self._check_shared_memory(shared_mem)
        native = self.module._module
        level = build.LEVELS[build.sanitize_level()] if native.sanitize else 0
        counted = None
        if _traffic:
            if not native.sanitize:
                raise LaunchError(f"kernel '{self.name}': emu.traffic() counts the loads the sanitizer's "
                                  "instrumentation reports, and this module was compiled without it "
                                  "(CUDA_EMU_SANITIZE=off, or emu.sanitizer('off'))")
            counted, level = (ctypes.c_uint64 * 3)(), max(level, build.LEVELS["memcheck"])
        arrays, values = self._convert(args)
        staged = StagedArguments(arrays)
        try:
            pointers = (ctypes.c_void_p * max(1, len(values)))()
            for i, value in enumerate(values):
                if value is _ARRAY:
                    value = ctypes.c_void_p(staged.pointers[i])
                elif isinstance(value, TensorMap):   # its record, where the kernel reads its parameter
                    value = _MapRecord(value.record(staged.pointers[i]))
                    values[i] = value
                    pointers[i] = value.address
                    continue
                values[i] = value
                pointers[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
            err = ctypes.create_string_buffer(4096)
            fault = ctypes.c_uint64(0)
            ranges = staged.ranges()
            shared = [v for offset, size, _ in self._entry["shared_variables"] for v in (offset, size)]
            names = "\n".join(name for _, _, name in self._entry["shared_variables"]).encode()
            failed = runtime().emu_launch(native.handle, self._entry["address"], pointers,
                                          (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                                          int(_order[-1] == "descending"),
                                          (ctypes.c_uint64 * max(1, len(ranges)))(*ranges), len(ranges) // 2,
                                          level, (ctypes.c_uint64 * max(1, len(shared)))(*shared),
                                          len(shared) // 2, names, counted, ctypes.byref(fault), err, len(err))
            problems = staged.finish()
            if failed:
                near = staged.region_near(fault.value) if fault.value else ""
                problems.append(f"failed: {source_lines(err.value.decode())}{near}")
            if problems:
                raise KernelError(f"kernel '{self.name}' " + "\n".join(problems))
            if counted is not None:
                for counts in _traffic:
                    counts.setdefault(self.name, Traffic()).add(*counted)
        finally:
            staged.free()

    def _launch_shape(self, grid, block):
        """CuPy's rules: tuples of up to three ints, missing ones 1, zeros raised to 1."""
        shapes = []
        for what, value in (("grid", grid), ("block", block)):
            if not isinstance(value, tuple):
                raise LaunchError(f"kernel '{self.name}': {what} must be a tuple, not {type(value).__name__}")
            shapes.append(tuple(max(1, int(v)) for v in (value + (1, 1))[:3]))
        grid, block = shapes
        threads = block[0] * block[1] * block[2]
        if any(b > m for b, m in zip(block, MAX_BLOCK_DIM)) or threads > MAX_THREADS_PER_BLOCK:
            raise LaunchError(f"kernel '{self.name}': block {block} has {threads} threads; a GPU allows "
                              f"{MAX_THREADS_PER_BLOCK} per block and at most {MAX_BLOCK_DIM} per dimension")
        if threads > self.max_threads_per_block:
            raise LaunchError(f"kernel '{self.name}': block {block} has {threads} threads, more than its "
                              f"__launch_bounds__({self.max_threads_per_block})")
        if any(g > m for g, m in zip(grid, MAX_GRID_DIM)):
            raise LaunchError(f"kernel '{self.name}': grid {grid} exceeds a GPU's limits {MAX_GRID_DIM}")
        return grid, block

    def _check_shared_memory(self, shared_mem):
        shared_mem = int(shared_mem)
        if shared_mem < 0:
            raise LaunchError(f"kernel '{self.name}': shared_mem={shared_mem} is negative")
        static, allowed = self.shared_size_bytes, self.max_dynamic_shared_size_bytes
        if shared_mem > allowed:
            limit = (f"a GPU allows {SHARED_BYTES_WITHOUT_OPT_IN} bytes of shared memory per block without "
                     f"opt-in (max_dynamic_shared_size_bytes)"
                     if allowed == SHARED_BYTES_WITHOUT_OPT_IN - static
                     else f"max_dynamic_shared_size_bytes is {allowed}")
            raise LaunchError(f"kernel '{self.name}': shared_mem={shared_mem} bytes of dynamic shared memory "
                              f"(plus {static} static): {limit}")
        return shared_mem

    def _convert(self, args):
        args = tuple(args)
        if len(args) != len(self._parameters):
            declared = ", ".join(p.declaration for p in self._parameters)
            raise LaunchError(f"kernel '{self.name}' takes {len(self._parameters)} arguments ({declared}), "
                              f"got {len(args)}")
        arrays, values = [], []
        for param, arg in zip(self._parameters, args):
            if isinstance(arg, TensorMap):
                arrays.append((_tensor_parameter(param), arg.span()))
                values.append(arg)
            elif isinstance(arg, np.ndarray):
                convert_array(param, arg)
                arrays.append((param, arg))
                values.append(_ARRAY)
            elif arg is None:
                if not param.spec["pointer"]:
                    raise LaunchError(f"{param.label()}: got None for a parameter that is not a pointer")
                values.append(ctypes.c_void_p(0))
            else:
                values.append(convert_scalar(param, arg))
        return arrays, values


_ARRAY = object()  # placeholder for an array argument until its guarded copy exists


def _tensor_parameter(param):
    """The parameter that takes an emu.TensorMap (a 128-byte struct by value, sm90.cuh's TensorMap), checked, and a
    read-only pointer parameter standing for its tensor among the launch's arrays (same index, as no array is
    passed for the parameter itself)."""
    spec = param.spec
    if spec["pointer"] or spec["kind"] != "s" or spec["size"] * spec["count"] != 128:
        raise LaunchError(f"{param.label()}: got an emu.TensorMap; the parameter is not a tensor map (sm90.cuh's "
                          "TensorMap, 128 bytes by value: `const __grid_constant__ TensorMap map`)")
    return Parameter(param.index, param.kernel, {**spec, "pointer": True, "const": True, "kind": "v", "align": 1},
                     f"the tensor of {param.declaration}")


class _MapRecord:
    """A tensor map's 128 bytes for a launch, 64-byte aligned as CUtensorMap is."""

    def __init__(self, record):
        self.buffer = ctypes.create_string_buffer(len(record) + 64)
        self.address = ctypes.addressof(self.buffer) + -ctypes.addressof(self.buffer) % 64
        ctypes.memmove(self.address, record, len(record))
_PC = re.compile(r" \{pc:([^:}]+):([0-9a-f]+)\}")
_EMULATOR_HEADERS = ("cuda_emu.h", "tensor_core.cuh", "sm90.cuh")   # the emulation's own lines: name the caller's


def source_lines(message):
    """The runtime's code addresses in ``message`` ({pc:module:offset}) as the .cu lines they are
    (" at kernels/cuda/x.cu:12"), read from the module's line table by addr2line; dropped if it
    cannot tell."""
    def line(match):
        try:
            out = subprocess.run(["addr2line", "-e", match.group(1), "-i", match.group(2)], capture_output=True,
                                 text=True, timeout=30).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            return ""
        places = [p.split(" (")[0] for p in out if not p.startswith("??")]
        own = [p for p in places if not p.rsplit(":", 1)[0].endswith(_EMULATOR_HEADERS)]
        chosen = (own or places)[:1]
        return f" at {chosen[0]}" if chosen else ""
    return re.sub(r" at (\S+) at \1(?=\W|$)", r" at \1", _PC.sub(line, message))   # a place said twice: once
