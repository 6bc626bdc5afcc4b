"""Files of models: written atomically, so that an interruption leaves the old file intact."""
import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write to a temporary file beside ``path`` and rename it over ``path`` only
    when the writing finished, so an interruption leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
