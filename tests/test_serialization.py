"""Weights as safetensors (nn/serialization.py): a round trip through our model, what the file
holds, and a clear error for every way a file can fail to fit. (PyTorch's side of the format:
tests/test_torch_parity.py.)"""
import numpy as np
import pytest
import safetensors.numpy

import nn
from helpers import rng


def trained_a_little(seed, width=2):
    """ResNet-18 at ``width`` after two SGD steps, so that the running statistics and the
    batch counters are not their initial values."""
    nn.manual_seed(seed)
    model = nn.resnet18(width=width)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = rng()
    for _ in range(2):
        x = nn.Tensor(g.random((4, 1, 28, 28), dtype=np.float32))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), g.integers(0, 10, 4)).backward()
        opt.step()
    return model


def outputs(model, x):
    model.eval()
    with nn.no_grad():
        return model(nn.Tensor(x)).data


def test_a_round_trip_gives_the_same_model(tmp_path):
    saved, other = trained_a_little(1), trained_a_little(2)
    x = rng().random((3, 1, 28, 28), dtype=np.float32)
    assert not np.array_equal(outputs(saved, x), outputs(other, x))
    nn.save_safetensors(saved, tmp_path / "w.safetensors")
    flat = other.flat_parameters().data
    nn.load_safetensors(other, tmp_path / "w.safetensors")
    assert other.flat_parameters().data is flat, "loaded in place: the flat buffers stay"
    for key, value in saved.state_dict().items():
        np.testing.assert_array_equal(other.state_dict()[key], value, err_msg=key)
    np.testing.assert_array_equal(outputs(other, x), outputs(saved, x))


def test_the_file_holds_the_state_dict_with_its_keys_dtypes_and_shapes(tmp_path):
    model = trained_a_little(3)
    nn.save_safetensors(model, tmp_path / "w.safetensors")
    state = safetensors.numpy.load_file(tmp_path / "w.safetensors")
    assert set(state) == set(model.state_dict())   # in an order of safetensors' own
    for key, value in model.state_dict().items():
        assert state[key].dtype == value.dtype and state[key].shape == value.shape, key
    assert state["1.num_batches_tracked"].dtype == np.int64 and int(state["1.num_batches_tracked"]) == 2
    assert {"0.weight", "resnet_block1.0.conv1.weight", "resnet_block2.0.conv3.bias", "fc.1.weight",
            "resnet_block4.1.bn2.running_var"} <= set(state)
    assert not list(tmp_path.glob(".*.tmp")), "written atomically, no temporary file left"


def write(path, state):
    safetensors.numpy.save_file(state, str(path))
    return path


@pytest.mark.parametrize("spoil, message", [
    (lambda s: s.pop("fc.1.bias"), r"missing keys \['fc.1.bias'\]"),
    (lambda s: s.update(extra=np.zeros(3, np.float32)), r"unexpected keys \['extra'\]"),
    (lambda s: s.update({"0.weight": np.zeros((2, 1, 5, 5), np.float32)}),
     r"0.weight is float32 of shape \(2, 1, 5, 5\), the model's is float32 of shape \(2, 1, 3, 3\)"),
    (lambda s: s.update({"0.bias": s["0.bias"].astype(np.float64)}),
     r"0.bias is float64 of shape \(2,\), the model's is float32"),
    (lambda s: s.update({"1.num_batches_tracked": np.zeros((), np.int32)}), r"1.num_batches_tracked is int32"),
])
def test_a_file_that_does_not_fit_is_an_error_naming_it(tmp_path, spoil, message):
    model = trained_a_little(4)
    state = {k: np.array(v) for k, v in model.state_dict().items()}
    spoil(state)
    before = model.flat_parameters().data.copy()
    with pytest.raises(nn.SerializationError, match=message):
        nn.load_safetensors(model, write(tmp_path / "w.safetensors", state))
    np.testing.assert_array_equal(model.flat_parameters().data, before, err_msg="nothing was loaded")


def test_what_is_not_a_safetensors_file_says_so(tmp_path):
    model = nn.resnet18(width=2)
    (tmp_path / "junk").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(nn.SerializationError, match="junk is not a safetensors file, or it is corrupt"):
        nn.load_safetensors(model, tmp_path / "junk")
    with pytest.raises(nn.SerializationError, match="nowhere.safetensors: no such file"):
        nn.load_safetensors(model, tmp_path / "nowhere.safetensors")
