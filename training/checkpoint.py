"""Checkpoints: one .npz (no pickles) holding the flat parameters, the batch-norm
buffers, the optimizer's velocity and a JSON record of everything else (epoch,
configuration, metrics, RNG state). Files are written atomically."""
import json
from pathlib import Path

import numpy as np

from kernels import get_array_module
from nn.modules import FlatParameters
from nn.serialization import atomic_write, file_kind

FILENAME = "checkpoint.npz"
_BUFFER = "buffer/"


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable or does not fit the model."""


class NotFinite(CheckpointError):
    """The model or the optimizer holds NaN or infinity: such a state is never written."""


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def save(path, model, optimizer, record):
    """``record``: a JSON-serialisable dict (epoch, config, metrics, RNG state...). NotFinite,
    and nothing written, when a parameter, the velocity or a buffer is NaN or infinite."""
    arrays = {"params": _host(optimizer.flat.data), "record": np.array(json.dumps(record, allow_nan=False)),
              "layout": np.array(FlatParameters.LAYOUT)}
    if optimizer.velocity is not None:
        arrays["velocity"] = _host(optimizer.velocity)
    for name, buf in model.named_buffers():
        arrays[_BUFFER + name] = _host(buf)
    spoiled = {name: int(np.count_nonzero(~np.isfinite(a))) for name, a in arrays.items() if a.dtype.kind == "f"}
    spoiled = {name: n for name, n in spoiled.items() if n}
    if spoiled:
        raise NotFinite("not finite: " + ", ".join(f"{n} of {arrays[name].size} elements of {name}"
                                                   for name, n in spoiled.items()))
    with atomic_write(path) as f:
        np.savez(f, **arrays)


def resolve(path):
    """A checkpoint file, or the checkpoint inside an output folder."""
    path = Path(path)
    if file_kind(path) == "a folder":
        path = path / FILENAME
    kind = file_kind(path)
    if kind is None:
        raise CheckpointError(f"no checkpoint at {path}")
    if kind != "a regular file":
        raise CheckpointError(f"{path} is {kind}, not a checkpoint file")
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) > 8 and head[8:9] == b"{":   # an 8-byte header length, then the JSON header
        raise CheckpointError(f"{path} is a safetensors file of weights, not a checkpoint of a run: start a new run "
                              f"from it with --init-from {path}")
    return path


def record_of(path):
    """The record (epoch, config, metrics, ...) of the checkpoint at ``path``, without its arrays."""
    path = resolve(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            return _complete(json.loads(str(f["record"])))
    except Exception as e:   # as in load()
        raise CheckpointError(f"not a checkpoint of this program, or corrupt: {path} ({_reason(e)})") from None


RECORD_KEYS = ("epoch", "config", "metrics", "rng_state")


def load(path):
    """(arrays, record) of the checkpoint at ``path`` (a file or an output folder)."""
    path = resolve(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        record = _complete(json.loads(str(arrays.pop("record"))))
        if "params" not in arrays:
            raise KeyError("no params")
    except Exception as e:  # a damaged zip, a .npy, missing keys, bad JSON: all the same to the user
        raise CheckpointError(f"not a checkpoint of this program, or corrupt: {path} ({_reason(e)})") from None
    return arrays, record


def _complete(record):
    """The record, or KeyError naming what it lacks."""
    missing = [k for k in RECORD_KEYS if not isinstance(record, dict) or k not in record]
    if missing:
        raise KeyError(f"no {', '.join(missing)}")
    return record


def _reason(error):
    """What went wrong reading a checkpoint, without NumPy's advice to allow pickles (never do)."""
    if "allow_pickle" in str(error):
        return "it holds pickled objects, which this program never writes nor reads"
    return f"{type(error).__name__}: {error}"


def _copy(target, value, name):
    if target.shape != value.shape:
        raise CheckpointError(f"checkpoint's {name} has shape {value.shape}, the model's "
                              f"{target.shape}: it was made for another width or model")
    target[...] = get_array_module(target).asarray(value)


def restore(arrays, model, optimizer):
    """Copy a checkpoint's arrays into ``model`` and ``optimizer`` in place."""
    layout = str(arrays["layout"]) if "layout" in arrays else "unaligned, every parameter in its own order"
    if layout != FlatParameters.LAYOUT:
        raise CheckpointError(f"the checkpoint's flat parameter buffer is laid out as '{layout}', this version's as "
                              f"'{FlatParameters.LAYOUT}': it was written by an earlier version and cannot be resumed "
                              f"by this one")
    with optimizer.flat.writing() as params:   # the rounded copy of the weights is remade from these
        _copy(params, arrays["params"], "flat parameter buffer")
    if optimizer.velocity is not None:
        if "velocity" not in arrays:
            raise CheckpointError("checkpoint has no momentum buffer but the optimizer uses momentum")
        _copy(optimizer.velocity, arrays["velocity"], "momentum buffer")
    for name, buf in model.named_buffers():
        if _BUFFER + name not in arrays:
            raise CheckpointError(f"checkpoint lacks the buffer {name}")
        _copy(buf, arrays[_BUFFER + name], name)
