"""Max pooling with argmax indices, and global average pooling.

Max pool pads with -inf so padded cells never win, views the windows with strides, and
takes the first maximum in row-major window order (np.argmax). Its argmax is the flat
index h * W + w into the unpadded input plane, as in PyTorch; the backward scatter-adds
dy at those indices with np.bincount, which sums the contributions of overlapping windows.
"""
import numpy as np

from ._util import output_size, pair, padded, windows
from .batchnorm import masked_backward_sums


def max_pool2d_forward(x, kernel_size, stride, padding):
    kernel, stride, padding = pair(kernel_size), pair(stride), pair(padding)
    _check_pool_args(x, kernel, stride, padding)
    n, c, h, w = x.shape
    xp = padded(x, padding, axes=(2, 3), value=-np.inf)
    win = windows(xp, kernel, stride, axes=(2, 3))          # (N, C, OH, OW, KH, KW)
    oh, ow = win.shape[2:4]
    flat = win.reshape(n, c, oh, ow, -1)
    k = flat.argmax(axis=-1)
    y = np.take_along_axis(flat, k[..., None], axis=-1)[..., 0]
    rows = _input_coord(k // kernel[1], oh, stride[0], padding[0], h, axis=2)
    cols = _input_coord(k % kernel[1], ow, stride[1], padding[1], w, axis=3)
    return y, (rows * w + cols).astype(np.int64, copy=False)


def max_pool2d_backward(dy, argmax, x_shape):
    n, c, h, w = x_shape
    plane = h * w
    # Offsetting each (n, c) plane makes one flat index space for a single bincount.
    index = argmax.reshape(n * c, -1) + np.arange(n * c)[:, None] * plane
    # bincount accumulates in float64; the sum is cast back to dy's dtype.
    dx = np.bincount(index.ravel(), weights=dy.ravel(), minlength=n * c * plane)
    return dx.astype(dy.dtype, copy=False).reshape(x_shape)


def global_avg_pool_forward(x):
    return x.mean(axis=(2, 3))


def global_avg_pool_backward(dy, x_shape, *, dtype=None, norm=None, norm_out=None):
    """dx (channels-last, like the convolutions' arrays that it flows back into); with `norm` = (y, x, mean,
    invstd, gamma, beta) (see conv2d_backward), also the backward sums (dgamma, dbeta) of the training
    batch norm whose output y the pool read (x its input), of that dx, into norm_out when given:
    (dx, dgamma, dbeta)."""
    n, c, h, w = x_shape
    dx = np.empty((n, h, w, c), dtype=dy.dtype if dtype is None else dtype)
    dx[...] = (dy / (h * w))[:, None, None, :]
    dx = dx.transpose(0, 3, 1, 2)
    return dx if norm is None else (dx, *masked_backward_sums(dx, *norm[:4], out=norm_out))


def _check_pool_args(x, kernel, stride, padding):
    if x.ndim != 4:
        raise ValueError(f"max_pool2d expects x (N, C, H, W), got {x.shape}")
    for k, p in zip(kernel, padding):
        # Wider padding would leave windows made only of padding, with no input to pick.
        if 2 * p > k:
            raise ValueError(f"max_pool2d padding {padding} exceeds half the kernel {kernel}")
    for d, k, s, p in zip((2, 3), kernel, stride, padding):
        output_size(x.shape[d], k, s, p)


def _input_coord(offset, out_size, stride, padding, size, axis):
    """Input row (or column) of a window offset, for every window along one axis.

    A window whose inputs are all -inf picks its first cell, which may be padding;
    clipping moves it to the window's first real cell, where PyTorch puts it, and
    keeps every index inside the plane.
    """
    shape = [1, 1, 1, 1]
    shape[axis] = out_size
    start = (np.arange(out_size) * stride - padding).reshape(shape)
    return np.clip(start + offset, 0, size - 1)
