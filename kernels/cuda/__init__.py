"""The CUDA backend: every op of the contract (kernels/cpu/__init__.py) as hand-written CUDA C.

Each op family has its kernels in ``<family>.cu`` and its launchers in ``<family>.py``. A
launcher takes the backend as its first argument, ``conv2d_forward(be, x, w, b, stride,
padding)``, and gets its array module (``be.xp``) and its compiled kernels
(``be.function(family, name)``) from it, so one launcher code serves two backends:

- ``cuda``: CuPy arrays; kernels compiled by NVRTC through ``cupy.RawModule`` (CuPy 14.2 and
  newer keep modules compiled with name expressions in their disk cache across runs; older
  ones, which the project refuses, recompile them in every process). Under
  ``KERNELS_SIMULATED_GPUS``, the simulated GPUs' arrays and RawModule (kernels/simulated);
- ``emu``: NumPy arrays; the same sources compiled by g++ and run by the CPU emulator's
  ``kernels.emu.RawModule`` (cached by source hash as well).

``make_backend(name)`` builds one; ``kernels.backend_of`` decides which one an array gets.
Each family is compiled once per process, on its first launch.
"""
import contextlib
import hashlib
import importlib
import json
import os
import re
import types
from pathlib import Path

import numpy as np

FAMILIES = ("conv", "conv_tc", "conv_bf16", "conv_sm90", "batchnorm", "elementwise", "pool", "linear", "loss",
            "optim")
TENSOR_CORE_FAMILIES = ("conv_tc", "conv_bf16")   # mma.sync of TF32 and BF16, cp.async: sm_80 and later
# wgmma, TMA, setmaxnreg: Hopper's own instructions, compiled for sm_90a, which no other GPU runs
HOPPER_FAMILIES = ("conv_sm90",)
# the GPUs the project compiles for: Volta and Turing (sm_70, sm_75: a V100, a T4) run the fp32 step, every
# family but the tensor cores'; Ampere (sm_80, sm_86), Ada (sm_89) and Hopper (sm_90) every precision
ARCHITECTURES = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90")


def families_for(arch):
    """The families that compile, and run, on GPUs of ``arch`` ("sm_75")."""
    number = int(arch[3:])
    return tuple(f for f in FAMILIES if (number >= 80 or f not in TENSOR_CORE_FAMILIES) and
                 (number == 90 or f not in HOPPER_FAMILIES))


def arch_of(family, arch):
    """The architecture NVRTC compiles ``family`` for on GPUs of ``arch``: sm_90a for the Hopper families."""
    return f"{arch}a" if family in HOPPER_FAMILIES else arch

OPTIONS = ("--std=c++17",)
HERE = Path(__file__).resolve().parent
COUNTERS = 4096   # the backend's counters per device, at least (Backend.counters)
NAN_FLOATS = 128   # Backend.nan_chunk's: a run of 4 chunks 32 floats apart reads 100 (tc_conv.cuh's run_of)
_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"[ \t]*$', re.MULTILINE)


def source(family):
    """The CUDA C source of a family with each header of this folder it includes
    (``#include "common.cuh"``, ...) pasted in place of its first #include and dropped from
    the later ones, so that the text handed to the compiler, and hence its cache key, covers
    the headers too; #line directives keep each line's own file and number for the compilers'
    messages and the emulator's sanitizer."""
    pasted = set()

    def expand(name):
        lines = [f'#line 1 "kernels/cuda/{name}"']
        for number, line in enumerate((HERE / name).read_text().splitlines(), 1):
            include = _LOCAL_INCLUDE.match(line)
            if include is None:
                lines.append(line)
            elif include.group(1) not in pasted:
                pasted.add(include.group(1))
                lines += [expand(include.group(1)), f'#line {number + 1} "kernels/cuda/{name}"']
            else:
                lines.append("")
        return "\n".join(lines)
    return expand(f"{family}.cu") + "\n"


def launcher(family):
    """The Python module of a family: its launchers, OPS (the contract functions it
    implements) and KERNELS (the name expressions of its kernels)."""
    return importlib.import_module(f"{__name__}.{family}")


class Backend:
    """The contract's functions, bound to one array module and one kernel compiler."""

    def __init__(self, name, xp, raw_module):
        self.name, self.xp = name, xp
        self._raw_module = raw_module
        self._modules, self._functions, self._counters, self._nan_chunks = {}, {}, {}, {}
        self._shared_allowed = {}   # (family, name), device: the dynamic shared memory a kernel is allowed there
        self._observers = []        # observing_launches' callbacks
        for family in FAMILIES:
            module = launcher(family)
            for op in module.OPS:
                setattr(self, op, types.MethodType(getattr(module, op), self))

    def module(self, family):
        """The family's compiled module (RawModule), compiled on first use: by CuPy, or by kernels.nvrtc for a
        Hopper family on a GPU (ArchModule)."""
        if family not in self._modules:
            if family in HOPPER_FAMILIES and self.xp.__name__ == "cupy":   # CuPy's own, not the simulated GPUs'
                self._modules[family] = ArchModule(source(family), OPTIONS, launcher(family).KERNELS)
            else:
                self._modules[family] = self._raw_module(code=source(family), options=OPTIONS,
                                                         name_expressions=launcher(family).KERNELS)
        return self._modules[family]

    def function(self, family, name, shared_mem=0):
        """A kernel of the family by its name expression. shared_mem: the dynamic shared memory its launches
        ask for, which it is then allowed on the current device (a CUDA function attribute, set for each
        device apart: CuPy's RawKernel.max_dynamic_shared_size_bytes sets it on the current one), past the
        48 KB a block has without asking."""
        for observe in self._observers:
            observe(family, name)
        key = (family, name)
        if key not in self._functions:
            self._functions[key] = self.module(family).get_function(name)
        kernel = self._functions[key]
        if shared_mem:
            allowed = (key, self.xp.cuda.runtime.getDevice() if self.xp is not np else None)
            if self._shared_allowed.get(allowed, 0) < shared_mem:
                kernel.max_dynamic_shared_size_bytes = shared_mem
                self._shared_allowed[allowed] = shared_mem
        return kernel

    @contextlib.contextmanager
    def observing_launches(self, on_launch):
        """While inside, every kernel launch calls on_launch(family, name) first, name its name expression
        (launch.launch looks each kernel up through function(), once a launch, whatever else it asks for): how
        the profiler, bench/kernel_times and the tests name the kernels a step launches."""
        self._observers.append(on_launch)
        try:
            yield
        finally:
            self._observers.remove(on_launch)

    def counters(self, count):
        """At least `count` zeroed unsigned counters on the current device, for the reductions that
        finish in the launch that split them (last_block in common.cuh): each launch leaves them at
        zero, and the launches of a device run one after another on its stream, so one set per device
        serves them all. Made on first use, and replaced by a larger set when a launch needs more (an
        evaluation of larger batches than the training step's): a graph captured before keeps its
        own (capture)."""
        device = self.xp.cuda.runtime.getDevice() if self.xp is not np else None
        have = self._counters.get(device)
        if have is None or have.size < count:
            have = self._counters[device] = self.xp.zeros(max(count, COUNTERS), np.uint32)
        return have

    def nan_chunk(self):
        """NAN_FLOATS float32 NaN on the current device, which the kernels that apply a batch norm and its relu
        to an operand as it lands copy where the operand is zero (conv_tc.cu's TcFold), a run of chunks at a
        time (tc_conv.cuh's tc_load_stage): made on first use, one per device, never written."""
        device = self.xp.cuda.runtime.getDevice() if self.xp is not np else None
        if device not in self._nan_chunks:
            chunk = self._nan_chunks[device] = self.xp.empty(NAN_FLOATS, np.float32)
            chunk.fill(np.nan)
        return self._nan_chunks[device]

    def hold(self, microseconds):
        """Keep the current stream busy for `microseconds` (elementwise.cu's hold, one thread): the work queued
        after it waits, so that the host can queue a whole step before the GPU starts on it (the profiler)."""
        from .launch import launch
        if not 0 <= microseconds < 2**31:
            raise ValueError(f"hold: takes 0 to 2**31 - 1 microseconds, got {microseconds}")
        launch(self, "elementwise", "hold", (1,), (int(microseconds),), block=(1,))

    def capture(self, fn):
        """(graph, fn()): fn's launches captured, not run; graph.launch() replays them (CUDA graphs on
        the GPU, a record of the launches on the emulator: see graph.py). The graph keeps alive every
        array its kernels were given and every array made during the capture: it holds their addresses."""
        from .graph import capture
        return capture(self, fn)

    def __repr__(self):
        return f"<kernels backend {self.name!r}>"


class ArchModule:
    """A source compiled for the current GPU's architecture-specific features (sm_90a: wgmma, setmaxnreg), which
    cupy.RawModule cannot ask NVRTC for (it gives -arch=sm_XX of the device): NVRTC (kernels.nvrtc, with CuPy's
    options) makes its CUBIN, kept in the cache folder by the source's hash, and CuPy loads it as a
    RawModule(path=...), whose kernels get_function finds by the lowered names of the name expressions (an extern "C"
    kernel by its own). The Hopper families' modules on a GPU, and the GPU tests of sm90.cuh's wrappers."""

    def __init__(self, code, options, name_expressions):
        self._code, self._options, self._names = code, tuple(options), tuple(name_expressions)
        self._module, self._lowered = None, None

    def compile(self):
        if self._module is None:
            from kernels import cache_folder, cupy_module, nvrtc
            cupy = cupy_module()
            arch = f"sm_{cupy.cuda.Device().compute_capability}a"
            key = hashlib.sha256(json.dumps([self._code, self._options, self._names, arch,
                                             list(nvrtc.version())]).encode()).hexdigest()[:32]
            folder = cache_folder("cubin")
            cubin, names = folder / f"{key}.cubin", folder / f"{key}.json"
            if not (cubin.exists() and names.exists()):
                compiled = nvrtc.compile(self._code, arch=arch, options=self._options, name_expressions=self._names)
                folder.mkdir(parents=True, exist_ok=True)
                for path, data in ((cubin, compiled.cubin), (names, json.dumps(compiled.lowered_names).encode())):
                    part = path.with_suffix(f".{os.getpid()}.part")
                    part.write_bytes(data)
                    part.replace(path)   # whole or not at all, for the processes that compile it at once
            self._lowered = json.loads(names.read_text())
            self._module = cupy.RawModule(path=str(cubin))
        return self._module

    def get_function(self, name):
        module = self.compile()
        return module.get_function(self._lowered.get(name, name))


def make_backend(name):
    """The CUDA launchers bound to CuPy ("cuda") or to NumPy and the CPU emulator ("emu")."""
    if name == "emu":
        from kernels.emu import RawModule
        return Backend("emu", np, RawModule)
    if name == "cuda":
        from kernels import cupy_module
        cupy = cupy_module()
        return Backend("cuda", cupy, cupy.RawModule)
    raise ValueError(f"unknown device backend {name!r}: 'cuda' or 'emu'")
