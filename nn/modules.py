"""Module, Parameter, the flat parameter buffers, and the layers of ResNet.

The API follows PyTorch: parameters and submodules register themselves on
assignment, ``state_dict()`` has dotted names, ``train()``/``eval()`` switch
batch norm. A model's parameters and gradients live as views in two flat
buffers (``FlatParameters``), so the optimizer, the gradient all-reduce and the
checkpoint each touch one array.
"""
import contextlib
from collections import OrderedDict

import numpy as np

from kernels import array_module_for, backend_of, bfloat16, get_array_module
from . import functional as F
from . import hooks
from .init import init_layer
from .tensor import Tensor


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


class Parameter(Tensor):
    """A leaf that always has a gradient array, accumulated in place, so that the
    gradient can be a view into the model's flat gradient buffer.

    zero_grad() costs nothing on the device: it marks the gradient as zero without writing it
    (stale), and the first contribution of the next backward is written over it, by the op's
    backward itself where it can (``gradient_out``); later ones are added. Reading ``grad``
    while it is stale writes the zeros first."""

    def __init__(self, data):
        super().__init__(data, requires_grad=True)
        self.grad = get_array_module(self.data).zeros_like(self.data)
        self._flat = None
        self._stale = True   # zeros indeed; stale, so that the first backward writes, adding nothing

    @property
    def grad(self):
        if self._stale:
            self._grad.fill(0)
            self._stale = False
        return self._grad

    @grad.setter
    def grad(self, value):
        self._grad, self._stale = value, False

    def gradient_out(self):
        """The array a backward should write this parameter's gradient into, or None: while the
        gradient is stale, the gradient array itself (then no longer stale: the caller writes
        it), so that the first contribution costs neither a zeroing nor an addition."""
        if not self._stale:
            return None
        self._stale = False
        return self._grad

    def _accumulate(self, grad, owned=False):
        if grad is self._grad:   # written there by the backward (gradient_out)
            return
        if self._stale:
            self._grad[...] = grad
            self._stale = False
        else:
            backend_of(grad).add(self._grad, grad, out=self._grad)

    def zero_grad(self):
        self._stale = True

    def writing(self):
        """Around a write of this parameter's data by anything but the optimizer (a state dict loaded,
        the layer re-initialised): its flat buffer's copy of the weights that the convolutions multiply is
        stale from then on (see FlatParameters.writing); nothing to do for a parameter outside a flat buffer."""
        return self._flat.writing() if self._flat is not None else contextlib.nullcontext()


class FlatParameters:
    """Two contiguous buffers, ``data`` and ``grad``, holding every parameter in
    registration order; each Parameter's ``data`` and ``grad`` become views.

    Each parameter starts at a multiple of ALIGNMENT elements (16 bytes or more: what the
    tensor-core kernels' 16-byte copies need), the gaps zero. A 4-D parameter (a convolution's
    weight, (out, in, kh, kw)) lies channels-last, its memory (out, kh, kw, in) as PyTorch's
    channels_last weights: the layout the tensor-core convolutions read and write, so that
    they copy no weight and write no gradient through a transposition. LAYOUT names this
    arrangement, which a checkpoint of the flat buffer records.

    On a device backend the convolutions multiply the weights rounded: under the bf16 precision to
    bfloat16 (round to nearest even), under tf32 to TF32 (round_tf32: to nearest, ties away, in
    float32), and the float32 ``data`` stays the master copy that the optimizer updates (PyTorch's
    autocast keeps float32 weights too). ``multiplied(precision)`` is ``data`` so rounded, at the same
    offsets, kept here so that a step rounds no weight: made on first request; kept current by the
    optimizer, whose update writes each new value's rounding beside it in the same launch
    (``updating()``); marked stale by every other write of ``data``, which goes through ``writing()``
    (a checkpoint restored, the parameters broadcast to the replicas, a state dict loaded, a layer
    re-initialised); refreshed by one pass over the buffer (a cast, round_tf32) when requested while
    stale. So whoever reads it (``multiplied()``, ``multiplied_view()``, a CUDA graph after
    ``refresh_multiplied()``) reads what rounding ``data`` now would give, and the copy holds no state
    of its own: a checkpoint, a broadcast or an export deals in ``data`` alone. One precision's copy
    at a time: a request for the other's replaces it."""
    ALIGNMENT = 4
    LAYOUT = "aligned to 4 elements; 4-D parameters channels-last"

    def __init__(self, params):
        if not params:
            raise ValueError("no parameters to flatten")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters of one flat buffer must share a dtype, got {dtypes}")
        xp = get_array_module(params[0].data)
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(-(-(self.offsets[-1] + p.size) // self.ALIGNMENT) * self.ALIGNMENT)
        self.data = xp.zeros(self.offsets[-1], dtype=params[0].dtype)
        self._grad = xp.zeros(self.offsets[-1], dtype=params[0].dtype)
        for p, lo in zip(params, self.offsets):
            stale = p._stale
            self.data[lo:lo + p.size] = _in_memory_order(p.data).ravel()
            if not stale:
                self._grad[lo:lo + p.size] = _in_memory_order(p._grad).ravel()
            p.data = _viewed(self.data[lo:lo + p.size], p.shape)
            p.grad = _viewed(self._grad[lo:lo + p.size], p.shape)
            p._flat, p._stale = self, stale
        self._copy = self._copy_views = None   # made by the first multiplied(); its dtype says which rounding
        self._copy_current = False

    @property
    def parameter_count(self):
        """The number of parameters (the buffers' length less the gaps between them)."""
        return sum(p.size for p in self.params)

    @property
    def grad(self):
        """The whole flat gradient buffer, every stale parameter's gradient zeroed first."""
        return self.gradients(0, len(self))

    def gradients(self, lo, hi):
        """The slice [lo, hi) of the gradient buffer (whole parameters), the stale gradients in it
        zeroed first, a run of neighbours at once: what an all-reduce or an optimizer reads."""
        run = None
        for p, start, end in zip(self.params, self.offsets, self.offsets[1:]):
            if start >= lo and end <= hi and p._stale:
                run = (run[0] if run else start, end)
                p._stale = False
            elif run:
                self._grad[run[0]:run[1]].fill(0)
                run = None
        if run:
            self._grad[run[0]:run[1]].fill(0)
        return self._grad[lo:hi]

    def zero_grad(self):
        """Every gradient zero, without touching the device (see Parameter)."""
        for p in self.params:
            p.zero_grad()

    # ---- the rounded copy of data that the convolutions multiply (see the class's docstring) ---------

    COPIES = {"bf16": bfloat16, "tf32": np.float32}   # the copy's dtype under each precision that has one

    def multiplied(self, precision):
        """``data`` rounded as the `precision`'s convolutions multiply it ("bf16": to bfloat16; "tf32": to
        TF32, float32 values), the same offsets: made on first request, refreshed (one pass) when something
        other than the optimizer has written ``data`` since."""
        if self._copy is None or self._copy.dtype != self.COPIES[precision]:
            self._copy = get_array_module(self.data).empty(len(self), self.COPIES[precision])   # refreshed whole
            self._copy_views = {id(p): _viewed(self._copy[lo:lo + p.size], p.shape)
                                for p, lo in zip(self.params, self.offsets)}
            self._copy_current = False
        self.refresh_multiplied()
        return self._copy

    def multiplied_view(self, param, precision):
        """``param``'s view of multiplied(precision), laid out as its view of ``data``: what a convolution
        multiplies under that precision (nn.functional.conv2d)."""
        self.multiplied(precision)
        return self._copy_views[id(param)]

    def refresh_multiplied(self):
        """Bring the rounded copy up to date if there is one and something other than the optimizer has
        written ``data`` since: what a replayed CUDA graph needs first, whose kernels read the copy
        without asking for it (training/step.py)."""
        if self._copy is not None and not self._copy_current:
            backend = backend_of(self.data)
            if self._copy.dtype == bfloat16:
                backend.cast(self.data, bfloat16, out=self._copy)
            else:
                backend.round_tf32(self.data, out=self._copy)
            self._copy_current = True

    @contextlib.contextmanager
    def writing(self):
        """``with flat.writing() as data:`` around every write of ``data`` (or of a parameter's view of
        it: Parameter.writing) but the optimizer's: the rounded copy is stale from the start, so that
        not even a write that fails midway leaves it current."""
        self._copy_current = False
        yield self.data

    @contextlib.contextmanager
    def updating(self):
        """``with flat.updating() as copy:`` around the optimizer's update of ``data``, which writes the
        new values' rounding into ``copy`` too (sgd_update's ``copy=``, whose dtype says which rounding;
        None while no copy has been asked for): current after the update, stale if it failed."""
        self._copy_current = False
        yield self._copy
        self._copy_current = self._copy is not None

    @staticmethod
    def existing(params):
        """The flat buffers holding exactly ``params`` in this order, or None."""
        flat = params[0]._flat if params else None
        same = flat is not None and len(flat.params) == len(params) and \
            all(a is b for a, b in zip(flat.params, params))
        return flat if same else None

    @classmethod
    def of(cls, params):
        """The flat buffers of ``params``, made on first use."""
        params = list(params)
        flat = cls.existing(params)
        if flat is not None:
            return flat
        if any(p._flat is not None for p in params):
            raise ValueError("these parameters already live in another flat buffer; "
                             "build the optimizer from model.parameters()")
        return cls(params)

    def __len__(self):
        return self.offsets[-1]


def _in_memory_order(a):
    """A parameter's array as a flat buffer lays it out: a 4-D one channels-last (see FlatParameters)."""
    return a.transpose(0, 2, 3, 1) if a.ndim == 4 else a


def _viewed(memory, shape):
    """The view of `shape` over a flat buffer's slice laid out as _in_memory_order does."""
    if len(shape) == 4:
        o, c, kh, kw = shape
        return memory.reshape(o, kh, kw, c).transpose(0, 3, 1, 2)
    return memory.reshape(shape)


class Module:
    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if name in self._buffers:  # `buffer += 1` assigns back the same array
            self._buffers[name] = value
            return
        for registry in (self._parameters, self._buffers, self._modules):
            registry.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        for registry in ("_parameters", "_buffers", "_modules"):
            entries = self.__dict__.get(registry, {})
            if name in entries:
                return entries[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def register_buffer(self, name, array):
        """State that is saved and loaded but not trained (batch-norm statistics)."""
        self._buffers[name] = array

    def add_module(self, name, module):
        self._modules[name] = module

    def __call__(self, *args, **kwargs):
        with hooks.module_scope(self):
            return self.forward(*args, **kwargs)

    # ---- traversal ------------------------------------------------------------------

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self):
        return [m for _, m in self.named_modules()]

    def children(self):
        return list(self._modules.values())

    def named_parameters(self):
        return [(f"{prefix}.{name}" if prefix else name, p)
                for prefix, m in self.named_modules() for name, p in m._parameters.items()]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_buffers(self):
        return [(f"{prefix}.{name}" if prefix else name, b)
                for prefix, m in self.named_modules() for name, b in m._buffers.items()]

    def flat_parameters(self):
        return FlatParameters.of(self.parameters())

    # ---- state ----------------------------------------------------------------------

    def state_dict(self):
        """Parameters and buffers by dotted name, in PyTorch's order (each module's
        own entries, then its children's)."""
        state = OrderedDict()
        for prefix, m in self.named_modules():
            for name, value in list(m._parameters.items()) + list(m._buffers.items()):
                state[f"{prefix}.{name}" if prefix else name] = value.data if isinstance(value, Tensor) else value
        return state

    def load_state_dict(self, state):
        """Copy ``state`` into the existing arrays, so flat buffers stay intact."""
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
        params = dict(self.named_parameters())
        for key, target in own.items():
            value = state[key]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"shape mismatch for {key}: the model has {tuple(target.shape)}, "
                                 f"the state dict {tuple(value.shape)}")
            value = value.data if isinstance(value, Tensor) else value
            xp = get_array_module(target)
            if xp is np and hasattr(value, "get"):  # a CuPy array into a host model
                value = value.get()
            with params[key].writing() if key in params else contextlib.nullcontext():
                target[...] = xp.asarray(value)

    def train(self, mode=True):
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        params = self.parameters()
        for p in params:
            p.zero_grad()

    def to(self, target):
        """A dtype casts parameters and floating buffers; a device moves them: 'cpu', 'cuda' (the
        current GPU) or 'cuda:N' (which makes GPU N the current one). Flat buffers are rebuilt:
        build the optimizer after this."""
        if isinstance(target, str):
            xp = array_module_for(target)
            convert = xp.asarray if xp is not np else lambda a: a.get() if hasattr(a, "get") else a
        else:
            convert = lambda a: a.astype(target)  # noqa: E731
        params = self.parameters()
        was_flat = bool(params) and params[0]._flat is not None
        for p in params:
            p.data = convert(p.data)
            p.grad = get_array_module(p.data).zeros_like(p.data)
            p._flat = None
            p.zero_grad()
        for m in self.modules():
            for name, b in m._buffers.items():
                if b.dtype.kind == "f":  # counters stay on the host
                    m._buffers[name] = convert(b)
        if was_flat:
            FlatParameters(params)
        return self

    # ---- printing ---------------------------------------------------------------------

    def extra_repr(self):
        return ""

    def __repr__(self):
        lines = [f"({name}): " + repr(child).replace("\n", "\n  ") for name, child in self._modules.items()]
        if not lines:
            return f"{type(self).__name__}({self.extra_repr()})"
        return f"{type(self).__name__}(\n  " + "\n  ".join(lines) + "\n)"


class Sequential(Module):
    def __init__(self, *modules):
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def forward(self, x):
        """Each module on the last one's output; a convolution followed by a batch norm computes the
        norm's statistics (BatchNorm2d.statistics_request) where its output is, and a batch norm
        followed by a relu applies the relu itself (the relu module, still called, then has nothing
        to do: its row stays in a profile)."""
        modules = list(self._modules.values())
        applied = False   # x is already the output of the relu module m
        for m, following in zip(modules, modules[1:] + [None]):
            if applied:
                x, applied = m(x, applied=True), False
            elif isinstance(m, Conv2d) and isinstance(following, BatchNorm2d):
                x = m(x, following.statistics_request())
            elif isinstance(m, BatchNorm2d) and isinstance(following, ReLU):
                x, applied = m(x, relu=True), True
            else:
                x = m(x)
        return x

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Conv2d(Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = _pair(kernel_size), _pair(stride), _pair(padding)
        self.weight = Parameter(np.empty((out_channels, in_channels) + self.kernel_size, np.float32))
        self.bias = Parameter(np.empty(out_channels, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, scheme="pytorch"):
        init_layer(self.weight, self.bias, scheme)

    def forward(self, x, statistics=None):
        """The convolution of x; with ``statistics`` (the request of the training batch norm that follows,
        BatchNorm2d.statistics_request), the output also carries that norm's batch statistics."""
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, statistics)

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


class Linear(Module):
    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(np.empty((out_features, in_features), np.float32))
        self.bias = Parameter(np.empty(out_features, np.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self, scheme="pytorch"):
        init_layer(self.weight, self.bias, scheme)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class BatchNorm2d(Module):
    """Running statistics: running <- (1 - momentum) running + momentum batch, the
    variance unbiased; normalisation uses the biased batch variance."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = Parameter(np.ones(num_features, np.float32))
        self.bias = Parameter(np.zeros(num_features, np.float32))
        self.register_buffer("running_mean", np.zeros(num_features, np.float32))
        self.register_buffer("running_var", np.ones(num_features, np.float32))
        # a host counter, as in PyTorch's state dict; not used in the arithmetic
        self.register_buffer("num_batches_tracked", np.zeros((), np.int64))
        self.group = None  # replicas whose batches this layer normalises together

    def statistics_request(self):
        """What the convolution before this norm computes for it in its forward (F.conv2d's
        ``statistics``): (eps, running pair or None, momentum) in training, when the statistics are
        this replica's batch's; None otherwise (evaluation, or synchronised across a group)."""
        if not self.training or self.group is not None:
            return None
        running = None if self.running_mean is None else (self.running_mean, self.running_var)
        return self.eps, running, self.momentum

    def forward(self, x, relu=False, residual=None, fold=False):
        """Batch norm of x; relu(it) with `relu`, relu(it + residual) with a `residual` (fused in
        training, see F.batch_norm). In training, x's statistics when the convolution that made it
        computed them (statistics_request), else its own pass over x. `fold`: the output's reader is
        a convolution, which may apply the norm as it loads x (F.batch_norm)."""
        if self.training:
            self.num_batches_tracked += 1
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, self.momentum, self.eps, self.group, relu=relu, residual=residual,
                            fold=fold)

    def extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


class ReLU(Module):
    def forward(self, x, applied=False):
        """relu(x); with ``applied``, x is the relu's output already (Sequential fuses the relu into the
        batch norm before it), passed on (F.applied_relu)."""
        return F.applied_relu(x) if applied else F.relu(x)


class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        super().__init__()
        self.kernel_size, self.padding = kernel_size, padding
        self.stride = kernel_size if stride is None else stride

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self):
        return f"output_size={self.output_size}"


class Flatten(Module):
    def forward(self, x):
        return F.flatten(x)


def synchronise_batch_norm(model, group):
    """Make every BatchNorm2d of ``model`` normalise over the batches of all replicas in
    ``group`` (see F.synchronised_batch_norm; None undoes it); returns how many there are."""
    layers = [m for m in model.modules() if isinstance(m, BatchNorm2d)]
    for m in layers:
        m.group = group
    return len(layers)
