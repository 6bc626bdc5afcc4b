"""The same ResNet-18 built in PyTorch (d2l's code, with a width knob), the weights
copied over: outputs, gradients, SGD steps and batch-norm statistics must agree."""
import numpy as np
import pytest

import nn
import nn.functional as F
from helpers import reproduce_hint, rng, validate

torch = pytest.importorskip("torch", reason="PyTorch is not installed: `pip install torch` (CPU build) "
                                            "runs the comparison with PyTorch")
tnn = torch.nn
tF = torch.nn.functional


class TorchResidual(tnn.Module):
    """d2l's Residual, unchanged."""

    def __init__(self, input_channels, num_channels, use_1x1conv=False, strides=1):
        super().__init__()
        self.conv1 = tnn.Conv2d(input_channels, num_channels, kernel_size=3, padding=1, stride=strides)
        self.conv2 = tnn.Conv2d(num_channels, num_channels, kernel_size=3, padding=1)
        self.conv3 = tnn.Conv2d(input_channels, num_channels, kernel_size=1, stride=strides) \
            if use_1x1conv else None
        self.bn1 = tnn.BatchNorm2d(num_channels)
        self.bn2 = tnn.BatchNorm2d(num_channels)

    def forward(self, X):
        Y = tF.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3:
            X = self.conv3(X)
        Y += X
        return tF.relu(Y)


def torch_resnet18(num_classes, in_channels, width):
    """d2l's resnet18 of the 'multiple GPUs, concise' section, 64 replaced by ``width``."""
    def resnet_block(in_channels, out_channels, num_residuals, first_block=False):
        blk = []
        for i in range(num_residuals):
            if i == 0 and not first_block:
                blk.append(TorchResidual(in_channels, out_channels, use_1x1conv=True, strides=2))
            else:
                blk.append(TorchResidual(out_channels, out_channels))
        return tnn.Sequential(*blk)
    w = width
    net = tnn.Sequential(tnn.Conv2d(in_channels, w, kernel_size=3, stride=1, padding=1),
                         tnn.BatchNorm2d(w), tnn.ReLU())
    net.add_module("resnet_block1", resnet_block(w, w, 2, first_block=True))
    net.add_module("resnet_block2", resnet_block(w, 2 * w, 2))
    net.add_module("resnet_block3", resnet_block(2 * w, 4 * w, 2))
    net.add_module("resnet_block4", resnet_block(4 * w, 8 * w, 2))
    net.add_module("global_avg_pool", tnn.AdaptiveAvgPool2d((1, 1)))
    net.add_module("fc", tnn.Sequential(tnn.Flatten(), tnn.Linear(8 * w, num_classes)))
    return net


def copy_into_torch(ours, theirs):
    state = {k: torch.from_numpy(np.array(v)) for k, v in ours.state_dict().items()}
    theirs.load_state_dict(state)  # strict: the keys must line up exactly


def test_state_dict_keys_match_d2l():
    assert list(nn.resnet18(width=64).state_dict()) == list(torch_resnet18(10, 1, 64).state_dict())


def close_as_pytorch(ours, truth, peer, name, scale=None):
    """float32 against PyTorch's float64 result: no further off than PyTorch's own float32
    (a few times its error, for the different summation orders), or within 1e-3 of the
    largest element: a pre-activation within rounding of zero may go the other way through
    a ReLU in either code, and one such unit moves a gradient by about that much."""
    ours, peer = np.asarray(ours, np.float64), np.asarray(peer, np.float64)
    scale = float(np.abs(truth).max()) if scale is None else scale
    ours_err, peer_err = float(np.abs(ours - truth).max()), float(np.abs(peer - truth).max())
    assert ours_err <= 4 * peer_err + 1e-3 * scale, (
        f"{name}: off by {ours_err:.3g} from float64, PyTorch float32 by {peer_err:.3g} "
        f"(scale {scale:.3g})\n{reproduce_hint()}")


def gradients_close_as_pytorch(ours, truth, peer, step):
    """float32 gradients as one vector against PyTorch's float64: a ReLU input within
    rounding of zero can go the other way in either float32 code, and a unit that flips
    moves the gradients of every layer below it by percents (2 % of their norm, seen with
    one unit of 1176 flipping in the second stage); a wrong kernel is off by the order of
    the gradient itself. The float64 test above checks the gradients exactly."""
    names = [name for name, _ in ours.named_parameters()]
    flat = lambda grads: np.concatenate([np.asarray(grads[n], np.float64).ravel() for n in names])  # noqa
    exact = flat({n: p.grad.detach().numpy() for n, p in truth.items()})
    error = lambda g: float(np.linalg.norm(g - exact) / np.linalg.norm(exact))  # noqa: E731
    ours_error = error(flat({n: p.grad for n, p in ours.named_parameters()}))
    peer_error = error(flat({n: p.grad.detach().numpy() for n, p in peer.items()}))
    assert ours_error <= max(4 * peer_error, 5e-2), (
        f"gradients, step {step}: {ours_error:.3g} of their norm off float64, PyTorch float32 "
        f"{peer_error:.3g}\n{reproduce_hint()}")
    return ours_error


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_training_steps_match_pytorch(dtype):
    """Two SGD steps with momentum and weight decay from the same weights and data, then
    evaluation: float64 must agree with PyTorch's float64 to 1e-9. float32 takes one step,
    held against PyTorch's float64 with PyTorch's own float32 as the error budget: after a
    ReLU flip (see gradients_close_as_pytorch) later steps start from other weights."""
    ours = nn.resnet18(width=4, init="pytorch").to(np.float64)
    for p in ours.parameters():  # non-trivial batch-norm scales and shifts too
        p.data[...] = p.data + 0.1 * rng().standard_normal(p.shape)
    truth, peer = torch_resnet18(10, 1, 4).double(), torch_resnet18(10, 1, 4).float()
    copy_into_torch(ours, truth)
    copy_into_torch(ours, peer)
    ours.to(dtype)
    opt = nn.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    torch_opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
                  for m in (truth, peer)]

    def compare(value, truth_value, peer_value, name, scale=None):
        truth_value = truth_value.detach().numpy()
        if dtype == np.float64:
            validate(value, truth_value, name, atol=1e-9 * (scale or 0), rtol=1e-9)
        else:
            close_as_pytorch(value, truth_value, peer_value.detach().numpy(), name, scale)

    def run_torch(x, y):
        outs = []
        for model, opt in zip((truth, peer), torch_opts):
            opt.zero_grad()
            logits = model(torch.from_numpy(x).to(next(model.parameters()).dtype))
            loss = tF.cross_entropy(logits, torch.from_numpy(y))
            loss.backward()
            outs.append((logits, loss, dict(model.named_parameters())))
        return outs

    for step in range(2 if dtype == np.float64 else 1):
        x, y = rng().random((6, 1, 28, 28)), rng().integers(0, 10, size=6)
        opt.zero_grad()
        logits = ours(nn.Tensor(x.astype(dtype)))
        loss = F.cross_entropy(logits, y)
        loss.backward()
        (t_logits, t_loss, t_params), (p_logits, p_loss, p_params) = run_torch(x, y)
        compare(logits.data, t_logits, p_logits, f"logits, step {step}")
        compare(loss.data, t_loss, p_loss, f"loss, step {step}")
        if dtype == np.float64:
            # a conv bias before batch norm has a zero gradient in exact arithmetic and rounding
            # noise in practice, so gradients are measured against the largest of the model
            scale = max(float(p.grad.abs().max()) for p in t_params.values())
            for name, p in ours.named_parameters():
                compare(p.grad, t_params[name].grad, p_params[name].grad, f"grad of {name}, step {step}", scale)
        else:
            gradients_close_as_pytorch(ours, t_params, p_params, step)
        opt.step()
        for o in torch_opts:
            o.step()
    if dtype == np.float32:
        return
    for name, value in ours.state_dict().items():
        compare(np.asarray(value), truth.state_dict()[name], peer.state_dict()[name], f"{name} after two steps")
    for model in (ours, truth, peer):
        model.eval()
    x = rng().random((3, 1, 28, 28))
    with torch.no_grad():
        compare(ours(nn.Tensor(x.astype(dtype))).data, truth(torch.from_numpy(x)),
                peer(torch.from_numpy(x).float()), "eval-mode logits")


def test_weights_go_to_pytorch_and_back_through_safetensors(tmp_path):
    """The file of --export (nn.save_safetensors) loads into d2l's PyTorch ResNet-18 with
    strict=True and gives our outputs; a file PyTorch wrote of its state dict loads into ours
    (nn.load_safetensors, what --init-from does) and gives PyTorch's. Eval mode, so that the
    running statistics and every buffer take part."""
    from safetensors.torch import load_file, save_file
    x = rng().random((5, 1, 28, 28), dtype=np.float32)

    def ours_out(model):
        model.eval()
        with nn.no_grad():
            return model(nn.Tensor(x)).data

    def theirs_out(net):
        net.eval()
        with torch.no_grad():
            return net(torch.from_numpy(x)).numpy()

    ours = nn.resnet18(width=4, init="pytorch")
    for name, value in ours.state_dict().items():     # every entry away from its initial value
        if value.dtype == np.float32:
            value[...] = np.abs(value + 0.1 * rng().standard_normal(value.shape)) if "running_var" in name \
                else value + 0.1 * rng().standard_normal(value.shape)
        else:
            value[...] = 7
    nn.save_safetensors(ours, tmp_path / "ours.safetensors")
    theirs = torch_resnet18(10, 1, 4)
    theirs.load_state_dict(load_file(tmp_path / "ours.safetensors"), strict=True)
    assert int(theirs.state_dict()["1.num_batches_tracked"]) == 7
    validate(theirs_out(theirs), ours_out(ours), "PyTorch's logits from our exported weights")

    torch.manual_seed(int(rng().integers(2**31)))
    trained = torch_resnet18(10, 1, 4)
    trained(torch.from_numpy(rng().random((8, 1, 28, 28), dtype=np.float32)))   # moves its running statistics
    save_file(trained.state_dict(), tmp_path / "theirs.safetensors")
    back = nn.resnet18(width=4)
    nn.load_safetensors(back, tmp_path / "theirs.safetensors")
    assert int(back.state_dict()["1.num_batches_tracked"]) == 1
    validate(ours_out(back), theirs_out(trained), "our logits from PyTorch's weights")
