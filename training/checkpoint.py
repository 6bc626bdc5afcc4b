"""Checkpoints: one .npz (no pickles) holding the flat parameters, the batch-norm
buffers, the optimizer's velocity and a JSON record of everything else (epoch,
configuration, metrics, RNG state). Files are written atomically."""
import json
from pathlib import Path

import numpy as np

from kernels import get_array_module
from nn.serialization import atomic_write

FILENAME = "checkpoint.npz"
_BUFFER = "buffer/"


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable or does not fit the model."""


def _host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def save(path, model, optimizer, record):
    """``record``: a JSON-serialisable dict (epoch, config, metrics, RNG state...)."""
    arrays = {"params": _host(optimizer.flat.data), "record": np.array(json.dumps(record))}
    if optimizer.velocity is not None:
        arrays["velocity"] = _host(optimizer.velocity)
    for name, buf in model.named_buffers():
        arrays[_BUFFER + name] = _host(buf)
    with atomic_write(path) as f:
        np.savez(f, **arrays)


def resolve(path):
    """A checkpoint file, or the checkpoint inside an output folder."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def load(path):
    """(arrays, record) of the checkpoint at ``path`` (a file or an output folder)."""
    path = resolve(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        record = json.loads(str(arrays.pop("record")))
    except Exception as e:  # a damaged zip, a missing key, bad JSON: all the same to the user
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    return arrays, record


def _copy(target, value, name):
    if target.shape != value.shape:
        raise CheckpointError(f"checkpoint's {name} has shape {value.shape}, the model's "
                              f"{target.shape}: it was made for another width or model")
    target[...] = get_array_module(target).asarray(value)


def restore(arrays, model, optimizer):
    """Copy a checkpoint's arrays into ``model`` and ``optimizer`` in place."""
    _copy(optimizer.flat.data, arrays["params"], "flat parameter buffer")
    if optimizer.velocity is not None:
        if "velocity" not in arrays:
            raise CheckpointError("checkpoint has no momentum buffer but the optimizer uses momentum")
        _copy(optimizer.velocity, arrays["velocity"], "momentum buffer")
    for name, buf in model.named_buffers():
        if _BUFFER + name not in arrays:
            raise CheckpointError(f"checkpoint lacks the buffer {name}")
        _copy(buf, arrays[_BUFFER + name], name)
