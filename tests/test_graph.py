"""The training step as a graph (training/step.py, kernels/cuda/graph.py), proven without a GPU.

- On the CPU emulator: the step's launches are recorded once, then the record is replayed step
  after step with the static inputs refilled (the batch's indices, the learning rate in device
  memory), against eager steps of an identical model, bit for bit, over steps whose cosine
  learning rate changes every step. A value baked into the record (a learning rate passed by
  value, as before lr_on_device) fails it: the control below shows that it would.
- On simulated GPUs: a graph keeps alive what its kernels were given (the counters that an
  evaluation of larger batches replaces). Through the trainer, --graph and --no-graph give the same
  checkpoint bit for bit, the graph replayed: on one GPU, in tf32 and with --sync-bn in fp32 (array
  operations captured); on two, whose NCCL all-reduces the capture records too, in fp32, and with
  --sync-bn over two epochs, resumed after the first; and with a capture that fails on one rank
  only, after which every rank runs eagerly; each over epochs whose last batch is short. A capture
  that fails warns once and trains eagerly.
- Marked gpu: the same comparison through CuPy's stream capture on a real GPU.
"""
import json

import numpy as np
import pytest

import kernels
import nn
from helpers import write_fashion_mnist
from kernels.cuda import conv_tc, launch
from kernels.cuda import graph as graphs
from parallel.comm import SingleProcess
from parallel.ddp import DataParallel
from training import config, loop
from training.step import GraphedStep, train_step

BATCH, STEPS = 2, 4


def replica(device, momentum=0.9):
    """ResNet-18 at width 2, SGD with momentum and weight decay, a cosine schedule over STEPS."""
    nn.manual_seed(5)
    model = nn.resnet18(width=2).to(device)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=5e-4)
    return model, opt, DataParallel(model, SingleProcess()), nn.CosineAnnealingLR(opt, STEPS)


def data(xp):
    """Images and labels, and STEPS batches of indices: a shuffled order cut in BATCH."""
    g, n = np.random.default_rng(6), STEPS * BATCH
    images = xp.asarray(g.integers(0, 256, (n, 28, 28)).astype(np.uint8))
    labels = xp.asarray(g.integers(0, 10, n).astype(np.int32))
    order = xp.asarray(g.permutation(n))
    return images, labels, [order[i * BATCH:(i + 1) * BATCH] for i in range(STEPS)]


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def run_both(device, xp, graphed_setup=lambda opt: None, eager=True, between=lambda step, model: None):
    """[(loss, correct)] per step and the final (params, velocity, running statistics) of an eager
    (unless `eager` is false) and a graphed replica trained on the same batches, `between(i, model)`
    called after each step i; and the step."""
    images, labels, batches = data(xp)
    results = []
    for graphed in (False, True)[0 if eager else 1:]:
        model, opt, ddp, schedule = replica(device)
        step = GraphedStep(model, opt, ddp, images, labels, BATCH, warn=pytest.fail) if graphed else \
            (lambda idx: train_step(model, opt, ddp, images, labels, idx))
        if graphed:
            graphed_setup(opt)
        outputs = []
        for i, idx in enumerate(batches):
            opt.lr = schedule.lr_at(i)
            outputs.append(tuple(float(host(v)) for v in step(ddp.scatter(idx))))
            between(i, model)
        state = [host(opt.flat.data), host(opt.velocity)] + [host(b) for _, b in model.named_buffers()]
        results.append((outputs, state, step))
    return results


def assert_same(eager, graphed):
    (eager_out, eager_state, _), (graph_out, graph_state, _) = eager, graphed
    assert graph_out == eager_out, "loss and correct count per step"
    for i, (a, b) in enumerate(zip(eager_state, graph_state)):
        np.testing.assert_array_equal(b, a, err_msg=f"state array {i} (params, velocity, buffers)")


@pytest.fixture
def split_reductions(monkeypatch):
    """Every reduction split over blocks, whatever the shape: the counters of the split reductions
    that finish in their own launch (common.cuh's last_block) are used again by every replay."""
    monkeypatch.setattr(launch, "MIN_SPLIT_LENGTH", 256)   # a few blocks per channel at this batch
    monkeypatch.setattr(conv_tc, "SPLIT_TARGET", 8)         # a few parts per GEMM
    monkeypatch.setattr(conv_tc, "MIN_SPLIT_K", conv_tc.BK)
    conv_tc.plan.cache_clear()
    yield
    conv_tc.plan.cache_clear()


def test_the_recorded_step_replayed_equals_eager_steps_bit_for_bit(split_reductions):
    def by_value(opt):   # the control: the learning rate passed by value, as before SGD.lr_on_device
        opt._lr_memory = None
    with kernels.emulate():
        eager, graphed = run_both("cpu", np)
        baked = run_both("cpu", np, graphed_setup=by_value, eager=False)
    step = graphed[2]
    assert isinstance(step.graph, graphs.LaunchRecord) and len(step.graph) > 100, "the step was recorded"
    assert_same(eager, graphed)
    lrs = [replica("cpu")[3].lr_at(i) for i in range(STEPS)]
    assert len(set(lrs)) == STEPS, "the learning rate changes every step"
    with pytest.raises(AssertionError):   # replays at the capture's learning rate: caught
        assert_same(eager, baked[0])


def test_a_capture_that_fails_warns_once_and_the_step_runs_eagerly(monkeypatch):
    warnings = []
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "off")   # the kernels of the test above, which checks them
    monkeypatch.setattr(graphs, "capture", lambda be, fn: (_ for _ in ()).throw(RuntimeError("no capture here")))
    with kernels.emulate():
        images, labels, batches = data(np)
        model, opt, ddp, _ = replica("cpu")
        step = GraphedStep(model, opt, ddp, images, labels, BATCH, warn=warnings.append)
        losses = [float(step(ddp.scatter(idx))[0]) for idx in batches[:3]]
        model2, opt2, ddp2, _ = replica("cpu")
        eager = [float(train_step(model2, opt2, ddp2, images, labels, ddp2.scatter(idx))[0]) for idx in batches[:3]]
    assert warnings == ["--graph: capturing the training step failed (RuntimeError: no capture here); it runs "
                        "eagerly"]
    assert losses == eager and step.graph is None
    assert [int(m.num_batches_tracked) for m in model.modules() if isinstance(m, nn.BatchNorm2d)] == [3] * 17


def test_graph_needs_gpus():
    with pytest.raises(config.ConfigError, match="--graph captures the step as a CUDA graph, on GPUs"):
        config.Config(graph=True).check()
    assert config.Config(gpus=1).replayed_step and not config.Config().replayed_step
    assert not config.Config(gpus=1, graph=False).replayed_step


# ---- simulated GPUs, through the trainer ---------------------------------------------------------

@pytest.fixture
def simulated(monkeypatch, tmp_path):
    """One simulated GPU in this process, current; the graphs it launches counted. The emulator without
    its sanitizer (a third of the time): what these prove is the graph's plumbing, and the kernels ran
    under it at these shapes in the recorded-step test above and in tests/test_simulated_gpus.py."""
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "2")
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "off")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    gpus = kernels.cupy_module()
    gpus.cuda.Device(0).use()
    launches = []
    real = gpus.cuda.Graph.launch
    monkeypatch.setattr(gpus.cuda.Graph, "launch", lambda self, stream=None: (launches.append(1), real(self))[1])
    return launches


def test_a_graph_keeps_what_its_kernels_were_given(simulated, monkeypatch):
    """A graph holds the addresses of what its kernels were given. Backend.counters replaces its
    array when a launch needs more, as an evaluation of larger batches than a rank's shard does
    (--gpus 2 --batch-size 512: 256 images per rank in training, 512 in evaluation); the replays
    after it must not run on the freed array (here: each launch's need exactly, and an evaluation
    of the whole split after the second step)."""
    monkeypatch.setattr(kernels.cuda, "COUNTERS", 1)
    gpus = kernels.cupy_module()
    backend = kernels.backend_of(gpus.zeros(1, np.float32))
    monkeypatch.setattr(backend, "_counters", {})
    images, labels, _ = data(gpus)
    grown = []

    def evaluate(i, model):
        if i == 1:
            before = backend.counters(0)
            loop.evaluate(model, images, labels, len(images))
            grown.append(backend.counters(0) is not before)
        if i == STEPS - 1:   # the graphed replica starts with counters for its own steps, as the eager one
            backend._counters.clear()
    eager, graphed = run_both("cuda", gpus, between=evaluate)
    assert grown == [True, True], "the evaluation replaced the counters"
    assert isinstance(graphed[2].graph, graphs.StreamGraph)
    assert_same(eager, graphed)


@pytest.mark.parametrize("flags", [{}, {"sync_bn": True, "precision": "fp32"}], ids=["tf32", "sync-bn-fp32"])
def test_graph_through_the_trainer_on_a_simulated_gpu_equals_no_graph(simulated, tmp_path, capsys, flags):
    """--sync-bn and fp32, whose steps hold array operations (CuPy's, captured too), included."""
    data_dir = write_fashion_mnist(tmp_path / "fashion", 18, 4)
    given = {"gpus": 1, "width": 2, "batch_size": 4, "epochs": 1, "momentum": 0.9, "schedule": "cosine",
             "data_dir": str(data_dir), **flags}
    runs = {}
    for graph in (True, False):
        out = tmp_path / f"graph-{graph}"
        runs[graph] = loop.run({**given, "graph": graph, "out": str(out)})
        if graph:
            # 5 batches, the last of 2 images (eager): a warm-up step, then the capture, replayed, and
            # two replays, each at its own learning rate
            assert len(simulated) == 3
        printed = capsys.readouterr()
        assert "warning" not in printed.out + printed.err
    for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
        assert [m[key] for m in runs[True]] == [m[key] for m in runs[False]], key
    saved = [np.load(tmp_path / f"graph-{g}" / "checkpoint.npz") for g in (True, False)]
    for name in saved[1].files:
        if saved[1][name].dtype.kind in "fi":
            np.testing.assert_array_equal(saved[0][name], saved[1][name], err_msg=name)
    assert json.loads(str(saved[0]["record"]))["config"]["graph"] is True


# 15 images in batches of 4: a warm-up step, the capture, a replay, and a last batch of 3, whose shards of
# 2 and 1 images are, the first, as large as a whole batch's: whether to replay must depend on the global
# batch, the same on every rank
TWO_GPUS = ["--gpus", "2", "--width", "2", "--batch-size", "4", "--limit", "15", "--test-limit", "4",
            "--momentum", "0.9"]


@pytest.fixture(scope="module")
def fifteen(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 15, 4)


def trained(data_dir, out, *flags):
    """The checkpoint's arrays of a run of train_resnet.py on two simulated GPUs, with TWO_GPUS and flags. Its
    workers, processes of their own, run the emulator without its sanitizer (a third of the time): what these
    runs prove is the step's capture and replay; test_simulated_gpus runs two GPUs under memcheck."""
    from test_simulated_gpus import train_resnet
    done = train_resnet(2, data_dir, out, *TWO_GPUS, *flags, sanitize="off")
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stdout + done.stderr and ("CUDA graph" in done.stdout) == ("--no-graph" not in flags)
    return np.load(out / "checkpoint.npz")


def assert_same_checkpoints(a, b):
    for name in b.files:
        if b[name].dtype.kind in "fi":
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.slow
def test_graph_with_two_simulated_gpus_in_fp32_equals_no_graph(fifteen, tmp_path):
    """Each worker captures its own step, NCCL calls on the side stream joined back, the fp32 step's
    array operations included; an epoch's short last batch runs eagerly on both ranks."""
    flags = ["--precision", "fp32", "--schedule", "cosine"]
    assert_same_checkpoints(trained(fifteen, tmp_path / "graph", *flags, "--graph"),
                            trained(fifteen, tmp_path / "eager", *flags, "--no-graph"))


SYNC_BN = ["--sync-bn", "--epochs", "2"]


@pytest.fixture(scope="module")
def sync_bn_eager(fifteen, tmp_path_factory):
    return trained(fifteen, tmp_path_factory.mktemp("eager"), *SYNC_BN, "--no-graph")


@pytest.mark.slow
def test_graph_with_two_simulated_gpus_and_sync_bn_resumed_equals_no_graph(fifteen, sync_bn_eager, tmp_path):
    """Sync batch norm's all-reduces and array operations replayed, in the first epoch and, after a
    resume, in the second."""
    trained(fifteen, tmp_path / "run", *SYNC_BN, "--graph", "--epochs", "1")
    assert_same_checkpoints(trained(fifteen, tmp_path / "run", *SYNC_BN, "--resume", str(tmp_path / "run")),
                            sync_bn_eager)


@pytest.mark.slow
def test_a_capture_that_fails_on_one_rank_makes_every_rank_run_eagerly(fifteen, sync_bn_eager, tmp_path, capfd,
                                                                        monkeypatch):
    """Out of memory on rank 1 while its graph's pool grows: the ranks agree on the outcome of the
    capture and both run eagerly (a collective replayed on one rank and eager on the other is what
    NCCL forbids), with the result of --no-graph."""
    import sim_targets
    from parallel import launch
    from parallel.comm import NCCLCommunicator
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "off")   # for the workers, as trained()'s
    given = {"gpus": 2, "width": 2, "batch_size": 4, "limit": 15, "test_limit": 4, "momentum": 0.9,
             "sync_bn": True, "epochs": 2, "graph": True, "data_dir": str(fifteen), "out": str(tmp_path / "run")}
    launch.run_workers(2, sim_targets.capture_fails, (given, NCCLCommunicator.unique_id(), 1))
    printed = capfd.readouterr().err
    assert "warning (rank 1): --graph: capturing the training step failed on rank(s) [1] (MemoryError: out of " \
           "memory while the graph's pool grew); every rank runs it eagerly" in printed, printed
    assert "warning (rank 0): --graph: capturing the training step failed on rank(s) [1]; every rank runs it " \
           "eagerly" in printed, printed
    assert_same_checkpoints(np.load(tmp_path / "run" / "checkpoint.npz"), sync_bn_eager)


@pytest.mark.gpu
def test_on_a_gpu_graph_replays_equal_eager_steps_bit_for_bit():
    """CuPy's stream capture: the same comparison as on the emulator, in the default tf32."""
    from test_kernels_cuda import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(reason)
    eager, graphed = run_both("cuda", kernels.cupy_module())
    assert isinstance(graphed[2].graph, graphs.StreamGraph)
    assert_same(eager, graphed)
