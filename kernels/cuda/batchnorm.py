"""Launchers of batchnorm.cu: batch normalisation per channel of float32 arrays, NCHW or
channels-last, in training and inference, with per-block partial sums added in a fixed order.

The kernels see an array as (N, C, plane): a channels-last array (N, C, H, W) is, in memory, the
NCHW array (N*H*W, C, 1, 1), so the same kernels serve both layouts; dy and the results take x's."""
import numpy as np

from .launch import THREADS, blocks, cdiv, dense, float32, in_place, is_channels_last, launch, like, split, \
    sum_partials

OPS = ("batch_norm_forward", "batch_norm_backward", "batch_norm_update_running", "batch_norm_inference",
       "batch_norm_inference_backward", "batch_norm_sums", "batch_norm_stats", "batch_norm_apply",
       "batch_norm_backward_sums", "batch_norm_backward_dx")
KERNELS = ("bn_stats_partials", "bn_stats_finish", "bn_apply<false>", "bn_apply<true>", "bn_invstd",
           "bn_backward_partials", "bn_backward_dx", "bn_inference_dx", "bn_update_running", "sum_partials")


def batch_norm_forward(be, x, gamma, beta, eps):
    x, (gamma, beta) = dense(be, "batch_norm_forward", x), float32(be, "batch_norm_forward", gamma, beta)
    n, c, plane = _sizes(x, gamma)
    # a sample of each channel (image 0, pixel 0) centres its sums
    shift = be.xp.ascontiguousarray(x[0, :, 0, 0])
    partial, splits = _stats_partials(be, x, shift)
    mean, invstd = _stats_finish(be, partial, splits, shift, n * plane, eps)
    return apply(be, x, gamma, beta, mean, invstd), mean, invstd


def batch_norm_sums(be, x, shift):
    x, (shift,) = dense(be, "batch_norm_sums", x), float32(be, "batch_norm_sums", shift)
    _sizes(x, shift)
    partial, splits = _stats_partials(be, x, shift)
    return _added(be, partial, splits)


def batch_norm_stats(be, sums, shift, count, eps):
    sums, shift = float32(be, "batch_norm_stats", sums, shift)
    if sums.shape != (2,) + shift.shape:
        raise ValueError(f"batch norm sums {sums.shape} do not fit shift {shift.shape}")
    return _stats_finish(be, sums, 1, shift, count, eps)


def batch_norm_apply(be, x, gamma, beta, mean, invstd):
    x = dense(be, "batch_norm_apply", x)
    gamma, beta, mean, invstd = float32(be, "batch_norm_apply", gamma, beta, mean, invstd)
    return apply(be, x, gamma, beta, mean, invstd)


def apply(be, x, gamma, beta, mean, invstd, relu=False):
    """gamma * (x - mean) * invstd + beta, and its relu when asked, in one kernel."""
    n, c, plane = _sizes(x, gamma)
    y = be.xp.empty_like(x)
    launch(be, "batchnorm", f"bn_apply<{'true' if relu else 'false'}>", blocks(x.size),
           (x, mean, invstd, gamma, beta, x.size, c, plane, y))
    return y


def batch_norm_backward(be, dy, x, gamma, mean, invstd):
    sums = batch_norm_backward_sums(be, dy, x, mean, invstd)
    dx = batch_norm_backward_dx(be, dy, x, gamma, mean, invstd, sums, x.size // x.shape[1])
    return dx, sums[0], sums[1]


def batch_norm_backward_sums(be, dy, x, mean, invstd):
    x = dense(be, "batch_norm_backward_sums", x)
    (dy,), (mean, invstd) = like(be, "batch_norm_backward_sums", x, dy), float32(be, "batch_norm_backward_sums",
                                                                                  mean, invstd)
    _sizes(x, mean, dy)
    return _affine_grads(be, dy, x, mean, invstd)


def batch_norm_backward_dx(be, dy, x, gamma, mean, invstd, sums, count):
    x = dense(be, "batch_norm_backward_dx", x)
    (dy,) = like(be, "batch_norm_backward_dx", x, dy)
    gamma, mean, invstd, sums = float32(be, "batch_norm_backward_dx", gamma, mean, invstd, sums)
    n, c, plane = _sizes(x, gamma, dy)
    dx = be.xp.empty_like(x)
    launch(be, "batchnorm", "bn_backward_dx", blocks(x.size),
           (dy, x, mean, invstd, gamma, sums, count, x.size, c, plane, dx))
    return dx


def batch_norm_update_running(be, running_mean, running_var, mean, invstd, count, momentum, eps):
    in_place(be, "batch_norm_update_running", running_mean, running_var)
    mean, invstd = float32(be, "batch_norm_update_running", mean, invstd)
    c = running_mean.size
    launch(be, "batchnorm", "bn_update_running", (cdiv(c, THREADS),),
           (running_mean, running_var, mean, invstd, c, float(1 - momentum), float(momentum), float(eps),
            float(count / max(count - 1, 1))))


def batch_norm_inference(be, x, gamma, beta, running_mean, running_var, eps):
    x = dense(be, "batch_norm_inference", x)
    gamma, beta, running_mean, running_var = float32(be, "batch_norm_inference", gamma, beta, running_mean,
                                                     running_var)
    _sizes(x, gamma)
    return apply(be, x, gamma, beta, running_mean, _invstd(be, running_var, eps))


def batch_norm_inference_backward(be, dy, x, gamma, running_mean, running_var, eps):
    x = dense(be, "batch_norm_inference_backward", x)
    (dy,) = like(be, "batch_norm_inference_backward", x, dy)
    gamma, running_mean, running_var = float32(be, "batch_norm_inference_backward", gamma, running_mean,
                                               running_var)
    n, c, plane = _sizes(x, gamma, dy)
    invstd = _invstd(be, running_var, eps)
    grads = _affine_grads(be, dy, x, running_mean, invstd)
    dx = be.xp.empty_like(x)
    launch(be, "batchnorm", "bn_inference_dx", blocks(x.size), (dy, invstd, gamma, x.size, c, plane, dx))
    return dx, grads[0], grads[1]


def _stats_partials(be, x, shift):
    """(partial (splits, 2, C) of bn_stats_partials, splits)."""
    n, c, plane = _sizes(x, shift)
    splits, chunk = split(n * plane, c)
    partial = be.xp.empty((splits, 2, c), np.float32)
    launch(be, "batchnorm", "bn_stats_partials", (c, splits), (x, shift, n, c, plane, chunk, partial))
    return partial, splits


def _stats_finish(be, partial, splits, shift, count, eps):
    c = shift.size
    mean, invstd = be.xp.empty((2, c), np.float32)
    launch(be, "batchnorm", "bn_stats_finish", (cdiv(c, THREADS),),
           (shift, partial, splits, c, count, float(eps), mean, invstd))
    return mean, invstd


def _affine_grads(be, dy, x, mean, invstd):
    """[dgamma; dbeta] (2, C): sums of dy * xhat and of dy per channel."""
    n, c, plane = _sizes(x, mean, dy)
    splits, chunk = split(n * plane, c)
    partial = be.xp.empty((splits, 2, c), np.float32)
    launch(be, "batchnorm", "bn_backward_partials", (c, splits), (dy, x, mean, invstd, n, c, plane, chunk, partial))
    return _added(be, partial, splits)


def _added(be, partial, splits):
    """The (2, C) sum of partial (splits, 2, C) over its splits, in split order."""
    if splits == 1:
        return partial[0]
    sums = be.xp.empty(partial.shape[1:], np.float32)
    sum_partials(be, "batchnorm", partial, splits, sums)
    return sums


def _invstd(be, var, eps):
    invstd = be.xp.empty_like(var)
    launch(be, "batchnorm", "bn_invstd", (cdiv(var.size, THREADS),), (var, var.size, float(eps), invstd))
    return invstd


def _sizes(x, gamma, dy=None):
    """(N, C, H*W) as the kernels see x, after checking the shapes: (N*H*W, C, 1) when it is
    channels-last (see the module's docstring)."""
    if x.ndim != 4 or gamma.shape != (x.shape[1],):
        raise ValueError(f"batch norm expects x (N, C, H, W) and per-channel parameters (C,), "
                         f"got x {x.shape} and gamma {gamma.shape}")
    if dy is not None and dy.shape != x.shape:
        raise ValueError(f"batch norm dy shape {dy.shape} differs from x {x.shape}")
    n, c, h, w = x.shape
    return (n * h * w, c, 1) if is_channels_last(x) else (n, c, h * w)
