"""Differentiable ops of the model: each is a forward and a backward that call the
kernels of the arrays' backend, with the backward written next to its forward."""
from kernels import backend_of, get_array_module, precision
from .tensor import Tensor


def _data(t):
    return None if t is None else t.data


def _outputs(*params):
    """Where a backward writes the gradients of `params` (None for any that is not a stale
    Parameter's, see Parameter.gradient_out); None when it writes none of them."""
    outs = tuple(getattr(p, "gradient_out", lambda: None)() for p in params)
    return outs if any(o is not None for o in outs) else None


def _multiplies_tf32(weight, K):
    """Whether a convolution by ``weight`` on backend K multiplies TF32: a device backend's under the tf32
    precision where the channel counts take its tensor cores (K.conv2d_tf32: not the stem's, which
    multiplies float32)."""
    return K.name != "cpu" and precision() == "tf32" and K.conv2d_tf32(weight.data)


def _multiplied(weight, K, tf32):
    """(array, w_tf32): what a convolution on backend K multiplies for ``weight``. On a device backend (cuda,
    emu), under the bf16 precision, or under tf32 where the convolution multiplies TF32 (`tf32`,
    _multiplies_tf32), a flat buffer's parameter's view of the buffer's copy rounded as that precision's
    tensor cores take it (FlatParameters.multiplied_view: bfloat16, or TF32 values in float32, w_tf32 true);
    else the float32 parameter itself (which a device backend's convolution rounds, at each call, where it
    multiplies bf16 or TF32; the CPU backend computes in float32 whatever the precision). The gradient goes
    to the float32 parameter either way."""
    flat, mode = getattr(weight, "_flat", None), precision()
    rounded = flat is not None and K.name != "cpu" and (mode == "bf16" or tf32)
    return (flat.multiplied_view(weight, mode), mode == "tf32") if rounded else (weight.data, False)


class Normalized(Tensor):
    """relu(batch norm(x)) of a training batch norm whose statistics a convolution computed (batch_norm's
    `fold`), left to its reader: a convolution reads x and applies the norm as it loads it (conv2d's
    normalize: on a device backend, TF32's GEMMs as each stage lands), so that the normalised activation
    is never stored; any other reader of ``data`` gets it computed then (batch_norm_apply), once."""

    def __init__(self, data):
        self._array, self._compute = None, None
        super().__init__(data)

    @property
    def data(self):
        if self._compute is not None:
            self._array, self._compute = self._compute(), None
        return self._array

    @data.setter
    def data(self, value):
        self._array = value

    # the norm's output has its input's shape and dtype: asked without computing it
    shape = property(lambda self: self._array.shape)
    dtype = property(lambda self: self._array.dtype)
    ndim = property(lambda self: self._array.ndim)
    size = property(lambda self: self._array.size)

    def pending(self):
        """(x, (gamma, beta, mean, invstd)) while the output is not computed, for a reader that applies the
        norm itself; None once it is."""
        return None if self._compute is None else self.normalizes


def conv2d(x, weight, bias=None, stride=1, padding=0, statistics=None):
    """PyTorch's F.conv2d. ``statistics``: a training batch norm's request (BatchNorm2d.statistics_request:
    its eps, running pair and momentum) for the statistics of the output, which the convolution computes
    where its output is (on a GPU, in the epilogue of its tensor-core kernel) and hands to that batch norm
    as the output tensor's ``statistics``, (mean, invstd); None otherwise. When x is a training batch
    norm's output with its relu or residual join (x.norm, see batch_norm) and this convolution's backward
    is the last of x's readers' to run, it computes that norm's backward sums where x's final gradient is
    (conv2d_backward's norm, dx added there to the gradient the other readers gave) and hands them to
    the norm's backward (so does adaptive_avg_pool2d). When x is a Normalized not yet computed, the
    convolution reads the norm's input and applies the norm (the backend's normalize), forward and
    backward, where the backend's kernels do (conv2d_folds; else x computed, once). Where it multiplies
    TF32, its output's ``tf32_gradient`` says so: the producer of that output's whole gradient may round it
    to TF32 where it makes it (batch_norm's backward), and say so in ``gradient_tf32``, so that backward-data
    reads it as it is (conv2d_backward's dy_tf32) rather than round it in a pass of its own."""
    pending = x.pending() if isinstance(x, Normalized) else None
    K = backend_of(x._array if pending else x.data)
    if pending and not K.conv2d_folds(pending[0].data, weight.data, stride, padding):
        pending = None
    source, normalize = (x.data, None) if pending is None else (pending[0].data, pending[1])
    tf32 = _multiplies_tf32(weight, K)
    w, w_tf32 = _multiplied(weight, K, tf32)   # the bias is added in float32 under every precision
    y = K.conv2d_forward(source, w, _data(bias), stride, padding, statistics=statistics, normalize=normalize,
                         w_tf32=w_tf32)
    y, stats = (y, None) if statistics is None else (y[0], y[1:])

    def backward(dy):
        # x's gradient so far, when no one else holds it, takes dx in place (a residual block's input);
        # without a bias there are two parents, and the tape ignores the third gradient. The weight
        # multiplied is the forward's: the optimizer writes the rounded copy only after the backward
        add_dx_to = x.grad if x._grad_owned else None
        norm = _norm_to_sum(x, adds=True)
        if norm is None:
            return K.conv2d_backward(dy, source, w, stride, padding, need_dx=x.requires_grad,
                                     out=_outputs(weight, bias), add_dx_to=add_dx_to, normalize=normalize,
                                     w_tf32=w_tf32, dy_tf32=out.gradient_tf32)
        return _handing_sums(norm, lambda **sums: K.conv2d_backward(
            dy, source, w, stride, padding, out=_outputs(weight, bias), add_dx_to=add_dx_to, normalize=normalize,
            w_tf32=w_tf32, dy_tf32=out.gradient_tf32, **sums))
    out = Tensor._make(y, (x, weight) if bias is None else (x, weight, bias), backward, fresh=True)
    out.statistics, out.tf32_gradient, out.gradient_tf32 = stats, tf32, False
    return out


def _norm_to_sum(x, adds):
    """x.norm (see batch_norm) when the op whose backward is running can compute that norm's backward sums
    where it makes x's gradient: it is the last of x's readers to run its backward (x's gradient is final
    after it), and x's gradient so far is none, or (an op that `adds` its dx in place) one no one else
    holds; None otherwise."""
    norm = getattr(x, "norm", None)
    if norm is None or not x.requires_grad or x._readers_left != 1:
        return None
    if isinstance(x, Normalized) and x.pending() is None:   # computed after all: its y as stored
        arrays, *rest = norm
        norm = ((x.data, *arrays[1:]), *rest)
    return norm if x.grad is None or (adds and x._grad_owned) else None


def _handing_sums(norm, backward):
    """backward(norm=, norm_out=) (a kernel's backward that also computes the sums of the batch norm whose
    request x.norm is, _norm_to_sum) with the norm's arrays and its parameters' gradients as the sums'
    outputs; the sums handed to the norm's backward, the backward's other results returned."""
    arrays, weight, bias, handed = norm
    *grads, dgamma, dbeta = backward(norm=arrays, norm_out=_outputs(weight, bias))
    handed["sums"] = (dgamma, dbeta)
    return tuple(grads)


def batch_norm(x, running_mean, running_var, weight, bias, training, momentum=0.1, eps=1e-5, group=None,
               relu=False, residual=None, fold=False):
    """PyTorch's F.batch_norm: in training, normalise with the batch statistics and
    move the running ones (plain arrays, updated in place) towards them; in eval,
    normalise with the running statistics. With a ``group`` of replicas (see
    synchronised_batch_norm), the training statistics are those of every replica's batch.
    ``relu`` gives relu(batch norm), ``residual`` (a tensor of x's shape) relu(batch norm +
    residual): the joins of a residual block, fused into the normalisation in training.
    ``fold`` (the output's reader is a convolution): in training, with a relu alone and the statistics
    from the convolution that made x, on a device backend under tf32, the output is a Normalized, which
    that convolution applies as it loads x rather than read it stored, where its kernels do
    (conv2d_folds)."""
    K = backend_of(x.data)
    if not training or group is not None:
        if not training:
            y = K.batch_norm_inference(x.data, weight.data, bias.data, running_mean, running_var, eps)
            y = Tensor._make(y, (x, weight, bias), lambda dy: K.batch_norm_inference_backward(
                dy, x.data, weight.data, running_mean, running_var, eps), fresh=True)
        else:
            y = synchronised_batch_norm(x, running_mean, running_var, weight, bias, momentum, eps, group)
        return _joined(y, relu, residual)
    running = None if running_mean is None else (running_mean, running_var)
    r = _data(residual)
    stats = getattr(x, "statistics", None)   # computed by the convolution that made x, at this norm's request
    alone = relu and residual is None   # a relu alone: its mask can be recomputed from x (see batch_norm_backward)
    # only where a convolution may apply it (a device backend's TF32 GEMMs), so that elsewhere the norm's own
    # op computes it, and a profile shows its cost in its row
    folded = fold and alone and stats is not None and K.name != "cpu" and precision() == "tf32"
    if folded:   # y left to the reader (Normalized)
        mean, invstd = stats
        y = None
    elif stats is not None:
        mean, invstd = stats
        y = K.batch_norm_apply(x.data, weight.data, bias.data, mean, invstd, relu=relu, residual=r)
    else:
        y, mean, invstd = K.batch_norm_forward(x.data, weight.data, bias.data, eps, running=running,
                                               momentum=momentum, relu=relu, residual=r)
    masked = relu or residual is not None
    handed = {}   # the sums that the convolution whose backward is the output's last computes (see conv2d)

    def backward(dy):
        # a Normalized's y where it was computed after all (a reader that does not fold)
        stored = out.data if folded and out.pending() is None else y
        # dx, and the residual's gradient, rounded to TF32 where they are their tensor's whole gradient and
        # its maker multiplies TF32 (see conv2d)
        for t in (x, residual):
            if t is not None:
                t.gradient_tf32 = getattr(t, "tf32_gradient", False) and t._readers_left == 1 and t.grad is None
        return K.batch_norm_backward(dy, x.data, weight.data, mean, invstd, y=stored if masked else None,
                                     beta=bias.data if alone else None, out=_outputs(weight, bias),
                                     shortcut=residual is not None, sums=handed.pop("sums", None),
                                     round_dx=x.gradient_tf32, round_g=residual is not None and residual.gradient_tf32)
    parents = (x, weight, bias) if residual is None else (x, weight, bias, residual)
    if folded:
        out = Normalized._make(x.data, parents, backward, fresh=True)
        out.normalizes = (x, (weight.data, bias.data, mean, invstd))
        out._compute = lambda: K.batch_norm_apply(x.data, weight.data, bias.data, mean, invstd, relu=True)
    else:
        out = Tensor._make(y, parents, backward, fresh=True)
    if masked:   # its output and what its sums need, for the convolution that reads it last (see conv2d)
        affine = (weight.data, bias.data) if alone else (None, None)
        out.norm = ((y, x.data, mean, invstd, *affine), weight, bias, handed)
    return out


def synchronised_batch_norm(x, running_mean, running_var, weight, bias, momentum, eps, group):
    """Training batch norm over the batches of all replicas, as one process holding them
    all would compute it. ``group.all_reduce(array)`` adds an array over the replicas in
    place, and ``group.batch_size`` is the number of images over all of them in this step.
    The forward adds the per-channel sums twice (for the mean, then centred on it, so that
    the variance does not cancel) and the backward adds its two sums once. The returned
    gradients of weight and bias are this replica's share, which the gradient all-reduce adds."""
    K, xp = backend_of(x.data), get_array_module(x.data)
    count = group.batch_size * (x.data.size // (x.data.shape[0] * x.data.shape[1]))
    centre = xp.zeros(x.shape[1], x.dtype)
    for _ in range(2):
        sums = group.all_reduce(K.batch_norm_sums(x.data, centre))
        mean, invstd = K.batch_norm_stats(sums, centre, count, eps)
        centre = mean
    y = K.batch_norm_apply(x.data, weight.data, bias.data, mean, invstd)
    if running_mean is not None:
        K.batch_norm_update_running(running_mean, running_var, mean, invstd, count, momentum, eps)

    def backward(dy):
        local = K.batch_norm_backward_sums(dy, x.data, mean, invstd)
        total = group.all_reduce(local.copy())
        dx = K.batch_norm_backward_dx(dy, x.data, weight.data, mean, invstd, total, count)
        return dx, local[0], local[1]
    return Tensor._make(y, (x, weight, bias), backward)


def _joined(y, with_relu, residual):
    """relu(y + residual), relu(y) or y, as separate ops (batch_norm fuses them in training)."""
    return add_relu(y, residual) if residual is not None else relu(y) if with_relu else y


def relu(x):
    K = backend_of(x.data)
    y = K.relu_forward(x.data)
    return Tensor._make(y, (x,), lambda dy: (K.relu_backward(dy, y),), fresh=True)


def applied_relu(y):
    """relu(y) where y is a relu's output already (a batch norm's that fused it: Sequential): y passed on,
    as an op of its own, so that the relu module keeps its place on the tape (module hooks, a profile's
    row); the norm's request for its backward sums (y.norm, see batch_norm) goes with it."""
    out = Tensor._make(y.data, (y,), lambda dy: (dy,))
    if hasattr(y, "norm"):
        out.norm = y.norm
    return out


def add_relu(a, b):
    """relu(a + b) in one op: the join of a residual block."""
    K = backend_of(a.data)
    y = K.add_relu_forward(a.data, b.data)

    def backward(dy):
        d = K.relu_backward(dy, y)
        return d, d
    return Tensor._make(y, (a, b), backward)


def max_pool2d(x, kernel_size, stride=None, padding=0):
    K = backend_of(x.data)
    stride = kernel_size if stride is None else stride
    y, argmax = K.max_pool2d_forward(x.data, kernel_size, stride, padding)
    return Tensor._make(y, (x,), lambda dy: (K.max_pool2d_backward(dy, argmax, x.shape),), fresh=True)


def adaptive_avg_pool2d(x, output_size):
    """Only the global pool, output (1, 1), which is what ResNet uses."""
    size = tuple(output_size) if isinstance(output_size, (tuple, list)) else (output_size,) * 2
    if size != (1, 1):
        raise ValueError(f"adaptive_avg_pool2d supports output_size (1, 1) only, got {output_size}")
    K = backend_of(x.data)
    n, c = x.shape[:2]
    y = K.global_avg_pool_forward(x.data).reshape(n, c, 1, 1)

    def backward(dy):
        # dx in x's dtype (bfloat16 under the bf16 precision on a device backend), not in dy's: dy is the
        # float32 linear layer's gradient; the sums of the batch norm that made x where dx is made (see conv2d)
        norm = _norm_to_sum(x, adds=False)
        if norm is None:
            return (K.global_avg_pool_backward(dy.reshape(n, c), x.shape, dtype=x.dtype),)
        return _handing_sums(norm, lambda **sums: K.global_avg_pool_backward(dy.reshape(n, c), x.shape,
                                                                             dtype=x.dtype, **sums))
    return Tensor._make(y, (x,), backward, fresh=True)


def flatten(x, start_dim=1):
    return x.reshape(x.shape[:start_dim] + (-1,))


def linear(x, weight, bias=None):
    K = backend_of(x.data)
    y = K.linear_forward(x.data, weight.data, _data(bias))
    return Tensor._make(y, (x, weight) if bias is None else (x, weight, bias),
                        lambda dy: K.linear_backward(dy, x.data, weight.data, out=_outputs(weight, bias)),
                        fresh=True)


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy over the batch; ``labels`` are class indices."""
    labels = labels.data if isinstance(labels, Tensor) else labels
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy wants logits (N, K) and labels (N,), got "
                         f"{logits.shape} and {labels.shape}")
    K = backend_of(logits.data)
    loss, probs = K.softmax_cross_entropy_forward(logits.data, labels)
    return Tensor._make(loss, (logits,),
                        lambda dloss: (K.softmax_cross_entropy_backward(dloss, probs, labels),))
