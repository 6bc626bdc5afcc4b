"""The launcher of --gpus N, on the CPU: worker processes that run plain functions. One
raises, one is killed by a signal, one hangs past the watchdog, the parent is interrupted:
every time, the parent ends every worker and says which one failed and how."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch_targets
from parallel import launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def short_grace(monkeypatch):
    monkeypatch.setattr(launch, "GRACE_SECONDS", 1.0)


@pytest.fixture(autouse=True)
def no_strays(tmp_path):
    """Whatever a test started, it does not outlive the test, passed or failed: the workers
    that recorded their pid in its folder, and the parents it started."""
    parents = []
    yield parents
    for parent in parents:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    for pid_file in tmp_path.glob("pid*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_all_ended(out, world_size):
    pids = [int((out / f"pid{r}").read_text()) for r in range(world_size)]
    assert not any(alive(p) for p in pids), "a worker outlived the job"


def test_workers_that_succeed_all_run(tmp_path):
    launch.run_workers(3, launch_targets.succeed, (tmp_path,))
    assert sorted(p.read_text() for p in tmp_path.glob("done*")) == ["0 of 3", "1 of 3", "2 of 3"]


def test_a_worker_that_raises_stops_the_others_and_is_named(tmp_path):
    began = time.monotonic()
    with pytest.raises(launch.WorkerFailed) as e:
        launch.run_workers(3, launch_targets.one_raises, (tmp_path, 1))
    assert (e.value.rank, e.value.reason) == (1, "raised ValueError: no such layer on rank 1")
    assert "Traceback" in e.value.trace
    assert time.monotonic() - began < 30
    assert_all_ended(tmp_path, 3)
    # the others were asked to leave their collectives before any signal
    assert (tmp_path / "stopped0").exists() and (tmp_path / "stopped2").exists()


def test_a_worker_killed_by_a_signal_is_named(tmp_path):
    with pytest.raises(launch.WorkerFailed) as e:
        launch.run_workers(2, launch_targets.one_is_killed, (tmp_path, 0))
    assert str(e.value) == "worker 0 was killed by signal SIGKILL"
    assert_all_ended(tmp_path, 2)


def test_a_worker_that_hangs_past_the_watchdog_is_named(tmp_path):
    began = time.monotonic()
    with pytest.raises(launch.WorkerFailed, match=r"worker 1 hung: no progress for \d+ s \(watchdog 1\.5 s\)"):
        launch.run_workers(2, launch_targets.one_hangs, (tmp_path, 1), watchdog=1.5)
    assert time.monotonic() - began < 30
    assert_all_ended(tmp_path, 2)


def test_a_frozen_worker_is_named_not_the_one_waiting_for_it(tmp_path):
    """Worker 1 stops (SIGSTOP) after its last heartbeat; worker 0 waits for it from before that: the one
    named is the frozen one, though worker 0 has been silent longer."""
    with pytest.raises(launch.WorkerFailed, match=r"worker 1 stopped \(SIGSTOP\): no progress for \d+ s"):
        launch.run_workers(2, launch_targets.one_freezes, (tmp_path, 1), watchdog=1.5)
    assert_all_ended(tmp_path, 2)


def start_parent(out, parents):
    """A parent process running two busy workers; returns it once both have started. It gets
    Ctrl-C's default handling whatever pytest was started with (a shell starts a background job
    with SIGINT ignored, and a child would inherit that)."""
    script = (f"import sys; sys.path[:0] = {[str(ROOT), str(ROOT / 'tests')]!r}\n"
              "import launch_targets\nfrom parallel import launch\nlaunch.GRACE_SECONDS = 1.0\n"
              "try:\n"
              f"    launch.run_workers(2, launch_targets.all_busy, ({str(out)!r},))\n"
              "except KeyboardInterrupt:\n    sys.exit(130)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    parents.append(parent)
    deadline = time.monotonic() + 30
    while len(list(out.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return parent


def wait_until_ended(out, world_size, seconds):
    deadline = time.monotonic() + seconds
    pids = [int((out / f"pid{r}").read_text()) for r in range(world_size)]
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert_all_ended(out, world_size)


def test_ctrl_c_in_the_parent_stops_every_worker(tmp_path, no_strays):
    parent = start_parent(tmp_path, no_strays)
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=30) == 130
    assert_all_ended(tmp_path, 2)


def test_ctrl_c_works_however_pytest_was_started(tmp_path, no_strays):
    """As under `pytest &` or nohup: SIGINT ignored in this process while the parent starts."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        parent = start_parent(tmp_path, no_strays)
    finally:
        signal.signal(signal.SIGINT, previous)
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=30) == 130
    assert_all_ended(tmp_path, 2)


@pytest.mark.parametrize("stderr", ["open", "a closed pipe"])
def test_workers_end_when_their_parent_is_killed(tmp_path, no_strays, stderr):
    parent = start_parent(tmp_path, no_strays)
    if stderr == "a closed pipe":   # the workers' "parent is gone" message then cannot be written
        parent.stderr.close()
    parent.kill()
    parent.wait(timeout=30)
    wait_until_ended(tmp_path, 2, seconds=10)


def test_more_gpus_than_the_machine_has_is_an_error_before_anything_starts(tmp_path):
    done = subprocess.run([sys.executable, "train_resnet.py", "--gpus", "64", "--out", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--gpus 64: this machine has" in done.stderr
    assert not (tmp_path / "run").exists()
