"""2-D convolution (cross-correlation, like PyTorch) as im2col + one large matrix product.

The input is padded and moved to NHWC in one copy, so that each window row (KH, KW, C) is
gathered from contiguous channel runs. Its windows form a (N*OH*OW, KH*KW*C) matrix whose
product with the weight, reordered to (KH, KW, C) columns, is the output in NHWC.
Backward rebuilds the same matrix for dw; for dx each kernel position contributes one
(N*OH*OW, O) @ (O, C) product, added into a strided slice of the padded input gradient
(col2im), which never materialises the full column gradient.
"""
import numpy as np

from ._util import output_size, pair, padded, windows


def conv2d_forward(x, w, b, stride, padding):
    stride, padding = pair(stride), pair(padding)
    n, oh, ow = _output_shape(x, w, stride, padding)
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"conv2d bias shape {b.shape} does not match {w.shape[0]} "
                         f"output channels")
    y = _im2col(x, w.shape[2:], stride, padding) @ _weight_matrix(w).T
    if b is not None:
        y += b
    return _nhwc_to_nchw(y.reshape(n, oh, ow, -1))


def conv2d_backward(dy, x, w, stride, padding):
    stride, padding = pair(stride), pair(padding)
    n, oh, ow = _output_shape(x, w, stride, padding)
    if dy.shape != (n, w.shape[0], oh, ow):
        raise ValueError(f"conv2d dy shape {dy.shape} does not match the forward output "
                         f"{(n, w.shape[0], oh, ow)}")
    dy_rows = dy.transpose(0, 2, 3, 1).reshape(n * oh * ow, -1)
    cols = _im2col(x, w.shape[2:], stride, padding)
    o, c, kh, kw = w.shape
    dw = (dy_rows.T @ cols).reshape(o, kh, kw, c).transpose(0, 3, 1, 2)
    dx = _col2im(dy_rows, x.shape, w, stride, padding, (oh, ow))
    return dx, np.ascontiguousarray(dw), dy.sum(axis=(0, 2, 3))


def _output_shape(x, w, stride, padding):
    """(N, OH, OW) of the output, after checking that x and w fit together."""
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"conv2d expects x (N, C, H, W) and w (O, C, KH, KW), "
                         f"got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"conv2d input has {x.shape[1]} channels, weight expects {w.shape[1]}")
    oh, ow = (output_size(x.shape[d], w.shape[d], s, p)
              for d, s, p in zip((2, 3), stride, padding))
    return x.shape[0], oh, ow


def _im2col(x, kernel, stride, padding):
    """(N*OH*OW, KH*KW*C) matrix of the padded input's windows."""
    xp = padded(x.transpose(0, 2, 3, 1), padding, axes=(1, 2))
    win = windows(xp, kernel, stride, axes=(1, 2))      # (N, OH, OW, C, KH, KW)
    win = win.transpose(0, 1, 2, 4, 5, 3)
    return win.reshape(-1, win.shape[3] * win.shape[4] * win.shape[5])


def _col2im(dy_rows, x_shape, w, stride, padding, out_hw):
    """dx from the (N*OH*OW, O) output gradient: the adjoint of _im2col times the weight."""
    n, c, h, width = x_shape
    (sh, sw), (ph, pw), (oh, ow) = stride, padding, out_hw
    w_taps = np.ascontiguousarray(w.transpose(2, 3, 0, 1))     # (KH, KW, O, C)
    dxp = np.zeros((n, h + 2 * ph, width + 2 * pw, c), dtype=dy_rows.dtype)
    # Windows overlap when the kernel is larger than the stride, but at one kernel
    # position they all touch distinct cells, so a strided += per position is exact.
    for i in range(w_taps.shape[0]):
        for j in range(w_taps.shape[1]):
            tap = (dy_rows @ w_taps[i, j]).reshape(n, oh, ow, c)
            dxp[:, i:i + sh * oh:sh, j:j + sw * ow:sw, :] += tap
    return _nhwc_to_nchw(dxp[:, ph:ph + h, pw:pw + width, :])


def _weight_matrix(w):
    """(O, KH*KW*C): the weight with columns in the order _im2col lays out a window."""
    return w.transpose(0, 2, 3, 1).reshape(w.shape[0], -1)


def _nhwc_to_nchw(a):
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2))
