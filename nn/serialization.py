"""Files of models: written atomically, so that an interruption leaves the old file intact; and
the state dict as safetensors, the format the ecosystem shares weights in.

``save_safetensors(model, path)`` writes ``model.state_dict()``: d2l's PyTorch keys for
ResNet-18, float32 parameters and running statistics, int64 ``num_batches_tracked``, so that
``net.load_state_dict(safetensors.torch.load_file(path))`` loads it into d2l's model with
``strict=True``. ``load_safetensors(model, path)`` reads such a file, whichever framework wrote
it, into the model's existing arrays: bfloat16 and float16 values are widened to float32, which is
exact; a missing or extra key, a shape or another dtype that does not fit, a value that is NaN or
infinite, or a negative running variance is a SerializationError naming the key. Only regular
files are read (a named pipe would block the open). No pickle either way.
"""
import contextlib
import errno
import json
import os
import stat
from pathlib import Path

import numpy as np

from kernels import bfloat16

# what a float32 weight may come as in a file, widened exactly: the halves' values are all float32's
_WIDENED = (np.dtype(np.float16), bfloat16)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


# paths that name nothing a file could be, in file_kind's words
_PATH_ERRORS = {errno.ELOOP: "a loop of symbolic links", errno.ENAMETOOLONG: "a name too long for the file system"}


def file_kind(path):
    """What is at ``path``, following symbolic links: "a regular file", "a folder", "a named pipe
    (FIFO)", "a character device", ..., "a loop of symbolic links", "a name too long for the file
    system"; None when nothing is. Asked before an open, which would
    block on a named pipe and ignore signals while it waits."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:   # what the path itself cannot be
        if e.errno in _PATH_ERRORS:
            return _PATH_ERRORS[e.errno]
        raise
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


class SerializationError(ValueError):
    """A weights file that cannot be read or does not fit the model; the message says why."""


def temporary(path):
    """The temporary file beside ``path`` that atomic_write of this process writes first."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one


def remove_stale_temporaries(path, pattern=None):
    """Delete the temporary files beside ``path`` that writers killed before they finished left
    (SIGKILL, a power cut): those of processes that no longer run. With ``pattern`` ("*"), those of
    every file of the folder ``path`` whose name matches it."""
    path = Path(path)
    folder, name = (path, pattern) if pattern else (path.parent, path.name)
    for leftover in folder.glob(f".{name}.*.tmp"):
        pid = leftover.name[:-len(".tmp")].rpartition(".")[2]
        if pid.isdigit() and not _running(int(pid)):
            leftover.unlink(missing_ok=True)


def _running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write to a temporary file beside ``path`` and rename it over ``path`` only
    when the writing finished, so an interruption leaves the old file intact."""
    path = Path(path)
    remove_stale_temporaries(path)
    tmp = temporary(path)
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    except OSError as e:  # a full disk, say: the error names the file meant, not the temporary one
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        tmp.unlink(missing_ok=True)


def save_safetensors(model, path):
    """``model.state_dict()`` as a safetensors file at ``path``, written atomically."""
    import safetensors.numpy
    # copies: C-contiguous (a conv weight of a flat buffer is a channels-last view), on the host, and
    # 0-d kept 0-d (np.ascontiguousarray would make it 1-d)
    state = {key: np.array(value if isinstance(value, np.ndarray) else value.get(), order="C")
             for key, value in model.state_dict().items()}
    # "pt": the keys, dtypes and shapes are those of PyTorch's state dict (loaders such as
    # transformers' refuse a file that does not say its format)
    with atomic_write(path) as f:
        f.write(safetensors.numpy.save(state, metadata={"format": "pt"}))


def load_safetensors(model, path):
    """Copy the state dict in the safetensors file at ``path`` into ``model``, in place (its flat
    buffers stay intact); SerializationError unless every key, shape and dtype fits and every value
    is possible (see the module's docstring)."""
    state = _read_safetensors(path)
    own = model.state_dict()
    missing, extra = [k for k in own if k not in state], [k for k in state if k not in own]
    if missing or extra:
        prefixed = [k for k in extra if k.startswith("module.") and k[len("module."):] in own]
        if prefixed and len(prefixed) == len(extra):
            raise SerializationError(f"{path}: every key starts with 'module.' (a state dict of a model wrapped in "
                                     f"PyTorch's DataParallel or DistributedDataParallel): save the wrapped model's "
                                     f"net.module.state_dict() instead")
        raise SerializationError(f"{path} does not hold this model's state dict: "
                                 + "; ".join(filter(None, [missing and f"missing keys {_some(missing)}",
                                                           extra and f"unexpected keys {_some(extra)}"])))
    for key, target in own.items():
        value = state[key]
        if value.dtype != target.dtype and target.dtype == np.float32 and value.dtype in _WIDENED:
            value = state[key] = value.astype(np.float32)   # exact
        if value.shape != tuple(target.shape) or value.dtype != target.dtype:
            raise SerializationError(f"{path}: {key} is {value.dtype} of shape {value.shape}, the model's is "
                                     f"{target.dtype} of shape {tuple(target.shape)}")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise SerializationError(f"{path}: {key} holds {np.count_nonzero(~np.isfinite(value))} values that are "
                                     f"NaN or infinite, of {value.size}")
        if key.endswith("running_var") and (value < 0).any():
            raise SerializationError(f"{path}: {key} holds a negative variance ({value.min():g}): not a running "
                                     f"variance")
    model.load_state_dict(state)


def _some(keys, shown=6):
    """A few of ``keys`` for a one-line message, and how many more there are."""
    more = len(keys) - shown
    return repr(keys[:shown]) + (f" and {more} more" if more > 0 else "")


def _read_safetensors(path):
    """{key: NumPy array} of a safetensors file: bfloat16 as ml_dtypes' (which kernels registers with
    NumPy), unless the file holds a dtype NumPy lacks (float8): then read by _read_widening."""
    import safetensors
    import safetensors.numpy
    kind = file_kind(path)
    if kind is None:
        raise SerializationError(f"{path}: no such file")
    if kind != "a regular file":
        raise SerializationError(f"{path} is {kind}, not a regular file")
    try:
        return safetensors.numpy.load_file(str(path))
    except (OSError, safetensors.SafetensorError) as e:
        raise SerializationError(f"{path} is not a safetensors file, or it is corrupt ({e})") from None
    except (TypeError, AttributeError):   # a dtype NumPy does not have (float8): read the file here
        try:
            return _read_widening(path)
        except (ValueError, KeyError, TypeError) as e:
            raise SerializationError(f"{path} is not a safetensors file, or it is corrupt ({e})") from None


_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
           "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


def _read_widening(path):
    """The safetensors format read directly (an 8-byte length, a JSON header, the data), for files
    whose dtypes NumPy lacks: bfloat16 becomes float32 (its bits are float32's upper half, so the
    widening is exact); any other such dtype is an error naming the key."""
    data = Path(path).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    body, state = memoryview(data)[8 + length:], {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if entry["dtype"] == "BF16":
            bits = np.frombuffer(body[begin:end], "<u2").astype(np.uint32) << np.uint32(16)
            state[key] = bits.view(np.float32).reshape(entry["shape"])
        elif entry["dtype"] in _DTYPES:
            state[key] = np.frombuffer(body[begin:end], _DTYPES[entry["dtype"]]).reshape(entry["shape"]).copy()
        else:
            raise SerializationError(f"{path}: {key} is {entry['dtype']}, a dtype this loader does not take "
                                     f"(float32, or bfloat16 and float16, which it widens to float32)")
    return state
