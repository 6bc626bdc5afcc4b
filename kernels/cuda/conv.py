"""The convolution ops. Under the tf32 precision (kernels.precision(), the default) the network's
activations are channels-last (NCHW views of NHWC memory): the convolutions whose channel counts
the tensor cores take (conv_tc.supports) run the TF32 GEMMs of conv_tc.cu, the others (ResNet-18's
stem) conv.cu's FP32 kernels, which read x, dy and w in whichever layout they come, write dw in its
own and y and dx channels-last alike, so that nothing copies. Under fp32, conv.cu's kernels on NCHW
float32 arrays (copied if need be: the flat buffer's channels-last weights are), NCHW out, dw in
the layout it is given. conv.cu's launchers: forward,
backward-data and backward-weight (with the bias gradient) as FP32 implicit GEMMs (see the header
of conv.cu)."""
import numpy as np

import kernels
from kernels.cpu._util import output_size, pair

from . import conv_tc
from .launch import cdiv, dense, float32, gradient_outputs, in_place, is_channels_last, launch, split

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
    f"conv2d_dgrad_strided<{t}>" for t in TILES)


def choose_tile(rows, columns):
    """The tile for a (rows x columns) output: Tile128 when both sides fill it and the grid
    keeps at least LARGE_TILE_MIN_BLOCKS blocks; else Tile64."""
    large = cdiv(rows, 128) * cdiv(columns, 128)
    return "Tile128" if min(rows, columns) >= 128 and large >= LARGE_TILE_MIN_BLOCKS else "Tile64"


def conv2d_forward(be, x, w, b, stride, padding):
    tf32 = kernels.precision() == "tf32"   # whose activations are channels-last
    x, w = _operands(be, "conv2d_forward", tf32, x, w)
    (b,) = float32(be, "conv2d_forward", b)
    geometry = _geometry(x, w, stride, padding, b)
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if tf32 and conv_tc.supports(c, o):
        return conv_tc.forward(be, nhwc(be, x), nhwc(be, w), b, geometry).transpose(0, 3, 1, 2)
    y = _empty(be, (n, o, oh, ow), channels_last=tf32)
    tile = choose_tile(o, n * oh * ow)
    launch(be, "conv", _kernel("conv2d_forward", tile, kh, kw),
           (cdiv(n * oh * ow, TILES[tile]), cdiv(o, TILES[tile])), (x, w, b, y, *geometry, *_layouts(x, w, y)))
    return y


def conv2d_backward(be, dy, x, w, stride, padding, *, need_dx=True, out=None, add_dx_to=None):
    """See kernels/cpu/conv.py: dx (None unless need_dx), dw and db, written into out = (dw, db)
    (float32, the parameters' gradients, say) when given; a new dw takes w's layout. dx is added
    to add_dx_to in place (in the tensor-core backward-data kernel's epilogue) when it is given."""
    tf32 = kernels.precision() == "tf32"   # whose activations are channels-last
    dy, x, w = _operands(be, "conv2d_backward", tf32, dy, x, w)
    geometry = _geometry(x, w, stride, padding)
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if dy.shape != (n, o, oh, ow):
        raise ValueError(f"conv2d dy shape {dy.shape} does not match the forward output {(n, o, oh, ow)}")
    dw, db = gradient_outputs(be, "conv2d_backward", out, (w.shape, w.shape[:1]))
    dw = _empty(be, w.shape, is_channels_last(w)) if dw is None else dw
    db = be.xp.empty((o,), np.float32) if db is None else db
    if add_dx_to is not None:
        in_place(be, "conv2d_backward", add_dx_to)
        if add_dx_to.shape != x.shape:
            raise ValueError(f"conv2d_backward: add_dx_to has shape {add_dx_to.shape}, dx {x.shape}")
    if tf32 and conv_tc.supports(c, o):
        dy, x = nhwc(be, dy), nhwc(be, x)
        dx = None
        if need_dx:
            into = None if add_dx_to is None else add_dx_to.transpose(0, 2, 3, 1)   # its memory, if that is NHWC
            if into is None or into.flags.c_contiguous:
                dx = conv_tc.backward_data(be, dy, nhwc(be, w), geometry, into).transpose(0, 3, 1, 2)
                dx = dx if into is None else add_dx_to
            else:   # an NCHW add_dx_to: added by a kernel of its own
                dx = _added(be, add_dx_to, conv_tc.backward_data(be, dy, nhwc(be, w), geometry).transpose(0, 3, 1, 2))
        return (dx, *conv_tc.backward_weight(be, dy, x, geometry, dw, db))
    dx = _added(be, add_dx_to, _backward_data(be, dy, w, geometry, channels_last=tf32)) if need_dx else None
    return (dx, *_backward_weight(be, dy, x, geometry, dw, db))


def _operands(be, op, tf32, *arrays):
    """The float32 arrays: under tf32 dense ones as they are (its kernels read NCHW and channels-last
    memory alike: no copies, so that a step is kernels only, which a graph replays on the emulator
    too), under fp32 C-contiguous (NCHW, copied if need be). conv.cu reads channels-last weights
    too, but its loads run along k, which they scatter: with them the forward's loads touch 2.4x
    the 32-byte sectors, backward-data's 1.6x (emu.traffic(), 64 and 128 channels, 3x3), in every
    block that re-reads the weights, where the copy is one coalesced pass."""
    return tuple(dense(be, op, a) for a in arrays) if tf32 else float32(be, op, *arrays)


def _added(be, total, dx):
    """dx, or total += dx (in place, by the elementwise add) when total is given."""
    return dx if total is None else be.add(total, dx, out=total)


def _empty(be, shape, channels_last):
    """A new float32 array of an NCHW shape: channels-last (an NCHW view of NHWC memory) or NCHW."""
    if channels_last:
        n, c, h, w = shape
        return be.xp.empty((n, h, w, c), np.float32).transpose(0, 3, 1, 2)
    return be.xp.empty(shape, np.float32)


def _layouts(*arrays):
    """conv.cu's layout flags of its arrays: 1 for channels-last, 0 for NCHW (C-contiguous)."""
    return tuple(int(is_channels_last(a)) for a in arrays)


def nhwc(be, x):
    """The C-contiguous NHWC array of a 4-D array: the memory of a channels-last one (or of one
    with a single channel) as it is, else a copy."""
    return be.xp.ascontiguousarray(x.transpose(0, 2, 3, 1))


def _backward_data(be, dy, w, geometry, channels_last):
    """dx, channels-last or NCHW; at a stride above 1, one GEMM per stride phase of the input cells
    (conv.cu)."""
    n, c, h, wd, o, kh, kw, sh, sw = geometry[:9]
    dx = _empty(be, (n, c, h, wd), channels_last)
    columns = n * cdiv(h, sh) * cdiv(wd, sw)   # of the largest phase
    tile = choose_tile(c, columns)
    grid = (cdiv(columns, TILES[tile]), cdiv(c, TILES[tile]))
    if (sh, sw) == (1, 1):
        launch(be, "conv", _kernel("conv2d_dgrad", tile, kh, kw), grid, (dy, w, dx, *geometry, *_layouts(dy, w, dx)))
    else:
        launch(be, "conv", f"conv2d_dgrad_strided<{tile}>", grid + (sh * sw,),
               (dy, w, dx, *geometry, *_layouts(dy, w, dx)))
    return dx


def _backward_weight(be, dy, x, geometry, dw, db):
    """(dw, db): dw into `dw` (C-contiguous or channels-last) and the bias gradient into `db`, in
    one launch, split over the N*OH*OW sum into partials (dw's in its layout) when the
    (O x C*KH*KW) grid is small, added in the same launch."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    columns = c * kh * kw
    tile = choose_tile(o, columns)
    grid = (cdiv(columns, TILES[tile]), cdiv(o, TILES[tile]))
    splits, chunk = split(n * oh * ow, grid[0] * grid[1], multiple=16)   # whole K tiles of either tile
    partial, db_partial = ((be.xp.empty((splits, dw.size), np.float32), be.xp.empty((splits, o), np.float32))
                           if splits > 1 else (None, None))
    launch(be, "conv", _kernel("conv2d_wgrad", tile, kh, kw), grid + (splits,),
           (dy, x, partial, db_partial, be.counters(grid[0] * grid[1]), dw, db, *geometry, chunk,
            *_layouts(dy, x, dw)))
    return dw, db


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
