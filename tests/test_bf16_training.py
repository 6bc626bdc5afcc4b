"""Training under the bf16 precision (mixed precision, as PyTorch's autocast to bfloat16 with
channels_last): float32 master weights, a bfloat16 copy of them for the convolutions.

- The copy's life, on the emulator's backend (FlatParameters): made on first request, equal to the
  weights rounded to nearest even; kept current by the optimizer's update without a cast; stale after
  every other kind of write of the weights (a checkpoint restored, the broadcast to the replicas, a
  state dict or safetensors file loaded, a layer re-initialised), and refreshed by one cast when next
  asked for; the convolutions multiply it, never a stale one, and the float32 parameter wherever the
  bf16 precision is not in force (the CPU backend, tf32) or the weight has no flat buffer.
- The trainer on simulated GPUs (KERNELS_SIMULATED_GPUS) with --precision bf16, at width 2: the loss
  falls; --graph and --no-graph give the same checkpoint bit for bit; a resumed run equals one never
  stopped; two GPUs, graphed and eager alike, with --export writing the float32 master weights.
"""
import contextlib
import json

import ml_dtypes
import numpy as np
import pytest

import kernels
import nn
from helpers import rng, write_fashion_mnist
from nn import functional as F
from parallel.comm import SingleProcess
from parallel.ddp import DataParallel
from training import checkpoint, loop

WIDTH = 2


def rounded(a):
    """The bits of `a` rounded to bfloat16 (nearest even), for comparisons bit for bit."""
    return np.asarray(a).astype(ml_dtypes.bfloat16).view(np.uint16)


def bits(a):
    return np.asarray(a).view(np.uint16)


def model_and_optimizer(seed=0):
    nn.manual_seed(seed)
    model = nn.resnet18(width=WIDTH)
    return model, nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)


@pytest.fixture
def emulated(monkeypatch):
    """The bf16 precision on the emulator's backend, every cast of it counted: yields the list of the
    arrays cast."""
    casts = []
    with kernels.emulate(), kernels.use_precision("bf16"):
        backend = kernels.backend_of(np.zeros(1, np.float32))
        real = backend.cast

        def counted(a, dtype, out=None):
            casts.append(a)
            return real(a, dtype, out=out)
        monkeypatch.setattr(backend, "cast", counted)
        yield casts


def assert_current(flat):
    np.testing.assert_array_equal(bits(flat.multiplied("bf16")), rounded(flat.data))


# ---- the copy's life -----------------------------------------------------------------------------------

def test_the_copy_is_made_on_first_request_as_the_weights_rounded_with_the_same_offsets(emulated):
    model, opt = model_and_optimizer()
    flat = opt.flat
    assert emulated == [], "no copy before one is asked for"
    copy = flat.multiplied("bf16")
    assert copy.dtype == kernels.bfloat16 and copy.shape == flat.data.shape and len(emulated) == 1
    assert_current(flat)
    assert flat.multiplied("bf16") is copy and len(emulated) == 1, "asked again: no cast"
    conv = model.resnet_block2[0].conv1
    view = flat.multiplied_view(conv.weight, "bf16")
    assert view.shape == conv.weight.shape and np.shares_memory(view, copy)
    assert view.strides == tuple(s // 2 for s in conv.weight.data.strides), "channels-last, as the weight"
    np.testing.assert_array_equal(bits(view), rounded(conv.weight.data))


def test_the_optimizer_keeps_it_current_without_a_cast(emulated):
    model, opt = model_and_optimizer()
    flat = opt.flat
    flat.multiplied("bf16")
    for _ in range(2):
        for p in model.parameters():
            p.grad[...] = rng().standard_normal(p.shape).astype(np.float32)
        before = flat.data.copy()
        opt.step()
        assert not np.array_equal(flat.data, before)
        assert_current(flat)
    assert len(emulated) == 1, "only the first request cast"


def test_no_copy_is_made_or_cast_before_one_is_asked_for(emulated):
    model, opt = model_and_optimizer()
    opt.step()
    opt.flat.refresh_multiplied()   # what a replayed graph does first
    assert emulated == []


def restored(model, opt, other, tmp_path):
    _, other_opt = other
    checkpoint.save(tmp_path / "checkpoint.npz", other[0], other_opt, dict.fromkeys(checkpoint.RECORD_KEYS, 1))
    checkpoint.restore(checkpoint.load(tmp_path / "checkpoint.npz")[0], model, opt)


def broadcast(model, opt, other, tmp_path):
    """Rank 0's parameters (the other model's) arriving through DataParallel's broadcast."""
    ddp = DataParallel(model, SingleProcess())
    rank_0 = {id(a): b for a, b in zip([opt.flat.data, *ddp.buffers], [other[1].flat.data, *(
        b for _, b in other[0].named_buffers() if b.dtype.kind == "f")])}

    def from_rank_0(array, root=0):
        array[...] = rank_0.get(id(array), array)
        return array
    ddp.comm.broadcast = from_rank_0
    ddp.broadcast_state((opt.velocity,))


def loaded_state_dict(model, opt, other, tmp_path):
    model.load_state_dict(other[0].state_dict())


def loaded_safetensors(model, opt, other, tmp_path):
    nn.save_safetensors(other[0], tmp_path / "w.safetensors")
    nn.load_safetensors(model, tmp_path / "w.safetensors")


def reinitialised(model, opt, other, tmp_path):
    nn.init.manual_seed(1)
    nn.init.init_model(model, "pytorch")


@pytest.mark.parametrize("write", [restored, broadcast, loaded_state_dict, loaded_safetensors, reinitialised])
def test_every_other_write_of_the_weights_leaves_it_stale_and_one_cast_refreshes_it(emulated, tmp_path, write):
    model, opt = model_and_optimizer()
    flat = opt.flat
    flat.multiplied("bf16")
    stale = bits(flat.multiplied("bf16")).copy()
    write(model, opt, model_and_optimizer(seed=1), tmp_path)
    assert not np.array_equal(rounded(flat.data), stale), "the write changed the weights"
    assert len(emulated) == 1, "marked stale, not refreshed yet"
    assert_current(flat)
    assert len(emulated) == 2 and emulated[-1] is flat.data, "one cast over the whole buffer"


def test_a_write_that_fails_midway_leaves_it_stale(emulated):
    model, opt = model_and_optimizer()
    flat = opt.flat
    flat.multiplied("bf16")
    state = {k: v.copy() for k, v in model_and_optimizer(seed=1)[0].state_dict().items()}
    state["fc.1.bias"] = np.zeros(3, np.float32)   # the last key: every weight before it written
    with pytest.raises(ValueError, match="shape mismatch for fc.1.bias"):
        model.load_state_dict(state)
    assert_current(flat)
    assert len(emulated) == 2


# ---- what the convolutions multiply --------------------------------------------------------------------

@pytest.fixture
def recorded(monkeypatch):
    """The weights and biases that the backend's convolutions are handed, forward and backward (the
    backend's own convolutions replaced by stand-ins of the right shapes)."""
    calls = []

    def record(backend):
        def forward(x, w, b, stride, padding, statistics=None, normalize=None, w_tf32=False):   # a layer alone
            assert statistics is None and normalize is None
            calls.append(("forward", w, b, w_tf32))
            return np.zeros((x.shape[0], w.shape[0]) + x.shape[2:], x.dtype)

        def backward(dy, x, w, stride, padding, need_dx=True, out=None, add_dx_to=None, normalize=None,
                     w_tf32=False, dy_tf32=False):
            assert normalize is None
            calls.append(("backward", w, None, w_tf32))
            return np.zeros_like(x), np.zeros(w.shape, np.float32), np.zeros(w.shape[0], np.float32)
        monkeypatch.setattr(backend, "conv2d_forward", forward)
        monkeypatch.setattr(backend, "conv2d_backward", backward)
    return calls, record


def convolve(layer, x):
    y = layer(nn.Tensor(x, requires_grad=True))
    y.backward(np.ones(y.shape, y.dtype))


def test_the_convolutions_multiply_the_current_copy_and_the_float32_bias(emulated, recorded):
    calls, record = recorded
    model, opt = model_and_optimizer()
    record(kernels.backend_of(opt.flat.data))
    conv = model.resnet_block1[0].conv1
    x = rng().standard_normal((2, WIDTH, 4, 4)).astype(kernels.bfloat16)
    convolve(conv, x)
    (_, w, b, tf32), (_, w_back, _, tf32_back) = calls
    assert not tf32 and not tf32_back
    assert w is opt.flat.multiplied_view(conv.weight, "bf16") and w_back is w, "the forward's weight, backward too"
    assert b is conv.bias.data and b.dtype == np.float32
    model.load_state_dict(model_and_optimizer(seed=1)[0].state_dict())
    convolve(conv, x)
    np.testing.assert_array_equal(bits(calls[-1][1]), rounded(conv.weight.data))


@pytest.mark.parametrize("where", ["cpu backend", "emu, fp32", "emu, bf16, outside a flat buffer",
                                   "emu, tf32, outside a flat buffer", "emu, tf32, the stem"])
def test_elsewhere_the_convolutions_multiply_the_float32_parameter(recorded, where):
    """Under bf16 and tf32 a device backend's convolution rounds a float32 weight itself, at each call; under
    tf32 the stem (one input channel) multiplies in float32 on conv.cu's kernels, and gets the float32 weight."""
    calls, record = recorded
    nn.manual_seed(0)
    model = nn.resnet18(width=WIDTH)
    if not where.endswith("outside a flat buffer"):
        model.flat_parameters()
    conv = model[0] if where.endswith("stem") else model.resnet_block1[0].conv1
    precision = "bf16" if where == "cpu backend" else where.split(", ")[1]
    with kernels.emulate() if where != "cpu backend" else contextlib.nullcontext(), kernels.use_precision(precision):
        record(kernels.backend_of(conv.weight.data))
        convolve(conv, np.zeros((2, conv.weight.shape[1], 4, 4), np.float32))
    assert calls[0][1] is conv.weight.data and calls[1][1] is conv.weight.data
    assert not calls[0][3] and not calls[1][3], "w_tf32 for a weight not rounded"


def test_under_tf32_the_convolutions_multiply_the_flat_buffers_tf32_copy(recorded):
    """A device backend's convolutions read a flat buffer's weight from its TF32 copy (w_tf32), forward and
    backward, which holds the weights rounded (round_tf32) and which the optimizer's update keeps current."""
    calls, record = recorded
    nn.manual_seed(0)
    model = nn.resnet18(width=4)   # channel counts that the TF32 tensor cores take: multiples of 4
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    with kernels.emulate(), kernels.use_precision("tf32"):
        conv = model.resnet_block1[0].conv1
        record(kernels.backend_of(conv.weight.data))
        convolve(conv, np.ones((2, 4, 4, 4), np.float32))
        (_, w, _, tf32), (_, w_back, _, tf32_back) = calls
        assert w is opt.flat.multiplied_view(conv.weight, "tf32") and w_back is w and tf32 and tf32_back
        assert w.dtype == np.float32 and w.strides == conv.weight.data.strides
        np.testing.assert_array_equal(opt.flat.multiplied("tf32"), kernels.cpu.round_tf32(opt.flat.data))
        opt.flat.grad[...] = rng().standard_normal(len(opt.flat)).astype(np.float32)
        opt.step()   # the update writes the copy: current with no refresh
        assert opt.flat._copy_current
        np.testing.assert_array_equal(opt.flat.multiplied("tf32"), kernels.cpu.round_tf32(opt.flat.data))
        assert (opt.flat.multiplied("tf32").view(np.uint32) & 0x1FFF == 0).all()
        with conv.weight.writing():   # a write other than the optimizer's: the copy is remade when next read
            conv.weight.data[...] *= 3
        np.testing.assert_array_equal(opt.flat.multiplied("tf32"), kernels.cpu.round_tf32(opt.flat.data))
        conv.weight.data[...] *= 3   # planted: a write that bypasses writing() leaves the copy stale
        assert not np.array_equal(opt.flat.multiplied("tf32"), kernels.cpu.round_tf32(opt.flat.data))


def test_global_average_pooling_hands_back_the_activations_dtype(emulated):
    x = nn.Tensor(rng().standard_normal((2, 8, 3, 3)).astype(kernels.bfloat16), requires_grad=True)
    y = F.adaptive_avg_pool2d(x, 1)
    y.backward(np.ones(y.shape, np.float32))
    assert x.grad.dtype == kernels.bfloat16
    np.testing.assert_array_equal(x.grad.astype(np.float32), np.full(x.shape, 1 / 9, np.float32).astype(
        kernels.bfloat16).astype(np.float32))


# ---- the trainer on simulated GPUs -----------------------------------------------------------------------

@pytest.fixture
def one_gpu(monkeypatch, tmp_path):
    """One simulated GPU in this process, current; the emulator without its sanitizer (these tests prove
    the trainer's plumbing; the kernels' own tests run them under every check, and the first below
    runs the whole bf16 network under memcheck)."""
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "off")
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    gpus = kernels.cupy_module()
    gpus.cuda.Device(0).use()
    return gpus


def test_bf16_training_lowers_the_loss(one_gpu, tmp_path, monkeypatch):
    """Steps on one batch: the loss falls, as mixed-precision training of a real network's would."""
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "memcheck")
    from training.step import train_step
    images, labels = (one_gpu.asarray(a) for a in batch(tmp_path, 4))
    nn.manual_seed(3)
    model = nn.resnet18(width=WIDTH).to("cuda")
    opt = nn.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ddp = DataParallel(model, SingleProcess())
    idx = one_gpu.arange(4)
    with kernels.use_precision("bf16"):
        losses = [float(train_step(model, opt, ddp, images, labels, ddp.scatter(idx))[0]) for _ in range(6)]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])) and losses[-1] < 0.8 * losses[0], losses
    assert model.resnet_block2[0].conv1.weight.data.dtype == np.float32, "float32 master weights"


def test_a_replayed_step_after_another_write_of_the_weights_reads_them_refreshed(one_gpu):
    """A state dict loaded between two replays: the replay multiplies the new weights, as an eager step does
    (the graph's convolutions read the bfloat16 copy without asking for it)."""
    from test_graph import assert_same, run_both
    nn.manual_seed(11)
    loaded = {k: v.copy() for k, v in nn.resnet18(width=WIDTH).state_dict().items()}

    def load(step, model):
        if step == 1:   # after the capture and its replay: two replays follow
            model.load_state_dict(loaded)
    with kernels.use_precision("bf16"):
        eager, graphed = run_both("cuda", one_gpu, between=load)
    assert_same(eager, graphed)


def batch(tmp_path, n):
    """n images and int32 labels of the generated Fashion-MNIST, on the host."""
    from training import fashion_mnist
    splits = fashion_mnist.load_fashion_mnist(write_fashion_mnist(tmp_path / "fashion", n, 1), log=lambda *a: None)
    images, labels = splits["train"]
    return images, labels.astype(np.int32)


# 10 images in batches of 4: a warm-up step, the capture (replayed), and a short last batch (eager); from
# the second epoch on, two replays, each at its own learning rate
ONE_GPU = {"gpus": 1, "precision": "bf16", "width": WIDTH, "batch_size": 4, "test_limit": 4, "momentum": 0.9,
           "weight_decay": 5e-4, "schedule": "cosine"}


def test_on_one_gpu_the_graph_equals_no_graph_and_a_resumed_run_one_never_stopped(one_gpu, tmp_path, monkeypatch,
                                                                                   capsys):
    """--graph and --no-graph give the same checkpoint bit for bit, and so does a run stopped after its first
    epoch and resumed (its bfloat16 weights remade from the restored float32 ones) to the run that went on."""
    data_dir = write_fashion_mnist(tmp_path / "fashion", 10, 4)
    kept, write, train_epoch = {}, loop._write_epoch, loop.train_epoch

    def keeping(out, model, opt, record):   # every epoch's checkpoint, not only the last one
        write(out, model, opt, record)
        kept[out.name, record["epoch"]] = dict(np.load(out / checkpoint.FILENAME))
    monkeypatch.setattr(loop, "_write_epoch", keeping)
    given = {**ONE_GPU, "data_dir": str(data_dir), "epochs": 2}
    straight = loop.run({**given, "graph": False, "out": str(tmp_path / "eager")})

    def stopped_in_epoch_2(model, opt, schedule, images, labels, cfg, epoch, **kw):
        if epoch == 1:
            raise KeyboardInterrupt
        return train_epoch(model, opt, schedule, images, labels, cfg, epoch, **kw)
    monkeypatch.setattr(loop, "train_epoch", stopped_in_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        loop.run({**given, "graph": True, "out": str(tmp_path / "graph")})
    assert_same(kept["graph", 1], kept["eager", 1])
    monkeypatch.setattr(loop, "train_epoch", train_epoch)
    resumed = loop.run({"resume": str(tmp_path / "graph")})
    assert_same(kept["graph", 2], kept["eager", 2])
    assert [m["train_loss"] for m in resumed] == [m["train_loss"] for m in straight]
    assert [m["precision"] for m in resumed] == ["bf16", "bf16"]
    record = json.loads(str(kept["graph", 2]["record"]))
    assert record["config"]["precision"] == "bf16" and record["config"]["graph"] is True
    printed = capsys.readouterr()
    assert "warning" not in printed.out + printed.err, "every capture succeeded"


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in b:
        if b[name].dtype.kind in "fi":
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert a["params"].dtype == np.float32, "the checkpoint holds the float32 master weights"


def test_on_two_gpus_the_graph_equals_no_graph_and_export_writes_the_float32_master_weights(tmp_path):
    """Each worker keeps its own bfloat16 weights, remade after the broadcast from rank 0; the gradients are
    summed in float32."""
    from test_graph import trained   # two simulated GPUs, the flags of its TWO_GPUS
    data_dir = write_fashion_mnist(tmp_path / "fashion", 15, 4)
    flags = ["--precision", "bf16", "--schedule", "cosine"]
    weights = tmp_path / "w.safetensors"
    graphed = trained(data_dir, tmp_path / "graph", *flags, "--graph", "--export", str(weights))
    eager = trained(data_dir, tmp_path / "eager", *flags, "--no-graph")
    assert_same(dict(graphed), dict(eager))
    metrics = json.loads((tmp_path / "graph" / "metrics.json").read_text())
    assert metrics[0]["precision"] == "bf16" and metrics[0]["world_size"] == 2
    import safetensors.numpy
    exported = safetensors.numpy.load_file(str(weights))
    assert {str(a.dtype) for a in exported.values()} == {"float32", "int64"}, "float32, and the step counters"
    model = nn.resnet18(width=WIDTH)
    nn.load_safetensors(model, weights)
    np.testing.assert_array_equal(model.flat_parameters().data, graphed["params"])
