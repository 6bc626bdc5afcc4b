"""Every CUDA op, forward and backward, on the GPU against PyTorch float64 on the same GPU: at the exact
shape of every ResNet-18 layer at batch 256 (bench/layers.py lists them), and on odd shapes (batch 1
and 3; channels 1, 3, 5, 17; spatial 1x1 and 5x7; stride 2 on odd sizes). Those tests are marked ``gpu``
and skipped with the reason where there is no GPU, CuPy or PyTorch with CUDA; bench/gpu_check runs them.

New CuPy arrays start as NaN (poisoned_device_empty), so an output element a kernel leaves unwritten
fails. Each result must satisfy ||ours - torch|| / ||torch|| < 1e-5 for element-wise ops and < 1e-4
for reductions and GEMMs; the convolutions and the linear layer run in every precision, < 2e-3
under tf32 and < 1e-2 under bf16 (kernels.precision()); NumPy references are for small shapes only (tests/test_kernels_cuda.py),
at this size they would take minutes. The whole training step is test_kernels_cuda.py's
test_resnet18_training_step_on_the_gpu_matches_numpy. A batch norm with its relu is checked on inputs drawn
clear of the relu's kink, where float32 and float64 may decide an element's gradient differently (KINK);
the tests at the end, on the CPU, show that such a check fails at the kink and on a relu decided wrongly.

Each check is ``check(ours, torch, device, layer)``: the ops namespace under test (here the cuda
backend through OnDevice), PyTorch, the device of PyTorch's tensors, and the layer; those comparing
a forward and its backward build a TORCH_PEERS case and hand it to compare_with_torch.
tests/test_gpu_check.py runs the same checks on the CPU, small, to check the checks.
"""
import dataclasses
import functools

import numpy as np
import pytest

import kernels
from bench.layers import Layer, distinct, resnet18_layers
from helpers import rng
from test_kernels_cuda import (EPS, OnDevice, compare_with_torch, gpu, poisoned_device_empty,  # noqa: F401
                               relative_error, shifted_batch)

ELEMENTWISE, REDUCTION = 1e-5, 1e-4     # bounds on ||ours - torch|| / ||torch||
# ... for the products of each precision: under tf32 each product's factors are rounded to TF32
# (a relative error of up to 2^-11 each, about 4e-4 in norm on random data); under bf16 to bfloat16
# (2^-8 each), and the result stored as bfloat16 too (about 4e-3 in norm in all)
BOUNDS = {"fp32": REDUCTION, "tf32": 2e-3, "bf16": 1e-2}
MOMENTUM = 0.1                          # batch norm's, as PyTorch counts it


@pytest.fixture
def on_gpu(request):
    """(the cuda backend's ops on NumPy arrays, torch), new CuPy arrays filled with NaN."""
    backend, _, torch = request.getfixturevalue("gpu")
    request.getfixturevalue("poisoned_device_empty")
    return OnDevice(backend), torch


@dataclasses.dataclass(frozen=True)
class Pool:
    """A max pooling; ResNet-18 has none (d2l's drops the stem's), so it is checked at the scale of
    the stem's output."""
    x: tuple
    kernel: int
    stride: int
    padding: int
    op = "max_pool2d"

    @property
    def label(self):
        return f"max pool {self.kernel}/{self.stride} {'x'.join(map(str, self.x))}"


def against_torch(build):
    """A check from `build(layer)`, which gives a TORCH_PEERS case of tests/test_kernels_cuda.py."""
    @functools.wraps(build)
    def check(ours, torch, device, layer):
        compare_with_torch(ours, torch, device, build(layer))
    return check


# ---- forward and backward against PyTorch's ------------------------------------------------

def in_precision(build):
    """A product's check in each precision (kernels.precision()): ``<name>_fp32`` within REDUCTION,
    ``<name>_tf32`` within TF32 (its inputs rounded to 10 mantissa bits), ``<name>_bf16`` within
    bfloat16 (its inputs and outputs rounded to 7)."""
    def check_in(precision):
        def check(ours, torch, device, layer):
            with kernels.use_precision(precision):
                compare_with_torch(ours, torch, device, build(layer) + (BOUNDS[precision],))
        check.__name__ = f"{build.__name__}_{precision}"
        return check
    return [check_in(precision) for precision in kernels.PRECISIONS]


def conv2d(layer):
    s, p = layer.stride, layer.padding
    return (layer.label, [layer.x, layer.w, layer.w[:1]],
            lambda F, x, w, b: F.conv2d(x, w, b, stride=s, padding=p),
            lambda m, x, w, b: m.conv2d_forward(x, w, b, s, p),
            lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, s, p))


@against_torch
def batch_norm(layer):
    c = layer.x[1]
    return (layer.label, [shifted_batch(layer.x).astype(np.float32), (c,), (c,)],
            lambda F, x, gamma, beta: F.batch_norm(x, None, None, gamma, beta, training=True, eps=EPS),
            lambda m, x, gamma, beta: m.batch_norm_forward(x, gamma, beta, EPS),
            lambda m, dy, x, gamma, beta, y, mean, invstd: m.batch_norm_backward(dy, x, gamma, mean, invstd),
            REDUCTION)


# The relu after a batch norm passes an element's gradient or not by the sign of its pre-activation,
# x * scale + (beta - mean * scale) (+ the shortcut), scale = gamma * invstd, which float32 gets only to
# within a few ulps of its terms (the statistics' rounding and its own): an element nearer zero than that
# may fall on the other side of the relu than in float64, in any float32 implementation, and then its whole
# gradient counts as error. On one H200, one element of 3.2 million, 5e-8 from zero, made dx's relative
# error 3.5e-4 at 256x7x7, ours and cuDNN's float32 alike; over 48 other draws at ResNet-18's shapes each
# took such an element across in 3 (in other draws), and neither any once the draws were cleared of it. So
# these checks draw no pre-activation within KINK (128 ulps) of its terms' magnitude.
KINK = 2.0 ** -16


def relu_join_inputs(shape, residual=False):
    """[x, gamma, beta] (and the shortcut, with residual) of a training batch norm of `shape` with its relu:
    x from shifted_batch, the others standard normal."""
    x = shifted_batch(shape).astype(np.float32)
    g = rng()
    gamma, beta = g.standard_normal((2, shape[1])).astype(np.float32)
    return [x, gamma, beta] + ([g.standard_normal(shape).astype(np.float32)] if residual else [])


def clear_of_the_kink(x, *others):
    """relu_join_inputs with each element of x (in place) whose pre-activation lies within KINK of its terms'
    magnitude moved away from zero, until none does."""
    for step in 2.0 ** np.arange(2, 12):
        z, terms, scale = pre_activation(x, *others)
        near = np.abs(z) < KINK * terms
        if not near.any():
            return [x, *others]
        x += np.where(near, np.where(z < 0, -step, step) * KINK * terms / scale, 0).astype(np.float32)
    raise AssertionError(f"{np.count_nonzero(near)} pre-activations stay within {KINK:g} of the relu's kink")


def pre_activation(x, gamma, beta, residual=None):
    """Per element, in float64 of the float32 inputs: a training batch norm's pre-activation, the magnitude
    of its terms (x * scale, mean * scale, beta, residual) and scale, its slope in x."""
    x = x.astype(np.float64)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    scale = gamma[:, None, None] / np.sqrt(x.var(axis=(0, 2, 3), keepdims=True) + EPS)
    r = 0.0 if residual is None else residual.astype(np.float64)
    z = (x - mean) * scale + beta[:, None, None] + r
    return z, np.abs(scale) * (np.abs(x) + np.abs(mean)) + np.abs(beta)[:, None, None] + np.abs(r), scale


@against_torch
def batch_norm_relu(layer):
    """relu(batch norm), fused: the first batch norm of a residual block."""
    return (layer.label, clear_of_the_kink(*relu_join_inputs(layer.x)),
            lambda F, x, gamma, beta: F.relu(F.batch_norm(x, None, None, gamma, beta, training=True, eps=EPS)),
            lambda m, x, gamma, beta: m.batch_norm_forward(x, gamma, beta, EPS, relu=True),
            lambda m, dy, x, gamma, beta, y, mean, invstd: m.batch_norm_backward(dy, x, gamma, mean, invstd, y=y),
            REDUCTION)


@against_torch
def batch_norm_add_relu(layer):
    """relu(batch norm + shortcut), fused: the join of a residual block, with the shortcut's gradient."""
    return (layer.label, clear_of_the_kink(*relu_join_inputs(layer.x, residual=True)),
            lambda F, x, gamma, beta, r: F.relu(F.batch_norm(x, None, None, gamma, beta, training=True, eps=EPS) + r),
            lambda m, x, gamma, beta, r: m.batch_norm_forward(x, gamma, beta, EPS, residual=r),
            lambda m, dy, x, gamma, beta, r, y, mean, invstd: m.batch_norm_backward(dy, x, gamma, mean, invstd, y=y,
                                                                                     shortcut=True),
            REDUCTION)


@against_torch
def batch_norm_inference(layer):
    c = layer.x[1]
    g = rng()
    mean, var = g.standard_normal(c).astype(np.float32), g.uniform(0.3, 3.0, c).astype(np.float32)
    return (f"{layer.label} (inference)", [shifted_batch(layer.x).astype(np.float32), (c,), (c,)],
            lambda F, x, gamma, beta: F.batch_norm(x, x.new_tensor(mean), x.new_tensor(var), gamma, beta,
                                                   training=False, eps=EPS),
            lambda m, x, gamma, beta: m.batch_norm_inference(x, gamma, beta, mean, var, EPS),
            lambda m, dy, x, gamma, beta, y: m.batch_norm_inference_backward(dy, x, gamma, mean, var, EPS),
            REDUCTION)


@against_torch
def relu(layer):
    return (layer.label, [layer.x], lambda F, x: F.relu(x), lambda m, x: m.relu_forward(x),
            lambda m, dy, x, y: m.relu_backward(dy, y), ELEMENTWISE)


@against_torch
def add_relu(layer):
    return (layer.label, [layer.x, layer.x], lambda F, a, b: F.relu(a + b), lambda m, a, b: m.add_relu_forward(a, b),
            lambda m, dy, a, b, y: (m.relu_backward(dy, y),) * 2, ELEMENTWISE)


@against_torch
def global_avg_pool(layer):
    return (layer.label, [layer.x], lambda F, x: x.mean(dim=(2, 3)), lambda m, x: m.global_avg_pool_forward(x),
            lambda m, dy, x, y: m.global_avg_pool_backward(dy, x.shape), REDUCTION)


@against_torch
def max_pool2d(pool):
    k, s, p = pool.kernel, pool.stride, pool.padding
    return (pool.label, [pool.x], lambda F, x: F.max_pool2d(x, k, s, p), lambda m, x: m.max_pool2d_forward(x, k, s, p),
            lambda m, dy, x, y, argmax: m.max_pool2d_backward(dy, argmax, x.shape), ELEMENTWISE)


def linear(layer):
    return (layer.label, [layer.x, layer.w, layer.w[:1]], lambda F, x, w, b: F.linear(x, w, b),
            lambda m, x, w, b: m.linear_forward(x, w, b), lambda m, dy, x, w, b, y: m.linear_backward(dy, x, w))


@against_torch
def softmax_cross_entropy(layer):
    n, classes = layer.x
    labels = rng().integers(0, classes, n).astype(np.int32)   # the trainer's labels are int32
    return (layer.label, [layer.x, labels], lambda F, z, labels: F.cross_entropy(z, labels),
            lambda m, z, labels: m.softmax_cross_entropy_forward(z, labels),
            lambda m, dloss, z, labels, loss, probs: m.softmax_cross_entropy_backward(dloss, probs, labels),
            REDUCTION)


# ---- the ops that are not a forward and a backward ------------------------------------------

def batch_norm_update_running(ours, torch, device, layer):
    g = rng()
    c = layer.x[1]
    x = shifted_batch(layer.x).astype(np.float32)
    gamma, beta, running_mean = g.standard_normal((3, c)).astype(np.float32)
    running_var = g.uniform(0.3, 3.0, c).astype(np.float32)
    peer = [torch.tensor(a, dtype=torch.float64, device=device) for a in (x, running_mean, running_var, gamma, beta)]
    torch.nn.functional.batch_norm(*peer, training=True, momentum=MOMENTUM, eps=EPS)
    # the running statistics moved by the op of their own, and by the training forward itself
    folded = running_mean.copy(), running_var.copy()
    _, mean, invstd = ours.batch_norm_forward(x, gamma, beta, EPS)
    ours.batch_norm_update_running(running_mean, running_var, mean, invstd, x.size // c, MOMENTUM, EPS)
    ours.batch_norm_forward(x, gamma, beta, EPS, running=folded, momentum=MOMENTUM)
    for name, o, t in (("running mean", running_mean, peer[1]), ("running var", running_var, peer[2]),
                       ("running mean, folded", folded[0], peer[1]), ("running var, folded", folded[1], peer[2])):
        assert relative_error(o, t.cpu().numpy()) < REDUCTION, f"{layer.label}: {name}"


def sgd_update(ours, torch, device, layer, lr=0.1, momentum=0.9, weight_decay=5e-4):
    """Two steps of SGD with momentum and weight decay over the flat buffer against torch.optim.SGD
    in float64: the parameters and the velocity (PyTorch's momentum buffer)."""
    g = rng()
    param, *grads = g.standard_normal((3,) + layer.x).astype(np.float32)
    velocity = np.zeros_like(param)
    peer = torch.tensor(param, dtype=torch.float64, device=device, requires_grad=True)
    opt = torch.optim.SGD([peer], lr=lr, momentum=momentum, weight_decay=weight_decay)
    for grad in grads:
        peer.grad = torch.tensor(grad, dtype=torch.float64, device=device)
        opt.step()
        assert ours.sgd_update(param, grad, velocity, lr, momentum, weight_decay) is None
    assert relative_error(param, peer.detach().cpu().numpy()) < ELEMENTWISE, f"{layer.label}: parameters"
    assert relative_error(velocity, opt.state[peer]["momentum_buffer"].cpu().numpy()) < ELEMENTWISE, \
        f"{layer.label}: velocity"


def images_to_float(ours, torch, device, layer):
    images = rng().integers(0, 256, layer.x).astype(np.uint8)
    images.flat[:2] = (0, 255)
    out = ours.images_to_float(images)
    assert out.dtype == np.float32 and out.shape == layer.y
    peer = torch.tensor(images, device=device).unsqueeze(1).to(torch.float64) / 255
    assert relative_error(out, peer.cpu().numpy()) < ELEMENTWISE


def count_correct(ours, torch, device, layer):
    g = rng()
    n, classes = layer.x
    logits = g.standard_normal(layer.x).astype(np.float32)
    labels = g.integers(0, classes, n).astype(np.int32)
    labels[: n // 2] = logits[: n // 2].argmax(axis=1)     # some hits for certain
    peer = torch.tensor(logits, device=device).argmax(dim=1) == torch.tensor(labels, device=device).long()
    assert int(ours.count_correct(logits, labels)) == int(peer.sum())


CHECKS = {
    "conv2d": in_precision(conv2d), "batch_norm": [batch_norm, batch_norm_inference, batch_norm_update_running],
    "batch_norm_relu": [batch_norm_relu], "batch_norm_add_relu": [batch_norm_add_relu],
    "relu": [relu], "add_relu": [add_relu], "global_avg_pool": [global_avg_pool], "max_pool2d": [max_pool2d],
    "linear": in_precision(linear), "softmax_cross_entropy": [softmax_cross_entropy, count_correct],
    "sgd_update": [sgd_update], "images_to_float": [images_to_float],
}


def params(shapes):
    """pytest params (check, layer) for every check of every layer."""
    return [pytest.param(check, layer, id=f"{check.__name__}-{layer.label}")
            for layer in shapes for check in CHECKS[layer.op]]


RESNET18_LAYERS = [layer for layer, _ in distinct(resnet18_layers())] + [
    Pool((256, 64, 28, 28), 3, 2, 1), Pool((256, 64, 28, 28), 2, 2, 0)]


def odd(op, x, w=None, stride=1, padding=0):
    return Layer(op, "odd", x, w, stride, padding)


ODD_SHAPES = [
    odd("conv2d", (1, 1, 5, 7), (3, 1, 3, 3), 1, 1),        # batch 1, one input channel
    odd("conv2d", (3, 3, 5, 7), (5, 3, 3, 3), 2, 1),        # stride 2 on odd sizes
    odd("conv2d", (3, 17, 7, 5), (3, 17, 3, 3), 2, 1),
    odd("conv2d", (3, 17, 5, 7), (17, 17, 1, 1), 2, 0),     # the 1x1 projection on odd sizes
    odd("conv2d", (1, 5, 1, 1), (17, 5, 3, 3), 1, 1),       # 1x1 spatial, all but the centre tap padding
    odd("conv2d", (3, 5, 1, 1), (3, 5, 1, 1), 1, 0),
    odd("batch_norm", (3, 1, 5, 7)), odd("batch_norm", (1, 17, 5, 7)), odd("batch_norm", (3, 5, 1, 1)),
    odd("batch_norm", (1, 3, 5, 7)), odd("batch_norm_relu", (3, 5, 1, 1)), odd("batch_norm_add_relu", (1, 17, 5, 7)),
    odd("relu", (1, 1, 1, 1)), odd("relu", (3, 17, 5, 7)),
    odd("add_relu", (1, 5, 1, 1)), odd("add_relu", (3, 3, 5, 7)),
    odd("global_avg_pool", (1, 17, 5, 7)), odd("global_avg_pool", (3, 1, 1, 1)), odd("global_avg_pool", (3, 5, 5, 7)),
    Pool((1, 3, 5, 7), 3, 2, 1), Pool((3, 17, 5, 7), 2, 2, 0), Pool((3, 1, 1, 1), 1, 1, 0), Pool((3, 5, 7, 5), 3, 2, 1),
    odd("linear", (1, 17), (3, 17)), odd("linear", (3, 1), (5, 1)), odd("linear", (3, 5), (17, 5)),
    odd("linear", (1, 3), (1, 3)),
    odd("softmax_cross_entropy", (1, 5)), odd("softmax_cross_entropy", (3, 17)), odd("softmax_cross_entropy", (3, 3)),
    odd("sgd_update", (1,)), odd("sgd_update", (17,)), odd("sgd_update", (1037,)),
    odd("images_to_float", (1, 5, 7)), odd("images_to_float", (3, 1, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("check, layer", params(RESNET18_LAYERS))
def test_resnet18_layer_shape(on_gpu, check, layer):
    ours, torch = on_gpu
    check(ours, torch, "cuda", layer)


@pytest.mark.gpu
@pytest.mark.parametrize("check, layer", params(ODD_SHAPES))
def test_odd_shape(on_gpu, check, layer):
    ours, torch = on_gpu
    check(ours, torch, "cuda", layer)


# ---- on the CPU: the checks of a relu after a batch norm and its kink ---------------------------------

def flipped_relu(y, at):
    """y with the relu's decision at flat index `at` reversed, as a backward reading it for the mask takes it."""
    y = y.copy()
    y.flat[at] = 0.0 if y.flat[at] > 0 else 1.0
    return y


@pytest.mark.parametrize("planted", ["inputs at the kink", "a relu decided wrongly"])
def test_a_relu_join_check_fails_at_the_kink_and_on_a_wrong_relu(poisoned_empty, planted):
    """Planted, on the emulator against PyTorch on the CPU: 64 shortcut elements that bring the pre-activation
    to zero in float64, to within float32's rounding, where float32 (ours, PyTorch's) takes either side; or
    ours deciding the relu wrongly at the element nearest the kink of those the check draws, where float32
    resolves it: the check fails, and says how far PyTorch's float32 is. The twin: ours on the check's own
    inputs passes."""
    torch = pytest.importorskip("torch")
    ours = kernels._device_backend("emu")
    name, inputs, torch_op, forward, backward, bound = batch_norm_add_relu.__wrapped__(
        odd("batch_norm_add_relu", (16, 8, 7, 7)))
    z, terms, _ = pre_activation(*inputs)
    if planted == "inputs at the kink":
        at = rng().choice(z.size, 64, replace=False)
        shortcut = inputs[3].copy()
        shortcut.flat[at] = shortcut.flat[at] - z.flat[at]
        wrong = (name, [*inputs[:3], shortcut], torch_op, forward, backward, bound)
    else:
        at = np.argmin(np.abs(z) / terms)
        wrong = (name, inputs, torch_op, forward, lambda m, dy, x, gamma, beta, r, y, mean, invstd:
                 backward(m, dy, x, gamma, beta, r, flipped_relu(y, at), mean, invstd), bound)
    with pytest.raises(AssertionError, match=r"gradient \d+: .* PyTorch's float32 on the same inputs"):
        compare_with_torch(ours, torch, "cpu", wrong)
    compare_with_torch(ours, torch, "cpu", (name, inputs, torch_op, forward, backward, bound))


@pytest.mark.parametrize("build", [batch_norm_relu, batch_norm_add_relu], ids=["relu", "residual"])
def test_the_relu_join_checks_draw_no_input_at_the_kink(build):
    """At a million elements a draw has some pre-activations within KINK of zero (the twin); the check's
    inputs have none."""
    layer = odd(build.__name__, (256, 64, 8, 8))
    for inputs, near in ((relu_join_inputs(layer.x, build is batch_norm_add_relu), True),
                         (build.__wrapped__(layer)[1], False)):
        z, terms, _ = pre_activation(*inputs)
        assert np.any(np.abs(z) < KINK * terms) == near
