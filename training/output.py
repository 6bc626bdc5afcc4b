"""The output folder of a run: a fresh one by default, checked before any data is loaded, refused
when it holds an earlier run that the flags neither continue (--resume) nor replace
(--overwrite), and locked for the run's life, so that two runs never write into one folder."""
import fcntl
import itertools
import os
import time
from pathlib import Path

from . import checkpoint
from .config import ConfigError

RUN_FILES = (checkpoint.FILENAME, "metrics.json", "metrics.csv", "training.png")
LOCK = ".lock"   # holds the pid of the run that has the folder


def fresh_default(root=Path("runs")):
    """runs/resnet18-<date>-<time>, made now: -2, -3, ... appended when another run took the name
    in the same second (mkdir is the arbiter)."""
    base = root / time.strftime("resnet18-%Y%m%d-%H%M%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    except OSError as e:
        raise ConfigError(f"cannot make an output folder in {root} ({e.strerror}): give one with --out") from None


class Claim:
    """The lock on a run's folder, held until ``release()`` (or the process's end)."""

    def __init__(self, fd):
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)   # closing the file drops the lock
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def claim(out, continues=False, overwrite=False):
    """Lock the folder ``out`` (made if missing) for this process. ConfigError when it is a file,
    cannot be written, is locked by another run, or holds an earlier run that this one neither
    ``continues`` (a resumed run, or a profile, which writes files of its own) nor may
    ``overwrite`` (then the earlier run's files are deleted now)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror})") from None
    held = Claim(fd)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(f"--out {out} is in use by another run (process {owner}): wait for it to end, or "
                              f"choose another --out") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot write there ({e.strerror})") from None
        earlier = [name for name in RUN_FILES if (out / name).exists()]
        if earlier and not continues:
            if not overwrite:
                raise ConfigError(f"--out {out} holds an earlier run ({', '.join(earlier)}): continue it with "
                                  f"--resume {out}, or replace it with --overwrite")
            for name in earlier:
                (out / name).unlink()
    except BaseException:
        held.release()
        raise
    return held


def kept(out):
    """What an interrupted run leaves in ``out``, in words, for its last message."""
    path = Path(out) / checkpoint.FILENAME if out else None
    if path is None or not path.is_file():
        return "no epoch had finished: nothing was saved"
    try:
        epoch = checkpoint.load(path)[1]["epoch"]
    except checkpoint.CheckpointError:
        return f"{path} is not readable"
    return f"the checkpoint of epoch {epoch} is kept; --resume {out} continues from it"
