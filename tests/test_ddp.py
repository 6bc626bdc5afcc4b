"""Data parallelism: real MPI ranks (two processes under mpiexec) against single-process
references, and the pieces that need no MPI (shards, buckets, a world of one).

The ranks run tests/ddp_worker.py; what they compute comes back in .npz files.
Skipped, with the reason, where mpiexec or mpi4py is missing (``pip install '.[mpi]'``).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nn
from helpers import write_fashion_mnist
from parallel import launch
from parallel.comm import SingleProcess, from_environment
from parallel.ddp import plan_buckets, shard_bounds
from test_profiler import check_timeline

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("ddp_worker.py")
MPIEXEC = shutil.which("mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def mpi_unavailable_reason():
    if MPIEXEC is None:
        return "mpiexec not found (pip install '.[mpi]')"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (pip install '.[mpi]')"
    return None


needs_mpi = pytest.mark.skipif(mpi_unavailable_reason() is not None, reason=str(mpi_unavailable_reason()))


def mpirun(ranks, *args, timeout=120, cwd=ROOT):
    """``mpiexec -n ranks python args...`` from the repository root (or ``cwd``); CompletedProcess."""
    command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), sys.executable, *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def relative_error(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---- without MPI -------------------------------------------------------------------------

@pytest.mark.parametrize("n, world", [(8, 2), (7, 2), (5, 3), (2, 2), (10, 4)])
def test_shards_cover_the_batch_once_and_differ_by_at_most_one(n, world):
    bounds = [shard_bounds(n, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


@pytest.mark.parametrize("bucket_bytes", [1, 8, 40, 100, 10 ** 9])
def test_buckets_hold_every_parameter_once_in_reverse_order(bucket_bytes):
    sizes = [3, 10, 1, 7, 2, 5]
    plan = plan_buckets(sizes, 4, bucket_bytes)
    assert [i for bucket in plan for i in bucket] == list(reversed(range(len(sizes))))
    for bucket in plan[:-1]:
        assert sum(sizes[i] for i in bucket) * 4 >= bucket_bytes
        assert sum(sizes[i] for i in bucket[:-1]) * 4 < bucket_bytes  # closed as soon as full


def test_a_bucket_size_of_zero_is_refused():
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets([3], 4, 0)


def test_mpi_environment_is_read_from_open_mpi_and_mpich_variables():
    assert launch.mpi_world({}) is None
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert launch.mpi_world(ompi) == launch.World(3, 4, 1, 2)
    assert launch.mpi_world({"PMI_RANK": "1", "PMI_SIZE": "2"}) == launch.World(1, 2, 1, 2)


def test_threads_are_limited_to_the_cores_of_each_rank_unless_set():
    environ = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
               "MKL_NUM_THREADS": "7"}
    threads = launch.limit_threads(environ)
    assert threads == launch.cores_per_rank(2) >= 1
    assert environ["OMP_NUM_THREADS"] == environ["OPENBLAS_NUM_THREADS"] == str(threads)
    assert environ["MKL_NUM_THREADS"] == "7"
    assert launch.limit_threads({}) is None


def test_a_world_of_one_needs_no_mpi(monkeypatch):
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    comm = from_environment()
    assert isinstance(comm, SingleProcess) and (comm.rank, comm.world_size) == (0, 1)
    a = np.arange(3.0)
    assert comm.all_reduce(a, average=True) is a and list(a) == [0, 1, 2]
    assert comm.all_gather_scalar(5) == [5.0]
    assert comm.all_gather_bytes(b"\x00\xffrank 0") == [b"\x00\xffrank 0"]
    with pytest.raises(ValueError, match="root 1"):
        comm.broadcast(a, root=1)


# ---- two MPI ranks -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of two ranks of ddp_worker.py equivalence computed."""
    reason = mpi_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("ddp")
    done = mpirun(2, WORKER, "equivalence", out)
    assert done.returncode == 0, done.stdout + done.stderr
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(2)]


def test_two_ranks_with_sync_bn_equal_one_process_with_the_whole_batch(ranks):
    """Three steps with global batches of 8, 7 and 5 (shards of 4+4, 4+3, 3+2), float64."""
    for r in ranks:
        assert relative_error(r["sync_bn"], ranks[0]["reference_sync_bn"]) < 1e-5


def test_two_ranks_with_their_own_batch_norm_equal_averaged_shard_gradients(ranks):
    for r in ranks:
        assert relative_error(r["per_replica"], ranks[0]["reference_per_replica"]) < 1e-5


def test_every_gradient_element_is_reduced_once_in_the_same_order_on_every_rank(ranks):
    size = ranks[0]["bucket0_params"].size
    counts = []
    for i in range(3):
        order = ranks[0][f"bucket{i}_order"]
        assert np.array_equal(order, ranks[1][f"bucket{i}_order"]), f"bucket plan {i}: ranks differ"
        covered = np.zeros(size, int)
        for lo, hi in order:
            covered[lo:hi] += 1
        assert (covered == 1).all(), f"bucket plan {i}: elements reduced {set(covered.tolist())} times"
        assert list(order[:, 1]) == sorted(order[:, 1], reverse=True), "buckets run from the last parameter"
        counts.append(len(order))
        # the bucket size changes when gradients are summed, not what the sum is
        assert relative_error(ranks[0][f"bucket{i}_params"], ranks[0]["bucket2_params"]) < 1e-12
    assert counts[0] > counts[1] > counts[2] == 1


def test_running_statistics_are_averaged_to_the_same_values_on_every_rank(ranks):
    before = [r["buffers_before"] for r in ranks]
    assert not np.allclose(before[0], before[1]), "per-replica statistics should differ before"
    np.testing.assert_allclose(ranks[0]["buffers_after"], (before[0] + before[1]) / 2, rtol=1e-12)
    assert np.array_equal(ranks[0]["buffers_after"], ranks[1]["buffers_after"])


def test_sharded_evaluation_of_uneven_shards_equals_one_process(ranks):
    """41 test images over 2 ranks (21 + 20), evaluated in batches of 2."""
    assert ranks[0]["evaluation_one_process"][1] > 0, "some images should be right, so that counts are tested"
    for r in ranks:
        np.testing.assert_allclose(r["evaluation"], ranks[0]["evaluation_one_process"], rtol=1e-6)


# ---- the program under mpiexec ----------------------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fashion")
    write_fashion_mnist(folder, 48, 20)
    return folder


SMALL = ["--gpus", "0", "--width", "2", "--batch-size", "16", "--limit", "40", "--test-limit", "15"]


@needs_mpi
def test_training_with_two_ranks_then_resuming_with_one(data_dir, tmp_path):
    out = tmp_path / "run"
    done = mpirun(2, "train_resnet.py", "--data-dir", data_dir, "--out", out, "--epochs", "1", "--sync-bn",
                  "--check-sync", "1", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data parallel: 2 ranks, global batch 16, 8 images per rank, lr 0.1" in done.stdout
    assert done.stdout.count("epoch 1/1:") == 1, "only rank 0 prints"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics[0]["world_size"] == 2
    resumed = subprocess.run([sys.executable, "train_resnet.py", "--resume", out, "--epochs", "2"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert [m["world_size"] for m in json.loads((out / "metrics.json").read_text())] == [2, 1]


@needs_mpi
def test_a_rank_that_raises_ends_the_whole_job_naming_the_rank(data_dir, tmp_path):
    done = mpirun(2, WORKER, "cli", "raise:1:2", "--data-dir", data_dir, "--out", tmp_path, "--epochs", "2",
                  *SMALL, timeout=60)
    assert done.returncode != 0
    assert "rank 1 of 2: error: RuntimeError: injected fault at step 2" in done.stderr


@needs_mpi
def test_check_sync_stops_when_the_replicas_diverge(data_dir, tmp_path):
    done = mpirun(2, WORKER, "cli", "diverge:1:2", "--data-dir", data_dir, "--out", tmp_path, "--epochs", "2",
                  "--check-sync", "1", *SMALL, timeout=60)
    assert done.returncode != 0
    assert "parameters differ across ranks after epoch 1, step 2: rank(s) [1] disagree with rank 0" in done.stderr


@needs_mpi
def test_ranks_without_out_share_one_new_folder(data_dir, tmp_path):
    """rank 0 makes the default folder and tells the others its name."""
    done = mpirun(2, ROOT / "train_resnet.py", "--data-dir", data_dir, *SMALL, "--epochs", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    made = list((tmp_path / "runs").iterdir())
    assert len(made) == 1 and made[0].name.startswith("resnet18-"), made
    assert json.loads((made[0] / "metrics.json").read_text())[0]["world_size"] == 2


@needs_mpi
def test_ranks_started_with_different_flags_stop_before_training_naming_the_flag(data_dir, tmp_path):
    """mpiexec -n 1 ... --lr 0.1 : -n 1 ... --lr 0.2: one line naming the flag and its value on each rank
    (the replicas used to drift apart, or hang at the end), without argparse's usage, which is for a command
    line it cannot read."""
    def rank(*flags):
        return ["-n", "1", sys.executable, "train_resnet.py", "--data-dir", str(data_dir), "--out", str(tmp_path),
                *SMALL, "--epochs", "1", *flags]
    command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", *rank("--lr", "0.1"), ":", *rank("--lr", "0.2")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr and "usage:" not in done.stderr, done.stderr
    assert ("\ntrain_resnet.py: error: the ranks were started with different flags: --lr is 0.1 on rank 0, 0.2 on "
            "rank 1; start every rank with the same flags\n") in "\n" + done.stderr, done.stderr
    assert not (tmp_path / "checkpoint.npz").exists()


@needs_mpi
def test_a_command_line_argparse_cannot_read_is_printed_by_rank_0_alone(data_dir, tmp_path):
    """Every rank finds an unknown flag; the usage and the error are printed once, not once a rank."""
    done = mpirun(2, "train_resnet.py", "--data-dir", data_dir, "--out", tmp_path, "--bogus", timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("usage: train_resnet.py") == 1, done.stderr
    assert done.stderr.count("train_resnet.py: error: unrecognized arguments: --bogus") == 1, done.stderr


def test_gpus_per_node_must_match_the_ranks_mpiexec_started_here(monkeypatch):
    from parallel.comm import for_training
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    with pytest.raises(launch.LaunchError, match="--gpus 4 is the GPUs per node, but mpiexec started 2 ranks"):
        for_training(4)


@needs_mpi
def test_gpus_under_mpiexec_on_a_machine_without_them_is_one_clear_error(data_dir, tmp_path):
    done = mpirun(2, "train_resnet.py", "--data-dir", data_dir, "--out", tmp_path, *SMALL[2:], "--gpus", "1",
                  timeout=60)
    assert done.returncode == 2
    assert done.stderr.count("--gpus 1: this machine has 0 GPU(s)") == 1, done.stderr


@needs_mpi
def test_profile_of_two_ranks_has_a_row_for_each_all_reduce_bucket(data_dir, tmp_path):
    done = mpirun(2, "train_resnet.py", "--data-dir", data_dir, "--out", tmp_path, "--profile", "--profile-steps", "2",
                  "--bucket-mb", "0.01", *SMALL)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads((tmp_path / "profile.json").read_text())
    assert document["config"]["world_size"] == 2
    buckets = [row for row in document["rows"] if row["category"] == "allreduce"]
    assert len(buckets) >= 2 and all(row["name"].startswith("all-reduce bucket ") for row in buckets)
    assert all(row["backward_ms"] > 0 for row in buckets)
    # both ranks' timelines, gathered to rank 0: each all-reduce blocks, nested in the backward
    events = json.loads((tmp_path / "profile.trace.json").read_text())["traceEvents"]
    check_timeline(events, [name for name, _ in nn.resnet18(width=2).named_modules()], steps=2, ranks=(0, 1))
    for rank in (0, 1):
        spans = [e for e in events if e["pid"] == rank and e.get("cat") == "allreduce"]
        per_step = sorted(f"{row['name']} backward" for row in buckets)
        assert sorted(e["name"] for e in spans) == sorted(per_step * 2)
        assert {e["tid"] for e in spans} == {0}
