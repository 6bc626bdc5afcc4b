"""The layers, modules, hooks, optimizer and ResNet-18 of ``nn``."""
import math

import numpy as np
import pytest

import nn
import nn.functional as F
from helpers import gradcheck, gradcheck_leaves, rng, validate
from nn import Tensor


def normal(*shape):
    return rng().standard_normal(shape)


def labels(n, k):
    return rng().integers(0, k, size=n)


# ---- every functional op through the tape, against finite differences ------------------

FUNCTIONAL = [
    ("conv2d 3x3 pad 1", lambda x, w, b: F.conv2d(x, w, b, 1, 1), [(2, 3, 5, 4), (4, 3, 3, 3), (4,)]),
    ("conv2d stride 2 no bias", lambda x, w: F.conv2d(x, w, None, 2, 0), [(1, 2, 7, 5), (3, 2, 3, 3)]),
    ("conv2d 1x1 stride 2", lambda x, w, b: F.conv2d(x, w, b, 2, 0), [(2, 3, 5, 5), (2, 3, 1, 1), (2,)]),
    ("batch_norm train", lambda x, g, b: F.batch_norm(x, None, None, g, b, True), [(3, 2, 3, 2), (2,), (2,)]),
    ("batch_norm train, relu", lambda x, g, b: F.batch_norm(x, None, None, g, b, True, relu=True),
     [(3, 2, 3, 2), (2,), (2,)]),
    ("batch_norm train, residual join", lambda x, g, b, r: F.batch_norm(x, None, None, g, b, True, residual=r),
     [(3, 2, 3, 2), (2,), (2,), (3, 2, 3, 2)]),
    ("batch_norm eval, residual join",
     lambda x, g, b, r: F.batch_norm(x, np.zeros(2), np.ones(2), g, b, False, residual=r),
     [(3, 2, 3, 2), (2,), (2,), (3, 2, 3, 2)]),
    ("relu", F.relu, [(3, 4, 2)]),
    ("add_relu", F.add_relu, [(2, 3, 4), (2, 3, 4)]),
    ("max_pool2d 2x2", lambda x: F.max_pool2d(x, 2), [(2, 2, 4, 6)]),
    ("max_pool2d 3x3 s2 p1", lambda x: F.max_pool2d(x, 3, 2, 1), [(1, 2, 5, 5)]),
    ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, (1, 1)), [(2, 3, 3, 5)]),
    ("linear", F.linear, [(4, 5), (3, 5), (3,)]),
    ("linear no bias", F.linear, [(4, 5), (3, 5)]),
    ("flatten", F.flatten, [(2, 3, 2, 2)]),
]


@pytest.mark.parametrize("name,fn,shapes", FUNCTIONAL, ids=[c[0] for c in FUNCTIONAL])
def test_functional_gradients(name, fn, shapes):
    gradcheck(fn, [normal(*s) for s in shapes], name)


def test_cross_entropy_gradient_and_value():
    logits, y = normal(5, 4), labels(5, 4)
    gradcheck(lambda z: F.cross_entropy(z, y), [logits], "cross_entropy")
    shifted = logits - logits.max(axis=1, keepdims=True)
    expected = -np.mean(shifted[np.arange(5), y] - np.log(np.exp(shifted).sum(axis=1)))
    validate(F.cross_entropy(Tensor(logits), y).data, expected, "cross_entropy value")


def test_cross_entropy_rejects_mismatched_labels():
    with pytest.raises(ValueError, match="labels"):
        F.cross_entropy(Tensor(normal(5, 4)), labels(4, 4))


def test_batch_norm_eval_gradients():
    mean, var = normal(3), np.abs(normal(3)) + 0.5
    gradcheck(lambda x, g, b: F.batch_norm(x, mean, var, g, b, False),
              [normal(2, 3, 2, 2), normal(3), normal(3)], "batch_norm eval")


# ---- composed networks: every parameter and the input against finite differences ---------

class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 3 * 2, 4))

    def forward(self, x):
        return self.head(self.features(x))


class Shared(nn.Module):
    """One linear layer applied twice: its parameters get two contributions per backward."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return self.layer(F.relu(self.layer(x)))


@pytest.mark.parametrize("make,shape", [
    (Small, (3, 2, 6, 4)),
    (Shared, (3, 4)),
    (lambda: nn.Residual(3, 3), (2, 3, 4, 4)),
    (lambda: nn.Residual(2, 3, use_1x1conv=True, stride=2), (2, 2, 5, 5)),
], ids=["conv-bn-relu-pool-linear", "shared layer", "residual", "residual with projection"])
def test_composed_network_gradients(make, shape):
    model = make().to(np.float64)
    for p in model.parameters():  # away from the init's zero biases and unit scales
        p.data[...] = normal(*p.shape) * 0.5
    x = Tensor(normal(*shape), requires_grad=True)
    projection = None

    def loss():
        nonlocal projection
        out = model(x)
        if out.ndim == 2:
            return F.cross_entropy(out, np.arange(out.shape[0]) % out.shape[1])
        projection = normal(*out.shape) if projection is None else projection
        return (out * projection).sum()
    gradcheck_leaves(loss, [x] + model.parameters(), "composed network")


# ---- batch norm statistics -------------------------------------------------------------

def test_batch_norm_running_statistics_and_eval():
    bn = nn.BatchNorm2d(3).to(np.float64)
    running_mean, running_var = np.zeros(3), np.ones(3)
    for _ in range(4):
        x = normal(5, 3, 2, 3) * 2 + 1
        out = bn(Tensor(x))
        m = x.mean(axis=(0, 2, 3))
        v_biased = x.var(axis=(0, 2, 3))
        v_unbiased = x.var(axis=(0, 2, 3), ddof=1)
        validate(out.data, (x - m[:, None, None]) / np.sqrt(v_biased[:, None, None] + 1e-5),
                 "train output uses the biased batch variance")
        running_mean = 0.9 * running_mean + 0.1 * m
        running_var = 0.9 * running_var + 0.1 * v_unbiased
        validate(bn.running_mean, running_mean, "running mean")
        validate(bn.running_var, running_var, "running var (unbiased)", rtol=1e-8)
    assert int(bn.num_batches_tracked) == 4
    bn.eval()
    x = normal(2, 3, 2, 2)
    expected = (x - running_mean[:, None, None]) / np.sqrt(running_var[:, None, None] + 1e-5)
    validate(bn(Tensor(x)).data, expected, "eval output uses the running statistics")
    validate(bn.running_mean, running_mean, "eval leaves the running mean alone")


# ---- optimizer and schedule ----------------------------------------------------------------

@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 5e-4), (0.0, 1e-2)])
def test_sgd_against_a_hand_computation(momentum, weight_decay):
    model = nn.Linear(3, 2).to(np.float64)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    w, b = model.weight.data.copy(), model.bias.data.copy()
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    for _ in range(3):
        x = normal(4, 3)
        opt.zero_grad()
        (model(Tensor(x)) ** 2).sum().backward()
        gw = 2 * (x @ w.T + b).T @ x + weight_decay * w
        gb = 2 * (x @ w.T + b).sum(axis=0) + weight_decay * b
        vw, vb = momentum * vw + gw, momentum * vb + gb
        w, b = w - 0.1 * vw, b - 0.1 * vb
        opt.step()
        validate(model.weight.data, w, "weight after SGD step")
        validate(model.bias.data, b, "bias after SGD step")


def test_sgd_rejects_bad_hyperparameters():
    for kwargs in ({"lr": 0.0}, {"lr": -1.0}, {"lr": 0.1, "momentum": -0.5}):
        with pytest.raises(ValueError):
            nn.SGD(nn.Linear(2, 2).parameters(), **kwargs)


def test_cosine_schedule():
    opt = nn.SGD(nn.Linear(2, 2).parameters(), lr=0.2)
    schedule = nn.CosineAnnealingLR(opt, T_max=4, eta_min=0.02)
    seen = []
    for _ in range(5):
        schedule.step()
        seen.append(opt.lr)
    expected = [0.02 + 0.18 * (1 + math.cos(math.pi * t / 4)) / 2 for t in (1, 2, 3, 4, 4)]
    np.testing.assert_allclose(seen, expected)


# ---- hooks ------------------------------------------------------------------------------------

def test_grad_final_hook_fires_once_per_parameter_with_the_final_gradient():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    params = model.parameters()
    fired = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: fired.append((i, p.grad.copy())))
    x = Tensor(normal(5, 3).astype(np.float32))
    (model(x) * model(x)).sum().backward()  # every parameter is used twice
    assert sorted(i for i, _ in fired) == list(range(len(params)))
    for i, grad in fired:
        validate(grad, params[i].grad, f"gradient of parameter {i} when its hook fired")
    order = [i // 2 for i, _ in fired]  # layer of each hook, in firing order
    assert order == sorted(order, reverse=True), "later layers' gradients are final first"


def test_module_hooks_nest_and_run_once_each_way():
    model = nn.resnet18(width=2)
    events = []
    handle = nn.register_module_hook(lambda m, e: events.append((e, m)))
    try:
        loss = F.cross_entropy(model(Tensor(normal(2, 1, 8, 8).astype(np.float32))), labels(2, 10))
        forward = list(events)
        events.clear()
        loss.backward()
    finally:
        handle.remove()
    modules = model.modules()
    for phase, log in (("forward", forward), ("backward", events)):
        begins = [m for e, m in log if e == f"{phase}_begin"]
        assert sorted(map(id, begins)) == sorted(map(id, modules)), f"{phase}: once per module"
        stack = []
        for e, m in log:  # well nested
            if e.endswith("begin"):
                stack.append(m)
            else:
                assert stack.pop() is m, f"{phase}: {e} of a module that is not innermost"
        assert not stack
    forward_order = [id(m) for e, m in forward if e == "forward_begin"]
    backward_order = [id(m) for e, m in events if e == "backward_end"]
    leaves = [id(m) for m in modules if not m.children()]
    fwd_leaves = [i for i in forward_order if i in leaves]
    bwd_leaves = [i for i in backward_order if i in leaves]
    assert bwd_leaves == fwd_leaves[::-1], "leaf layers run backward in reverse forward order"


# ---- modules, state, flat buffers ----------------------------------------------------------------

def test_parameters_are_views_of_the_flat_buffers_after_load_state_dict():
    model = nn.resnet18(width=2)
    flat = model.flat_parameters()
    other = nn.resnet18(width=2, init="pytorch")
    model.load_state_dict(other.state_dict())
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert np.shares_memory(p.data, flat.data) and np.shares_memory(p.grad, flat.grad), name
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[key], value, err_msg=key)
    assert model.flat_parameters() is flat


def test_the_flat_buffers_align_every_parameter_and_keep_conv_weights_channels_last():
    model = nn.resnet18(width=2)
    values = [p.data.copy() for p in model.parameters()]
    flat = model.flat_parameters()
    assert flat.parameter_count == sum(v.size for v in values) < len(flat)
    expected = np.zeros(len(flat), np.float32)
    for p, v, lo, hi in zip(model.parameters(), values, flat.offsets, flat.offsets[1:]):
        assert lo % flat.ALIGNMENT == 0 and hi - lo < v.size + flat.ALIGNMENT
        memory = v.transpose(0, 2, 3, 1) if v.ndim == 4 else v    # (out, kh, kw, in) for a conv weight
        expected[lo:lo + v.size] = memory.ravel()
        np.testing.assert_array_equal(p.data, v)
        if v.ndim == 4 and v.shape[1] > 1:
            assert p.data.transpose(0, 2, 3, 1).flags.c_contiguous and p.grad.transpose(0, 2, 3, 1).flags.c_contiguous
    np.testing.assert_array_equal(flat.data, expected)    # the gaps zero
    F.cross_entropy(model(Tensor(normal(2, 1, 8, 8).astype(np.float32))), labels(2, 10)).backward()
    gaps = np.ones(len(flat), bool)
    for p, lo in zip(model.parameters(), flat.offsets):
        gaps[lo:lo + p.size] = False
    assert gaps.any() and not flat.grad[gaps].any()


class DeviceArray:
    """What a CuPy array offers a host model: its shape, get() to the host, and a ``data``
    attribute that is a device pointer, not the values."""

    def __init__(self, array):
        self.array, self.shape, self.data = array, array.shape, object()

    def get(self):
        return self.array


def test_load_state_dict_takes_tensors_and_device_arrays():
    model, other = nn.resnet18(width=2), nn.resnet18(width=2, init="pytorch")
    state = {k: (DeviceArray(v) if i % 2 else nn.Tensor(v)) for i, (k, v) in enumerate(other.state_dict().items())}
    model.load_state_dict(state)
    for key, value in other.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[key], value, err_msg=key)


def test_load_state_dict_names_the_mismatch():
    model = nn.resnet18(width=2)
    state = dict(model.state_dict())
    with pytest.raises(KeyError, match="fc.1.bias"):
        model.load_state_dict({k: v for k, v in state.items() if k != "fc.1.bias"})
    with pytest.raises(KeyError, match="extra.weight"):
        model.load_state_dict({**state, "extra.weight": np.zeros(1)})
    with pytest.raises(ValueError, match=r"0\.weight.*\(2, 1, 3, 3\).*\(4, 1, 3, 3\)"):
        model.load_state_dict({**state, "0.weight": np.zeros((4, 1, 3, 3))})


def test_train_eval_and_zero_grad():
    model = nn.resnet18(width=2)
    assert all(m.training for m in model.modules())
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    F.cross_entropy(model(Tensor(normal(2, 1, 8, 8).astype(np.float32))), labels(2, 10)).backward()
    assert np.any(model.flat_parameters().grad != 0)
    model.zero_grad()
    assert not np.any(model.flat_parameters().grad)


def test_zero_grad_writes_nothing_and_the_next_backward_writes_over_the_stale_gradients():
    nn.manual_seed(0)
    model = Small()
    flat = model.flat_parameters()
    x, y = Tensor(normal(3, 2, 6, 4).astype(np.float32)), labels(3, 4)

    def gradients():
        F.cross_entropy(model(x), y).backward()
        return flat.grad.copy()
    first = gradients()
    model.zero_grad()
    np.testing.assert_array_equal(flat._grad, first)    # nothing written: every gradient is stale
    weight = model.features[0].weight
    assert weight.grad.shape == (3, 2, 3, 3) and not weight.grad.any()  # reading one writes its zeros
    np.testing.assert_array_equal(flat._grad[weight.size:], first[weight.size:])    # and only its own
    np.testing.assert_array_equal(gradients(), first)   # written over the stale values, not added to them
    validate(gradients(), 2 * first, "a second backward without zero_grad adds")
    model.zero_grad()
    head = flat.offsets[-3]   # the linear layer's weight and bias: one all-reduce bucket, say
    np.testing.assert_array_equal(flat.gradients(head, len(flat)), 0)
    np.testing.assert_array_equal(flat._grad[:head], 2 * first[:head])    # outside the slice, still stale


# ---- ResNet-18 -------------------------------------------------------------------------------------

def test_resnet18_size_keys_and_output():
    model = nn.resnet18()
    assert sum(p.size for p in model.parameters()) == 11_175_818
    keys = list(model.state_dict())
    assert keys[:7] == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                        "1.num_batches_tracked"]
    assert "resnet_block2.0.conv3.weight" in keys and "resnet_block1.0.conv3.weight" not in keys
    assert keys[-2:] == ["fc.1.weight", "fc.1.bias"]
    out = model(Tensor(normal(1, 1, 28, 28).astype(np.float32)))
    assert out.shape == (1, 10) and out.dtype == np.float32


@pytest.mark.parametrize("width", [1, 4, 16])
def test_resnet18_width(width):
    model = nn.resnet18(num_classes=7, in_channels=3, width=width)
    w = width
    conv = lambda i, o, k: i * o * k * k + o  # noqa: E731
    block = lambda i, o, proj: conv(i, o, 3) + conv(o, o, 3) + (conv(i, o, 1) if proj else 0) + 4 * o  # noqa
    expected = (conv(3, w, 3) + 2 * w + 2 * block(w, w, False)
                + sum(block(c // 2, c, True) + block(c, c, False) for c in (2 * w, 4 * w, 8 * w))
                + 8 * w * 7 + 7)
    assert sum(p.size for p in model.parameters()) == expected
    assert model(Tensor(normal(2, 3, 12, 12).astype(np.float32))).shape == (2, 7)


def test_init_schemes():
    nn.manual_seed(1)
    model = nn.resnet18(width=8)
    w = model.state_dict()["resnet_block3.0.conv1.weight"]
    assert abs(float(w.std()) - 0.01) < 0.001 and not np.any(model.state_dict()["fc.1.bias"])
    nn.manual_seed(1)
    again = nn.resnet18(width=8)
    np.testing.assert_array_equal(model.flat_parameters().data, again.flat_parameters().data)
    torchlike = nn.resnet18(width=8, init="pytorch")
    bound = 1 / math.sqrt(16 * 9)  # fan-in: 16 channels, 3x3
    w = torchlike.state_dict()["resnet_block3.0.conv1.weight"]
    assert w.max() <= bound and w.min() >= -bound and w.std() > 0.5 * bound
    with pytest.raises(ValueError, match="init scheme"):
        nn.resnet18(width=2, init="xavier")


def test_one_training_step_lowers_the_loss_on_a_fixed_batch():
    nn.manual_seed(0)
    model = nn.resnet18(width=4)
    opt = nn.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = Tensor(rng().random((16, 1, 28, 28)).astype(np.float32)), labels(16, 10)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0] and losses[2] < losses[0], losses
