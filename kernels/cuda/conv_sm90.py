"""Launchers of conv_sm90.cu: the convolutions of Hopper (compute capability 9.0), warpgroup MMA fed by TMA, in bf16
and TF32 (forward, backward-data, backward-weight), which conv_tc's forward and backward-data and conv.py's
backward-weight run where `chosen`, `chosen_dgrad` and `chosen_wgrad` say so, and the mma.sync kernels of conv_bf16.cu
and conv_tc.cu elsewhere. Backward-data of a stride-1 convolution is the forward GEMM of dy by the
weights mirrored (dgrad_geometry), of a stride-2 one a GEMM a phase of dx; backward-weight a GEMM a filter tap, split
over the pixels (wgrad_plan).

The arrays are C-contiguous NHWC, bfloat16 or float32 (TF32: the products of TF32 values, as conv_tc.cu's: the
weights and backward-data's dy hold them, x is rounded as it lands), the geometry conv.py's tuple (N, C, H, W, O, KH,
KW, SH, SW, PH, PW, OH, OW). x and w reach the kernel as TMA tensor maps (launch.tensor_map): x as (N, H, W, C) in
boxes of a tile's output box of pixels by a 128-byte line of channels (64 bf16, 32 float32; at stride 2, its pixels
of each parity of row and column a map apiece: x_maps), w as (O, KH*KW*C) in boxes of BN filters by a line.
"""
import os
import typing

import numpy as np

from kernels import bfloat16

from .batchnorm import NO_STATISTICS, NO_SUMS
from .launch import aligned, cdiv, device_property, launch, sum_partials, tensor_map, tile_of

OPS = ()   # the contract's op is conv.py's conv2d_forward, through conv_tc.forward
THREADS = 384   # the forward's: a producer warpgroup and two consumer warpgroups (Sm90Tile::THREADS)
ROWS, BK, LINE = 128, 64, 128   # the rows (output pixels) of a tile, channels a multiple of BK, a stage's line bytes
# tile: (columns BN, stages): 128 filters where the output channels are a multiple of 128, else 64; bf16's and TF32's
TILES = {"Sm90x128": (128, 4), "Sm90x64": (64, 6), "Sm90Tf32x128": (128, 4), "Sm90Tf32x64": (64, 6)}
ELEMENTS = {bfloat16: "bf16", np.dtype(np.float32): "float"}   # the storage each tile family takes
# backward-weight's tiles: (output channels BM, input channels BN, stages, blocks an SM, copies: TF32's stages
# transposed, conv_sm90_wgrad_tf32); a stage's k is a box of a line's pixels (64 of bf16, 32 of TF32: LINE // the
# element's bytes). Its grid (a block a tap and tile) splits the pixels into parts until it has WGRAD_SPLIT_TARGET
# blocks (two waves of an H200's 132 SMs at one block an SM), at least WGRAD_MIN_BOXES boxes a part.
WGRAD_TILES = {"Sm90Wgrad128": (128, 128, 4, 1, 0), "Sm90Wgrad64": (64, 64, 6, 2, 0),
               "Sm90Tf32Wgrad128": (128, 128, 3, 1, 3), "Sm90Tf32Wgrad64": (64, 64, 4, 2, 2)}
WGRAD_SPLIT_TARGET, WGRAD_MIN_BOXES = 2 * 132, 8
# the kernels that multiply (forward and backward-data; weight, bf16's and TF32's)
GEMMS = ("conv_sm90_forward", "conv_sm90_wgrad", "conv_sm90_wgrad_tf32")
KERNELS = tuple(f"conv_sm90_forward<{tile}, {add}>" for tile in TILES for add in ("false", "true")) + tuple(
    f"conv_sm90_wgrad{'_tf32' if 'Tf32' in tile else ''}<{tile}>" for tile in WGRAD_TILES) + tuple(
    f"mirrored_weights<{element}>" for element in ELEMENTS.values()) + ("sum_partials",)


# KERNELS_HOPPER=0 leaves a Hopper on conv_bf16.cu's and conv_tc.cu's mma.sync kernels: the escape hatch while this
# family's first runs on a GPU are to come (bench/RESULTS.md), and a way to compare the two there
DISABLE = "KERNELS_HOPPER"


def precision_of(kernel):
    """The tensor cores' precision ("TF32" or "BF16") a GEMM of this family (its name expression) multiplies in."""
    return "TF32" if "Tf32" in kernel else "BF16"


def available(be):
    """Whether `be` runs on a GPU of compute capability 9.0, whose sm_90a code this family is (a simulated GPU
    reports the capability it simulates; the emulator's own backend takes conv_bf16.cu's kernels, and the tests
    call this family directly), unless KERNELS_HOPPER=0."""
    return be.xp is not np and os.environ.get(DISABLE, "1") != "0" and be.xp.cuda.Device().compute_capability == "90"


def supports(geometry):
    """Whether the family computes this forward (and backward-weight): stride 1, or 2 of an image of two rows and
    columns at least (the box of the output is a box of x, or of its pixels of one parity: x_maps), and input and
    output channels multiples of 64 (a stage's k, the 128-byte rows of the swizzle; the tiles' columns)."""
    n, c, h, w, o, kh, kw, sh, sw = geometry[:9]
    return sh == sw and (sh == 1 or sh == 2 and h >= 2 and w >= 2) and c % BK == 0 and o % 64 == 0


def x_maps(be, x, stride, box, nan_fill=False):
    """The four tensor maps of x (N, H, W, C) that conv_sm90.cu's Sm90Tap reads, boxes of `box`: those of its pixels
    of each parity of row a and column b, x[:, a::2, b::2], map 2a + b, at stride 2; x's own, four times, at 1. NaN
    past the image with nan_fill (a norm applied as x lands, whose relu makes it the padding's 0)."""
    if stride == 1:
        return (tensor_map(be, x, box, nan_fill=nan_fill),) * 4
    return tuple(tensor_map(be, x[:, a::2, b::2], box, nan_fill=nan_fill) for a in (0, 1) for b in (0, 1))


def chosen(be, geometry):
    return available(be) and supports(geometry)


def dgrad_geometry(geometry):
    """The geometry of the forward convolution that backward-data of a stride-1 one is: dy (N, O, OH, OW) convolved
    with the weights mirrored (C, KH, KW, O), padding KH - 1 - PH, to dx (N, C, H, W)."""
    n, c, h, w, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    return (n, o, oh, ow, c, kh, kw, 1, 1, kh - 1 - ph, kw - 1 - pw, h, w)


def supports_dgrad(geometry):
    """Whether the family computes this backward-data: a stride-1 convolution whose padding the filter covers (dy's
    padding KH - 1 - PH is not negative), its forward GEMM one the family takes; or one of stride 2 the forward takes
    (dgrad_plan: a GEMM a phase of dx)."""
    kh, kw, sh, sw, ph, pw = geometry[5:11]
    if sh == sw == 2:
        return supports(geometry)
    return sh == sw == 1 and ph < kh and pw < kw and supports(dgrad_geometry(geometry))


def chosen_dgrad(be, geometry):
    return available(be) and supports_dgrad(geometry)


def choose_box(n, oh, ow, pixels=ROWS):
    """(box_i, box_h, box_w) of `pixels` output pixels (a forward tile's 128 rows, backward-weight's 64 k): powers of
    two whose boxes cover the output (N, OH, OW) with the fewest pixels past its edges, the widest rows among equals
    (rows of x and of y contiguous in memory)."""
    boxes = [(pixels // (bh * bw), bh, bw) for bw in (2**i for i in range(8)) for bh in (2**i for i in range(8))
             if bh * bw <= pixels]
    return min(boxes, key=lambda b: (cdiv(n, b[0]) * cdiv(oh, b[1]) * cdiv(ow, b[2]), -b[2], -b[1]))


def choose_tile(o, dtype=bfloat16):
    return f"Sm90{'Tf32' if dtype == np.float32 else ''}x{128 if o % 128 == 0 else 64}"


def dynamic_shared(kernel):
    """The bytes of dynamic shared memory a block of `kernel` (a name expression) asks for, its tile's
    (Sm90Tile::SHARED_BYTES): 1024 bytes to align the ring, its stages of A (BM rows of 64 bf16) and B (BN rows),
    a full and an empty barrier a stage, and the epilogues' scratch (12 bytes a column for each consumer warp's
    rows); 0 for the others (no shared memory)."""
    name, tile = kernel.partition("<")[0], tile_of(kernel)
    copies = 0
    if name == "conv_sm90_forward":
        rows, (columns, stages) = ROWS, TILES[tile]
    elif name in ("conv_sm90_wgrad", "conv_sm90_wgrad_tf32"):
        rows, columns, stages, _, copies = WGRAD_TILES[tile]
    else:
        return 0
    return 1024 + (stages + copies) * (rows + columns) * LINE + 2 * stages * 8 + 12 * (rows // 16) * columns


class Plan(typing.NamedTuple):
    """The forward's tiles: a box of output pixels by BN filters (the tile's columns), of each phase of the output
    (conv_sm90.cu's Sm90Tiles), which a persistent grid's blocks take in turn (grid)."""
    tile: str
    box: tuple          # (box_i, box_h, box_w) of a tile's pixels
    boxes: int          # of the output (of its largest phase)
    filter_tiles: int
    phases: int

    @property
    def tiles(self):
        return self.boxes * self.filter_tiles * self.phases

    def grid(self, be):
        """A block an SM (the ring's shared memory allows no more), none without a tile."""
        return (min(self.tiles, multiprocessors(be)),)


# the blocks of a persistent grid on the emulator, which runs them one after another: a few, each taking several
# tiles in turn, as a GPU's do
EMULATED_SMS = 3


def multiprocessors(be):
    """The SMs of the current GPU (132 on an H100 or H200; the simulated GPUs report an H200's), EMULATED_SMS on the
    emulator."""
    if be.xp is np:
        return EMULATED_SMS
    return int(device_property(be, "multiProcessorCount"))


def plan(geometry, phases=1, dtype=bfloat16):
    """The forward's Plan, of `dtype`'s tiles: the tile, the boxes of the output by its BN filters; with `phases` 4
    (backward-data of a stride-2 convolution, whose output is the geometry's x), the boxes of dx's largest phase,
    (0, 0), for each."""
    n, o, oh, ow = geometry[0], geometry[4], geometry[11], geometry[12]
    if phases == 4:
        n, o, oh, ow = n, geometry[1], cdiv(geometry[2], 2), cdiv(geometry[3], 2)
    box = choose_box(n, oh, ow)
    tile = choose_tile(o, dtype)
    boxes = cdiv(n, box[0]) * cdiv(oh, box[1]) * cdiv(ow, box[2])
    return Plan(tile, box, boxes, o // TILES[tile][0], phases)


def dgrad_plan(geometry, dtype=bfloat16):
    """Backward-data's Plan: the forward's of dgrad_geometry at stride 1; at stride 2, a GEMM a phase of dx (its
    pixels of row parity a and column parity b, conv_sm90.cu's Sm90Phase and Sm90Taps), phase 2a + b."""
    if geometry[7] == 1:
        return plan(dgrad_geometry(geometry), dtype=dtype)
    return plan(geometry, phases=4, dtype=dtype)


def _operands(what, geometry, supported, *arrays):
    """The element type of `arrays` (bfloat16, or float32 for TF32), which must share it; else a ValueError."""
    dtypes = {a.dtype for a in arrays}
    if not supported(geometry) or len(dtypes) != 1 or next(iter(dtypes)) not in ELEMENTS:
        raise ValueError(f"conv_sm90: takes {what} of bfloat16 or float32 (TF32) operands alike, channels multiples "
                         f"of 64, got {', '.join(str(a.dtype) for a in arrays)}, geometry {geometry}")
    return next(iter(dtypes))


def forward(be, x, w_krsc, b, geometry, into=None, stats=NO_STATISTICS, sums=NO_SUMS, x_tf32=False, fold=None):
    """y (N, OH, OW, O) of x's dtype = conv(x (N, H, W, C), w_krsc (O, KH, KW, C)) + b (float32 (O,), or None); added
    to `into` (a C-contiguous (N, OH, OW, O) array of that dtype), in place, rounded once, when given. From the
    epilogue, as the mma.sync kernels': `stats`, the BN_STATS_PARAMS of the batch norm that follows, whose statistics
    of y it computes (conv_tc.statistics_arguments over the plan's tiles), or `sums`, the BN_SUMS_PARAMS of the norm
    whose backward sums of y (after the add) it computes (backward_data); NO_STATISTICS, NO_SUMS: none. float32 (TF32):
    w_krsc holds TF32 values (conv_tc.tf32_values), and x too where x_tf32, else its stages are rounded as they land;
    with `fold` = (gamma, beta, mean, invstd) (float32 (C,)), the convolution of relu(the batch norm of x with them),
    rounded so, applied as x lands (conv_tc.forward's fold, TF32's alone)."""
    n, c, h, w, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    dtype = _operands("convolutions of stride 1 or 2", geometry, supports, x, w_krsc)
    if fold is not None and dtype != np.float32:
        raise ValueError("conv_sm90: applies a batch norm to x as it lands in TF32 alone (bf16's is applied before)")
    p = plan(geometry, dtype=dtype)
    y = be.xp.empty((n, oh, ow, o), dtype) if into is None else into
    gamma, beta, mean, invstd = (None,) * 4 if fold is None else (aligned(a) for a in fold)
    _launch_forward(be, p, x_maps(be, aligned(x), sh, (*p.box, LINE // dtype.itemsize), nan_fill=fold is not None),
                    w_krsc.reshape(o, kh * kw * c), b, y, into,
                    (n, c, o, kh, kw, ph, pw, sh, 1, oh, ow, *p.box[::-1], p.boxes,
                     int(dtype == np.float32 and not x_tf32), mean, invstd, gamma, beta), stats, sums)
    return y


def _launch_forward(be, p, maps, w, b, out, into, sizes, stats, sums):
    """conv_sm90_forward of Plan p: A from the four `maps` (x_maps), B from w (the GEMM's columns by its k, C-contiguous,
    of the tile's element type), the bias b, into `out`, added to what it holds where `into` is given; `sizes`: the
    kernel's (n, c, o, kh, kw, ph, pw, stride, phases, oh, ow, box_w, box_h, box_i, boxes, round_a, and the folded
    norm's mean, invstd, gamma and beta)."""
    kernel = f"conv_sm90_forward<{p.tile}, {'false' if into is None else 'true'}>"
    w_map = tensor_map(be, aligned(w), (TILES[p.tile][0], LINE // w.dtype.itemsize))
    launch(be, "conv_sm90", kernel, p.grid(be), (*maps, w_map, b, out, *sizes, *stats, *sums), block=(THREADS,),
           shared_mem=dynamic_shared(kernel))


def backward_data(be, dy, w_krsc, geometry, into=None, sums=NO_SUMS):
    """dx (N, H, W, C) of dy's dtype from dy (N, OH, OW, O) and w_krsc (O, KH, KW, C) (float32: TF32, both holding TF32
    values); added to `into` (as forward's) when given, with the sums of a batch norm (forward's `sums`, over the tiles
    of dgrad_plan's grid, every phase's): at stride 1, the forward of dy by the mirrored weights (mirrored_weights, a
    launch); at stride 2, the GEMMs of dx's four phases, each of the filter's taps that reach it, in one launch."""
    n, c, h, w, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    dtype = _operands("the backward-data of convolutions of stride 1 whose filter covers the padding, or of stride 2,",
                      geometry, supports_dgrad, dy, w_krsc)
    mirrored = be.xp.empty((c, kh, kw, o), dtype)
    launch(be, "conv_sm90", f"mirrored_weights<{ELEMENTS[dtype]}>", (cdiv(mirrored.size, 256),),
           (aligned(w_krsc), mirrored, o, kh * kw, c), block=(256,))
    if sh == 1:
        return forward(be, dy, mirrored, None, dgrad_geometry(geometry), into, sums=sums, x_tf32=True)
    p = dgrad_plan(geometry, dtype)
    dx = be.xp.empty((n, h, w, c), dtype) if into is None else into
    _launch_forward(be, p, x_maps(be, aligned(dy), 1, (*p.box, LINE // dtype.itemsize)),
                    mirrored.reshape(c, kh * kw * o), None, dx, into,
                    (n, o, c, kh, kw, ph, pw, 2, 4, h, w, *p.box[::-1], p.boxes, 0, *(None,) * 4), NO_STATISTICS,
                    sums)
    return dx


def chosen_wgrad(be, geometry):
    """Backward-weight takes what the forward does (supports)."""
    return available(be) and supports(geometry)


class WgradPlan(typing.NamedTuple):
    tile: str
    box: tuple      # (box_i, box_h, box_w) of a stage's pixels
    boxes: int      # the boxes of a part
    parts: int
    grid: tuple

    @property
    def kernel(self):
        return f"conv_sm90_wgrad{'_tf32' if 'Tf32' in self.tile else ''}<{self.tile}>"


def wgrad_pixels(dtype=bfloat16):
    """The pixels of a backward-weight stage's k: a 128-byte line of the element type's (64 bf16, 32 float32)."""
    return LINE // np.dtype(dtype).itemsize


def wgrad_plan(geometry, dtype=bfloat16):
    """The tile of `dtype` (128 x 128 where both channel counts are multiples of 128, else 64 x 64), the box of a
    stage's pixels, and the split of the boxes into parts: a block a tap, tile and part."""
    n, c, h, w, o, kh, kw = geometry[:7]
    oh, ow = geometry[11:]
    tile = f"Sm90{'Tf32' if dtype == np.float32 else ''}Wgrad{128 if c % 128 == 0 and o % 128 == 0 else 64}"
    rows, columns = WGRAD_TILES[tile][:2]
    box = choose_box(n, oh, ow, wgrad_pixels(dtype))
    total = cdiv(n, box[0]) * cdiv(oh, box[1]) * cdiv(ow, box[2])
    tiles = (c // columns) * (o // rows) * kh * kw
    parts = max(1, min(cdiv(WGRAD_SPLIT_TARGET, tiles), total // WGRAD_MIN_BOXES))
    boxes = cdiv(total, parts)
    parts = cdiv(total, boxes)   # no part without boxes: conv_sm90_wgrad's blocks each have at least one
    return WgradPlan(tile, box, boxes, parts, (c // columns, o // rows, kh * kw * parts))


def backward_weight(be, dy, x, geometry, dw, db, fold=None):
    """dw (O, KH, KW, C), float32, C-contiguous (channels-last weights), from dy (N, OH, OW, O) and x (N, H, W, C),
    bfloat16, or float32 (TF32: the products of both rounded to TF32 as they land, dy as given or holding TF32 values
    already); and the bias gradient, dy (as given) summed per output channel, into db (O,) float32 unless it is None.
    `fold`: TF32's, as forward's (x is the input of a batch norm with its relu, applied as x lands). Split over the
    pixels, the parts' partials added in order by sum_partials."""
    n, c, h, w, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    dtype = _operands("the backward-weight of convolutions of stride 1 or 2", geometry, supports, dy, x)
    if fold is not None and dtype != np.float32:
        raise ValueError("conv_sm90: applies a batch norm to x as it lands in TF32 alone (bf16's is applied before)")
    p = wgrad_plan(geometry, dtype)
    rows = WGRAD_TILES[p.tile][0]
    dy, x = aligned(dy), aligned(x)
    box = (*p.box, wgrad_pixels(dtype))   # a line of channels
    out = dw if p.parts == 1 else be.xp.empty((p.parts, o, kh, kw, c), np.float32)
    bias_out = db if p.parts == 1 or db is None else be.xp.empty((p.parts, o), np.float32)
    arguments = (tensor_map(be, dy, box), *x_maps(be, x, sh, box, nan_fill=fold is not None), out, bias_out, n, c, o,
                 kw, kh * kw, ph, pw, sh, oh, ow, p.box[2], p.box[1], p.box[0], p.boxes)
    if dtype == np.float32:
        gamma, beta, mean, invstd = (None,) * 4 if fold is None else (aligned(a) for a in fold)
        arguments += (mean, invstd, gamma, beta)
    launch(be, "conv_sm90", p.kernel, p.grid, arguments, block=(128 * (1 + rows // 64),),
           shared_mem=dynamic_shared(p.kernel))
    if p.parts > 1:
        sum_partials(be, "conv_sm90", out, p.parts, dw)
        if db is not None:
            sum_partials(be, "conv_sm90", bias_out, p.parts, db)
    return dw, db
