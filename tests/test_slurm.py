"""Slurm: ``srun --ntasks-per-node=G python train_resnet.py --gpus G`` without mpiexec (parallel/launch.py's
slurm_world and rendezvous, parallel/comm.py's from_slurm). Srun's variables and the rendezvous are read and
tried here without Slurm; the tests marked `slurm` run srun on a one-node cluster (conftest's `slurm`
fixture), on simulated GPUs: the same result, bit for bit, as --gpus 2 started by the project; a task that
dies ends the job, named, with no task left behind; CPU tasks without MPI are one line."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import kernels
from helpers import free_port, slurm_idle, write_fashion_mnist
from parallel import launch
from training import checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--width", "2", "--batch-size", "8", "--limit", "8", "--test-limit", "4", "--epochs", "1",
        "--momentum", "0.9"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 16, 8)


def srun_variables(rank, tasks, port=None, **extra):
    """What srun sets for task ``rank`` of a step of ``tasks`` tasks on one node."""
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": str(tasks),
            "SLURM_STEP_NODELIST": "localhost", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
            **({"MASTER_PORT": str(port)} if port else {}), **extra}


def test_slurms_world_and_first_node_are_read_as_srun_sets_them():
    world = launch.slurm_world({**srun_variables(3, 6), "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                                "SLURM_STEP_TASKS_PER_NODE": "2(x2),2"})
    assert world == launch.World(3, 6, 1, 2)
    assert launch.slurm_world({}) is None
    with pytest.raises(launch.LaunchError, match=r"Slurm's environment does not make sense \(SLURM_PROCID='7'"):
        launch.slurm_world(srun_variables(7, 2))
    with pytest.raises(launch.LaunchError, match=r"this Slurm job has SLURM_NTASKS=2 tasks, and this process is "
                                                 r"not one of them \(no job step\): start them with srun"):
        launch.slurm_world({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"})   # python run in an sbatch -n 2 script
    assert launch.slurm_world({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) is None
    assert launch.first_node({"SLURM_STEP_NODELIST": "gpu[07-09,12],login2"}) == "gpu07"
    assert launch.first_node({"SLURM_JOB_NODELIST": "a,b"}) == "a"


def test_a_plain_run_in_a_job_of_several_tasks_says_to_use_srun(data_dir, tmp_path, capsys, monkeypatch):
    """python train_resnet.py in an sbatch -n 2 script (or salloc's shell) used to train alone without a word."""
    from helpers import run_cli, one_line_error
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    err = one_line_error(capsys, run_cli, data_dir, tmp_path / "run", TINY)
    assert "this Slurm job has SLURM_NTASKS=2 tasks, and this process is not one of them" in err, err


def test_a_task_that_never_arrives_is_named():
    """Rank 0 waits for the others at the rendezvous, a rank for rank 0: whoever is missing when the time-out
    passes is named."""
    port = free_port()
    with pytest.raises(launch.LaunchError, match=r"rank\(s\) 1, 2 of 3 never reached rank 0 on port \d+"):
        launch.rendezvous(launch.World(0, 3, 0, 3), b"id", ("here", "0"), {"MASTER_PORT": str(port)}, timeout=0.5)
    with pytest.raises(launch.LaunchError, match=r"rank 1 of 2: rank 0 never answered at localhost:\d+ within 0.5 s"):
        launch.rendezvous(launch.World(1, 2, 1, 2), None, None, srun_variables(1, 2, port), timeout=0.5)


def started_with(variable):
    """{pid: command line} of the processes whose environment holds ``variable`` ("NAME=value")."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and variable.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            pass
    return found


def srun(slurm, tmp_path, *command, gpus=None, timeout=120):
    """``srun --kill-on-bad-exit`` of two tasks on the cluster: CompletedProcess. Each task records its exit
    status in ``tmp_path``. Should srun not return within ``timeout`` seconds, the test fails naming what
    still runs of what srun started (tasks, or processes they left behind holding srun's output), with the
    end of slurmd's log; unless all of it has ended, when it is Slurm that lost the step's end (srun waiting
    for a message that never came): then the tasks' own statuses stand in for srun's, with a warning."""
    environment = {**slurm, "TMPDIR": str(tmp_path), "CUDA_EMU_SANITIZE": "off", "MASTER_PORT": str(free_port()),
                   **({kernels.SIMULATED_GPUS: str(gpus)} if gpus else {})}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    slurm_idle(environment, 60)   # the job before may still be completing
    recorded = ['bash', '-c', '"$@"; status=$?; echo $status > "$0/status.$SLURM_PROCID"; exit $status', tmp_path]
    arguments = ["srun", "--ntasks=2", "--kill-on-bad-exit=1", *map(str, recorded + list(command))]
    try:
        return subprocess.run(arguments, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment)
    except subprocess.TimeoutExpired as e:
        out, err = ((b or b"").decode(errors="replace") for b in (e.stdout, e.stderr))
    left = started_with(f"TMPDIR={tmp_path}")
    for pid in left:
        os.kill(pid, 9)
    running = "".join(f"{pid}: {command}\n" for pid, command in left.items())
    subprocess.run(["scancel", f"--user={os.getuid()}"], capture_output=True, timeout=60, env=environment)
    statuses = [tmp_path / f"status.{rank}" for rank in range(2)]
    log = Path(slurm.get("SLURM_CONF", "/nonexistent")).with_name("slurmd.log")
    log = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]) if log.exists() else ""
    said = f"srun's stderr:\n{err}\nthe end of slurmd's log:\n{log}"
    if not running and not any(status.exists() for status in statuses):
        pytest.fail(f"srun did not return within {timeout} s, and none of its tasks ran\n{said}")
    if running or not all(status.exists() for status in statuses):
        pytest.fail(f"srun did not return within {timeout} s; tasks still running:\n{running}\n{said}")
    warnings.warn(f"srun did not return within {timeout} s though both tasks had ended: Slurm lost the step's "
                  f"end; their exit statuses are used\n{said}")
    code = max(int(status.read_text()) for status in statuses)
    return subprocess.CompletedProcess(arguments, code, out, err)


@pytest.mark.slurm
def test_the_slurm_tests_run_on_one_worker(request):
    """Under pytest-xdist's --dist loadgroup the tests marked slurm form one group (conftest), so that one
    worker starts the session's cluster: two would share slurmd's port, and one's jobs would run in the
    other's cluster. pytest 9.2 keeps node ids where pytest-xdist 3.8 renames them, and the groups were lost."""
    if not getattr(request.config.option, "loadgroup", False):   # set in pytest-xdist's workers alone
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@slurm"), (
        f"pytest-xdist did not group this test (its id is {request.node.nodeid!r}, with pytest "
        f"{pytest.__version__}): pip install -e '.[test]' installs a pytest whose groups take")


@pytest.mark.slurm
def test_two_srun_tasks_on_two_gpus_equal_gpus_2_started_by_the_project(slurm, data_dir, tmp_path):
    flags = ["--data-dir", data_dir, *TINY, "--gpus", "2", "--precision", "fp32"]
    done = srun(slurm, tmp_path, sys.executable, "train_resnet.py", *flags, "--out", tmp_path / "srun", gpus=2)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "data parallel: 2 ranks" in done.stdout and done.stdout.count("test acc: ") == 1, done.stdout
    environment = {**os.environ, kernels.SIMULATED_GPUS: "2", "TMPDIR": str(tmp_path), "CUDA_EMU_SANITIZE": "off"}
    ours = subprocess.run([sys.executable, "train_resnet.py", *map(str, flags), "--out", tmp_path / "project"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=environment)
    assert ours.returncode == 0, ours.stderr
    a, b = (checkpoint.load(tmp_path / name)[0]["params"] for name in ("srun", "project"))
    np.testing.assert_array_equal(a, b)


@pytest.mark.slurm
def test_a_task_that_dies_ends_the_job_naming_it_and_leaves_none_behind(slurm, data_dir, tmp_path):
    marker = tmp_path / "dies"
    script = (f'[ "$SLURM_PROCID" = 1 ] && exit 3; exec {sys.executable} train_resnet.py --data-dir {data_dir} '
              f'{" ".join(TINY)} --gpus 2 --out {marker}')
    done = srun(slurm, tmp_path, "bash", "-c", script, gpus=2)
    assert done.returncode != 0 and "task 1: Exited with exit code 3" in done.stderr, done.stderr
    left = started_with(f"TMPDIR={tmp_path}")
    assert not left, f"tasks left running: {left}"


@pytest.mark.slurm
def test_cpu_tasks_without_mpi_are_one_line(slurm, data_dir, tmp_path):
    """srun -n 2 on the CPU: MPI sees each task alone, and the two would train two copies without a word."""
    done = srun(slurm, tmp_path, sys.executable, "train_resnet.py", "--data-dir", data_dir, *TINY, "--out",
                tmp_path / "run")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert ("train_resnet.py: error: srun started 2 tasks, and MPI sees each of them alone: ranks on the CPU exchange "
            "gradients over MPI (srun --mpi=pmix, or mpiexec inside the allocation), ranks on GPUs over NCCL (--gpus "
            "G, one task per GPU)") in done.stderr, done.stderr
    assert done.stderr.count("error: srun started") == 1 and not (tmp_path / "run" / "checkpoint.npz").exists()


@pytest.mark.slurm
def test_a_step_that_never_ends_fails_naming_what_still_runs_and_stops_it(slurm, tmp_path):
    """The srun helper's own time-out: a task that leaves a process holding srun's output keeps srun
    waiting; the test fails naming it, and nothing is left running."""
    with pytest.raises(pytest.fail.Exception, match=r"(?s)did not return within 10 s; tasks still running:.*sleep 600"):
        srun(slurm, tmp_path, "bash", "-c", "(sleep 600 &); exit 0", timeout=10)
    assert not started_with(f"TMPDIR={tmp_path}")
    done = srun(slurm, tmp_path, "bash", "-c", "exit $SLURM_PROCID", timeout=60)   # its twin returns
    assert done.returncode == 1 and "task 1: Exited with exit code 1" in done.stderr, done.stderr


def test_when_slurm_loses_the_end_of_a_step_whose_tasks_all_ended_their_statuses_are_used(tmp_path):
    """The srun helper's other way out, with an srun that starts both tasks, sees them end, and never returns
    (as when a task's exit message is lost)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/bash\nshift 2\nfor r in 0 1; do SLURM_PROCID=$r "$@" & done\nwait\n'
                                'echo lost >&2\nexec sleep 60\n')
    (bin_ / "srun").chmod(0o755)
    (bin_ / "scancel").symlink_to("/bin/true")
    (bin_ / "sinfo").write_text("#!/bin/sh\necho idle\n")
    (bin_ / "sinfo").chmod(0o755)
    slurm = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    with pytest.warns(UserWarning, match="both tasks had ended: Slurm lost the step's end"):
        done = srun(slurm, tmp_path, "bash", "-c", "echo hi $SLURM_PROCID; exit $((2 * SLURM_PROCID))", timeout=3)
    assert done.returncode == 2 and "lost" in done.stderr and "hi 1" in done.stdout, done
