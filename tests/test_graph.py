"""The training step as a graph (training/step.py, kernels/cuda/graph.py), proven without a GPU.

- On the CPU emulator: the step's launches are recorded once, then the record is replayed step
  after step with the static inputs refilled (the batch's indices, the learning rate in device
  memory), against eager steps of an identical model, bit for bit, over steps whose cosine
  learning rate changes every step. A value baked into the record (a learning rate passed by
  value, as before lr_on_device) fails it: the control below shows that it would.
- On simulated GPUs, through the trainer: --graph and --no-graph give the same checkpoint bit for
  bit, the graph replayed; with two GPUs, whose NCCL all-reduces the capture records too; a
  capture that fails warns once and trains eagerly.
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


def run_both(device, xp, graphed_setup=lambda opt: None, eager=True):
    """[(loss, correct)] per step and the final (params, velocity, running statistics) of an eager
    (unless `eager` is false) and a graphed replica trained on the same batches; and the step."""
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
    """One simulated GPU in this process, current; the graphs it launches counted."""
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    gpus = kernels.cupy_module()
    gpus.cuda.Device(0).use()
    launches = []
    real = gpus.cuda.Graph.launch
    monkeypatch.setattr(gpus.cuda.Graph, "launch", lambda self, stream=None: (launches.append(1), real(self))[1])
    return launches


def test_graph_through_the_trainer_on_a_simulated_gpu_equals_no_graph(simulated, tmp_path, capsys):
    data_dir = write_fashion_mnist(tmp_path / "fashion", 18, 4)
    given = {"gpus": 1, "width": 2, "batch_size": 4, "epochs": 1, "momentum": 0.9, "schedule": "cosine",
             "data_dir": str(data_dir)}
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


@pytest.mark.slow
def test_graph_with_two_simulated_gpus_records_the_nccl_all_reduces(tmp_path):
    """Each worker captures its own step, NCCL calls on the side stream joined back; the result is
    --no-graph's, bit for bit."""
    from test_simulated_gpus import train_resnet
    data_dir = write_fashion_mnist(tmp_path / "fashion", 20, 4)
    flags = ["--gpus", "2", "--width", "2", "--batch-size", "4", "--limit", "20", "--test-limit", "4",
             "--momentum", "0.9", "--schedule", "cosine"]
    for graph in ("--graph", "--no-graph"):
        done = train_resnet(2, data_dir, tmp_path / graph, *flags, graph)
        assert done.returncode == 0, done.stderr
        assert "warning" not in done.stdout + done.stderr and ("CUDA graph" in done.stdout) == (graph == "--graph")
    saved = [np.load(tmp_path / g / "checkpoint.npz") for g in ("--graph", "--no-graph")]
    for name in saved[1].files:
        if saved[1][name].dtype.kind in "fi":
            np.testing.assert_array_equal(saved[0][name], saved[1][name], err_msg=name)


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
