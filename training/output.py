"""The output folder of a run: a fresh one by default, checked before any data is loaded, refused
when it holds an earlier run that the flags neither continue (--resume) nor replace
(--overwrite), and locked for the run's life, so that two runs never write into one folder.

Nothing of an earlier run is lost to a run that fails: --overwrite sets the earlier run's files
aside (in the folder's ``.replaced``) only once the new run has passed every check, deletes them
when the new run writes its first checkpoint, and puts them back when it ends without one; a
process killed in between leaves them set aside, and the next run on the folder puts them back
first. The files a run writes are its own: --export may name none of them."""
import fcntl
import itertools
import os
import shutil
import time
from pathlib import Path

from nn.serialization import file_kind, remove_stale_temporaries
from . import checkpoint
from .config import ConfigError

RUN_FILES = (checkpoint.FILENAME, "metrics.json", "metrics.csv", "training.png")
LOCK = ".lock"   # holds the pid of the run that has the folder
REPLACED = ".replaced"   # an earlier run's files, set aside by --overwrite until the new run has a checkpoint
_made = []   # the default folders this process made, removed again if it writes nothing in them


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
                _made.append(path)
                return path
            except FileExistsError:
                continue
    except OSError as e:
        raise ConfigError(f"cannot make an output folder in {root} ({e.strerror}): give one with --out") from None


def discard_unused():
    """Remove the default folders this process made that hold nothing but a lock (a start that failed)."""
    for path in _made:
        try:
            if {p.name for p in path.iterdir()} <= {LOCK}:
                shutil.rmtree(path)
        except OSError:
            pass
    _made.clear()


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
    ``overwrite`` (then ``set_aside`` moves the earlier run's files out of the way, once the new
    run is ready to start). Files an earlier overwrite set aside and never settled go back first."""
    out = Path(out)
    kind = file_kind(out)
    if kind not in (None, "a folder"):
        raise ConfigError(f"--out {out} is {'a file' if kind == 'a regular file' else kind}, not a folder")
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
            restore_set_aside(out)
            remove_stale_temporaries(out, "*")   # the run's files', and an export's into the folder
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot write there ({e.strerror})") from None
        earlier = earlier_run(out)
        if earlier and not continues and not overwrite:
            raise ConfigError(f"--out {out} holds an earlier run ({', '.join(earlier)}): continue it with "
                              f"--resume {out}, or replace it with --overwrite")
    except BaseException:
        held.release()
        raise
    return held


def earlier_run(out):
    """The files of a run that ``out`` holds."""
    return [name for name in RUN_FILES if (Path(out) / name).exists()]


def set_aside(out):
    """Move the earlier run's files in ``out`` into its .replaced folder: a run with --overwrite
    does so once it has passed every check, before its first epoch."""
    aside = Path(out) / REPLACED
    for name in earlier_run(out):
        aside.mkdir(exist_ok=True)
        os.replace(Path(out) / name, aside / name)


def settle(out):
    """The run in ``out`` has written a checkpoint of its own: the files it replaced go for good."""
    shutil.rmtree(Path(out) / REPLACED, ignore_errors=True)


def restore_set_aside(out):
    """Put back the files of an earlier run that a run which never wrote a checkpoint set aside
    (it failed, was stopped, or was killed), unless a file of that name is there now."""
    aside = Path(out) / REPLACED
    if not aside.is_dir():
        return
    for moved in aside.iterdir():
        if not (Path(out) / moved.name).exists():
            os.replace(moved, Path(out) / moved.name)
    shutil.rmtree(aside, ignore_errors=True)


def put_back_before_resuming(resume):
    """Put back what an --overwrite run that never wrote a checkpoint set aside in the folder that
    ``resume`` names (a folder, or the checkpoint in one), before the resumed run looks for its
    checkpoint: a run killed outright (SIGKILL) in its first epoch leaves the earlier run's files
    in .replaced, and --resume is the next run on the folder. Nothing is done while another run
    holds the folder (it is alive, and settles them itself)."""
    path = Path(resume)
    folder = path if file_kind(path) == "a folder" else path.parent
    if file_kind(folder / REPLACED) != "a folder":
        return
    try:
        fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return   # a folder this run cannot write: the checkpoint check says what is missing
    with Claim(fd):
        for _ in range(50):   # a sibling rank putting them back holds the lock a moment
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
        else:
            return
        try:
            restore_set_aside(folder)
        except OSError:
            pass


def export_target(export, out, resume=None):
    """The regular file that ``--export`` writes: the path given, or where its symbolic link leads
    (the link itself is never replaced). ConfigError, at the start rather than after training,
    when it is empty, a folder, a device, a pipe or a socket, in a folder that does not exist or
    cannot be written, or one of the run's own files: those of ``out``, and the checkpoint it
    resumes with the files beside it (a fork writes nothing of the run it came from)."""
    if not export:
        raise ConfigError("--export needs the name of the file to write")
    try:
        target = Path(export).resolve()   # through any symbolic links
    except (RuntimeError, OSError):   # a loop of them (RuntimeError before Python 3.13)
        target = Path(export)
    kind = file_kind(target)
    if kind not in (None, "a regular file"):
        raise ConfigError(f"--export {export} is {kind}: it writes regular files only")
    folder = file_kind(target.parent)
    if folder != "a folder":
        raise ConfigError(f"--export {export}: the folder {target.parent} "
                          + ("does not exist" if folder is None else f"is {folder}, not a folder"))
    if not os.access(target.parent, os.W_OK):
        raise ConfigError(f"--export {export}: the folder {target.parent} cannot be written")
    own = [(Path(out) / name, "the run itself") for name in (*RUN_FILES, LOCK)] if out else []
    if resume is not None:
        resumed = checkpoint.resolve(resume)
        own += [(path, "the run it resumes") for path in (resumed, *(resumed.parent / n for n in (*RUN_FILES, LOCK)))]
    for path, whose in own:
        if path.resolve() == target:
            raise ConfigError(f"--export {export} is {path.name} of {whose}: it would overwrite it with weights; "
                              f"export to a file of its own")
    remove_stale_temporaries(target)   # of an export killed before it finished
    return target


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
