"""Launchers of conv_tc.cu: the convolution GEMMs on TF32 tensor cores, on channels-last (NHWC)
memory, which conv.py and linear.py call under the tf32 precision (kernels.precision()); the
linear layer is the 1x1 convolution of 1x1 images.

Every function here takes C-contiguous NHWC arrays and the geometry tuple of conv.py,
(N, C, H, W, O, KH, KW, SH, SW, PH, PW, OH, OW), and returns C-contiguous arrays.
"""
import numpy as np

from .launch import cdiv, launch, split, sum_partials

OPS = ()  # the contract's ops are conv.py's and linear.py's, which call these
BK = 16   # the k step of every tile (TC_BK)
TILES = {"Tc128x64": (128, 64), "Tc64x64": (64, 64)}
GEMMS = ("conv_tc_forward", "conv_tc_dgrad", "conv_tc_wgrad")
# VEC = 4 (16-byte copies) for either tile; VEC = 1 (channel counts not a multiple of 4) with the
# small tile only.
KERNELS = tuple(f"{k}<{t}, 4>" for k in GEMMS for t in TILES) + tuple(f"{k}<Tc64x64, 1>" for k in GEMMS) + (
    "bias_grad_partials", "sum_partials")
# The large tile does twice the work per block: worth it only while the grid stays large.
LARGE_TILE_MIN_BLOCKS = 256


def choose_tile(rows, columns, vec):
    """The tile for a (rows x columns) output: Tc128x64 when rows fill it, copies are 16 bytes
    and the grid keeps at least LARGE_TILE_MIN_BLOCKS blocks; else Tc64x64."""
    large = cdiv(rows, 128) * cdiv(columns, 64)
    return "Tc128x64" if vec == 4 and rows >= 128 and large >= LARGE_TILE_MIN_BLOCKS else "Tc64x64"


def _vec(*channels):
    """4 when every channel count that the copies run along is a multiple of 4, else 1."""
    return 4 if all(c % 4 == 0 for c in channels) else 1


def _grid(kernel, rows, columns, vec, z=1):
    tile = choose_tile(rows, columns, vec)
    bm, bn = TILES[tile]
    return f"{kernel}<{tile}, {vec}>", (cdiv(rows, bm), cdiv(columns, bn), z)


def forward(be, x, w_krsc, b, geometry):
    """y (N, OH, OW, O) = conv(x (N, H, W, C), w_krsc (O, KH, KW, C)) + b (may be None)."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    y = be.xp.empty((n, oh, ow, o), np.float32)
    kernel, grid = _grid("conv_tc_forward", n * oh * ow, o, _vec(c))
    launch(be, "conv_tc", kernel, grid, (x, w_krsc, b, y, *geometry), block=(128,))
    return y


def backward_data(be, dy, w_rsco, geometry):
    """dx (N, H, W, C) from dy (N, OH, OW, O) and w_rsco (KH, KW, C, O): one GEMM per stride
    phase of the input cells (grid.z), sized for the largest."""
    n, c, h, wd, o, kh, kw, sh, sw = geometry[:9]
    dx = be.xp.empty((n, h, wd, c), np.float32)
    kernel, grid = _grid("conv_tc_dgrad", n * cdiv(h, sh) * cdiv(wd, sw), c, _vec(o), sh * sw)
    launch(be, "conv_tc", kernel, grid, (dy, w_rsco, dx, *geometry), block=(128,))
    return dx


def backward_weight(be, dy, x, geometry):
    """dw_krsc (O, KH, KW, C) from dy (N, OH, OW, O) and x (N, H, W, C), split over the
    N*OH*OW sum into partials (added in order) when the (O x KH*KW*C) grid is small."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    columns = kh * kw * c
    kernel, grid = _grid("conv_tc_wgrad", o, columns, _vec(o, c))
    splits, chunk = split(n * oh * ow, grid[0] * grid[1], multiple=BK)
    dw = be.xp.empty((o, kh, kw, c), np.float32)
    partial = dw if splits == 1 else be.xp.empty((splits, o, kh, kw, c), np.float32)
    launch(be, "conv_tc", kernel, grid[:2] + (splits,), (dy, x, partial, *geometry, chunk), block=(128,))
    if splits > 1:
        sum_partials(be, "conv_tc", partial, splits, dw)
    return dw
