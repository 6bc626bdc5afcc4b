"""Files of models: written atomically, so that an interruption leaves the old file intact; and
the state dict as safetensors, the format the ecosystem shares weights in.

``save_safetensors(model, path)`` writes ``model.state_dict()``: d2l's PyTorch keys for
ResNet-18, float32 parameters and running statistics, int64 ``num_batches_tracked``, so that
``net.load_state_dict(safetensors.torch.load_file(path))`` loads it into d2l's model with
``strict=True``. ``load_safetensors(model, path)`` reads such a file, whichever framework wrote
it, into the model's existing arrays; a missing or extra key, or a shape or dtype that does not
fit, is a SerializationError naming it. No pickle either way.
"""
import contextlib
import os
from pathlib import Path

import numpy as np


class SerializationError(ValueError):
    """A weights file that cannot be read or does not fit the model; the message says why."""


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write to a temporary file beside ``path`` and rename it over ``path`` only
    when the writing finished, so an interruption leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
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
    buffers stay intact); SerializationError unless every key, shape and dtype fits."""
    import safetensors
    import safetensors.numpy
    try:
        state = safetensors.numpy.load_file(str(path))
    except FileNotFoundError:
        raise SerializationError(f"{path}: no such file") from None
    except (OSError, safetensors.SafetensorError) as e:
        raise SerializationError(f"{path} is not a safetensors file, or it is corrupt ({e})") from None
    own = model.state_dict()
    missing, extra = [k for k in own if k not in state], [k for k in state if k not in own]
    if missing or extra:
        raise SerializationError(f"{path} does not hold this model's state dict: "
                                 + "; ".join(filter(None, [missing and f"missing keys {missing}",
                                                           extra and f"unexpected keys {extra}"])))
    for key, target in own.items():
        value = state[key]
        if value.shape != tuple(target.shape) or value.dtype != target.dtype:
            raise SerializationError(f"{path}: {key} is {value.dtype} of shape {value.shape}, the model's is "
                                     f"{target.dtype} of shape {tuple(target.shape)}")
    model.load_state_dict(state)
