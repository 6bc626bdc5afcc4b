"""Tensor: an array (NumPy or CuPy), its gradient, and the tape that produced it.

Each op computes its result and hands ``Tensor._make`` a closure that maps the
output's gradient to its inputs' gradients; ``backward()`` is a topological sort
that calls those closures, consumers before producers. The model code is in
``functional.py``; the operators here serve everything else (losses written by
hand, tests, experiments).
"""
import collections
import contextlib

import numpy as np

from kernels import backend_of, get_array_module
from . import hooks

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Ops inside record no tape."""
    global _grad_enabled
    previous, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = previous


def is_grad_enabled():
    return _grad_enabled


def _unbroadcast(grad, shape):
    """Sum ``grad`` over the axes along which an operand of ``shape`` was broadcast."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


class Tensor:
    def __init__(self, data, requires_grad=False, dtype=None):
        if isinstance(data, Tensor):
            data = data.data
        if dtype is None and not hasattr(data, "dtype"):  # Python numbers and lists
            dtype = np.float32
        xp = get_array_module(data)
        self.data = xp.asarray(data, dtype=dtype)
        self.grad = None
        self.requires_grad = requires_grad
        self._parents = ()
        self._backward = None
        self._fresh = False        # its backward returns arrays of its own (see _make)
        self._grad_owned = False   # self.grad is an array no one else holds: it may be added to in place
        self._module_path = ()
        self._grad_hooks = []
        # during backward(), the ops reading this tensor whose backward has not yet returned (the one
        # running included): 1 tells that op it is the last, so that the gradient it adds is final
        self._readers_left = 0

    @classmethod
    def _make(cls, data, parents, backward, fresh=False):
        """The output of an op; ``backward(grad)`` returns one gradient per parent. ``fresh``: the
        op's backward makes every gradient it returns (no view of its own gradient, nothing kept),
        so that a parent given one of them alone may add later gradients to it in place."""
        out = cls(data)
        if _grad_enabled and any(p.requires_grad for p in parents):
            out.requires_grad = True
            out._parents = parents
            out._backward = backward
            out._fresh = fresh
            out._module_path = hooks.current_path()
        return out

    # ---- autograd -------------------------------------------------------------

    def register_post_accumulate_grad_hook(self, fn):
        """Call ``fn(tensor)`` once per backward, when this leaf's gradient is final."""
        self._grad_hooks.append(fn)

    def _accumulate(self, grad, owned=False):
        """Add `grad` (`owned`: no one else holds it) to this tensor's gradient: in a new array, since
        an op may hand the same array to several parents, unless the op has already added it there
        in place (grad is self.grad: see nn.functional.conv2d)."""
        if self.grad is None:
            self.grad, self._grad_owned = grad, owned
        elif grad is not self.grad:
            self.grad, self._grad_owned = backend_of(grad).add(self.grad, grad), True

    def _topological_order(self):
        order, seen, stack = [], set(), [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((p, False) for p in reversed(node._parents)
                         if p.requires_grad and id(p) not in seen)
        return order

    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``; frees the tape."""
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() without a gradient needs a scalar, got shape {self.shape}")
            grad = get_array_module(self.data).ones_like(self.data)
        order = self._topological_order()
        consumers = {}
        for node in order:
            for p in node._parents:
                consumers[id(p)] = consumers.get(id(p), 0) + 1
        self._accumulate(grad)
        path = ()
        for node in reversed(order):
            if node._backward is None:
                continue
            path = hooks.move_backward(path, node._module_path)
            for p in node._parents:
                p._readers_left = consumers[id(p)]
            grads = node._backward(node.grad)
            handed = collections.Counter(id(g) for g in grads if g is not None)
            for parent, g in zip(node._parents, grads):
                if g is not None and parent.requires_grad:
                    parent._accumulate(g, owned=node._fresh and handed[id(g)] == 1)
                consumers[id(parent)] -= 1
                if consumers[id(parent)] == 0 and parent._backward is None:
                    for fn in parent._grad_hooks:
                        fn(parent)
            node.grad, node._parents, node._backward = None, (), None
        hooks.move_backward(path, ())

    def detach(self):
        return Tensor(self.data)

    def zero_grad(self):
        self.grad = None

    # ---- array-like -----------------------------------------------------------

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    T = property(lambda self: self.transpose())

    def __len__(self):
        return len(self.data)

    def item(self):
        return self.data.item()

    def numpy(self):
        return self.data if isinstance(self.data, np.ndarray) else self.data.get()

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({self.data!r}{grad})"

    def _lift(self, other):
        """Operands that are not tensors take this tensor's dtype and array module."""
        if isinstance(other, Tensor):
            return other
        return Tensor(get_array_module(self.data).asarray(other, dtype=self.dtype))

    # ---- arithmetic with broadcasting -----------------------------------------

    def __add__(self, other):
        other = self._lift(other)
        return Tensor._make(self.data + other.data, (self, other),
                            lambda g: (_unbroadcast(g, self.shape), _unbroadcast(g, other.shape)))

    def __sub__(self, other):
        other = self._lift(other)
        return Tensor._make(self.data - other.data, (self, other),
                            lambda g: (_unbroadcast(g, self.shape), _unbroadcast(-g, other.shape)))

    def __mul__(self, other):
        other = self._lift(other)
        return Tensor._make(self.data * other.data, (self, other),
                            lambda g: (_unbroadcast(g * other.data, self.shape),
                                       _unbroadcast(g * self.data, other.shape)))

    def __truediv__(self, other):
        other = self._lift(other)
        return Tensor._make(self.data / other.data, (self, other),
                            lambda g: (_unbroadcast(g / other.data, self.shape),
                                       _unbroadcast(-g * self.data / other.data ** 2, other.shape)))

    def __pow__(self, exponent):
        if isinstance(exponent, Tensor):  # a ** b = exp(b log a), for a > 0
            return (exponent * self.log()).exp()
        return Tensor._make(self.data ** exponent, (self,),
                            lambda g: (g * exponent * self.data ** (exponent - 1),))

    def __neg__(self):
        return Tensor._make(-self.data, (self,), lambda g: (-g,))

    def __radd__(self, other):
        return self._lift(other) + self

    def __rsub__(self, other):
        return self._lift(other) - self

    def __rmul__(self, other):
        return self._lift(other) * self

    def __rtruediv__(self, other):
        return self._lift(other) / self

    def __rpow__(self, base):
        return self._lift(base) ** self

    def __matmul__(self, other):
        other = self._lift(other)
        a, b = self.data, other.data

        def backward(g):
            # promote vectors to matrices so one rule serves every rank
            a2 = a[None, :] if a.ndim == 1 else a
            b2 = b[:, None] if b.ndim == 1 else b
            g2 = g[..., None] if b.ndim == 1 else g
            g2 = g2[..., None, :] if a.ndim == 1 else g2
            ga = g2 @ b2.swapaxes(-1, -2)
            gb = a2.swapaxes(-1, -2) @ g2
            ga = ga[..., 0, :] if a.ndim == 1 else ga
            gb = gb[..., 0] if b.ndim == 1 else gb
            return _unbroadcast(ga, a.shape), _unbroadcast(gb, b.shape)
        return Tensor._make(a @ b, (self, other), backward)

    def __rmatmul__(self, other):
        return self._lift(other) @ self

    # ---- reductions -------------------------------------------------------------

    def sum(self, axis=None, keepdims=False):
        def backward(g):
            if not keepdims and axis is not None:
                g = get_array_module(g).expand_dims(g, axis)
            return (get_array_module(g).broadcast_to(g, self.shape),)
        return Tensor._make(self.data.sum(axis=axis, keepdims=keepdims), (self,), backward)

    def mean(self, axis=None, keepdims=False):
        axes = range(self.ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
        count = int(np.prod([self.shape[a] for a in axes]))
        return self.sum(axis=axis, keepdims=keepdims) / count

    def max(self, axis=None, keepdims=False):
        """Ties share the gradient equally, so the result does not depend on
        which of several equal elements a kernel happens to pick."""
        out = self.data.max(axis=axis, keepdims=keepdims)

        def backward(g):
            xp = get_array_module(g)
            peak = self.data.max(axis=axis, keepdims=True)
            mask = (self.data == peak).astype(g.dtype)
            if not keepdims and axis is not None:
                g = xp.expand_dims(g, axis)
            return (mask * g / mask.sum(axis=axis, keepdims=True),)
        return Tensor._make(out, (self,), backward)

    # ---- elementwise functions ------------------------------------------------------

    def exp(self):
        out = get_array_module(self.data).exp(self.data)
        return Tensor._make(out, (self,), lambda g: (g * out,))

    def log(self):
        out = get_array_module(self.data).log(self.data)
        return Tensor._make(out, (self,), lambda g: (g / self.data,))

    # ---- shape --------------------------------------------------------------------

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return Tensor._make(self.data.reshape(shape), (self,), lambda g: (g.reshape(self.shape),))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(axes) or tuple(reversed(range(self.ndim)))
        inverse = tuple(np.argsort(axes))
        return Tensor._make(self.data.transpose(axes), (self,), lambda g: (g.transpose(inverse),))

    def __getitem__(self, index):
        if isinstance(index, Tensor):
            index = index.data

        def backward(g):
            xp = get_array_module(g)
            full = xp.zeros(self.shape, dtype=g.dtype)
            xp.add.at(full, index, g)  # repeated indices add up
            return (full,)
        return Tensor._make(self.data[index], (self,), backward)
