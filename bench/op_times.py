"""Tier (c) of bench/gpu_check: each op of ResNet-18's layers, forward and backward, at the layer's
exact shape (batch 256), beside PyTorch doing the same work with TF32 off, with its defaults and under
autocast to bfloat16: ours in the tf32 precision (the default) beside PyTorch's defaults (cuDNN
convolutions in TF32), the convolutions and linear layer in fp32 beside PyTorch with TF32 off, and
every op in the bf16 precision (its activations and their gradients stored in bfloat16) beside
PyTorch's torch.autocast(device, torch.bfloat16) on channels_last bfloat16 activations.

  PYTHONPATH=. python -m bench.op_times --out ops.json             # on the GPU
  PYTHONPATH=. python -m bench.op_times --dry-run --out ops.json   # tiny shapes, NumPy backend, CPU

Our side calls the contract's ops on the backend of its arrays (kernels.backend_of: the cuda
launchers for CuPy arrays) and nothing else. PyTorch's side runs torch.nn.functional on tensors
holding the same values; its backward is torch.autograd.grad over a graph kept for the
repetitions. A batch-norm forward includes the update of the running statistics, as PyTorch's
does in the same call; SGD is one step over every parameter (PyTorch: one tensor per parameter,
as in its training). Times are medians (bench/timing.py), with TFLOP/s and GB/s from
profiler/costs.py. Each layer's row is written to the JSON file as soon as it is timed.
"""
import argparse
import contextlib
import sys

import numpy as np

import kernels
from bench import layers, report, timing
from nn.modules import FlatParameters
from profiler import costs

EPS, MOMENTUM = 1e-5, 0.1            # batch norm
PHASES = {"forward", "backward"}
LR, SGD_MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4
# PyTorch's precision settings, (name, TF32, autocast): TF32 off for convolutions and matrix products,
# or as PyTorch leaves them (cuDNN convolutions in TF32, matmul in full float32, in recent releases),
# or those and mixed precision, as a model trained under torch.autocast(device, torch.bfloat16) with
# channels_last runs: its activations bfloat16 and channels-last, its products in bfloat16.
SETTINGS = (("torch_fp32", False, False), ("torch_default", None, False), ("torch_bf16", None, True))
# Our sides: the default precision (kernels.precision()), whose products run on the TF32 tensor
# cores, fp32, and bf16. tf32 and fp32 differ in the products (PRODUCTS) only; under bf16 every op
# stores its activations in bfloat16, so that every op differs. Each is compared with the PyTorch
# setting that rounds as it does.
OUR_SIDES = (("ours", "tf32"), ("ours_fp32", "fp32"), ("ours_bf16", "bf16"))
PRODUCTS = ("conv2d", "linear")
PEERS = {"ours": "torch_default", "ours_fp32": "torch_fp32", "ours_bf16": "torch_bf16"}
FULL = {"device": "cuda", "batch": layers.BATCH, "width": 64, "warmup": 3, "repeats": 10, "min_repeat_ms": 2.0}
DRY = {"device": "cpu", "batch": 2, "width": 4, "warmup": 1, "repeats": 2, "min_repeat_ms": 0.0}


class Bench:
    """Where the ops run: the array module, our backend, PyTorch (None without it), the clocks; and
    whether the PyTorch peers being built run under autocast to bfloat16 (``autocast``)."""

    def __init__(self, config, torch, model_layers):
        self.device, self.torch, self.model_layers = config["device"], torch, model_layers
        self.autocast = False
        self.xp = kernels.array_module_for(self.device)
        self.ops = kernels.backend_of(self.xp.zeros(1, np.float32))
        self.rng = np.random.default_rng(0)
        self.timing = {k: config[k] for k in ("warmup", "repeats", "min_repeat_ms")}
        self.clocks = {"ours": timing.clock("ours", self.device)}
        if torch is not None:
            self.clocks["torch"] = timing.clock("torch", self.device, torch)

    def randn(self, shape):
        return self.xp.asarray(self.rng.standard_normal(shape, dtype=np.float32))

    def stores_bfloat16(self):
        """Whether our side stores activations in bfloat16: under the bf16 precision, on the GPU (the
        NumPy backend computes in float32 whatever the precision)."""
        return self.device == "cuda" and kernels.storage_dtype() == kernels.bfloat16

    def stored(self, array):
        """An activation or its gradient (float32 values) as our side stores it (stores_bfloat16)."""
        return self.ops.cast(array, kernels.bfloat16) if self.stores_bfloat16() else array

    def integers(self, high, shape, dtype):
        return self.xp.asarray(self.rng.integers(0, high, shape).astype(dtype))

    def time(self, fn, side):
        return timing.median_ms(fn, self.clocks[side], **self.timing)

    def tensor(self, array, grad=False, dtype=None):
        """A PyTorch copy of one of our arrays, on the same device."""
        t = self.torch.from_dlpack(array).clone()
        t = t if dtype is None else t.to(dtype)
        return t.requires_grad_(grad)

    def leaves(self, *arrays):
        return [self.tensor(a, grad=True) for a in arrays]

    @contextlib.contextmanager
    def setting(self, tf32, mixed):
        """A setting of SETTINGS for the PyTorch peers built and timed inside: TF32 (precision) and,
        when `mixed`, autocast to bfloat16 with bfloat16 channels_last activations."""
        self.autocast = mixed
        try:
            with precision(self.torch, tf32), autocast(self.torch, self.device, mixed):
                yield
        finally:
            self.autocast = False

    def activation(self, array, grad=False):
        """PyTorch's copy of an activation or its gradient: under autocast (``autocast``) bfloat16 and,
        4-D, channels_last, as a model trained so holds them."""
        t = self.tensor(array)
        if self.autocast:
            t = t.to(self.torch.bfloat16)
            t = t.contiguous(memory_format=self.torch.channels_last) if t.ndim == 4 else t
        return t.requires_grad_(grad)

    def activations(self, *arrays):
        return [self.activation(a, grad=True) for a in arrays]


class Peer:
    """PyTorch doing one layer's work: `forward()`; backward: the gradients of its output with
    respect to `wrt` for the upstream gradient `dy`, on one graph kept for every repetition."""

    def __init__(self, torch, forward, wrt=(), dy=None):
        self.torch, self.forward, self.wrt, self.dy = torch, forward, tuple(wrt), dy

    def phases(self):
        """{'forward': fn, 'backward': fn}, built under the precision setting in force."""
        if not self.wrt:
            return {"forward": self.forward}
        y = self.forward()
        dy = self.torch.empty_like(y).copy_(self.dy)   # y's dtype (bfloat16 under autocast) and layout
        return {"forward": self.forward,
                "backward": lambda: self.torch.autograd.grad(y, self.wrt, dy, retain_graph=True)}


def autocast(torch, device, on):
    """torch.autocast(device, torch.bfloat16) when `on`, else nothing."""
    return torch.autocast(device, torch.bfloat16) if on else contextlib.nullcontext()


@contextlib.contextmanager
def precision(torch, tf32):
    """TF32 for cuDNN convolutions and cuBLAS products set to `tf32`, or left as they are (None)."""
    flags = (torch.backends.cudnn, torch.backends.cuda.matmul)
    saved = [f.allow_tf32 for f in flags]
    try:
        if tf32 is not None:
            for f in flags:
                f.allow_tf32 = tf32
        yield {"cudnn.allow_tf32": flags[0].allow_tf32, "cuda.matmul.allow_tf32": flags[1].allow_tf32}
    finally:
        for f, value in zip(flags, saved):
            f.allow_tf32 = value


# ---- one builder per op of the layer list: our calls by phase, and PyTorch's peer -----------
# Each returns ({'forward': [(op, args[, kwargs])], 'backward': [...]}, peer(bench) -> Peer).

def conv2d(b, layer):
    """Ours multiplies the weights as the trainer's convolutions get them (FlatParameters.multiplied): under
    bf16 bfloat16 ones; under tf32 on the GPU, where the convolution multiplies TF32, ones rounded to TF32
    (w_tf32), and its dy rounded so too, as the batch norm's backward before it makes it (dy_tf32)."""
    x, w, bias, dy = b.randn(layer.x), b.randn(layer.w), b.randn(layer.w[:1]), b.randn(layer.y)
    s, p = layer.stride, layer.padding

    def peer(b):
        (tx,), (tw, tb) = b.activations(x), b.leaves(w, bias)
        F = b.torch.nn.functional
        return Peer(b.torch, lambda: F.conv2d(tx, tw, tb, s, p), (tx, tw, tb), b.tensor(dy))
    ours_x, ours_w, ours_dy = b.stored(x), b.stored(w), b.stored(dy)
    forward, backward = {}, {}
    if b.device == "cuda" and kernels.precision() == "tf32" and b.ops.conv2d_tf32(ours_w):
        ours_w, ours_dy = b.ops.round_tf32(ours_w), b.ops.round_tf32(ours_dy)
        forward, backward = {"w_tf32": True}, {"w_tf32": True, "dy_tf32": True}
    return {"forward": [("conv2d_forward", (ours_x, ours_w, bias, s, p), forward)],
            "backward": [("conv2d_backward", (ours_dy, ours_x, ours_w, s, p), backward)]}, peer


def batch_norm(b, layer):
    """Training batch norm with its running statistics, and for the ops batch_norm_relu and
    batch_norm_add_relu the join fused into it: relu(bn(x)), relu(bn(x) + residual)."""
    c = layer.x[1]
    x, gamma, beta, dy = b.randn(layer.x), b.randn((c,)), b.randn((c,)), b.randn(layer.x)
    residual = b.randn(layer.x) if layer.op == "batch_norm_add_relu" else None
    relu = layer.op != "batch_norm"
    running = b.xp.zeros(c, np.float32), b.xp.ones(c, np.float32)

    def peer(b):
        (tx,), (tg, tb) = b.activations(x), b.leaves(gamma, beta)
        tm, tv = map(b.tensor, running)
        F = b.torch.nn.functional
        tr = None if residual is None else b.activation(residual, grad=True)

        def forward():
            t = F.batch_norm(tx, tm, tv, tg, tb, True, MOMENTUM, EPS)
            return F.relu(t + tr) if tr is not None else F.relu(t) if relu else t
        return Peer(b.torch, forward, (tx, tg, tb) + ((tr,) if tr is not None else ()), b.tensor(dy))
    ours_x, ours_dy = b.stored(x), b.stored(dy)
    forward = {"running": running, "momentum": MOMENTUM, "relu": relu,
               "residual": None if residual is None else b.stored(residual)}
    y, mean, invstd = b.ops.batch_norm_forward(ours_x, gamma, beta, EPS, **forward)
    return {"forward": [("batch_norm_forward", (ours_x, gamma, beta, EPS), forward)],
            "backward": [("batch_norm_backward", (ours_dy, ours_x, gamma, mean, invstd),
                          {"y": y if relu else None, "shortcut": residual is not None})]}, peer


def relu(b, layer):
    x, dy = b.randn(layer.x), b.randn(layer.x)

    def peer(b):
        (tx,) = b.activations(x)
        return Peer(b.torch, lambda: b.torch.nn.functional.relu(tx), (tx,), b.tensor(dy))
    ours_x, ours_dy = b.stored(x), b.stored(dy)
    y = b.ops.relu_forward(ours_x)
    return {"forward": [("relu_forward", (ours_x,))], "backward": [("relu_backward", (ours_dy, y))]}, peer


def add_relu(b, layer):
    x, shortcut, dy = b.randn(layer.x), b.randn(layer.x), b.randn(layer.x)

    def peer(b):
        tx, ts = b.activations(x, shortcut)
        return Peer(b.torch, lambda: b.torch.nn.functional.relu(tx + ts), (tx, ts), b.tensor(dy))
    ours = b.stored(x), b.stored(shortcut)
    y = b.ops.add_relu_forward(*ours)
    return {"forward": [("add_relu_forward", ours)], "backward": [("relu_backward", (b.stored(dy), y))]}, peer


def global_avg_pool(b, layer):
    """The pooled features and their gradient are float32 (the linear layer's) under every precision;
    the gradient flows back in the activations' dtype."""
    x, dy = b.randn(layer.x), b.randn(layer.y)

    def peer(b):
        (tx,) = b.activations(x)
        return Peer(b.torch, lambda: b.torch.nn.functional.adaptive_avg_pool2d(tx, 1), (tx,),
                    b.tensor(dy).reshape(*layer.y, 1, 1))
    ours_x = b.stored(x)
    return {"forward": [("global_avg_pool_forward", (ours_x,))],
            "backward": [("global_avg_pool_backward", (dy, layer.x), {"dtype": ours_x.dtype})]}, peer


def linear(b, layer):
    x, w, bias, dy = b.randn(layer.x), b.randn(layer.w), b.randn(layer.w[:1]), b.randn(layer.y)

    def peer(b):
        tx, tw, tb = b.leaves(x, w, bias)
        return Peer(b.torch, lambda: b.torch.nn.functional.linear(tx, tw, tb), (tx, tw, tb), b.tensor(dy))
    return {"forward": [("linear_forward", (x, w, bias))], "backward": [("linear_backward", (dy, x, w))]}, peer


def softmax_cross_entropy(b, layer):
    n, classes = layer.x
    logits, labels = b.randn(layer.x), b.integers(classes, (n,), np.int32)   # the trainer's labels
    dloss = b.xp.ones((), np.float32)
    _, probs = b.ops.softmax_cross_entropy_forward(logits, labels)

    def peer(b):
        (tz,) = b.leaves(logits)
        tl = b.tensor(labels, dtype=b.torch.int64)
        return Peer(b.torch, lambda: b.torch.nn.functional.cross_entropy(tz, tl), (tz,), b.tensor(dloss))
    return {"forward": [("softmax_cross_entropy_forward", (logits, labels))],
            "backward": [("softmax_cross_entropy_backward", (dloss, probs, labels))]}, peer


def sgd_update(b, layer):
    """On the GPU under bf16 and tf32 the update also writes the weights' copy rounded to the precision
    (bfloat16, TF32), as the trainer's (nn.modules.FlatParameters)."""
    param, grad = b.randn(layer.x), b.randn(layer.x)
    velocity = b.xp.zeros(layer.x, np.float32)
    dtype = FlatParameters.COPIES.get(kernels.precision()) if b.device == "cuda" else None
    copy = None if dtype is None else b.xp.empty(layer.x, dtype)

    def peer(b):
        torch = b.torch
        params = [torch.randn(shape, device=b.device) for shape in layers.parameter_shapes(b.model_layers)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.SGD(params, lr=LR, momentum=SGD_MOMENTUM, weight_decay=WEIGHT_DECAY)
        return Peer(torch, opt.step)
    return {"forward": [("sgd_update", (param, grad, velocity, LR, SGD_MOMENTUM, WEIGHT_DECAY), {"copy": copy})]}, peer


def images_to_float(b, layer):
    images = b.integers(256, layer.x, np.uint8)

    def peer(b):
        ti = b.tensor(images)
        return Peer(b.torch, lambda: ti.unsqueeze(1).to(b.torch.float32).div_(255))
    return {"forward": [("images_to_float", (images,))]}, peer


BUILDERS = {fn.__name__: fn for fn in (conv2d, batch_norm, relu, add_relu, global_avg_pool, linear,
                                       softmax_cross_entropy, sgd_update, images_to_float)}
BUILDERS.update(batch_norm_relu=batch_norm, batch_norm_add_relu=batch_norm)


# ---- timing ----------------------------------------------------------------------------------

def time_layer(b, layer, count):
    """The row of one layer: per phase, its cost and the median times of each side."""
    row = {"layer": layer.label, "name": layer.name, "op": layer.op, "count": count, "x": layer.x,
           "w": layer.w, "stride": layer.stride, "padding": layer.padding}
    make_peer = None
    for side, chosen in OUR_SIDES:
        if side != "ours" and chosen != "bf16" and layer.op not in PRODUCTS:
            for phase in PHASES & row.keys():   # the same kernels as the default precision's: one measurement
                row[phase][side] = row[phase]["ours"]
            continue
        with kernels.use_precision(chosen):
            ours, peer = BUILDERS[layer.op](b, layer)   # the arrays as this precision stores them
            make_peer = make_peer or peer
            for phase, calls in ours.items():
                calls = [(op, args, *kwargs) if kwargs else (op, args, {}) for op, args, *kwargs in calls]
                if side == "ours":
                    cost = sum((costs.cost_of(op, *args, **kwargs) for op, args, kwargs in calls), costs.ZERO)
                    row[phase] = {"flops": cost.flops, "bytes": cost.bytes}
                run = lambda calls=calls: [getattr(b.ops, op)(*args, **kwargs) for op, args, kwargs in calls]  # noqa: E731
                row[phase][side] = rates(b.time(run, "ours"), costs.Cost(row[phase]["flops"], row[phase]["bytes"]))
    if b.torch is not None:
        for setting, tf32, mixed in SETTINGS:
            with b.setting(tf32, mixed):
                for phase, fn in make_peer(b).phases().items():
                    cost = costs.Cost(row[phase]["flops"], row[phase]["bytes"])
                    row[phase][setting] = rates(b.time(fn, "torch"), cost)
    return row


def rates(measured, cost):
    ms = measured["ms"]
    return {**measured, "tflops": cost.tflops(ms) if ms > 0 else None, "gbs": cost.gbs(ms) if ms > 0 else None}


SIDES = tuple(side for side, _ in OUR_SIDES) + tuple(setting for setting, *_ in SETTINGS)


def per_step(rows):
    """Milliseconds of one training step's ops, each layer's forward and backward times its count,
    per side; None for a side that is missing from any row."""
    totals = {}
    for side in SIDES:
        times = [row["count"] * row[phase][side]["ms"] for row in rows for phase in ("forward", "backward")
                 if phase in row and side in row[phase]]
        complete = all(side in row["forward"] for row in rows)
        totals[side] = sum(times) if complete and rows else None
    return totals


def line(row):
    """One line of the log: per phase, each side's ms with its TFLOP/s and GB/s."""
    phases = []
    for phase, short in (("forward", "fwd"), ("backward", "bwd")):
        if phase in row:
            sides = [f"{side} {t['ms']:.3f} ms {t['tflops']:.2f} TFLOP/s {t['gbs']:.0f} GB/s"
                     for side, t in row[phase].items() if side in SIDES and t["ms"] > 0]
            phases.append(f"{short}: " + ", ".join(sides))
    return f"{row['layer']:32s} x{row['count']:<2d} " + "; ".join(phases)


def load_torch(device):
    """PyTorch, or None (and why) where it is missing or, for the GPU, built without CUDA."""
    try:
        import torch
    except ImportError as e:
        return None, f"PyTorch is not installed ({e})"
    if device == "cuda" and not torch.cuda.is_available():
        return None, "PyTorch cannot use the GPU (a CPU-only build, or no driver)"
    if device == "cpu":
        torch.set_num_threads(1)   # the dry run checks the code, not the speed: quick and steady
    return torch, None


def run(out, dry_run=False):
    config = DRY if dry_run else FULL
    torch, why_not = load_torch(config["device"])
    b = Bench(config, torch, layers.resnet18_layers(config["batch"], config["width"]))
    result = {"environment": report.environment(), "config": config, "torch": why_not or "compared", "rows": []}
    if torch is not None:
        with precision(torch, None) as defaults:
            result["torch_defaults"] = defaults
    for layer, count in layers.distinct(b.model_layers):
        result["rows"].append(time_layer(b, layer, count))
        print(line(result["rows"][-1]), flush=True)
        report.write_json(out, result)
    result["per_step_ms"] = per_step(result["rows"])
    report.write_json(out, result)
    print("one step's ops, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in result["per_step_ms"].items() if v))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the NumPy backend, timed by the wall clock")
    args = p.parse_args(argv)
    run(args.out, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
