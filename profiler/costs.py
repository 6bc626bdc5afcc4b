"""What each op of the kernel contract costs: floating-point operations and the fewest bytes it
must move between the GPU's memory and its cores, from the shapes of its arguments.

One function per op of kernels/cpu/__init__.py, with the same parameters, every array replaced
by its shape (a tuple; None stays None): ``conv2d_forward((256, 64, 28, 28), (64, 64, 3, 3),
(64,), 1, 1)``. ``cost_of(op, *args)`` makes that replacement, so a caller holding an op's real
arguments (a benchmark, a profiler) gets its cost in one line.

Conventions. A multiply-add counts 2 FLOPs; an add, a multiply, a comparison, an exp, a division
1 each; the per-element counts below follow the formulas in the kernels' comments. Bytes are
each input read once and each output written once: an activation, its gradient and a weight the
products read at their own element's bytes (the Shape of an array says it: float32's 4, or 2 for
the bf16 precision's bfloat16; a plain tuple counts 4), an output of an activation at its input's,
statistics, batch-norm parameters and every parameter gradient at float32's 4, argmax (int64) at 8,
images (uint8) at 1 and labels at 4 (int32, what the trainer passes), the copy of sgd_update
(bfloat16 or TF32's float32) and global_avg_pool_backward's dtype as they say: the least any implementation moves,
so bytes / time is a lower bound on the bandwidth it reached. The first activation, images_to_float's
output, counts 4 bytes an element (its dtype is the precision's, which its arguments do not say).
"""
import dataclasses
import math

import numpy as np

FLOAT, INDEX, LABEL, PIXEL = 4, 8, 4, 1
BFLOAT16 = 2   # one side of a cast
# FLOPs per element of the batch-norm passes: statistics (x and x*x into two sums) + normalise
# (one multiply-add by the per-channel scale and shift); backward: x-hat (2), dy * x-hat and
# the two sums (3), dx = k * (dy - mean dy - x-hat * mean(dy x-hat)) (4).
BN_FORWARD, BN_BACKWARD = 3 + 2, 2 + 3 + 4
BN_INFERENCE, BN_INFERENCE_BACKWARD = 2, 1 + 2 + 3
# The same passes in parts, for batch norm synchronised across replicas: the sums of x - shift and
# of its square (subtract, add, multiply, add); the normalisation alone; the backward's sums
# (x-hat, dy * x-hat, two sums) and its dx (x-hat again, then dx); per channel, the statistics
# from the sums (two divisions, square, subtract, add eps, square root, reciprocal, add shift).
BN_SUMS, BN_APPLY, BN_BACKWARD_SUMS, BN_BACKWARD_DX, BN_STATS = 4, 2, 2 + 3, 2 + 4, 8
# softmax cross-entropy per logit: max, subtract, exp, sum, divide; backward: subtract, scale
XENT_FORWARD, XENT_BACKWARD = 5, 2


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: int
    bytes: int

    def __add__(self, other):
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def tflops(self, ms):
        """TFLOP/s at `ms` milliseconds per call."""
        return self.flops / (ms * 1e-3) / 1e12

    def gbs(self, ms):
        """GB/s (1e9 bytes) at `ms` milliseconds per call."""
        return self.bytes / (ms * 1e-3) / 1e9


ZERO = Cost(0, 0)


def cost_of(op, *args, **kwargs):
    """The cost of the contract's `op` called with `args` and `kwargs` (arrays, or already shapes)."""
    return globals()[op](*map(shape_of, args), **{k: shape_of(v) for k, v in kwargs.items()})


class Shape(tuple):
    """An array's shape, and the bytes of its element (`itemsize`)."""

    def __new__(cls, shape, itemsize):
        shape = super().__new__(cls, shape)
        shape.itemsize = itemsize
        return shape


def shape_of(a):
    """What the cost functions take for an argument of an op: an array's Shape; a tuple of arrays (an
    op's `out`) as a tuple of those; anything else (a number, a dtype, which has a shape of its own, a
    Shape already) as it is."""
    if isinstance(a, tuple) and not isinstance(a, Shape):
        return tuple(shape_of(v) for v in a)
    return Shape(a.shape, a.dtype.itemsize) if hasattr(a, "shape") and not isinstance(a, np.dtype) else a


def size(shape):
    return math.prod(shape) if shape is not None else 0


def item(shape):
    """The bytes of an element of the array of `shape`: its Shape's, else float32's."""
    return getattr(shape, "itemsize", FLOAT)


def nbytes(shape):
    """The bytes of the array of `shape` (0 for None)."""
    return item(shape) * size(shape)


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _conv_out(x, w, stride, padding):
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    n, _, h, wd = x
    o, _, kh, kw = w
    return n, o, (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1


def _conv_macs(x, w, stride, padding):
    """Multiply-adds of one of the three GEMMs of a convolution (they are equal)."""
    _, c, kh, kw = w
    return size(_conv_out(x, w, stride, padding)) * c * kh * kw


# ---- convolution ---------------------------------------------------------------------------

def conv2d_forward(x, w, b, stride, padding, statistics=None, normalize=None, w_tf32=False):
    """With `statistics` (a batch norm's eps, running pair and momentum), also that norm's statistics of
    y, summed where y is (no pass reads y for them): the sums of each value (as batch_norm_sums), per
    channel the statistics, mean and invstd written and the running pair moved. With `normalize`, the
    batch norm before it and its relu applied to x as the GEMM loads it (_normalized)."""
    y = size(_conv_out(x, w, stride, padding))
    cost = Cost(2 * _conv_macs(x, w, stride, padding) + (y if b is not None else 0),
                nbytes(x) + nbytes(w) + FLOAT * size(b) + item(x) * y) + _normalized(normalize, x, w, stride, padding)
    if statistics is None:
        return cost
    o = w[0]
    return cost + Cost(BN_SUMS * y + BN_STATS * o, FLOAT * (2 * o + (4 * o if statistics[1] is not None else 0)))


def conv2d_folds(x, w, stride, padding):
    """A question the launchers answer: no kernel."""
    return ZERO


def conv2d_tf32(w):
    """A question the launchers answer: no kernel."""
    return ZERO


def conv2d_backward(dy, x, w, stride, padding, need_dx=True, out=None, add_dx_to=None, norm=None, norm_out=None,
                    normalize=None, w_tf32=False, dy_tf32=False):
    """Backward-data (unless need_dx is false) and backward-weight GEMMs and the bias gradient (a
    sum over dy); dx added to add_dx_to (read, and one add per element) when given; with `norm`, the
    batch norm's backward sums of dx where dx is: its y and x read (as batch_norm_backward_sums reads
    them, less dx; x alone where the relu's mask is recomputed), the sums written; with `normalize`,
    as conv2d_forward's, in backward-weight."""
    passes = 2 if need_dx else 1
    added = size(add_dx_to) if need_dx else 0
    data = nbytes(w) + item(dy) * (size(x) + added) if need_dx else 0   # w read, dx written, add_dx_to read
    cost = Cost(2 * passes * _conv_macs(x, w, stride, padding) + size(dy) + added,
                nbytes(dy) + nbytes(x) + FLOAT * (size(w) + w[0]) + data)   # dy and x read, dw and db written
    cost += _normalized(normalize, x, w, stride, padding)
    return cost if norm is None else cost + _handed_sums(norm, x[1])


def _normalized(normalize, x, w, stride, padding):
    """A batch norm and its relu applied to x as a GEMM loads it (a `normalize` argument): per element of
    im2col(x) loaded, a multiply-add and the relu (BN_APPLY); the norm's four vectors read."""
    if normalize is None:
        return ZERO
    return Cost(BN_APPLY * _conv_macs(x, w, stride, padding) // w[0], FLOAT * 4 * x[1])


def _handed_sums(norm, channels):
    """What a backward adds for the batch norm's sums it computes where dx is (a `norm` = (y, x, mean,
    invstd, gamma, beta) argument): the norm's x read, and its y unless a relu alone's mask is recomputed
    from x (a multiply-add then, beside the comparison), the sums written."""
    y, x_norm, recomputed = norm[0], norm[1], norm[5] is not None
    return Cost(BN_BACKWARD_SUMS * size(x_norm) + (2 if recomputed else 1) * size(x_norm),
                (0 if recomputed else nbytes(y)) + nbytes(x_norm) + FLOAT * 4 * channels)


# ---- batch normalisation ---------------------------------------------------------------------

def batch_norm_forward(x, gamma, beta, eps, running=None, momentum=0.1, relu=False, residual=None):
    """With the fused relu (a comparison) or residual join (an add and a comparison, the residual read)."""
    c = x[1]
    join = (2 if residual is not None else 1 if relu else 0) * size(x)
    statistics = 4 * c + (4 * c if running is not None else 0)   # gamma, beta, mean, invstd; the running pair
    return Cost(BN_FORWARD * size(x) + join, 2 * nbytes(x) + nbytes(residual) + FLOAT * statistics)


def batch_norm_backward(dy, x, gamma, mean, invstd, y=None, beta=None, out=None, shortcut=False, sums=None,
                        round_dx=False, round_g=False):
    """Masked by a fused relu's output y (read, one comparison), writing the masked dy for a shortcut;
    with its sums given (computed by the convolution after it), its dx pass alone, which with `beta`
    (a relu alone) recomputes the mask from x (a multiply-add and a comparison) instead of reading y."""
    c = x[1]
    recomputed = beta is not None and sums is not None
    mask = 0 if y is None else 2 * size(x) if recomputed else size(y)
    return Cost((BN_BACKWARD_DX if sums is not None else BN_BACKWARD) * size(x) + mask,
                nbytes(dy) + nbytes(x) + (0 if recomputed else nbytes(y)) + item(x) * size(x) * (2 if shortcut else 1)
                + FLOAT * 5 * c)


def batch_norm_sums(x, shift):
    c = x[1]
    return Cost(BN_SUMS * size(x), nbytes(x) + FLOAT * 3 * c)


def batch_norm_stats(sums, shift, count, eps):
    c = size(shift)
    return Cost(BN_STATS * c, FLOAT * 5 * c)


def batch_norm_apply(x, gamma, beta, mean, invstd, relu=False, residual=None):
    """With the fused relu or residual join, as batch_norm_forward."""
    c = x[1]
    join = (2 if residual is not None else 1 if relu else 0) * size(x)
    return Cost(BN_APPLY * size(x) + join, 2 * nbytes(x) + nbytes(residual) + FLOAT * 4 * c)


def batch_norm_backward_sums(dy, x, mean, invstd):
    c = x[1]
    return Cost(BN_BACKWARD_SUMS * size(x), nbytes(dy) + nbytes(x) + FLOAT * 4 * c)


def batch_norm_backward_dx(dy, x, gamma, mean, invstd, sums, count):
    c = x[1]
    return Cost(BN_BACKWARD_DX * size(x), nbytes(dy) + 2 * nbytes(x) + FLOAT * 5 * c)


def batch_norm_update_running(running_mean, running_var, mean, invstd, count, momentum, eps):
    c = size(running_mean)
    return Cost(8 * c, FLOAT * 6 * c)


def batch_norm_inference(x, gamma, beta, running_mean, running_var, eps):
    c = x[1]
    return Cost(BN_INFERENCE * size(x), 2 * nbytes(x) + FLOAT * 4 * c)


def batch_norm_inference_backward(dy, x, gamma, running_mean, running_var, eps):
    c = x[1]
    return Cost(BN_INFERENCE_BACKWARD * size(x), nbytes(dy) + 2 * nbytes(x) + FLOAT * 5 * c)


# ---- element-wise --------------------------------------------------------------------------

def add(a, b, out=None):
    return Cost(size(a), 3 * nbytes(a))


def relu_forward(x):
    return Cost(size(x), 2 * nbytes(x))


def relu_backward(dy, y):
    return Cost(size(dy), 3 * nbytes(dy))


def add_relu_forward(a, b):
    return Cost(2 * size(a), 3 * nbytes(a))


def images_to_float(images, idx=None):
    """From the images of idx when given (each index read too)."""
    n = size(images) if idx is None else size(idx) * size(images[1:])
    return Cost(n, (PIXEL + FLOAT) * n + INDEX * size(idx))


def take(a, idx):
    return Cost(0, (INDEX + 2 * LABEL) * size(idx))


def cast(a, dtype, out=None):
    """float32 to bfloat16 or back (no arithmetic: a rounding): one side of each."""
    return Cost(0, (FLOAT + BFLOAT16) * size(a))


def round_tf32(a, out=None):
    """float32 to TF32 in float32 (no arithmetic: a rounding): read and written."""
    return Cost(0, 2 * FLOAT * size(a))


def _itemsize(dtype):
    """Bytes per element of an output of `dtype` (None: float32, the contract's default)."""
    return FLOAT if dtype is None else np.dtype(dtype).itemsize


# ---- pooling -------------------------------------------------------------------------------

def max_pool2d_forward(x, kernel_size, stride, padding):
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel_size), _pair(stride), _pair(padding)
    n, c, h, w = x
    y = n * c * ((h + 2 * ph - kh) // sh + 1) * ((w + 2 * pw - kw) // sw + 1)
    return Cost(kh * kw * y, nbytes(x) + item(x) * y + INDEX * y)


def max_pool2d_backward(dy, argmax, x_shape):
    return Cost(size(dy), (item(dy) + INDEX) * size(dy) + item(dy) * size(x_shape))


def global_avg_pool_forward(x):
    return Cost(size(x), nbytes(x) + FLOAT * size(x[:2]))


def global_avg_pool_backward(dy, x_shape, *, dtype=None, norm=None, norm_out=None):
    """With `norm`, the batch norm's backward sums of dx in the same pass: its y and x read, as
    conv2d_backward's norm."""
    cost = Cost(size(x_shape), FLOAT * size(dy) + _itemsize(dtype) * size(x_shape))
    return cost if norm is None else cost + _handed_sums(norm, x_shape[1])


# ---- linear --------------------------------------------------------------------------------

def linear_forward(x, w, b):
    n, o = x[0], w[0]
    return Cost(2 * n * size(w) + (n * o if b is not None else 0),
                FLOAT * (size(x) + size(w) + size(b) + n * o))


def linear_backward(dy, x, w, out=None):
    return Cost(4 * x[0] * size(w) + size(dy), FLOAT * (size(dy) + 2 * size(x) + 2 * size(w) + w[0]))


# ---- loss ----------------------------------------------------------------------------------

def softmax_cross_entropy_forward(logits, labels):
    n = logits[0]
    return Cost(XENT_FORWARD * size(logits) + 2 * n, FLOAT * (2 * size(logits) + 1) + LABEL * n)


def softmax_cross_entropy_backward(dloss, probs, labels):
    n = probs[0]
    return Cost(XENT_BACKWARD * size(probs), FLOAT * (2 * size(probs) + 1) + LABEL * n)


def count_correct(logits, labels):
    n = logits[0]
    return Cost(size(logits), FLOAT * size(logits) + LABEL * n + INDEX)


# ---- optimiser -----------------------------------------------------------------------------

def sgd_update(param, grad, velocity, lr, momentum, weight_decay, copy=None):
    """param -= lr * (momentum * velocity + grad + weight_decay * param): a multiply-add for
    each term that is present; velocity read and written only with momentum; the bfloat16 or TF32 copy
    written when given."""
    n = size(param)
    with_velocity = momentum != 0
    flops = 2 * n * (1 + (weight_decay != 0) + with_velocity)
    return Cost(flops, FLOAT * n * (3 + 2 * with_velocity) + nbytes(copy))
