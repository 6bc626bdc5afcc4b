"""Compile a CUDA C source into a shared library the emulator runs, and cache it.

The source itself is compiled unchanged, by the system's g++ (C++20, -O2), with cuda_emu.h
included first. Around it, a generated file adds, for each kernel (every non-template
``__global__`` function found in the preprocessed source, and every name expression), an
entry point that calls it from an array of argument pointers and describes its parameters;
and it defines the names of the ``extern __shared__`` arrays as one thread-local buffer, so
that, as on a GPU, all of them alias the launch's dynamic shared memory.

The runtime (runtime.cpp) is compiled once per machine and linked by every module. Both are
cached by a hash of everything that goes into them: the emulator's own sources, the compiler's
version, the flags, the source, the options and the name expressions. The headers a source
includes are recorded with their contents' hashes and checked on every cache hit. A module missing
from the cache is compiled by one process at a time (a lock file beside it): the others wait for it.
A cache that holds what is asked for is only read; one that cannot be written where something is
missing is a CacheError naming the folder.

Modules are compiled for the sanitizer (SANITIZE_FLAGS; see README.md) unless
``CUDA_EMU_SANITIZE=off`` (full, the default, or memcheck: see sanitize_level). Environment: ``CUDA_EMU_CACHE_DIR`` (default
``$XDG_CACHE_HOME/resnet-cuda-from-scratch/emu``), ``CUDA_EMU_CXXFLAGS`` (extra g++ flags, e.g.
``-O0 -g`` to debug a kernel in gdb), ``CUDA_EMU_SANITIZE``.
"""
import ast
import contextlib
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import CacheError, CompileError

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emu.h"
ABI_HEADER = HERE / "emu_abi.h"
RUNTIME_SOURCE = HERE / "runtime.cpp"

CXX_FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared",
             # CUDA code reinterprets float arrays as float4 and the like; nvcc allows it.
             "-fno-strict-aliasing",
             # No fused multiply-adds the source does not ask for; math without errno.
             "-ffp-contract=off", "-fno-math-errno",
             # A frame larger than a thread's stack would skip the guard page and land in the
             # next thread's stack: probe every page, so that it faults as a stack overflow.
             "-fstack-clash-protection",
             # Frame pointers: the runtime tells a call instance (of a barrier, of a warp-wide
             # instruction) by the chain of return addresses.
             "-fno-omit-frame-pointer",
             # A template kernel's __shared__ array is a thread_local static of an inline function, which
             # g++ otherwise binds STB_GNU_UNIQUE: one per process, across libraries loaded RTLD_LOCAL, so
             # that a source built both with and without the sanitizer would share the first one's.
             "-fno-gnu-unique",
             # The extern __shared__ arrays are thread_local names of the module's dynamic shared memory
             # (_entries_source), which needs no initialiser: declared in a template's body, g++ would call
             # one through a weak symbol no one defines.
             "-fno-extern-tls-init",
             "-fmax-errors=10")
# The sanitizer (runtime.cpp): ThreadSanitizer's instrumentation makes every load and store of a
# kernel call __tsan_{read,write}N, and the coverage instrumentation's trace-cmp every comparison
# __sanitizer_cov_trace_cmpN with its operands (an undefined shuffle value may not be compared), which
# the runtime defines (TSan's own runtime is never linked: the module is compiled with these flags and
# linked without them); line tables, to name the .cu line of an access; and no transformation that
# changes the accesses the source makes (vectorised or merged loads and stores would look misaligned)
# or merges two call sites into one.
SANITIZE_FLAGS = ("-fsanitize=thread", "-fsanitize-coverage=trace-cmp", "-fno-plt", "-fno-exceptions", "-DEMU_SANITIZE=1",
                  "-g1", "-fno-tree-vectorize", "-fno-tree-slp-vectorize", "-fno-tree-sra", "-fno-store-merging",
                  "-fno-crossjumping", "-fno-tree-tail-merge", "-fno-optimize-sibling-calls")


LEVELS = {"full": 2, "memcheck": 1, "off": 0}
_ALIASES = {"1": "full", "": "full", "0": "off"}
_levels = []   # what sanitizer() asked for, innermost last


def sanitize_level():
    """The sanitizer's level for what is compiled and launched now: "full" (every check), "memcheck"
    (bounds, alignment, divergent barriers and the uses of undefined shuffle values: not the shadow memory
    that races and uninitialised reads need, which costs the most) or "off": as sanitizer() says, else
    CUDA_EMU_SANITIZE (full by default)."""
    if _levels:
        return _levels[-1]
    value = os.environ.get("CUDA_EMU_SANITIZE", "full").strip().lower()
    level = _ALIASES.get(value, value)
    if level not in LEVELS:
        raise CompileError(f"CUDA_EMU_SANITIZE={value!r}: give full, memcheck or off (1 or 0)")
    return level


def sanitizing():
    """Whether modules compiled now are instrumented for the sanitizer (at any level but off)."""
    return sanitize_level() != "off"


@contextlib.contextmanager
def sanitizer(level="full"):
    """Modules made and kernels launched inside the block run with the sanitizer at `level` ("full",
    "memcheck" or "off"; True and False for full and off): a test of the emulation itself turns it off
    (a kernel that reads a cp.async destination before its wait, to see the NaN there), whole networks
    may run under memcheck only. A module compiled without the sanitizer runs without it."""
    level = {True: "full", False: "off"}.get(level, level)
    level = _ALIASES.get(str(level).strip().lower(), str(level).strip().lower())
    if level not in LEVELS:
        raise ValueError(f"sanitizer level {level!r}: full, memcheck or off")
    _levels.append(level)
    try:
        yield
    finally:
        _levels.pop()


def cache_dir():
    explicit = os.environ.get("CUDA_EMU_CACHE_DIR")
    if explicit:
        return Path(explicit)
    from kernels import cache_folder   # the package's, imported before this module
    return cache_folder("emu")


def _extra_flags():
    return tuple(shlex.split(os.environ.get("CUDA_EMU_CXXFLAGS", "")))


@functools.lru_cache(maxsize=None)
def _compiler_identity():
    cxx = shutil.which("g++")
    if cxx is None:
        raise CompileError("the CUDA emulator needs g++ (with C++20) on the PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    return cxx, version.splitlines()[0]


def _digest(*parts):
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else str(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


@contextlib.contextmanager
def _writing_the_cache():
    """An OSError inside (a read-only file system, no write permission, a path under a file, a full disk)
    becomes a CacheError of one line that names the cache folder."""
    try:
        yield
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        raise CacheError(f"the CUDA emulator's cache folder {cache_dir()} cannot be written "
                         f"({e.strerror or e}{where}); set CUDA_EMU_CACHE_DIR to a folder that can be") from None


def _write_atomically(path, data):
    with _writing_the_cache():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        os.replace(tmp, path)


@contextlib.contextmanager
def _compiling(path):
    """Held while this process compiles what ``path`` names (a lock file beside it, in a folder it makes):
    another process that needs the same module at the same time (the two workers of --gpus 2, two test
    workers on a new machine) waits for it and then finds it in the cache, instead of compiling it a
    second time. The lock goes with the process, should it die."""
    import fcntl  # noqa: PLC0415  (POSIX, as g++ and the emulator's fibers are)
    with _writing_the_cache():
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run_compiler(args, what):
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise CompileError(f"{what}: g++ failed\n{result.stderr.strip()}")
    return result


@functools.lru_cache(maxsize=None)
def runtime_library():
    """The path of the compiled runtime, compiling it on first use on this machine."""
    cxx, version = _compiler_identity()
    flags = CXX_FLAGS + _extra_flags()
    key = _digest(RUNTIME_SOURCE.read_bytes(), ABI_HEADER.read_bytes(), version, flags)
    path = cache_dir() / f"libcudaemu-{key}.so"
    if path.exists():
        return path
    with _compiling(path):
        if not path.exists():   # unless another process made it while this one waited
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            # Modules find the runtime by this name among the libraries already loaded (native.py
            # loads it first), so that every module of a process talks to the same scheduler.
            _run_compiler([cxx, *flags, str(RUNTIME_SOURCE), "-o", str(tmp), f"-Wl,-soname,{path.name}",
                           "-pthread", "-ldl"], "emulator runtime")
            os.replace(tmp, path)
    return path


# ---- options ----------------------------------------------------------------------------------

def preprocessor_flags(options):
    """g++ flags for the NVRTC options that change what the source means (-I, -D, -U,
    -include); every other option (architecture, -std, --use_fast_math, -lineinfo, ...)
    concerns code generation for a GPU and is ignored."""
    flags = []
    takes_value = {"-I": "-I", "--include-path": "-I", "-D": "-D", "--define-macro": "-D",
                   "-U": "-U", "--undefine-macro": "-U", "-include": "-include",
                   "--pre-include": "-include"}
    options = list(options)
    i = 0
    while i < len(options):
        opt = options[i]
        name, eq, value = opt.partition("=")
        if opt in takes_value and i + 1 < len(options):
            flag, value = takes_value[opt], options[i + 1]
            i += 1
        elif eq and name in takes_value and name.startswith("--"):
            flag = takes_value[name]
        elif opt[:2] in ("-I", "-D", "-U") and len(opt) > 2:
            flag, value = opt[:2], opt[2:]
        else:
            flag = None
        i += 1
        if flag == "-I":
            flags.append("-I" + str(Path(value).resolve()))
        elif flag == "-include":
            flags += ["-include", str(Path(value).resolve()) if Path(value).exists() else value]
        elif flag:
            flags.append(flag + value)
    return flags


# ---- finding the kernels -----------------------------------------------------------------------

_GLOBAL = re.compile(r"\b__global__\b")
_EXTERN_SHARED = re.compile(
    r"(?:\bextern\b[^;{}]*?\b__shared__\b|\b__shared__\b[^;{}]*?\bextern\b)[^;{}]*?\b(\w+)\s*\[\s*\]\s*;")


def _matching_paren(text, open_index):
    depth = 0
    for i in range(open_index, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _split_top_level(text):
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _integer_constant(text):
    """The value of a constant integer expression such as ``256`` or ``(32 * 8)``, else None."""
    try:
        node = ast.parse(re.sub(r"(\d)[uUlL]+\b", r"\1", text.strip()), mode="eval").body
    except SyntaxError:
        return None

    def value(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div)):
            left, right = value(n.left), value(n.right)
            if isinstance(n.op, (ast.Div, ast.FloorDiv)):
                return left // right
            return {ast.Add: left + right, ast.Sub: left - right, ast.Mult: left * right}[type(n.op)]
        raise ValueError

    try:
        return value(node)
    except (ValueError, ZeroDivisionError):
        return None


def _namespaces(text):
    """[(start, end, name)]: the spans of the source's named namespaces."""
    spans, open_braces = [], []
    for m in re.finditer(r"\bnamespace\s+([\w:]+)\s*\{|\{|\}", text):
        if m.group(1) or m.group(0) == "{":
            open_braces.append((m.group(1), m.end()))
        elif open_braces:
            name, start = open_braces.pop()
            if name:
                spans.append((start, m.start(), name))
    return sorted(spans)


def scan_kernels(text):
    """The ``__global__`` functions of a preprocessed source: {name: {"qualified": name with
    its namespaces, "template": bool, "parameters": [declarations], "launch_bounds": int or None}}."""
    kernels = {}
    namespaces = _namespaces(text)
    for match in _GLOBAL.finditer(text):
        start = max(text.rfind(c, 0, match.start()) for c in ";{}") + 1
        head_end = match.end()
        while True:
            call = re.compile(r"\b([A-Za-z_]\w*)\s*\(").search(text, head_end)
            if call is None:
                break
            close = _matching_paren(text, call.end() - 1)
            if call.group(1) in ("__launch_bounds__", "__attribute__", "alignas", "__align__"):
                head_end = close + 1
                continue
            name, parameters = call.group(1), text[call.end():close]
            head = text[start:call.start()]
            bounds = re.search(r"__launch_bounds__\s*\(", head)
            max_threads = None
            if bounds:
                arguments = head[bounds.end():_matching_paren(head, bounds.end() - 1)]
                max_threads = _integer_constant(_split_top_level(arguments)[0])
            declarations = [] if parameters.strip() in ("", "void") else _split_top_level(parameters)
            qualifier = "".join(f"{ns}::" for first, last, ns in namespaces if first <= match.start() < last)
            kernels.setdefault(name, {
                "qualified": qualifier + name,
                "template": re.search(r"\btemplate\b", text[start:match.start()]) is not None,
                "parameters": [" ".join(d.split()) for d in declarations],
                "launch_bounds": max_threads,
            })
            break
    return kernels


def scan_extern_shared(text):
    return sorted(set(_EXTERN_SHARED.findall(text)))


# ---- generated files ---------------------------------------------------------------------------

def _entries_source(source_path, expressions, extern_shared):
    lines = [f'#include "{HEADER}"', f'#include "{source_path}"', "",
             "// Generated by kernels/emu/build.py: the dynamic shared memory, under every",
             "// extern __shared__ name (a name in assembly can alias it whatever its C++ type),",
             "// and the kernels' entry points.",
             'extern "C" {',
             "alignas(kEmuDynamicSharedAlign) thread_local unsigned char",
             "    emu_dynamic_shared[kEmuDynamicSharedBytes + kEmuSharedTailBytes];",
             "void* emu_dynamic_shared_base() { return emu_dynamic_shared; }",
             "}"]
    lines += [f'asm(".globl {name}\\n.type {name}, @tls_object\\n.set {name}, emu_dynamic_shared");'
              for name in extern_shared]
    lines += [f"EMU_KERNEL_ENTRY({i}, {expression})" for i, expression in enumerate(expressions)]
    return "\n".join(lines) + "\n"


def _dependencies(depfile, exclude):
    """The headers g++ read for a source (from its -MMD file) with their contents' hashes."""
    text = Path(depfile).read_text().replace("\\\n", " ")
    files = shlex.split(text.partition(":")[2])
    return {f: _digest(Path(f).read_bytes()) for f in map(os.path.abspath, files) if f not in exclude}


def _dependencies_unchanged(deps):
    try:
        return all(_digest(Path(f).read_bytes()) == h for f, h in deps.items())
    except OSError:
        return False


def build_module(code, options=(), name_expressions=()):
    """Compile (or find in the cache) the module for a source. Returns its metadata:
    {"library": path of the .so, "entries": [{"expression", "kernel", ...scan fields}]}."""
    cxx, version = _compiler_identity()
    runtime = runtime_library()
    pre = preprocessor_flags(options)
    sanitize = sanitizing()
    flags = CXX_FLAGS + (SANITIZE_FLAGS if sanitize else ()) + _extra_flags()
    name_expressions = tuple(name_expressions or ())
    key = _digest(HEADER.read_bytes(), ABI_HEADER.read_bytes(), version, flags, runtime.name,
                  code, pre, name_expressions)
    folder = cache_dir() / key[:2]
    meta_path = folder / f"{key}.json"
    cached = _cached(meta_path)
    if cached:
        return cached
    with _compiling(meta_path):
        return _cached(meta_path) or _build(code, key, folder, meta_path, cxx, pre, flags, runtime, sanitize,
                                            name_expressions)


def _cached(meta_path):
    """The metadata of a module in the cache whose headers are unchanged, else None."""
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if _dependencies_unchanged(meta["dependencies"]) and Path(meta["library"]).exists():
            return meta
    return None


def _build(code, key, folder, meta_path, cxx, pre, flags, runtime, sanitize, name_expressions):
    """build_module's compile of a module missing from the cache (under its lock)."""
    source = folder / f"{key}.cu"
    _write_atomically(source, code)

    depfile = folder / f"{key}.{os.getpid()}.d"
    scan = _run_compiler([cxx, "-E", "-P", "-x", "c++", "-std=c++20", "-D__CUDACC__=1", "-D__CUDA_EMU__=1",
                          *pre, "-MMD", "-MF", str(depfile), str(source)], "preprocessing")
    kernels = scan_kernels(scan.stdout)
    dependencies = _dependencies(depfile, exclude={str(source)})
    depfile.unlink()
    expressions = [v["qualified"] for v in kernels.values() if not v["template"]]
    expressions += [e for e in name_expressions if e not in expressions]
    entries = []
    for expression in expressions:
        kernel = re.match(r"\s*(?:::)?([\w:]+)", expression).group(1).split("::")[-1]
        info = kernels.get(kernel, {"template": False, "parameters": [], "launch_bounds": None})
        entries.append({**info, "expression": expression, "kernel": kernel})

    entries_file = folder / f"{key}.entries.cpp"
    _write_atomically(entries_file, _entries_source(source, expressions, scan_extern_shared(scan.stdout)))
    library = folder / f"{key}-{_digest(json.dumps(dependencies, sort_keys=True))}.so"
    tmp = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    objects = folder / f"{key}.{os.getpid()}.o"
    _run_compiler([cxx, *flags, *pre, "-c", str(entries_file), "-o", str(objects)], f"compiling {source}")
    _run_compiler([cxx, *CXX_FLAGS, str(objects), str(runtime), "-Wl,-z,defs", "-o", str(tmp)], f"linking {source}")
    objects.unlink()
    os.replace(tmp, library)
    meta = {"library": str(library), "source": str(source), "entries": entries, "dependencies": dependencies,
            "sanitize": sanitize}
    _write_atomically(meta_path, json.dumps(meta, indent=1))
    return meta
