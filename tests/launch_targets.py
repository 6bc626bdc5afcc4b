"""Plain functions for the launcher's tests to run as workers: target(rank, world_size, ...).
A module of their own, so that a spawned worker imports little."""
import os
import signal
import time
from pathlib import Path

from parallel import launch


def busy(seconds=60.0):
    """Make progress (heartbeats) for a while, as a healthy training worker does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        launch.heartbeat()
        time.sleep(0.02)


def record_pid(out, rank):
    (Path(out) / f"pid{rank}").write_text(str(os.getpid()))


def succeed(rank, world_size, out):
    (Path(out) / f"done{rank}").write_text(f"{rank} of {world_size}")


def one_raises(rank, world_size, out, bad):
    record_pid(out, rank)
    # what the NCCL communicator registers: leave the collective when the job is stopped
    launch.on_stop(lambda: (Path(out) / f"stopped{rank}").write_text("aborted"))
    if rank == bad:
        time.sleep(0.3)
        raise ValueError(f"no such layer on rank {rank}")
    busy()


def one_is_killed(rank, world_size, out, bad):
    record_pid(out, rank)
    if rank == bad:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    busy()


def one_hangs(rank, world_size, out, bad):
    record_pid(out, rank)
    if rank == bad:
        time.sleep(3600)  # no heartbeat: stuck, as in a collective whose peer is gone
    busy()


def one_freezes(rank, world_size, out, frozen):
    """Rank ``frozen`` is stopped (kill -STOP) a moment after its last heartbeat; the others wait for it
    from before then, without heartbeats, as in a collective."""
    record_pid(out, rank)
    launch.heartbeat()
    if rank == frozen:
        time.sleep(0.5)
        launch.heartbeat()
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)


def all_busy(rank, world_size, out):
    record_pid(out, rank)
    busy()
