"""ctypes bindings to the emulator's runtime and to the compiled kernel modules."""
import ctypes
import functools
import re
import struct
from pathlib import Path

from . import build
from .errors import CompileError

_ERROR_BYTES = 4096


@functools.lru_cache(maxsize=None)
def runtime():
    lib = ctypes.CDLL(str(build.runtime_library()))
    lib.emu_module_load.restype = ctypes.c_void_p
    lib.emu_module_load.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.emu_module_symbol.restype = ctypes.c_void_p
    lib.emu_module_symbol.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint), ctypes.c_size_t,
                               ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int,
                               ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int, ctypes.c_char_p,
                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p,
                               ctypes.c_size_t]
    lib.emu_fenced_alloc.restype = ctypes.c_void_p
    lib.emu_fenced_alloc.argtypes = [ctypes.c_size_t]
    lib.emu_fenced_free.restype = None
    lib.emu_fenced_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


_dladdr = ctypes.CDLL(None).dladdr
_dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]


def elf_symbols(path):
    """(functions, tls): {offset: [names]} of the functions and [(name, offset, size)] of the
    thread-local objects in a shared library's full symbol table (.symtab)."""
    data = Path(path).read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    functions, tls = {}, []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings_offset = sections[link][4]
        for at in range(offset, offset + size, entsize):
            name_at, info, _, _, value, sym_size = struct.unpack_from("<IBBHQQ", data, at)
            end = data.index(b"\0", strings_offset + name_at)
            name = data[strings_offset + name_at:end].decode()
            if info & 0xF == 2:  # STT_FUNC
                functions.setdefault(value, []).append(name)
            elif info & 0xF == 6:  # STT_TLS
                tls.append((name, value, sym_size))
    return functions, tls


class Module:
    """A loaded kernel module: its entries' addresses, signatures and symbol names, and the
    static shared memory each kernel declares."""

    def __init__(self, meta):
        rt = runtime()
        err = ctypes.create_string_buffer(_ERROR_BYTES)
        self.handle = rt.emu_module_load(meta["library"].encode(), err, _ERROR_BYTES)
        if not self.handle:
            raise CompileError(f"cannot load {meta['library']}: {err.value.decode()}")
        functions, tls = elf_symbols(meta["library"])
        dynamic = {offset for name, offset, _ in tls if name == "emu_dynamic_shared"}
        self.library, self.sanitize = meta["library"], meta.get("sanitize", False)
        self.entries = []
        for i, entry in enumerate(meta["entries"]):
            address = self._symbol(f"emu_entry_{i}")
            kernel_address = ctypes.CFUNCTYPE(ctypes.c_void_p)(self._symbol(f"emu_kernel_{i}"))()
            info = _DlInfo()
            _dladdr(kernel_address, ctypes.byref(info))
            if info.saddr == kernel_address:  # an exported kernel
                symbol = info.sname.decode()
            else:  # a static one: only the full symbol table knows it
                names = functions.get(kernel_address - info.fbase, [])
                symbol = next((n for n in names if n.startswith("_Z")), names[0] if names else "")
            buf = ctypes.create_string_buffer(_ERROR_BYTES)
            describe = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int)(self._symbol(f"emu_signature_{i}"))
            describe(buf, _ERROR_BYTES)
            self.entries.append({**entry, "address": address, "symbol": symbol,
                                 "signature": _parse_signature(buf.value.decode()),
                                 "static_shared": _static_shared(symbol, tls, dynamic)})
        kernels = {_locals_prefix(e["symbol"]) for e in self.entries}
        for e in self.entries:
            e["shared_variables"] = _shared_variables(_locals_prefix(e["symbol"]), kernels, tls, dynamic)

    def _symbol(self, name):
        address = runtime().emu_module_symbol(self.handle, name.encode())
        if not address:
            raise CompileError(f"emulator module lacks {name}")
        return address


def _parse_signature(text):
    parameters = []
    for item in filter(None, text.split(";")):
        pointer, const, kind, size, count, align = item.split(",")
        parameters.append({"pointer": pointer == "1", "const": const == "1", "kind": kind,
                           "size": int(size), "count": int(count), "align": int(align)})
    return parameters


def _locals_prefix(symbol):
    """How the symbols of a function's block-scope statics begin: _ZZ<its encoding>E."""
    encoding = symbol[2:] if symbol.startswith("_Z") else f"{len(symbol)}{symbol}"
    return f"_ZZ{encoding}E"


def _static_shared(symbol, tls, dynamic):
    """Bytes of the __shared__ arrays a kernel declares in its body (their symbols are
    _ZZ<kernel>E<name>), plus any at namespace scope."""
    own = _locals_prefix(symbol)
    return sum(size for name, offset, size in tls
               if offset not in dynamic and (name.startswith(own) or not name.startswith("_ZZ")))


def _shared_variables(own, kernels, tls, dynamic):
    """[(offset, bytes, name)] of the __shared__ variables a kernel may access (the sanitizer's
    memcheck): its own, those at namespace scope and those of the device functions it may call;
    not another kernel's (nor the dynamic shared memory, whose size the launch gives)."""
    return [(offset, size, _short_name(name)) for name, offset, size in tls
            if offset not in dynamic and size and (name.startswith(own) or not name.startswith("_ZZ") or
                                                   not any(name.startswith(k) for k in kernels))]


def _short_name(symbol):
    """The source's name of a block-scope static (_ZZ...E4tile: tile), else the symbol."""
    match = re.search(r"E(\d+)(\w+?)(?:_\d+)?$", symbol) if symbol.startswith("_ZZ") else None
    return match.group(2)[:int(match.group(1))] if match and len(match.group(2)) >= int(match.group(1)) else symbol
