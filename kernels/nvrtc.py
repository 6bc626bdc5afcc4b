"""NVRTC without a GPU: compile a CUDA C source for an architecture, get PTX (and CUBIN) and
the compiler's log, and read registers, shared memory and spills from ptxas' report.

NVRTC needs only its library (the nvidia-cuda-nvrtc wheel): no driver, no device. CuPy's
higher-level compile helpers query the device, so this module calls ``cupy.cuda.nvrtc``
directly, with the very options CuPy gives NVRTC for a ``cupy.RawModule`` (``cupy_options``:
``-ftz=true`` among them), so that what is compiled here is what runs on the GPU.

    result = nvrtc.compile(source, arch="sm_90", options=("-DTILE=16",),
                           name_expressions=("axpy<float>",), verbose=True)
    result.ptx, result.cubin, result.log, result.lowered_names["axpy<float>"]
    result.resources()["_Z4axpyIfEvT_PKS0_PS0_i"].registers
"""
import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


class NvrtcError(Exception):
    """NVRTC refused the source; ``log`` holds its diagnostics."""

    def __init__(self, message, log=""):
        super().__init__(message)
        self.log = log


def _nvrtc():
    from cupy.cuda import nvrtc  # noqa: PLC0415  (optional dependency: the cuda extras)
    nvrtc.getVersion()  # loads the library: raises when the wheel is missing
    return nvrtc


def unavailable_reason():
    """None when NVRTC can compile here, else why not (for a test's skip message)."""
    try:
        _nvrtc()
    except Exception as e:  # ImportError, or CuPy's error when libnvrtc cannot be loaded
        return f"NVRTC unavailable ({type(e).__name__}: {e}); install the cuda12 or cuda13 extra"
    return None


def version():
    return _nvrtc().getVersion()


def unsupported_reason(arch):
    """None when an NVRTC here compiles for ``arch`` ("sm_70"): CuPy's, or CUDA 12's beside it
    (nvrtc_for); else why not."""
    if nvrtc_for(arch) is not None:
        return None
    supported = _nvrtc().getSupportedArchs()
    major, minor = version()
    return (f"NVRTC {major}.{minor} does not compile for {arch} (it compiles for sm_{min(supported)} to "
            f"sm_{max(supported)}), and CUDA 12's NVRTC, which does, is not installed beside it "
            f"(pip install nvidia-cuda-nvrtc-cu12)")


def nvrtc_for(arch):
    """The NVRTC that compiles for ``arch``: CuPy's (kernels.nvrtc's module of the functions), else CUDA 12's
    library from the nvidia-cuda-nvrtc-cu12 wheel, loaded beside it (CUDA 13 dropped sm_70; CuPy binds one
    NVRTC, the one of its own CUDA), else None. An architecture's own features ("sm_90a") compile where it does."""
    nvrtc = _nvrtc()
    number = int(arch.partition("_")[2].rstrip("af"))
    if number in nvrtc.getSupportedArchs():
        return nvrtc
    other = cuda12()
    return other if other is not None and number in other.getSupportedArchs() else None


@functools.lru_cache(maxsize=None)
def cuda12():
    """CUDA 12's NVRTC (Nvrtc12) from the nvidia-cuda-nvrtc-cu12 wheel, or None where it is not installed.
    CuPy's is loaded first: CuPy takes whichever libnvrtc the process already holds (cuda.pathfinder), and
    must not take this one."""
    _nvrtc()
    try:
        import nvidia.cuda_nvrtc  # noqa: PLC0415  (the wheel's namespace package)
        for root in map(Path, nvidia.cuda_nvrtc.__path__):
            if (root / "lib" / "libnvrtc.so.12").exists():
                return Nvrtc12(root / "lib" / "libnvrtc.so.12")
    except (ImportError, OSError):
        pass
    return None


class Nvrtc12:
    """CUDA 12's libnvrtc through ctypes, with the calls ``compile`` makes of ``cupy.cuda.nvrtc`` and their
    results' types (PTX and CUBIN as bytes, the log and lowered names as str)."""

    class NVRTCError(RuntimeError):
        pass

    def __init__(self, path):
        import ctypes  # noqa: PLC0415
        self._c, self._lib = ctypes, ctypes.CDLL(str(path))
        self._lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _call(self, name, *arguments):
        status = getattr(self._lib, name)(*arguments)
        if status:
            raise self.NVRTCError(f"{self._lib.nvrtcGetErrorString(status).decode()} ({status})")

    def getVersion(self):
        major, minor = self._c.c_int(), self._c.c_int()
        self._call("nvrtcVersion", self._c.byref(major), self._c.byref(minor))
        return major.value, minor.value

    def getSupportedArchs(self):
        count = self._c.c_int()
        self._call("nvrtcGetNumSupportedArchs", self._c.byref(count))
        archs = (self._c.c_int * count.value)()
        self._call("nvrtcGetSupportedArchs", archs)
        return list(archs)

    def createProgram(self, source, name, headers, include_names):
        assert not headers and not include_names, "headers are pasted into the source (kernels.cuda.source)"
        program = self._c.c_void_p()
        self._call("nvrtcCreateProgram", self._c.byref(program), source.encode(), name.encode(), 0, None, None)
        return program

    def addNameExpression(self, program, expression):
        self._call("nvrtcAddNameExpression", program, expression.encode())

    def compileProgram(self, program, options):
        flags = (self._c.c_char_p * len(options))(*(o.encode() for o in options))
        self._call("nvrtcCompileProgram", program, len(options), flags)

    def _bytes(self, what, program):
        size = self._c.c_size_t()
        self._call(f"nvrtcGet{what}Size", program, self._c.byref(size))
        buffer = self._c.create_string_buffer(size.value)
        self._call(f"nvrtcGet{what}", program, buffer)
        return buffer.raw

    def getPTX(self, program):
        return self._bytes("PTX", program)

    def getCUBIN(self, program):
        return self._bytes("CUBIN", program)

    def getProgramLog(self, program):
        return self._bytes("ProgramLog", program).decode(errors="replace")

    def getLoweredName(self, program, expression):
        lowered = self._c.c_char_p()
        self._call("nvrtcGetLoweredName", program, expression.encode(), self._c.byref(lowered))
        return lowered.value.decode()

    def destroyProgram(self, program):
        self._call("nvrtcDestroyProgram", self._c.byref(program))


@dataclass
class Resources:
    """What ptxas reports for one kernel (``-Xptxas -v``)."""
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0


@dataclass
class Compiled:
    ptx: str
    cubin: bytes | None  # for a real architecture (sm_XX) only
    log: str
    lowered_names: dict  # name expression -> mangled name

    def resources(self):
        """{kernel's (mangled) name: Resources}, from a log compiled with verbose=True."""
        return parse_ptxas_log(self.log)

    def named_resources(self):
        """resources(), each kernel named by its name expression where it has one ("conv2d_wgrad<Tile128, 1,
        1>"), else by its symbol (an extern "C" kernel's own name)."""
        names = {mangled: expression for expression, mangled in self.lowered_names.items()}
        return {names.get(symbol, symbol): r for symbol, r in self.resources().items()}

    def sass(self):
        """{kernel's (mangled) name: its SASS instructions}: the cubin disassembled by cuobjdump."""
        return disassemble(self.cubin)


def cupy_options(options=(), arch="sm_90", nvrtc_version=None):
    """The NVRTC options of CuPy 14.2 for ``cupy.RawModule(code=..., options=options)`` on ``arch``,
    in CuPy's order: core.pyx's assemble_cupy_compiler_options (the options, ``--std=c++17``
    unless one is given, CCCL's, CuPy's and CUDA's include folders), then compiler.py's
    ``-ftz=true`` (always: a later ``-ftz=false`` does not undo it), ``--device-debug
    --generate-line-info`` under CUPY_CUDA_COMPILE_WITH_DEBUG, the architecture,
    ``--device-as-default-execution-space``, and ``--pch`` under CUPY_NVRTC_USE_PCH (for NVRTC 12.8 or
    newer: ``nvrtc_version``, by default CuPy's)."""
    from cupy._core.core import assemble_cupy_compiler_options  # noqa: PLC0415
    from cupy.cuda import compiler  # noqa: PLC0415
    flags = (*assemble_cupy_compiler_options(tuple(options)), "-ftz=true")
    if compiler._get_bool_env_variable("CUPY_CUDA_COMPILE_WITH_DEBUG", False):
        flags += ("--device-debug", "--generate-line-info")
    flags += (f"-arch={arch}", "--device-as-default-execution-space")
    if compiler._use_pch and (nvrtc_version or version()) >= (12, 8):
        flags += ("--pch",)
    return flags


def compile(source, arch="sm_90", options=(), name_expressions=(), filename="kernel.cu", verbose=False):
    """Compile ``source`` for ``arch`` ("sm_90" gives PTX and CUBIN, "compute_90" PTX only) as
    CuPy compiles a RawModule: NVRTC gets ``cupy_options(options, arch)``. The NVRTC is CuPy's, or CUDA
    12's where CuPy's does not compile for ``arch`` (nvrtc_for: sm_70 under CUDA 13).

    options: the RawModule's options (``-I``, ``-D``, ``--std=c++17``, ...). verbose: ask ptxas for
    its resource report (needs a real architecture). Raises NvrtcError with the log on failure.
    """
    nvrtc = nvrtc_for(arch.replace("compute_", "sm_")) or _nvrtc()   # CuPy's refuses what neither compiles
    flags = list(cupy_options(options, arch, nvrtc.getVersion()))
    if verbose:
        flags += ["-Xptxas", "-v"]
    program = nvrtc.createProgram(source, filename, [], [])
    try:
        for expression in name_expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, flags)
        except nvrtc.NVRTCError as e:
            log = _log(nvrtc, program)
            raise NvrtcError(f"NVRTC failed to compile {filename} for {arch}: {e}\n{log}", log) from None
        return Compiled(
            ptx=nvrtc.getPTX(program).rstrip(b"\0").decode(),
            cubin=nvrtc.getCUBIN(program) if arch.startswith("sm_") else None,
            log=_log(nvrtc, program),
            lowered_names={e: nvrtc.getLoweredName(program, e) for e in name_expressions})
    finally:
        nvrtc.destroyProgram(program)


_RELEASE = re.compile(r"Cuda compilation tools, release [\d.]+, (V[\d.]+)")


def release(ptx):
    """The CUDA release ("V13.5.37") whose compiler wrote a PTX (its header comment), or None."""
    m = _RELEASE.search(ptx)
    return m and m.group(1)


@functools.lru_cache(maxsize=None)
def ptxas(version):
    """The path of a ptxas of the CUDA release ``version`` ("V13.5.37", release()'s): on PATH, or from the
    nvidia-cuda-nvcc wheel; None without one. Of the very release only: another ptxas may make other SASS."""
    candidates = [Path(found)] if (found := shutil.which("ptxas")) else []
    try:
        import nvidia  # noqa: PLC0415  (the wheels' namespace package)
        candidates += [path for root in map(Path, nvidia.__path__) for path in sorted(root.glob("*/bin/ptxas"))]
    except ImportError:
        pass
    for candidate in candidates:
        try:
            done = subprocess.run([str(candidate), "--version"], capture_output=True, text=True, timeout=60)
        except OSError:
            continue
        if done.returncode == 0 and release(done.stdout) == version:
            return candidate
    return None


def assemble(compiled, arch, verbose=False):
    """Compiled for ``arch`` (sm_XX) from the PTX of another compile (``compiled``, for compute_YY), by the
    ptxas of the PTX's own release: what compile(source, arch) gives where NVRTC writes that PTX for arch
    too (but its .target line), without running NVRTC's front end again. None when no such ptxas is here.
    The log is ptxas' (verbose: its resource report, as parse_ptxas_log reads it)."""
    tool = ptxas(release(compiled.ptx))
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "module.ptx", Path(folder) / "module.cubin"
        source.write_text(compiled.ptx)
        done = subprocess.run([str(tool), f"-arch={arch}", *(["-v"] if verbose else []), str(source),
                               "-o", str(cubin)], capture_output=True, text=True)
        if done.returncode != 0:
            raise NvrtcError(f"ptxas failed to assemble for {arch}:\n{done.stderr}", done.stderr)
        return Compiled(ptx=compiled.ptx, cubin=cubin.read_bytes(), log=(done.stdout + done.stderr).strip(),
                        lowered_names=compiled.lowered_names)


def _log(nvrtc, program):
    return nvrtc.getProgramLog(program).rstrip("\0").strip()


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# a kernel that spills also gets "N bytes cumulative stack size" before the smem figure
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?"
                   r"(?:, (\d+) bytes cumulative stack size)?(?:, (\d+) bytes smem)?")


def parse_ptxas_log(log):
    """{kernel: Resources} from ptxas' verbose report."""
    kernels, current = {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = kernels.setdefault(m.group(1), Resources())
        elif current is None:
            continue
        elif m := _PROPERTIES.search(line):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif m := _USED.search(line):
            current.registers = int(m.group(1))
            current.barriers = int(m.group(2) or 0)
            current.shared_bytes = int(m.group(4) or 0)
    return kernels


# ---- SASS -------------------------------------------------------------------------------------------

def cuobjdump():
    """The path of cuobjdump (which runs nvdisasm beside it): on PATH, or from the
    nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels; None without one."""
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        for candidate in sorted(root.glob("*/bin/cuobjdump")):
            if (candidate.parent / "nvdisasm").exists():
                return candidate
    return None


_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.+?)\s*;")


def disassemble(cubin):
    """{kernel's (mangled) name: [SASS instruction, ...]} of a cubin (sm_XX), by cuobjdump -sass.
    NVRTC's CUBIN comes one byte short of its ELF size; cuobjdump reads it with a zero byte added."""
    tool = cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump is neither on PATH nor installed: pip install nvidia-cuda-cuobjdump "
                                "nvidia-cuda-nvdisasm")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "module.cubin"
        path.write_bytes(cubin + b"\0")
        env = {**os.environ, "PATH": f"{tool.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        done = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise NvrtcError(f"cuobjdump -sass failed: {done.stderr.strip()}", done.stderr)
    functions, current = {}, None
    for line in done.stdout.splitlines():
        if m := _FUNCTION.match(line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.search(line)):
            current.append(m.group(1))
    return functions
