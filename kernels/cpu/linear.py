"""Fully connected layer y = x @ w.T + b, one matrix product each way."""
from ._util import written


def linear_forward(x, w, b):
    _check(x, w)
    y = x @ w.T
    if b is not None:
        y += b
    return y


def linear_backward(dy, x, w, *, out=None):
    _check(x, w)
    dw, db = (None, None) if out is None else out
    return dy @ w, written(dw, dy.T @ x), written(db, dy.sum(axis=0))


def _check(x, w):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear expects x (N, I) and w (O, I), got {x.shape} and {w.shape}")
