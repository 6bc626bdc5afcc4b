"""Launchers of conv_tc.cu: the convolution GEMMs on TF32 tensor cores, on channels-last (NHWC)
memory, which conv.py calls under the tf32 precision (kernels.precision()) for the convolutions
whose channel counts are multiples of 4 (supports).

Every function here takes C-contiguous NHWC arrays and the geometry tuple of conv.py,
(N, C, H, W, O, KH, KW, SH, SW, PH, PW, OH, OW), and returns C-contiguous arrays. Inputs not
16-byte aligned (views at an odd offset) are copied first: the 16-byte cp.async needs it. A GEMM
split over k finishes in its own launch (the last parts to finish add the parts in a fixed
order, in two levels when there are many).
"""
import functools
import math
import typing

import numpy as np

from .launch import aligned, cdiv, is_channels_last, launch, memory

OPS = ()  # the contract's ops are conv.py's, which calls these
BK, THREADS = 16, 128   # the k step of every tile (TC_BK) and the threads of a block (TC_THREADS)
TILES = {"Tc128x64": (128, 64), "Tc64x64": (64, 64)}
GEMMS = ("conv_tc_forward", "conv_tc_dgrad", "conv_tc_wgrad")
# ALIGN = 16: every channel count a multiple of 16 and at most 32 filter taps, the copies'
# addresses worked out before the loop; ALIGN = 4: channel counts multiples of 4, every copy's
# address from its (row, k) (conv_tc.cu).
ALIGNS = (16, 4)
MAX_ALIGNED_TAPS = 32
# Backward-weight runs the large tile at every size (WGRAD_TILE): its grid is small and split-K
# fills the GPU, and the small tile's loop issues more than 8 instructions per HMMA.
WGRAD_TILE = "Tc128x64"
KERNELS = tuple(f"{k}<{t}, {a}>" for k in GEMMS[:2] for t in TILES for a in ALIGNS) + tuple(
    f"conv_tc_wgrad<{WGRAD_TILE}, {a}>" for a in ALIGNS)
# Split-K: a grid of fewer blocks than SPLIT_TARGET splits its k into parts of at least
# MIN_SPLIT_K (whole k steps) until it has that many blocks: two per SM of an H200 (132 SMs) for
# the forward and backward-data, whose grids are large but at the last stage. Backward-weight's k
# is the batch's pixels and its grid the size of the weights, small at every layer: it splits to
# WGRAD_SPLIT_TARGET, two waves of the blocks that fit on 132 SMs (3 of its blocks fit on an SM:
# bench/tc_plan.py shows the waves), in parts of at least WGRAD_MIN_SPLIT_K pixels.
SPLIT_TARGET, MIN_SPLIT_K = 264, 32 * BK
WGRAD_SPLIT_TARGET, WGRAD_MIN_SPLIT_K = 2 * 3 * 132, 2 * BK
# Parts beyond ONE_LEVEL_PARTS are added in two levels, groups of about sqrt(parts) (tc_finish).
ONE_LEVEL_PARTS = 8


def supports(c, o):
    """Whether these kernels take a convolution of C input and O output channels: their copies
    move 4 channels (16 bytes) at a time along both. conv.py runs the others, such as ResNet-18's
    stem (C = 1: a K of 9 per output, too little to feed the tensor cores), on conv.cu's FP32
    kernels, exact in float32."""
    return c % 4 == 0 and o % 4 == 0


def choose_tile(rows):
    """The tile for an output of `rows` rows: Tc128x64 when they fill it, Tc64x64 below 128. The
    large tile issues fewer instructions per HMMA (bench/tc_plan.py), and split-K keeps its grids
    large enough."""
    return "Tc128x64" if rows >= 128 else "Tc64x64"


class Plan(typing.NamedTuple):
    """How one GEMM of a convolution is launched: its kernel's name expression, the grid (x over
    output rows, y over output columns, z over split-K parts, times the stride phases for
    backward-data), the k per part, the number of parts and the parts per group of their sum."""
    kernel: str
    grid: tuple
    chunk: int
    splits: int
    group: int


@functools.lru_cache(maxsize=1024)
def plan(gemm, geometry):
    """The Plan of `gemm` ("forward", "dgrad" or "wgrad") for the geometry tuple of conv.py."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if not supports(c, o):
        raise ValueError(f"the tensor-core convolutions need channel counts that are multiples of 4, not C = {c}, "
                         f"O = {o}")
    align = 16 if c % 16 == 0 and o % 16 == 0 and kh * kw <= MAX_ALIGNED_TAPS else 4
    if gemm == "forward":
        return _plan("conv_tc_forward", n * oh * ow, o, kh * kw * c, align, choose_tile(n * oh * ow))
    if gemm == "dgrad":   # one GEMM per stride phase of the input cells, sized for the largest
        rows = n * cdiv(h, sh) * cdiv(wd, sw)
        return _plan("conv_tc_dgrad", rows, c, cdiv(kh, sh) * cdiv(kw, sw) * o, align, choose_tile(rows), sh * sw)
    return _plan("conv_tc_wgrad", kh * kw * c, o, n * oh * ow, align, WGRAD_TILE, target=WGRAD_SPLIT_TARGET,
                 min_split=WGRAD_MIN_SPLIT_K)


def splits(k, blocks, target=None, min_split=None):
    """(parts, k per part) for a GEMM of `blocks` blocks summing over `k`: a grid of fewer than
    `target` (SPLIT_TARGET) blocks splits its k into parts of at least `min_split` (MIN_SPLIT_K,
    whole k steps) until it has that many blocks, or parts that short. From the shapes alone, so
    that every run adds the same partials."""
    target = SPLIT_TARGET if target is None else target
    min_split = MIN_SPLIT_K if min_split is None else min_split
    parts = 1 if blocks >= target else max(1, min(cdiv(target, blocks), k // min_split))
    chunk = max(BK, k // parts // BK * BK) if parts > 1 else cdiv(max(k, 1), BK) * BK
    return cdiv(max(k, 1), chunk), chunk


def group_size(parts):
    """The parts per group of a split k's two-level sum: all of them up to ONE_LEVEL_PARTS, else
    about sqrt(parts), which balances the two levels."""
    return parts if parts <= ONE_LEVEL_PARTS else math.isqrt(parts - 1) + 1


def _plan(kernel, rows, columns, k, align, tile, phases=1, target=None, min_split=None):
    bm, bn = TILES[tile]
    grid = (cdiv(rows, bm), cdiv(columns, bn))
    parts, chunk = splits(k, grid[0] * grid[1] * phases, target, min_split)
    return Plan(f"{kernel}<{tile}, {align}>", grid + (phases * parts,), chunk, parts, group_size(parts))


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
    partial = be.xp.empty((partial_slots(p), o), np.float32) if p.splits > 1 and db is not None else None
    oh, ow = geometry[11:]
    _launch(be, p, (dy, x), memory(dw), geometry, (int(is_channels_last(dw)), db), (partial,),
            (*fast_divmod(oh * ow), *fast_divmod(ow)))
    return dw, db


def _groups(p):
    return cdiv(p.splits, p.group)


def partial_slots(p):
    """The partial outputs of a Plan's split k: one per part, and one per group when they are
    added in two levels (tc_finish); 0 without split."""
    groups = _groups(p)
    return 0 if p.splits == 1 else p.splits + (groups if groups > 1 else 0)


def fast_divmod(d):
    """(multiplier, shift) of conv_geometry.cuh's FastDivmod for the divisor d: n / d is
    (umulhi(n, multiplier) + n) >> shift for 0 <= n < 2^31, with shift = ceil(log2 d) and
    multiplier = floor(2^32 (2^shift - d) / d) + 1 (Granlund and Montgomery); as uint32 scalars,
    the kernel's unsigned parameters."""
    if not 1 <= d < 2**31:
        raise ValueError(f"FastDivmod takes divisors in [1, 2^31), not {d}")
    shift = (d - 1).bit_length()
    return np.uint32((2**32 * (2**shift - d)) // d + 1), np.uint32(shift)


def _launch(be, p, inputs, out, geometry, extra=(), partials=(), tail=()):
    """Launch the Plan on `inputs` into `out`, then the kernel's `extra` arguments, the partial
    output of each part of a split k, the kernel's other `partials`, the counters of its tiles
    (see conv_tc.cu's tc_finish), the geometry, the k per part and the parts per group, and the
    kernel's `tail` arguments."""
    partial = be.xp.empty((partial_slots(p), out.size), np.float32) if p.splits > 1 else None
    tiles = p.grid[0] * p.grid[1] * (p.grid[2] // p.splits)
    counters = tiles * (_groups(p) + 1)   # per tile: its groups' and its own
    launch(be, "conv_tc", p.kernel, p.grid,
           (*inputs, out, *extra, partial, *partials, be.counters(counters), *geometry, p.chunk, p.group, *tail),
           block=(THREADS,))
