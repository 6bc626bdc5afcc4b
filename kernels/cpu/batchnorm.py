"""Batch normalisation over (N, H, W) per channel, training and inference.

Every form is a per-channel affine map y = x * scale + shift, so the forward is two
passes over x once the statistics are known. Training uses the batch mean and biased
variance; its backward is the standard closed form
    dx = gamma * invstd / M * (M * dy - sum(dy) - xhat * sum(dy * xhat)),  M = N*H*W.
Inference uses the running statistics, which its backward treats as constants.

The training forward and backward are also offered in their parts (sums, stats, apply;
backward sums, backward dx), so that synchronised batch norm can add the per-channel
sums of every replica between the parts.

Each of these is a chain of elementwise passes; run over the whole array, every pass goes
to memory, so the training kernels run the chain on blocks of whole images that stay in
cache, the blocks on every core (kernels/cpu/_parallel.py), each block's sums added in the blocks'
order. The training kernels and the inference forward return channels-last arrays (see
kernels.cpu), whatever the layout of x.
"""
import numpy as np

from . import convert
from ._parallel import each
from ._util import channel_sum, workspace, written

_BLOCK_BYTES = 1 << 20


def batch_norm_forward(x, gamma, beta, eps, *, running=None, momentum=0.1, relu=False, residual=None):
    _check(x, gamma)
    mean, invstd = batch_statistics(x, eps, running, momentum)
    return batch_norm_apply(x, gamma, beta, mean, invstd, relu=relu, residual=residual), mean, invstd


def batch_statistics(x, eps, running, momentum):
    """(mean, invstd) of x's channels, moving `running` (the pair, or None) in place: the training
    forward's statistics (conv2d_forward computes them for the batch norm that follows it too)."""
    m = x.size // x.shape[1]
    # centred on the exact mean, the sum of squares does not cancel
    mean = channel_sum(x) / m
    mean, invstd = batch_norm_stats(batch_norm_sums(x, mean), mean, m, eps)
    if running is not None:
        batch_norm_update_running(*running, mean, invstd, m, momentum, eps)
    return mean, invstd


def batch_norm_backward(dy, x, gamma, mean, invstd, *, y=None, beta=None, out=None, shortcut=False, sums=None,
                        round_dx=False, round_g=False):
    if round_g and not shortcut:
        raise ValueError("batch_norm_backward: round_g rounds the shortcut's gradient, which only `shortcut` returns")
    given = dy
    # beta (a relu alone) lets a device backend recompute the mask from x; here reading y costs less
    y = relu_output(y, x, gamma, beta, mean, invstd)
    if shortcut and y is not None:   # the gradient through the relu is returned too: made whole, once
        dy, y = _nchw(_positive(_nhwc(y), _nhwc(dy))), None
    if sums is None:
        sums = masked_backward_sums(dy, y, x, mean, invstd, out=out)
    dx = _backward_dx(dy, y, x, gamma, mean, invstd, sums, x.size // x.shape[1])
    if round_dx:
        convert.round_tf32(dx, out=dx)
    if round_g:   # the caller's dy itself is not written
        dy = convert.round_tf32(dy, out=None if dy is given else dy)
    return (dx, *sums) + ((dy,) if shortcut else ())


def relu_output(y, x, gamma, beta, mean, invstd):
    """y, the output of a batch norm of x with its relu; where it was not stored (None, with beta: a relu
    alone that a device backend's reader applied as it loaded x), computed."""
    return batch_norm_apply(x, gamma, beta, mean, invstd, relu=True) if y is None and beta is not None else y


def masked_backward_sums(dy, y, x, mean, invstd, *, out=None):
    """(dgamma, dbeta) = batch_norm_backward_sums of dy where y > 0 (all of dy when y is None), written
    into out = (dgamma, dbeta) when given: the sums that conv2d_backward's norm asks for."""
    return written_sums(_backward_parts(dy, y, x, mean), invstd, out)


def written_sums(parts, invstd, out=None):
    """masked_backward_sums from the backward_sums_of_part of parts that cover the batch, added in their
    order."""
    sums = _finished(parts, invstd)
    dgamma, dbeta = (None, None) if out is None else out
    return written(dgamma, sums[0]), written(dbeta, sums[1])


def batch_norm_sums(x, shift):
    _check(x, shift)
    x_nhwc = _nhwc(x)

    def block(b):
        centred = np.subtract(x_nhwc[b], shift, out=_scratch(x_nhwc[b]))
        first = channel_sum(_nchw(centred))
        centred *= centred
        return np.stack((first, channel_sum(_nchw(centred))))
    return _added(_block_parts(x_nhwc, block))


def batch_norm_stats(sums, shift, count, eps):
    centre = sums[0] / count
    variance = np.maximum(sums[1] / count - centre * centre, 0)
    return shift + centre, 1 / np.sqrt(variance + eps)


def batch_norm_apply(x, gamma, beta, mean, invstd, *, relu=False, residual=None):
    _check(x, gamma)
    return _affine(x, gamma, beta, mean, invstd, residual=residual, relu=relu or residual is not None)


def batch_norm_backward_sums(dy, x, mean, invstd):
    return _backward_sums(dy, None, x, mean, invstd)


def batch_norm_backward_dx(dy, x, gamma, mean, invstd, sums, count):
    return _backward_dx(dy, None, x, gamma, mean, invstd, sums, count)


def _backward_sums(dy, y, x, mean, invstd):
    """batch_norm_backward_sums of dy where y > 0 (all of dy when y is None), the mask taken a block at a
    time, in cache, rather than over the whole of dy first."""
    return _finished(_backward_parts(dy, y, x, mean), invstd)


def _backward_parts(dy, y, x, mean):
    """backward_sums_of_part of each image block."""
    _check(x, mean)
    x_nhwc, dy_nhwc, y_nhwc = _nhwc(x), _nhwc(dy), None if y is None else _nhwc(y)
    return _block_parts(x_nhwc, lambda b: backward_sums_of_part(dy_nhwc[b], None if y is None else y_nhwc[b],
                                                                 x_nhwc[b], mean))


def _finished(parts, invstd):
    """The backward sums from the parts' shares: added in their order, the first times invstd."""
    sums = _added(parts)
    sums[0] *= invstd
    return sums


def backward_sums_of_part(dy_nhwc, y_nhwc, x_nhwc, mean):
    """(2, C): [sum((x - mean) * d), sum(d)] over a part of the images (NHWC views), d = dy where y > 0 (all
    of dy where y is None): the part's share of _backward_sums before its invstd, which a kernel that has
    the part of dy in cache (conv2d_backward's norm) computes there. The parts' shares added in their order,
    times invstd, are the backward sums."""
    d = dy_nhwc if y_nhwc is None else _positive(y_nhwc, dy_nhwc)
    sums = np.empty((2, x_nhwc.shape[3]), dy_nhwc.dtype)
    sums[1] = channel_sum(_nchw(d))
    product = np.subtract(x_nhwc, mean, out=_scratch(x_nhwc))
    product *= d
    sums[0] = channel_sum(_nchw(product))
    return sums


def statistics_of_part(y_nhwc):
    """(sum, squares, count) of a part of the images of y (an NHWC view): its channels' sums, their sums of
    squares about the part's own mean, and the values a channel has there; what a kernel that has the part
    in cache (conv2d_forward's statistics) computes there for statistics_of_parts."""
    count = y_nhwc.size // y_nhwc.shape[3]
    total = channel_sum(_nchw(y_nhwc))
    centred = np.subtract(y_nhwc, total / count, out=_scratch(y_nhwc))
    centred *= centred
    return total, channel_sum(_nchw(centred)), count


def statistics_of_parts(parts, eps, running, momentum):
    """batch_statistics from statistics_of_part of parts that cover the batch, added in their order: the
    mean of their sums, and each part's squares moved from its own mean to the whole's (Chan, Golub and
    LeVeque's update, as stable as squares about the exact mean)."""
    m = sum(count for _, _, count in parts)
    mean = _added([total for total, _, _ in parts]) / m
    sums = np.zeros((2, mean.size), mean.dtype)
    for total, squares, count in parts:
        offset = total / count - mean
        sums[0] += count * offset
        sums[1] += squares + count * offset * offset
    mean, invstd = batch_norm_stats(sums, mean, m, eps)
    if running is not None:
        batch_norm_update_running(*running, mean, invstd, m, momentum, eps)
    return mean, invstd


def _backward_dx(dy, y, x, gamma, mean, invstd, sums, count):
    """batch_norm_backward_dx of dy where y > 0 (all of dy when y is None), masked a block at a time."""
    _check(x, gamma)
    x_nhwc, dy_nhwc, y_nhwc = _nhwc(x), _nhwc(dy), None if y is None else _nhwc(y)
    scale, xhat_scale = gamma * invstd, invstd * sums[0] / count
    dx = np.empty(dy_nhwc.shape, dy.dtype)

    def block(b):
        xhat_term = np.subtract(x_nhwc[b], mean, out=_scratch(x_nhwc[b]))
        xhat_term *= xhat_scale
        d = dy_nhwc[b] if y is None else _positive(y_nhwc[b], dy_nhwc[b])
        out = np.subtract(d, sums[1] / count, out=dx[b])
        out -= xhat_term
        out *= scale
    _each_block(x_nhwc, block)
    return _nchw(dx)


def batch_norm_update_running(running_mean, running_var, mean, invstd, count, momentum, eps):
    unbiased = np.maximum(1 / (invstd * invstd) - eps, 0) * (count / max(count - 1, 1))
    running_mean *= 1 - momentum
    running_mean += momentum * mean
    running_var *= 1 - momentum
    running_var += momentum * unbiased


def batch_norm_inference(x, gamma, beta, running_mean, running_var, eps):
    _check(x, gamma)
    return _affine(x, gamma, beta, running_mean, 1 / np.sqrt(running_var + eps))


def batch_norm_inference_backward(dy, x, gamma, running_mean, running_var, eps):
    _check(x, gamma)
    invstd = 1 / np.sqrt(running_var + eps)
    dgamma = channel_sum(dy * (x - _channel(running_mean))) * invstd
    return dy * _channel(gamma * invstd), dgamma, channel_sum(dy)


def _affine(x, gamma, beta, mean, invstd, residual=None, relu=False):
    """gamma * (x - mean) * invstd + beta, folded into one scale and one shift; then + residual, then
    relu when asked: each block of images through all of it while it is in cache."""
    scale = gamma * invstd
    shift = beta - mean * scale
    x_nhwc, r_nhwc = _nhwc(x), None if residual is None else _nhwc(residual)
    y = np.empty(x_nhwc.shape, x.dtype)

    def block(b):
        out = np.multiply(x_nhwc[b], scale, out=y[b])
        out += shift
        if r_nhwc is not None:
            out += r_nhwc[b]
        if relu:
            np.maximum(out, 0, out=out)
    _each_block(x_nhwc, block)
    return _nchw(y)


def _positive(y_nhwc, dy_nhwc):
    """dy where y > 0, else 0 (a NaN or infinity of dy too), in dy's dtype and memory layout: the gradient
    through a relu, of NHWC views. dy's bits ANDed with all ones or all zeros, in two passes: np.where,
    which branches on each element, took seven times as long on a random mask (and, not being a ufunc,
    writes C order, so that on the NCHW views of channels-last arrays it transposed them too)."""
    bits = np.dtype(f"u{dy_nhwc.dtype.itemsize}")
    keep = np.negative(y_nhwc > 0, dtype=bits)   # 1 -> all ones
    return np.bitwise_and(dy_nhwc.view(bits), keep, out=keep).view(dy_nhwc.dtype)


def _image_blocks(x_nhwc):
    """Slices of about _BLOCK_BYTES of whole images."""
    n = x_nhwc.shape[0]
    per = min(n, max(1, _BLOCK_BYTES // max(1, x_nhwc[0].nbytes)))
    return [slice(i, min(i + per, n)) for i in range(0, n, per)]


def _each_block(x_nhwc, block):
    """block(b) for each of x's image blocks b, on every core."""
    blocks = _image_blocks(x_nhwc)
    each(lambda i: block(blocks[i]), len(blocks))


def _block_parts(x_nhwc, block):
    """[block(b) for each of x's image blocks b], on every core."""
    blocks = _image_blocks(x_nhwc)
    parts = [None] * len(blocks)
    each(lambda i: parts.__setitem__(i, block(blocks[i])), len(blocks))
    return parts


def _added(parts):
    """The parts (arrays of one shape) added in their order, whatever order they were made in."""
    total = np.zeros_like(parts[0])
    for part in parts:
        total += part
    return total


def _scratch(a):
    """This thread's scratch array of a's shape and dtype."""
    return workspace("batch-norm", a.shape, a.dtype)


def _check(x, gamma):
    if x.ndim != 4 or gamma.shape != (x.shape[1],):
        raise ValueError(f"batch norm expects x (N, C, H, W) and per-channel parameters (C,), "
                         f"got x {x.shape} and gamma {gamma.shape}")


def _channel(v):
    """A (C,) vector shaped to broadcast over (N, C, H, W)."""
    return v.reshape(1, -1, 1, 1)


def _nhwc(a):
    return a.transpose(0, 2, 3, 1)


def _nchw(a):
    return a.transpose(0, 3, 1, 2)
