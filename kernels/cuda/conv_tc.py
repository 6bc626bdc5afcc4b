"""Launchers of conv_tc.cu: the convolution GEMMs on TF32 tensor cores, on channels-last (NHWC)
memory, which conv.py and linear.py call under the tf32 precision (kernels.precision()); the
linear layer is the 1x1 convolution of 1x1 images.

Every function here takes C-contiguous NHWC arrays and the geometry tuple of conv.py,
(N, C, H, W, O, KH, KW, SH, SW, PH, PW, OH, OW), and returns C-contiguous arrays. Inputs not
16-byte aligned (views at an odd offset) are copied first: the 16-byte cp.async needs it. A GEMM
split over k finishes in its own launch (the last part of each tile adds the parts in order).
"""
import functools
import typing

import numpy as np

from .launch import aligned, cdiv, is_channels_last, launch, memory

OPS = ()  # the contract's ops are conv.py's and linear.py's, which call these
BK, THREADS = 16, 128   # the k step of every tile (TC_BK) and the threads of a block (TC_THREADS)
TILES = {"Tc128x64": (128, 64), "Tc64x64": (64, 64)}
GEMMS = ("conv_tc_forward", "conv_tc_dgrad", "conv_tc_wgrad")
# VEC = 4 (16-byte copies) for either tile; VEC = 1 (channel counts not a multiple of 4) with the
# small tile only.
KERNELS = tuple(f"{k}<{t}, 4>" for k in GEMMS for t in TILES) + tuple(f"{k}<Tc64x64, 1>" for k in GEMMS)
# The large tile does twice the work per block: worth it only while the grid stays large.
LARGE_TILE_MIN_BLOCKS = 256
# Split-K: a grid of fewer blocks than two per SM of an H200 (132 SMs) splits its k into parts of
# at least 32 k steps.
SPLIT_TARGET, MIN_SPLIT_K = 264, 32 * BK


def choose_tile(rows, columns, vec):
    """The tile for a (rows x columns) output: Tc128x64 when rows fill it, copies are 16 bytes
    and the grid keeps at least LARGE_TILE_MIN_BLOCKS blocks; else Tc64x64."""
    large = cdiv(rows, 128) * cdiv(columns, 64)
    return "Tc128x64" if vec == 4 and rows >= 128 and large >= LARGE_TILE_MIN_BLOCKS else "Tc64x64"


class Plan(typing.NamedTuple):
    """How one GEMM of a convolution is launched: its kernel's name expression, the grid (x over
    output rows, y over output columns, z over split-K parts, times the stride phases for
    backward-data), the k per part and the number of parts."""
    kernel: str
    grid: tuple
    chunk: int
    splits: int


@functools.lru_cache(maxsize=1024)
def plan(gemm, geometry):
    """The Plan of `gemm` ("forward", "dgrad" or "wgrad") for the geometry tuple of conv.py."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if gemm == "forward":
        return _plan("conv_tc_forward", n * oh * ow, o, kh * kw * c, _vec(c))
    if gemm == "dgrad":   # one GEMM per stride phase of the input cells, sized for the largest
        return _plan("conv_tc_dgrad", n * cdiv(h, sh) * cdiv(wd, sw), c, cdiv(kh, sh) * cdiv(kw, sw) * o, _vec(o, c),
                     sh * sw)
    return _plan("conv_tc_wgrad", o, kh * kw * c, n * oh * ow, _vec(o, c))


def splits(k, blocks):
    """(parts, k per part) for a GEMM of `blocks` blocks summing over `k`: a grid of fewer than
    SPLIT_TARGET blocks splits its k into parts of at least MIN_SPLIT_K (whole k steps) until it has
    about that many blocks. From the shapes alone, so that every run adds the same partials."""
    parts = 1 if blocks >= SPLIT_TARGET else max(1, min(cdiv(SPLIT_TARGET, blocks), k // MIN_SPLIT_K))
    chunk = cdiv(cdiv(max(k, 1), parts), BK) * BK
    return cdiv(max(k, 1), chunk), chunk


def _vec(*channels):
    """4 when every channel count that the copies run along is a multiple of 4, else 1."""
    return 4 if all(c % 4 == 0 for c in channels) else 1


def _plan(kernel, rows, columns, k, vec, phases=1):
    tile = choose_tile(rows, columns, vec)
    bm, bn = TILES[tile]
    grid = (cdiv(rows, bm), cdiv(columns, bn))
    parts, chunk = splits(k, grid[0] * grid[1] * phases)
    return Plan(f"{kernel}<{tile}, {vec}>", grid + (phases * parts,), chunk, parts)


def forward(be, x, w_krsc, b, geometry):
    """y (N, OH, OW, O) = conv(x (N, H, W, C), w_krsc (O, KH, KW, C)) + b (may be None)."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    p = plan("forward", geometry)
    x, w_krsc = aligned(x), aligned(w_krsc)
    y = be.xp.empty((n, oh, ow, o), np.float32)
    _launch(be, p, (x, w_krsc, b), y, geometry)
    return y


def backward_data(be, dy, w_krsc, geometry, into=None):
    """dx (N, H, W, C) from dy (N, OH, OW, O) and w_krsc (O, KH, KW, C); added to `into` (a
    C-contiguous (N, H, W, C) array), in place, when given."""
    n, c, h, wd = geometry[:4]
    p = plan("dgrad", geometry)
    dy, w_krsc = aligned(dy), aligned(w_krsc)
    dx = be.xp.empty((n, h, wd, c), np.float32) if into is None else into
    _launch(be, p, (dy, w_krsc), dx, geometry, (int(into is not None),))
    return dx


def backward_weight(be, dy, x, geometry, dw, db):
    """dw from dy (N, OH, OW, O) and x (N, H, W, C), into `dw` (O, C, KH, KW): C-contiguous, or
    channels-last (O, KH, KW, C memory); and the bias gradient, dy summed per channel, into `db`
    (O,) unless it is None; at any alignment (the kernel stores single floats)."""
    p = plan("wgrad", geometry)
    dy, x = aligned(dy), aligned(x)
    o = geometry[4]
    partial = be.xp.empty((p.splits, o), np.float32) if p.splits > 1 and db is not None else None
    _launch(be, p, (dy, x), memory(dw), geometry, (int(is_channels_last(dw)), db), (partial,))
    return dw, db


def _launch(be, p, inputs, out, geometry, extra=(), partials=()):
    """Launch the Plan on `inputs` into `out`, then the kernel's `extra` arguments, the partial
    output of each part of a split k, the kernel's other `partials` and the counters of its tiles
    (see conv_tc.cu's tc_finish)."""
    partial = be.xp.empty((p.splits, out.size), np.float32) if p.splits > 1 else None
    tiles = p.grid[0] * p.grid[1] * (p.grid[2] // p.splits)
    launch(be, "conv_tc", p.kernel, p.grid,
           (*inputs, out, *extra, partial, *partials, be.counters(tiles), *geometry, p.chunk), block=(THREADS,))
