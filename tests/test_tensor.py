"""Every Tensor operation: forward against NumPy, backward against finite differences."""
import numpy as np
import pytest

from helpers import gradcheck, rng, validate
from nn import Tensor, no_grad


class Positive(tuple):
    """A shape whose draws are kept away from zero and negatives (log, division, roots)."""


def normal(shape):
    return rng().standard_normal(shape)


# (name, function of tensors, input arrays, the same function on NumPy arrays)
CASES = [
    ("add", lambda a, b: a + b, [(3, 4), (4,)], np.add),
    ("add broadcast both", lambda a, b: a + b, [(2, 1, 3), (4, 1)], np.add),
    ("sub", lambda a, b: a - b, [(3, 4), (3, 1)], np.subtract),
    ("mul", lambda a, b: a * b, [(2, 3), (2, 3)], np.multiply),
    ("mul broadcast", lambda a, b: a * b, [(1, 3), (5, 1)], np.multiply),
    ("div", lambda a, b: a / b, [(3, 4), Positive((4,))], np.divide),
    ("neg", lambda a: -a, [(2, 5)], np.negative),
    ("pow 2", lambda a: a ** 2, [(3, 3)], lambda a: a ** 2),
    ("pow 3", lambda a: a ** 3, [(4,)], lambda a: a ** 3),
    ("pow 0.5", lambda a: a ** 0.5, [Positive((3, 2))], np.sqrt),
    ("pow tensor", lambda a, b: a ** b, [Positive((3,)), (3,)], np.power),
    ("rpow", lambda a: 2.0 ** a, [(3,)], lambda a: 2.0 ** a),
    ("radd", lambda a: 1.5 + a, [(3,)], lambda a: 1.5 + a),
    ("rsub", lambda a: 1.5 - a, [(3,)], lambda a: 1.5 - a),
    ("rmul", lambda a: 3.0 * a, [(3,)], lambda a: 3.0 * a),
    ("rdiv", lambda a: 3.0 / a, [Positive((3,))], lambda a: 3.0 / a),
    ("matmul", lambda a, b: a @ b, [(3, 4), (4, 5)], np.matmul),
    ("matmul batched broadcast", lambda a, b: a @ b, [(2, 3, 4), (4, 5)], np.matmul),
    ("matmul batched both", lambda a, b: a @ b, [(2, 1, 3, 4), (3, 4, 2)], np.matmul),
    ("matmul vec-mat", lambda a, b: a @ b, [(4,), (4, 3)], np.matmul),
    ("matmul mat-vec", lambda a, b: a @ b, [(3, 4), (4,)], np.matmul),
    ("matmul vec-vec", lambda a, b: a @ b, [(4,), (4,)], np.matmul),
    ("sum all", lambda a: a.sum(), [(3, 4)], np.sum),
    ("sum axis", lambda a: a.sum(axis=1), [(3, 4, 2)], lambda a: a.sum(axis=1)),
    ("sum axes keepdims", lambda a: a.sum(axis=(0, 2), keepdims=True), [(3, 4, 2)],
     lambda a: a.sum(axis=(0, 2), keepdims=True)),
    ("sum negative axis", lambda a: a.sum(axis=-1), [(3, 4)], lambda a: a.sum(axis=-1)),
    ("mean all", lambda a: a.mean(), [(3, 4)], np.mean),
    ("mean axes", lambda a: a.mean(axis=(1, 2)), [(2, 3, 4)], lambda a: a.mean(axis=(1, 2))),
    ("max all", lambda a: a.max(), [(3, 4)], np.max),
    ("max axis", lambda a: a.max(axis=0), [(3, 4)], lambda a: a.max(axis=0)),
    ("max keepdims", lambda a: a.max(axis=1, keepdims=True), [(3, 4)],
     lambda a: a.max(axis=1, keepdims=True)),
    ("exp", lambda a: a.exp(), [(3, 4)], np.exp),
    ("log", lambda a: a.log(), [Positive((3, 4))], np.log),
    ("reshape", lambda a: a.reshape(4, 3), [(3, 4)], lambda a: a.reshape(4, 3)),
    ("reshape tuple", lambda a: a.reshape((2, -1)), [(3, 4)], lambda a: a.reshape(2, -1)),
    ("transpose", lambda a: a.transpose(2, 0, 1), [(2, 3, 4)], lambda a: a.transpose(2, 0, 1)),
    ("T", lambda a: a.T, [(2, 3)], lambda a: a.T),
    ("slice", lambda a: a[1:, ::2], [(3, 4)], lambda a: a[1:, ::2]),
    ("int index", lambda a: a[1], [(3, 4)], lambda a: a[1]),
    ("fancy index with repeats", lambda a: a[np.array([0, 2, 0, 0])], [(3, 4)],
     lambda a: a[np.array([0, 2, 0, 0])]),
    ("composed", lambda a, b: ((a * b).exp().sum(axis=0) / (b ** 2 + 1.0)).mean(), [(3, 4), (4,)],
     lambda a, b: (np.exp(a * b).sum(axis=0) / (b ** 2 + 1.0)).mean()),
]


def draw(spec):
    return np.abs(normal(spec)) + 0.5 if isinstance(spec, Positive) else normal(spec)


@pytest.mark.parametrize("name,fn,specs,numpy_fn", CASES, ids=[c[0] for c in CASES])
def test_tensor_op(name, fn, specs, numpy_fn):
    arrays = [draw(s) for s in specs]
    out = fn(*[Tensor(a) for a in arrays])
    validate(out.data, numpy_fn(*arrays), f"{name} forward")
    gradcheck(fn, arrays, name)


def test_max_ties_share_the_gradient():
    x = Tensor(np.array([1.0, 3.0, 3.0, 2.0]), requires_grad=True)
    x.max().backward()
    np.testing.assert_array_equal(x.grad, [0.0, 0.5, 0.5, 0.0])


def test_gradients_accumulate_over_backward_calls():
    a = normal((3,))
    x = Tensor(a, requires_grad=True)
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    validate(x.grad, 2 * a + 3.0, "accumulated grad")


def test_a_tensor_used_twice_gets_both_gradients():
    a = normal((4,))
    x = Tensor(a, requires_grad=True)
    (x * x + x).sum().backward()
    validate(x.grad, 2 * a + 1, "grad of x*x + x")


def test_no_grad_records_no_tape():
    x = Tensor(normal((3,)), requires_grad=True)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_backward_needs_a_scalar_or_a_gradient():
    x = Tensor(normal((3,)), requires_grad=True)
    with pytest.raises(ValueError, match="scalar"):
        (x * 2.0).backward()
    y = x * 2.0
    y.backward(np.ones(3))
    validate(x.grad, np.full(3, 2.0), "grad with explicit upstream")


def test_scalars_keep_the_tensor_dtype():
    x = Tensor(np.ones(3, np.float32))
    assert (x * 2.0 + 1).dtype == np.float32
    assert Tensor(1.5).dtype == np.float32
