"""NCCL data parallelism on GPUs, marked ``gpu`` (bench/gpu_check runs them; skipped here
with the reason where there is no GPU or CuPy cannot load NCCL). They reach CuPy through
kernels.cupy_module(), so they run on simulated GPUs too (KERNELS_SIMULATED_GPUS=2, as
bench/gpu_check --dry-run does).

- The NCCL communicator's collectives in a world of one, the overlapped all-reduce included.
- The whole trainer through NCCL in a world of one equals the trainer without it, bit for bit.
- With two GPUs or more: two worker processes with --sync-bn against one GPU with the whole
  batch. NCCL refuses two ranks on one GPU, so on a one-GPU machine this one is skipped.
"""
import json

import numpy as np
import pytest

import kernels
from helpers import write_fashion_mnist
from parallel import launch
from parallel.comm import NCCLCommunicator, SingleProcess
from training import checkpoint
from training import loop

pytestmark = pytest.mark.gpu


def nccl_unavailable_reason():
    if kernels.gpu_count() == 0:
        return "no CUDA device visible to CuPy"
    if not kernels.nccl_module().available:
        return "CuPy cannot load NCCL (pip install '.[cuda13]')"
    return None


@pytest.fixture
def world_of_one():
    reason = nccl_unavailable_reason()
    if reason:
        pytest.skip(reason)
    kernels.cupy_module().cuda.Device(0).use()
    return NCCLCommunicator(0, 1, NCCLCommunicator.unique_id())


def test_collectives_in_a_world_of_one(world_of_one):
    cupy = kernels.cupy_module()
    comm = world_of_one
    a = cupy.asarray(np.random.default_rng().standard_normal(1000).astype(np.float32))
    before = a.get()
    assert comm.all_reduce(a) is a and np.array_equal(a.get(), before)
    comm.all_reduce(a, average=True)
    comm.broadcast(a, root=0)
    comm.start_all_reduce(a[10:500])
    comm.wait()
    comm.barrier()
    np.testing.assert_array_equal(a.get(), before)
    assert comm.all_gather_scalar(7) == [7.0]
    with pytest.raises(TypeError, match="CuPy arrays"):
        comm.all_reduce(np.zeros(3, np.float32))


# fp32: the sync-bn comparison needs it (under tf32, rounding the convolutions' inputs to TF32
# turns the two sums' float32 differences into differences of TF32's size), and simulated GPUs
# run the fp32 kernels twice as fast as the emulated tensor cores
FLAGS = {"gpus": 1, "width": 2, "batch_size": 8, "limit": 8, "test_limit": 8, "epochs": 2,
         "momentum": 0.9, "weight_decay": 1e-4, "seed": 3, "precision": "fp32"}


@pytest.fixture
def data_dir(tmp_path):
    write_fashion_mnist(tmp_path / "data", 32, 16)
    return tmp_path / "data"


def test_the_trainer_through_nccl_equals_the_trainer_without_it(world_of_one, data_dir, tmp_path):
    results = []
    for name, comm in (("plain", SingleProcess()), ("nccl", world_of_one)):
        metrics = loop.run({**FLAGS, "data_dir": str(data_dir), "out": str(tmp_path / name)}, comm,
                            log=lambda *a: None)
        results.append((metrics, checkpoint.load(tmp_path / name)[0]["params"]))
    (plain, plain_params), (nccl, nccl_params) = results
    assert np.array_equal(plain_params, nccl_params), "weights differ bit for bit"
    for a, b in zip(plain, nccl):
        assert (a["train_loss"], a["test_acc"]) == (b["train_loss"], b["test_acc"])


def sync_bn_worker(rank, world_size, flags, unique_id):
    kernels.cupy_module().cuda.Device(rank).use()
    loop.run(flags, NCCLCommunicator(rank, world_size, unique_id), log=lambda *a: None)


@pytest.mark.skipif(kernels.gpu_count() < 2, reason="needs two GPUs: NCCL refuses two ranks on one GPU")
def test_two_gpus_with_sync_bn_equal_one_gpu_with_the_whole_batch(data_dir, tmp_path):
    reason = nccl_unavailable_reason()
    if reason:
        pytest.skip(reason)
    # one step: training this small network is chaotic (a relative change of 1e-7 in the weights
    # grows to about 5e-3 in three steps, in float64 as in float32), so later steps amplify rounding
    flags = {**FLAGS, "data_dir": str(data_dir), "sync_bn": True, "epochs": 1, "limit": FLAGS["batch_size"]}
    loop.run({**flags, "out": str(tmp_path / "one")}, SingleProcess(), log=lambda *a: None)
    launch.run_workers(2, sync_bn_worker, ({**flags, "out": str(tmp_path / "two")}, NCCLCommunicator.unique_id()))
    one, two = (checkpoint.load(tmp_path / name)[0]["params"] for name in ("one", "two"))
    # float32, sums split differently over the two GPUs: equal to rounding, not bit for bit
    assert np.max(np.abs(one - two)) / np.max(np.abs(one)) < 1e-5
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())[0]["world_size"] == 2
