"""Launchers of pool.cu: max pooling with int64 argmax (NCHW: a channels-last input is copied to
NCHW first; no ResNet of this project max-pools), and global average pooling of NCHW or
channels-last arrays, whose gradient takes the layout of the activations it flows back into:
channels-last where they are (kernels.channels_last(), under the tf32 and bf16 precisions), as the
CPU backend's is, NCHW under fp32, so that the batch norm it reaches copies nothing. Activations are
float32 or bfloat16; the average pool's output and its gradient's input are float32, those of the
linear layer."""
import numpy as np

import kernels

from kernels.cpu._util import output_size, pair

from .batchnorm import backward_sums, pooled_backward, sums_outputs
from .launch import STORAGE_TYPES, blocks, cdiv, dense, float32, is_channels_last, launch, typed

OPS = ("max_pool2d_forward", "max_pool2d_backward", "global_avg_pool_forward", "global_avg_pool_backward")
KERNELS = tuple(f"{kernel}<{t}>" for kernel in OPS for t in STORAGE_TYPES.values())
WARPS_PER_BLOCK = 8


def max_pool2d_forward(be, x, kernel_size, stride, padding):
    x = be.xp.ascontiguousarray(dense(be, "max_pool2d_forward", x))
    (kh, kw), (sh, sw), (ph, pw) = pair(kernel_size), pair(stride), pair(padding)
    if x.ndim != 4:
        raise ValueError(f"max_pool2d expects x (N, C, H, W), got {x.shape}")
    if 2 * ph > kh or 2 * pw > kw:
        # Wider padding would leave windows made only of padding, with no input to pick.
        raise ValueError(f"max_pool2d padding {(ph, pw)} exceeds half the kernel {(kh, kw)}")
    n, c, h, w = x.shape
    oh, ow = output_size(h, kh, sh, ph), output_size(w, kw, sw, pw)
    y = be.xp.empty((n, c, oh, ow), x.dtype)
    argmax = be.xp.empty((n, c, oh, ow), np.int64)
    launch(be, "pool", f"max_pool2d_forward<{STORAGE_TYPES[x.dtype]}>", blocks(y.size),
           (x, n * c, h, w, kh, kw, sh, sw, ph, pw, oh, ow, y, argmax))
    return y, argmax


def max_pool2d_backward(be, dy, argmax, x_shape):
    dy = be.xp.ascontiguousarray(dense(be, "max_pool2d_backward", dy))
    argmax = typed(be, "max_pool2d_backward", argmax, np.int64)
    n, c, h, w = x_shape
    if argmax.shape != dy.shape or dy.shape[:2] != (n, c):
        raise ValueError(f"max_pool2d_backward: dy {dy.shape} and argmax {argmax.shape} do not fit x {x_shape}")
    t = STORAGE_TYPES[dy.dtype]
    dx = be.xp.empty((n, c, h, w), dy.dtype)
    # bfloat16: the cells' sums in float32, rounded once into dx
    sums = be.xp.empty(dx.shape, np.float32) if t == "bf16" else None
    launch(be, "pool", f"max_pool2d_backward<{t}>", blocks(n * c),
           (dy, argmax, n * c, h * w, dy.shape[2] * dy.shape[3], sums, dx))
    return dx


def global_avg_pool_forward(be, x):
    x = dense(be, "global_avg_pool_forward", x)
    if x.ndim != 4:
        raise ValueError(f"global_avg_pool expects x (N, C, H, W), got {x.shape}")
    n, c, h, w = x.shape
    y = be.xp.empty((n, c), np.float32)
    launch(be, "pool", f"global_avg_pool_forward<{STORAGE_TYPES[x.dtype]}>", (cdiv(n * c, WARPS_PER_BLOCK),),
           (x, n * c, h * w, c, int(is_channels_last(x)), y))
    return y


def global_avg_pool_backward(be, dy, x_shape, *, dtype=None, norm=None, norm_out=None):
    """See kernels/cpu/pool.py. With `norm`, the sums of the batch norm whose output the pool read, in the
    same pass where batchnorm.py's pooled_backward takes them, else in batchnorm.py's pass over dx."""
    op = "global_avg_pool_backward"
    (dy,) = float32(be, op, dy)
    dtype = np.dtype(np.float32 if dtype is None else dtype)
    if dtype not in STORAGE_TYPES:
        raise TypeError(f"global_avg_pool_backward: dx is float32 or bfloat16, not {dtype}")
    n, c, h, w = x_shape
    if dy.shape != (n, c):
        raise ValueError(f"global_avg_pool_backward: dy {dy.shape} does not fit x {tuple(x_shape)}")
    channels_last = kernels.channels_last()
    dx = be.xp.empty((n, h, w, c), dtype).transpose(0, 3, 1, 2) if channels_last else be.xp.empty((n, c, h, w), dtype)
    sums = None if norm is None else sums_outputs(be, op, norm_out, c)
    if norm is None or not pooled_backward(be, dy, dx, norm, sums, op):
        launch(be, "pool", f"global_avg_pool_backward<{STORAGE_TYPES[dtype]}>", blocks(dx.size),
               (dy, dx.size, h * w, c, int(channels_last), dx))
        if norm is not None:
            backward_sums(be, dx, *norm[:4], op, into=sums)
    return dx if norm is None else (dx, *sums)
