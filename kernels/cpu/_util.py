"""Helpers shared by the CPU kernels: argument pairs, output sizes, padding, sliding windows."""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def pair(v):
    """An int or an (h, w) pair as an (h, w) tuple of ints."""
    if np.ndim(v) == 0:
        return int(v), int(v)
    h, w = v
    return int(h), int(w)


def output_size(size, kernel, stride, padding):
    """Positions of a window sliding over one padded axis; ValueError if there are none."""
    if stride <= 0 or padding < 0:
        raise ValueError(f"stride must be positive and padding non-negative, "
                         f"got stride {stride}, padding {padding}")
    out = (size + 2 * padding - kernel) // stride + 1
    if out <= 0:
        raise ValueError(f"kernel {kernel} does not fit an input of size {size} "
                         f"with padding {padding}")
    return out


def padded(x, padding, axes, value=0):
    """A new C-contiguous copy of x, padded by (ph, pw) on both sides of the two axes.

    Always copies, so callers can pass a transposed view and get a contiguous array back.
    """
    shape = list(x.shape)
    index = [slice(None)] * x.ndim
    for axis, p in zip(axes, padding):
        shape[axis] += 2 * p
        index[axis] = slice(p, p + x.shape[axis])
    out = np.full(shape, value, dtype=x.dtype)
    out[tuple(index)] = x
    return out


def windows(x, kernel, stride, axes):
    """A view of x's kernel-sized windows at the given stride.

    The two axes become window positions (OH, OW) in place; (KH, KW) are appended last.
    """
    view = sliding_window_view(x, kernel, axis=axes)
    index = [slice(None)] * view.ndim
    for axis, s in zip(axes, stride):
        index[axis] = slice(None, None, s)
    return view[tuple(index)]
