"""The convolution ops: under the tf32 precision (kernels.precision(), the default), the
tensor-core GEMMs of conv_tc.cu on channels-last memory, whose outputs and dx are channels-last;
under fp32, the launchers of conv.cu: forward, backward-data, backward-weight and the bias
gradient as FP32 implicit GEMMs on NCHW float32 arrays (see the header of conv.cu)."""
import numpy as np

import kernels
from kernels.cpu._util import output_size, pair

from . import conv_tc
from .launch import cdiv, dense, float32, gradient_outputs, in_place, is_channels_last, launch, split, \
    sum_partials

OPS = ("conv2d_forward", "conv2d_backward")

# BM = BN of each tile of common.cuh; the kernel sizes with their own instantiation, (0, 0)
# being the one that takes any size at run time.
TILES = {"Tile64": 64, "Tile128": 128}
SIZES = ((3, 3), (1, 1), (0, 0))
GEMMS = ("conv2d_forward", "conv2d_dgrad", "conv2d_wgrad")
# The large tile does 4x the work per block: worth it only while the grid stays large.
LARGE_TILE_MIN_BLOCKS = 256


def _gemm(kernel, tile, kh, kw):
    return f"{kernel}<{tile}, {kh}, {kw}>"


KERNELS = tuple(_gemm(k, t, *s) for k in GEMMS for t in TILES for s in SIZES) + tuple(
    f"conv2d_dgrad_strided<{t}>" for t in TILES) + ("bias_grad", "sum_partials")


def choose_tile(rows, columns):
    """The tile for a (rows x columns) output: Tile128 when both sides fill it and the grid
    keeps at least LARGE_TILE_MIN_BLOCKS blocks; else Tile64."""
    large = cdiv(rows, 128) * cdiv(columns, 128)
    return "Tile128" if min(rows, columns) >= 128 and large >= LARGE_TILE_MIN_BLOCKS else "Tile64"


def conv2d_forward(be, x, w, b, stride, padding):
    if kernels.precision() == "tf32":
        x, w, (b,) = dense(be, "conv2d_forward", x), dense(be, "conv2d_forward", w), float32(be, "conv2d_forward", b)
        geometry = _geometry(x, w, stride, padding, b)
        return conv_tc.forward(be, nhwc(be, x), nhwc(be, w), b, geometry).transpose(0, 3, 1, 2)
    x, w, b = float32(be, "conv2d_forward", x, w, b)
    geometry = _geometry(x, w, stride, padding, b)
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    y = be.xp.empty((n, o, oh, ow), np.float32)
    tile = choose_tile(o, n * oh * ow)
    launch(be, "conv", _kernel("conv2d_forward", tile, kh, kw),
           (cdiv(n * oh * ow, TILES[tile]), cdiv(o, TILES[tile])), (x, w, b, y, *geometry))
    return y


def conv2d_backward(be, dy, x, w, stride, padding, *, need_dx=True, out=None, add_dx_to=None):
    """See kernels/cpu/conv.py: dx (None unless need_dx), dw and db, written into out = (dw, db)
    (float32, the parameters' gradients, say) when given; a new dw takes w's layout. dx is added
    to add_dx_to in place (in the backward-data kernel's epilogue under tf32) when it is given."""
    if kernels.precision() == "tf32":
        dy, x, w = (dense(be, "conv2d_backward", a) for a in (dy, x, w))
    else:
        dy, x, w = float32(be, "conv2d_backward", dy, x, w)
    geometry = _geometry(x, w, stride, padding)
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if dy.shape != (n, o, oh, ow):
        raise ValueError(f"conv2d dy shape {dy.shape} does not match the forward output {(n, o, oh, ow)}")
    dw, db = gradient_outputs(be, "conv2d_backward", out, (w.shape, w.shape[:1]))
    if add_dx_to is not None:
        in_place(be, "conv2d_backward", add_dx_to)
        if add_dx_to.shape != x.shape:
            raise ValueError(f"conv2d_backward: add_dx_to has shape {add_dx_to.shape}, dx {x.shape}")
    if kernels.precision() == "tf32":
        dy, x = nhwc(be, dy), nhwc(be, x)
        dx = None
        if need_dx:
            into = None if add_dx_to is None else add_dx_to.transpose(0, 2, 3, 1)   # its memory, if that is NHWC
            if into is None or into.flags.c_contiguous:
                dx = conv_tc.backward_data(be, dy, nhwc(be, w), geometry, into).transpose(0, 3, 1, 2)
                dx = dx if into is None else add_dx_to
            else:   # an NCHW add_dx_to: added by a kernel of its own
                dx = _added(be, add_dx_to, conv_tc.backward_data(be, dy, nhwc(be, w), geometry).transpose(0, 3, 1, 2))
        dw, db = conv_tc.backward_weight(be, dy, x, geometry, _like_layout(be, w) if dw is None else dw,
                                         be.xp.empty((o,), np.float32) if db is None else db)
        return dx, dw, db
    dx = _added(be, add_dx_to, _backward_data(be, dy, w, geometry)) if need_dx else None
    return dx, _backward_weight(be, dy, x, geometry, dw), bias_grad(be, dy.reshape(n, o, -1), db)


def _added(be, total, dx):
    """dx, or total += dx (in place, by the elementwise add) when total is given."""
    return dx if total is None else be.add(total, dx, out=total)


def _like_layout(be, a):
    """A new float32 array of a's shape and memory layout (NCHW or channels-last)."""
    if is_channels_last(a):
        n, c, h, w = a.shape
        return be.xp.empty((n, h, w, c), np.float32).transpose(0, 3, 1, 2)
    return be.xp.empty(a.shape, np.float32)


def nhwc(be, x):
    """The C-contiguous NHWC array of a 4-D array: the memory of a channels-last one (or of one
    with a single channel) as it is, else a copy."""
    return be.xp.ascontiguousarray(x.transpose(0, 2, 3, 1))


def _backward_data(be, dy, w, geometry):
    """dx; at a stride above 1, one GEMM per stride phase of the input cells (conv.cu)."""
    n, c, h, wd, o, kh, kw, sh, sw = geometry[:9]
    dx = be.xp.empty((n, c, h, wd), np.float32)
    columns = n * cdiv(h, sh) * cdiv(wd, sw)   # of the largest phase
    tile = choose_tile(c, columns)
    grid = (cdiv(columns, TILES[tile]), cdiv(c, TILES[tile]))
    if (sh, sw) == (1, 1):
        launch(be, "conv", _kernel("conv2d_dgrad", tile, kh, kw), grid, (dy, w, dx, *geometry))
    else:
        launch(be, "conv", f"conv2d_dgrad_strided<{tile}>", grid + (sh * sw,), (dy, w, dx, *geometry))
    return dx


def _backward_weight(be, dy, x, geometry, dw=None):
    """dw (into `dw` when given, through a copy when it is channels-last), split over the N*OH*OW
    sum into partials when the (O x C*KH*KW) grid is small."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    columns = c * kh * kw
    tile = choose_tile(o, columns)
    grid = (cdiv(columns, TILES[tile]), cdiv(o, TILES[tile]))
    splits, chunk = split(n * oh * ow, grid[0] * grid[1], multiple=16)   # whole K tiles of either tile
    target = dw
    dw = be.xp.empty((o, c, kh, kw), np.float32) if dw is None or not dw.flags.c_contiguous else dw
    partial = dw if splits == 1 else be.xp.empty((splits, o, c, kh, kw), np.float32)
    launch(be, "conv", _kernel("conv2d_wgrad", tile, kh, kw), grid + (splits,), (dy, x, partial, *geometry, chunk))
    if splits > 1:
        sum_partials(be, "conv", partial, splits, dw)
    if target is not None and target is not dw:   # a channels-last target (a flat buffer's parameter)
        target[...] = dw
        return target
    return dw


def bias_grad(be, dy, db=None):
    """The per-channel sums of dy (N, O, OH*OW), in one launch, into db (O,) when given (a bias's
    gradient, say), else a new array."""
    n, o, plane = dy.shape
    splits, chunk = split(n * plane, o)
    db = be.xp.empty((o,), np.float32) if db is None else db
    partial = be.xp.empty((splits, o), np.float32) if splits > 1 else None
    launch(be, "conv", "bias_grad", (o, splits), (dy, n, o, plane, chunk, partial, be.counters(o), db))
    return db


def _kernel(name, tile, kh, kw):
    """The instantiation for this kernel size, or the run-time-size one."""
    return _gemm(name, tile, *((kh, kw) if (kh, kw) in SIZES else (0, 0)))


def _geometry(x, w, stride, padding, b=None):
    """(N, C, H, W, O, KH, KW, SH, SW, PH, PW, OH, OW) after checking that the arrays fit."""
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"conv2d expects x (N, C, H, W) and w (O, C, KH, KW), got {x.shape} and {w.shape}")
    n, c, h, wd = x.shape
    o, wc, kh, kw = w.shape
    if wc != c:
        raise ValueError(f"conv2d input has {c} channels, weight expects {wc}")
    if b is not None and b.shape != (o,):
        raise ValueError(f"conv2d bias shape {b.shape} does not match {o} output channels")
    (sh, sw), (ph, pw) = pair(stride), pair(padding)
    oh, ow = output_size(h, kh, sh, ph), output_size(wd, kw, sw, pw)
    return n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow
