"""The linear layer, y = x @ w.T + b and its backward, on linear.cu's tiled FP32 GEMMs under either
precision (kernels.precision()): ResNet-18's is N x 512 -> 10, products too small, and with too
few outputs, to pay for the tensor cores' tiles."""
import numpy as np

from .launch import cdiv, float32, gradient_outputs, launch, sum_partials

OPS = ("linear_forward", "linear_backward")
TILE = "Tile64"
TILE_SIZE = 64
# The instantiation of each product, by which of A and B is contiguous along k (linear.cu).
FORWARD, DATA, WEIGHT = (f"matmul<{TILE}, {a}, {b}>" for a, b in (("true", "true"), ("true", "false"),
                                                                   ("false", "false")))
KERNELS = (FORWARD, DATA, WEIGHT, "sum_partials")


def linear_forward(be, x, w, b):
    x, w, b = float32(be, "linear_forward", x, w, b)
    n, i, o = _sizes(x, w)
    if b is not None and b.shape != (o,):
        raise ValueError(f"linear bias shape {b.shape} does not match {o} outputs")
    y = be.xp.empty((n, o), np.float32)
    _matmul(be, FORWARD, x, w, b, y, (n, o, i), (i, 1, i, 1))
    return y


def linear_backward(be, dy, x, w, *, out=None):
    """See kernels/cpu/linear.py: (dx, dw, db), dw and db written into out = (dw, db) when given."""
    dy, x, w = float32(be, "linear_backward", dy, x, w)
    n, i, o = _sizes(x, w)
    if dy.shape != (n, o):
        raise ValueError(f"linear dy shape {dy.shape} does not match the output {(n, o)}")
    dw, db = gradient_outputs(be, "linear_backward", out, (w.shape, w.shape[:1]))
    dw = be.xp.empty((o, i), np.float32) if dw is None else dw
    db = be.xp.empty((o,), np.float32) if db is None else db
    dx = be.xp.empty((n, i), np.float32)
    _matmul(be, DATA, dy, w, None, dx, (n, i, o), (o, 1, 1, i))
    _matmul(be, WEIGHT, dy, x, None, dw, (o, i, n), (1, o, 1, i))
    sum_partials(be, "linear", dy, n, db)
    return dx, dw, db


def _matmul(be, kernel, a, b, bias, c, sizes, strides):
    """c (M x N) = A . B (+ bias), sizes (M, N, K), strides (a_m, a_k, b_n, b_k) as in linear.cu."""
    m, n, _ = sizes
    launch(be, "linear", kernel, (cdiv(n, TILE_SIZE), cdiv(m, TILE_SIZE)), (a, b, bias, c, *sizes, *strides))


def _sizes(x, w):
    """(N, I, O) after checking the shapes."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear expects x (N, I) and w (O, I), got {x.shape} and {w.shape}")
    return x.shape[0], x.shape[1], w.shape[0]
