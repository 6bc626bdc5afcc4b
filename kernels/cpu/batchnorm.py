"""Batch normalisation over (N, H, W) per channel, training and inference.

Every form is a per-channel affine map y = x * scale + shift, so the forward is two
passes over x once the statistics are known. Training uses the batch mean and biased
variance; its backward is the standard closed form
    dx = gamma * invstd / M * (M * dy - sum(dy) - xhat * sum(dy * xhat)),  M = N*H*W.
Inference uses the running statistics, which its backward treats as constants.
"""
import numpy as np

from ._util import channel_sum


def batch_norm_forward(x, gamma, beta, eps):
    _check(x, gamma)
    m = x.size // x.shape[1]
    mean = channel_sum(x) / m
    centred = x - _channel(mean)
    centred *= centred
    invstd = 1 / np.sqrt(channel_sum(centred) / m + eps)
    return _affine(x, gamma, beta, mean, invstd), mean, invstd


def batch_norm_backward(dy, x, gamma, mean, invstd):
    _check(x, gamma)
    m = x.size // x.shape[1]
    xhat, dgamma, dbeta = _affine_grads(dy, x, mean, invstd)
    dx = dy - _channel(dbeta / m)
    xhat *= _channel(dgamma / m)
    dx -= xhat
    dx *= _channel(gamma * invstd)
    return dx, dgamma, dbeta


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
    _, dgamma, dbeta = _affine_grads(dy, x, running_mean, invstd)
    return dy * _channel(gamma * invstd), dgamma, dbeta


def _affine(x, gamma, beta, mean, invstd):
    """gamma * (x - mean) * invstd + beta, folded into one scale and one shift."""
    scale = gamma * invstd
    y = x * _channel(scale)
    y += _channel(beta - mean * scale)
    return y


def _affine_grads(dy, x, mean, invstd):
    """xhat and the gradients of gamma and beta, which both modes share."""
    xhat = (x - _channel(mean)) * _channel(invstd)
    return xhat, channel_sum(dy * xhat), channel_sum(dy)


def _check(x, gamma):
    if x.ndim != 4 or gamma.shape != (x.shape[1],):
        raise ValueError(f"batch norm expects x (N, C, H, W) and per-channel parameters (C,), "
                         f"got x {x.shape} and gamma {gamma.shape}")


def _channel(v):
    """A (C,) vector shaped to broadcast over (N, C, H, W)."""
    return v.reshape(1, -1, 1, 1)
