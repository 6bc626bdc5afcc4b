"""Launchers of the tensor-core convolutions, on channels-last (NHWC) memory: conv_tc.cu's TF32
GEMMs, which conv.py calls under the tf32 precision (kernels.precision()) for the convolutions whose
channel counts are multiples of 4, and conv_bf16.cu's BF16 GEMMs, under the bf16 precision for those
whose channel counts are multiples of 8 (supports). The arrays' dtype says which: float32 or
bfloat16 (kernels.bfloat16).

Every function here takes C-contiguous NHWC arrays and the geometry tuple of conv.py,
(N, C, H, W, O, KH, KW, SH, SW, PH, PW, OH, OW), and returns C-contiguous arrays. Inputs not
16-byte aligned (views at an odd offset) are copied first: the 16-byte cp.async needs it. A GEMM
split over k finishes in its own launch (the last parts to finish add the parts in a fixed order,
in two levels when there are many), its partial outputs float32 in either precision.
"""
import functools
import math
import typing

import numpy as np

from kernels import bfloat16

from . import conv_sm90
from .batchnorm import NO_STATISTICS, NO_SUMS
from .elementwise import round_tf32
from .launch import aligned, cdiv, device_property, is_channels_last, launch, memory, tile_of

OPS = ()  # the contract's ops are conv.py's, which calls these
THREADS = 128   # the threads of a block (TC_THREADS: 2 x 2 warps), but for the tiles of TILE_THREADS
# the tiles of 2 x 4 warps (tc_conv.cuh's TcTile with WARPS_N 4): BF16's and TF32's 128 x 128, 64 x 32 warp tiles
TILE_THREADS = {"Bf128x128": 256, "Tc128x128": 256, "Tc128x128Ring2": 256, "TcHalo288x64": 256, "TcPhase192x64": 256}
MAX_ALIGNED_TAPS = 32


def threads(kernel):
    """The threads of a block of `kernel` (a name expression): its tile's (the projection backward's
    PROJECTION_THREADS)."""
    if kernel in PROJECTION_KERNELS:
        return PROJECTION_THREADS
    return TILE_THREADS.get(tile_of(kernel), THREADS)


class Kind(typing.NamedTuple):
    """The tensor-core GEMMs of one precision: the family (.cu) of their kernels and the prefix of
    their names, the tiles by name (rows, columns, k of a stage), and the two copy paths of each
    tile: every channel count a multiple of the tile's k and at most MAX_ALIGNED_TAPS filter taps (a
    stage's k in one tap, the copies' addresses worked out before the loop: ALIGN = the k), or, for
    the tiles that have it, a multiple of `chunk`, the elements of a 16-byte copy, which every channel
    count must be (each copy's address from its (row, k): ALIGN = chunk). `halo`: the tile of the kernels
    of 3x3, stride-1 convolutions from windows of the image (see halo), whose windows hold `halo_channels`
    channels. `variants`: tiles that take another's place on some GPUs (for_device), by the tile whose shape they
    share (pairs)."""
    family: str
    tiles: tuple   # (name, rows, columns, k of a stage, whether it has the gathered copies) of each
    chunk: int
    halo: str
    halo_channels: int
    variants: tuple = ()   # (variant, tile) pairs

    def tile(self, name):
        """(rows, columns, k of a stage) of the tile `name` (or of the tile a variant stands for)."""
        name = dict(self.variants).get(name, name)
        return next(shape[:3] for tile, *shape in self.tiles if tile == name)

    @property
    def gemms(self):
        """The names of the three GEMM kernels (templates): forward, backward-data, backward-weight."""
        return tuple(f"{self.family}_{gemm}" for gemm in ("forward", "dgrad", "wgrad"))

    def kernel(self, gemm, tile, align):
        return f"{self.family}_{gemm}<{tile}, {align}>"

    def kernels(self, wgrad_tiles):
        return tuple(self.kernel(gemm, tile, align) for gemm in ("forward", "dgrad", "wgrad")
                     for tile, _, _, bk, gathered in self.tiles for align in ((bk, self.chunk) if gathered else (bk,))
                     if gemm != "wgrad" or tile in wgrad_tiles)


# TF32 (conv_tc.cu): a stage of 16 k. RING2: the 128 x 128 tile with a ring of 2 stages (see STAGES).
RING2 = "Tc128x128Ring2"
TF32 = Kind("conv_tc", (("Tc128x128", 128, 128, 16, False), ("Tc128x64", 128, 64, 16, True),
                        ("Tc64x64", 64, 64, 16, True)), 4, "TcHalo128x64", 16, ((RING2, "Tc128x128"),))
BK, GEMMS = 16, TF32.gemms
# TF32's stages a tile's ring holds (conv_tc.cu's TcConfig): in static shared memory where it takes at most
# STATIC_RING bytes (conv_tc.cu's TC_STATIC_RING, leaving the kernels' other static shared memory room under the
# 48 KB a block may have), else in dynamic shared memory (the 128 x 128 tile's: 51 to 60 KB, ring_bytes).
# RING2: the 128 x 128 tile with a ring of 2 stages (35 to 40 KB, static), which runs its GEMMs on a GPU whose SM
# has less than SQUARE_RING_SM bytes of shared memory (for_device): two blocks of the 3-stage ring, their other
# static shared memory (at most 5 KB) and the 1 KB the driver keeps a block need 132 KB; an A100's SM has 164 KB,
# an H100's 228, an RTX 3090's, 4090's or L4's (sm_86, sm_89) 100, which hold two blocks of RING2.
SQUARE_RING_SM = 132 * 1024
STAGES, STATIC_RING = {"Tc128x128": 3, RING2: 2, "Tc128x64": 3, "Tc64x64": 3}, 46 * 1024
# Backward-weight runs a large tile at every size (choose_wgrad_tile): its grid is small and split-K
# fills the GPU, and the small tile's loop issues more than 8 instructions per HMMA. The square tile copies
# a run of chunks at a time (tc_conv.cuh's run_of: one address and one test for 2 chunks of x and of dy where
# both channel counts are multiples of 64, for 4 where of 128), at the largest of WGRAD_SQUARE_ALIGNS that
# both channel counts are multiples of (square_wgrad_align), and at no other.
WGRAD_SQUARE_ALIGNS = (128, 64)
SQUARE_WGRADS = tuple(f"conv_tc_wgrad<Tc128x128, {align}>" for align in WGRAD_SQUARE_ALIGNS)
# The forward and backward-weight of a convolution whose input is a training batch norm's relu(bn(x)), read
# from x with the norm applied as each stage (or window) lands (conv_tc.cu's NORM): the large tiles, aligned
# copies, and the halo forward and backward-weight.
FOLD_TILES = ("Tc128x128", "Tc128x64")
FOLD_KERNELS = tuple(f"conv_tc_forward<{tile}, {BK}, true>" for tile in FOLD_TILES) + tuple(
    name[:-1] + ", true>" for name in SQUARE_WGRADS + (f"conv_tc_wgrad<Tc128x64, {BK}>",)) + (
    f"conv_tc_forward_halo<{TF32.halo}, true>", "conv_tc_wgrad_halo<TcHalo288x64, true>")
KERNELS = TF32.kernels(("Tc128x64",)) + SQUARE_WGRADS + tuple(
    f"conv_tc_{gemm}_halo<{TF32.halo}>" for gemm in ("forward", "dgrad")) + (
    "conv_tc_wgrad_halo<TcHalo288x64>",) + FOLD_KERNELS
KERNELS += tuple(kernel.replace("Tc128x128", RING2) for kernel in KERNELS if tile_of(kernel) == "Tc128x128")
# Split-K: a grid of fewer blocks than SPLIT_TARGET splits its k into parts of at least
# MIN_SPLIT_K (whole k steps) until it has that many blocks: one per SM of an H200 (132 SMs) for
# the forward and backward-data, whose grids are large but at the last stages, so that no SM is
# left idle (a grid of more blocks runs unsplit, and writes no float32 partials). Backward-weight's k is the
# batch's pixels and its grid the size of the weights, small at every layer: it splits to
# WGRAD_SPLIT_TARGET[tile], two waves of the 128 x 64 tile's blocks on 132 SMs (3 fit on an SM), one of
# the 128 x 128's (2 fit; two waves of them would write a third more float32 partials than the 128 x
# 64 tile's: bench/tc_plan.py shows the waves and the partials), in parts of at least
# WGRAD_MIN_SPLIT_K pixels.
SPLIT_TARGET, MIN_SPLIT_K = 132, 32 * BK
WGRAD_SPLIT_TARGET, WGRAD_MIN_SPLIT_K = {"Tc128x64": 2 * 3 * 132, "Tc128x128": 2 * 132}, 2 * BK

# BF16 (conv_bf16.cu): the 128 x 128 tile (64 x 64 warp tiles: 64 FLOPs per byte of operands a block
# loads), stages of 32 k, wherever the GEMM has more than 64 columns and channel counts that are
# multiples of 32 (all of ResNet-18's but the stem's); 128 x 64, stages of 64 k, where it has 64 or
# fewer (ResNet-18's first stage), or other multiples of 8 (small widths), for every GEMM. 2 blocks
# fit on an SM (registers). As TF32's, a forward or backward-data grid under BF16_SPLIT_TARGET blocks,
# one an SM, splits its k; backward-weight's under BF16_WGRAD_SPLIT_TARGET, one wave on 132 SMs.
BF16 = Kind("conv_bf16", (("Bf128x128", 128, 128, 32, False), ("Bf128x64", 128, 64, 64, True)), 8, "Halo128x64", 32)
# The 3x3, stride-1 convolutions of 64 columns or fewer (ResNet-18's first stage) forward and
# backward-data from windows of the image (conv_tc.cu's and conv_bf16.cu's halo kernels: a block of
# HALO_ROWS output pixels by 64 columns), where their window fits HALO_SLOTS slots and the grid needs no
# split of k; TF32's and BF16's alike.
HALO_ROWS, HALO_SLOTS = 128, 320
# Their backward-weight too, from windows of x (conv_bf16_wgrad_halo, conv_tc_wgrad_halo): a block's tile is
# the nine taps of WGRAD_HALO_CHANNELS input channels by 64 output channels, over stages of a number of pixels
# whose window fits a number of slots (WGRAD_HALO, by family); split-K to WGRAD_HALO_SPLIT_TARGET blocks, two
# waves of the blocks' pairs an SM on 132 SMs, in parts of at least WGRAD_HALO_MIN_SPLIT_K pixels (see plan).
# Their float32 partials are twice the 128 x 64 tile's, whose blocks hold half the accumulators.
WGRAD_HALO_CHANNELS, WGRAD_HALO_SPLIT_TARGET, WGRAD_HALO_MIN_SPLIT_K = 32, 2 * 132, 64


class WgradHalo(typing.NamedTuple):
    """A family's backward-weight from windows of x: its kernel (the one without a norm applied), the pixels of
    a stage, the slots of the window of a stage that its shared memory holds, and the bytes of dynamic shared
    memory a block asks for."""
    kernel: str
    pixels: int
    slots: int
    dynamic_shared: int


# BF16's in 47 KB of static shared memory; TF32's ring of 2 stages in dynamic shared memory (conv_tc.cu's
# TcWgradHaloShared: two windows of 16 channels, slots of 20 floats, dy's pixels, rows of 68 floats, and their
# slots), 56 pixels a stage, two rows of ResNet-18's first stage: with its 210 slots, a block's shared memory
# fits the 99 KB of an sm_86 or sm_89.
WGRAD_HALO = {"conv_bf16": WgradHalo("conv_bf16_wgrad_halo<Halo288x64>", 48, 224, 0),
              "conv_tc": WgradHalo("conv_tc_wgrad_halo<TcHalo288x64>", 56, 210, 2 * (2 * 210 * 20 + 56 * 68 + 56) * 4)}
# The backward of a 1x1, padding-0 convolution of PROJECTION_CHANNELS input and PROJECTION_OUTPUTS output channels,
# dx and dw and the bias gradient, in one kernel that reads dy once for both GEMMs (conv_tc.cu's
# conv_tc_projection_backward: ResNet-18's first projection, 64 -> 128 at stride 2): blocks of PROJECTION_CELLS
# output cells, each a part of backward-weight's split k. Its kernels: dx written, and added to what dx holds;
# its shared memory (TcProjectionShared::BYTES): w transposed, 64 rows of 132 floats, two stages of 32
# cells' dy (rows of 132) and x (rows of 72), the cells' pixels (3 ints each), 8 warps' bias sums; its blocks
# PROJECTION_THREADS threads (8 warps).
PROJECTION_CELLS, PROJECTION_CHANNELS, PROJECTION_OUTPUTS, PROJECTION_THREADS = 128, 64, 128, 256
PROJECTION_KERNELS = tuple(f"conv_tc_projection_backward<{adds}>" for adds in ("false", "true"))
PROJECTION_SHARED = (64 * 132 + 2 * 32 * (132 + 72) + 3 * PROJECTION_CELLS + PROJECTION_THREADS // 32 * 128) * 4
# Backward-data of a 3x3, stride-2, padding-1 convolution of even H and W and at most 64 input channels (a
# multiple of BK; ResNet-18's 64 -> 128), its four stride phases from windows of dy (conv_tc.cu's
# conv_tc_dgrad_phases): blocks of PHASE_ROWS cells of a phase by the C columns, where the window of a block's
# cells fits PHASE_SLOTS slots and the grid needs no split of k (see phase_windows); its ring's bytes
# (TcPhaseShared::BYTES): two stages of a window and four taps' weights (64 rows of 20 floats).
PHASE_KERNEL, PHASE_ROWS, PHASE_SLOTS = "conv_tc_dgrad_phases<TcPhase192x64>", 192, 304
PHASE_SHARED = 2 * (PHASE_SLOTS * 20 + 4 * 64 * 20) * 4
KERNELS += PROJECTION_KERNELS + (PHASE_KERNEL, "mirrored_weights<float>")
BF16_KERNELS = BF16.kernels(("Bf128x128", "Bf128x64")) + tuple(
    f"conv_bf16_{gemm}_halo<{BF16.halo}>" for gemm in ("forward", "dgrad")) + (WGRAD_HALO["conv_bf16"].kernel,)
BF16_GEMMS = BF16.gemms
BF16_SPLIT_TARGET, BF16_MIN_SPLIT_K = 132, 512
BF16_WGRAD_SPLIT_TARGET, BF16_WGRAD_MIN_SPLIT_K = 2 * 132, 64
# Parts beyond ONE_LEVEL_PARTS are added in two levels, groups of about sqrt(parts) (tc_finish).
ONE_LEVEL_PARTS = 8


def kind_of(dtype):
    """The Kind of the GEMMs of arrays of `dtype`: TF32 for float32, BF16 for bfloat16."""
    return BF16 if dtype == bfloat16 else TF32


def supports(c, o, kind=TF32):
    """Whether these kernels take a convolution of C input and O output channels: their copies
    move 16 bytes (4 floats, 8 bfloat16) at a time along both. conv.py runs the others, such as
    ResNet-18's stem (C = 1: a K of 9 per output, too little to feed the tensor cores), on conv.cu's
    FP32 kernels, exact in float32."""
    return c % kind.chunk == 0 and o % kind.chunk == 0


def choose_tile(rows, columns, aligned):
    """TF32's tile for an output of `rows` x `columns`: Tc128x128 when both fill it (more than 64
    columns) and `aligned` (its aligned copies take the convolution: channel counts multiples of 16, at
    most 32 filter taps; it has no other, as the gathered copies' loops issue 11-16 instructions per
    HMMA whatever the tile), Tc128x64 when the rows fill it, Tc64x64 below 128 rows. The large tiles
    issue fewer instructions per HMMA (bench/tc_plan.py) and the square one reads half again the
    FLOPs per byte of operands, and split-K keeps their grids large enough."""
    return "Tc64x64" if rows < 128 else "Tc128x128" if columns > 64 and aligned else "Tc128x64"


def square_wgrad_align(c, o, taps):
    """The ALIGN of TF32's square backward-weight tile for C input and O output channels and `taps` filter taps:
    the largest of WGRAD_SQUARE_ALIGNS that C and O are multiples of, None where none is (or past
    MAX_ALIGNED_TAPS taps)."""
    return next((align for align in WGRAD_SQUARE_ALIGNS if c % align == 0 and o % align == 0),
                None) if taps <= MAX_ALIGNED_TAPS else None


def choose_wgrad_tile(columns, square_align):
    """TF32's backward-weight tile for `columns` output channels: Tc128x128 above 64 where it has a
    `square_align` (square_wgrad_align), else Tc128x64."""
    return "Tc128x128" if columns > 64 and square_align else "Tc128x64"


def choose_bf16_tile(columns, aligned):
    """BF16's tile for an output of `columns` columns: Bf128x128 above 64 when `aligned` (its aligned
    copies take the convolution: channel counts multiples of its 32 k, at most 32 filter taps; it has
    no other), else Bf128x64."""
    return "Bf128x128" if columns > 64 and aligned else "Bf128x64"


class Plan(typing.NamedTuple):
    """How one GEMM of a convolution is launched: its kernel's name expression, the grid (x over
    output rows, y over output columns, z over split-K parts, times the stride phases for
    backward-data), the k per part, the number of parts and the parts per group of their sum."""
    kernel: str
    grid: tuple
    chunk: int
    splits: int
    group: int
    family: str


def folds(gemm, geometry):
    """Whether TF32's `gemm` ("forward" or "wgrad") of this convolution can read its input as a batch
    norm's relu(bn(x)) from x: its kernel has a twin in FOLD_KERNELS."""
    return plan(gemm, geometry, TF32).kernel[:-1] + ", true>" in FOLD_KERNELS


@functools.lru_cache(maxsize=1024)
def plan(gemm, geometry, kind=TF32, fold=False, windows=True):
    """The Plan of `gemm` ("forward", "dgrad" or "wgrad") for the geometry tuple of conv.py, on the
    GEMMs of `kind` (TF32 or BF16); `fold`: TF32's kernel that applies a batch norm to its input as it
    loads it (where `folds`); `windows`: backward-weight may take its halo kernel (wgrad_halo), which sums the
    bias gradient of the dy that its GEMM reads (TF32's: not of another dy rounded to it)."""
    if fold:
        if not folds(gemm, geometry):
            raise ValueError(f"conv_tc {gemm}: no kernel of it applies a batch norm to its input, for "
                             f"the convolution {geometry}")
        p = plan(gemm, geometry, TF32, windows=windows)
        return p._replace(kernel=p.kernel[:-1] + ", true>")
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if not supports(c, o, kind):
        raise ValueError(f"the {kind.family} convolutions need channel counts that are multiples of {kind.chunk}, "
                         f"not C = {c}, O = {o}")
    bf16, aligned = kind is BF16, c % 32 == 0 and o % 32 == 0 and kh * kw <= MAX_ALIGNED_TAPS
    tf32_aligned = c % BK == 0 and o % BK == 0 and kh * kw <= MAX_ALIGNED_TAPS   # TF32's copies of a 16-k stage
    if gemm == "forward":
        rows, columns, k, phases = n * oh * ow, o, kh * kw * c, 1
    elif gemm == "dgrad":   # one GEMM per stride phase of the input cells, sized for the largest
        rows, columns, k, phases = n * cdiv(h, sh) * cdiv(wd, sw), c, cdiv(kh, sh) * cdiv(kw, sw) * o, sh * sw
    else:
        rows, columns, k, phases = kh * kw * c, o, n * oh * ow, 1
    if gemm == "dgrad" and kind is TF32 and phase_windows(geometry):
        return Plan(PHASE_KERNEL, (cdiv(n * oh * ow, PHASE_ROWS), 1, phases), k, 1, 1, kind.family)
    if gemm != "wgrad" and halo(geometry, gemm, columns, kind):
        return Plan(f"{kind.family}_{gemm}_halo<{kind.halo}>", (cdiv(rows, HALO_ROWS), cdiv(columns, 64), 1), k, 1, 1,
                    kind.family)
    if gemm == "wgrad" and windows and wgrad_halo(geometry, kind):
        grid, halo_ = (c // WGRAD_HALO_CHANNELS, cdiv(o, 64)), WGRAD_HALO[kind.family]
        parts, chunk = splits(k, grid[0] * grid[1], halo_.pixels, WGRAD_HALO_SPLIT_TARGET, WGRAD_HALO_MIN_SPLIT_K)
        return Plan(halo_.kernel, grid + (parts,), chunk, parts, group_size(parts), kind.family)
    if gemm == "wgrad":
        square_align = square_wgrad_align(c, o, kh * kw)
        tile = choose_bf16_tile(columns, aligned) if bf16 else choose_wgrad_tile(columns, square_align)
        target, min_split = (BF16_WGRAD_SPLIT_TARGET, BF16_WGRAD_MIN_SPLIT_K) if bf16 else \
            (WGRAD_SPLIT_TARGET[tile], WGRAD_MIN_SPLIT_K)
    else:
        tile = choose_bf16_tile(columns, aligned) if bf16 else choose_tile(rows, columns, tf32_aligned)
        target, min_split = (BF16_SPLIT_TARGET, BF16_MIN_SPLIT_K) if bf16 else (SPLIT_TARGET, MIN_SPLIT_K)
    bm, bn, bk = kind.tile(tile)
    align = bk if c % bk == 0 and o % bk == 0 and kh * kw <= MAX_ALIGNED_TAPS else kind.chunk
    if gemm == "wgrad" and tile == "Tc128x128":
        align = square_align
    grid = (cdiv(rows, bm), cdiv(columns, bn))
    parts, chunk = splits(k, grid[0] * grid[1] * phases, bk, target, min_split)
    return Plan(kind.kernel(gemm, tile, align), grid + (phases * parts,), chunk, parts, group_size(parts), kind.family)


def projection(geometry):
    """Whether TF32's backward of this convolution may run its one-kernel projection backward
    (projection_backward): 1x1, padding 0, PROJECTION_CHANNELS input and PROJECTION_OUTPUTS output channels."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    return (kh, kw, ph, pw, c, o) == (1, 1, 0, 0, PROJECTION_CHANNELS, PROJECTION_OUTPUTS)


def projection_plan(geometry, add=False):
    """The Plan of projection_backward: a block of PROJECTION_CELLS output cells a part of backward-weight's
    split k; add: dx added to what the array holds."""
    n, oh, ow = geometry[0], geometry[11], geometry[12]
    parts = cdiv(n * oh * ow, PROJECTION_CELLS)
    return Plan(PROJECTION_KERNELS[int(add)], (parts, 1, 1), PROJECTION_CELLS, parts, group_size(parts), "conv_tc")


def projection_backward(be, dy, x, w_krsc, geometry, dw, db, into=None, w_tf32=False):
    """dx (N, H, W, C) and dw (O, C, 1, 1 float32: C-contiguous or channels-last, the same memory) and, unless
    db is None, the bias gradient (dy summed per channel, as given) into db (O,), of a convolution that
    `projection` takes, in one launch: dy (N, OH, OW, O), x (N, H, W, C), w_krsc (O, 1, 1, C). dx added to `into`
    (a C-contiguous (N, H, W, C) float32 array), in place, when given. dy holds TF32 values (as a batch norm's
    backward makes it: the kernel sums the bias gradient from what its GEMMs read); w_tf32: as backward_data's."""
    if not projection(geometry):
        raise ValueError(f"conv_tc projection_backward: not a 1x1, padding-0 convolution of {PROJECTION_CHANNELS} "
                         f"input and {PROJECTION_OUTPUTS} output channels: {geometry}")
    n, c, h, wd, o = geometry[:5]
    oh, ow = geometry[11:]
    p = projection_plan(geometry, into is not None)
    dy, x, w_krsc = aligned(dy), aligned(x), aligned(tf32_values(be, w_krsc, w_tf32))
    dx = be.xp.empty((n, h, wd, c), np.float32) if into is None else into
    partial, db_partial = (be.xp.empty((partial_slots(p), size), np.float32) if p.splits > 1 and out is not None
                           else None for size, out in ((o * c, dw), (o, db)))
    launch(be, p.family, p.kernel, p.grid,
           (dy, x, w_krsc, dx, memory(dw), db, partial, db_partial,
            be.counters(_groups(p) + 1), *geometry, p.group, *fast_divmod(oh * ow), *fast_divmod(ow)),
           block=(threads(p.kernel),), shared_mem=dynamic_shared(p.kernel))
    return dx


def phase_windows(geometry):
    """Whether TF32's backward-data of this convolution runs its four stride phases from windows of dy
    (PHASE_KERNEL): 3x3, stride 2, padding 1, H and W even (each phase's cells are dy's pixels), at most 64
    input channels (one tile of columns), channel counts multiples of BK, the window of a block's PHASE_ROWS
    cells within PHASE_SLOTS slots (rows of OW + 2, as the halo kernels'), and grid enough that the other
    kernel would not split k."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    return (kh, kw, sh, sw, ph, pw) == (3, 3, 2, 2, 1, 1) and h % 2 == 0 and wd % 2 == 0 and c <= 64 and \
        c % BK == 0 and o % BK == 0 and window_rows(PHASE_ROWS, oh, ow) * (ow + 2) <= PHASE_SLOTS and \
        4 * cdiv(n * oh * ow, PHASE_ROWS) >= SPLIT_TARGET


def halo(geometry, gemm, columns, kind):
    """Whether a GEMM ("forward" or "dgrad") of `kind` runs its halo kernel (conv_tc.cu's, conv_bf16.cu's):
    a 3x3 convolution of stride 1 and padding 1, 64 columns or fewer, channels multiples of the window's
    (kind.halo_channels) where its window is read (x's, or dy's), the window of a block's 128 pixels within
    HALO_SLOTS slots (rows of W + 2: those the pixels span, a row above and below, two of padding at each
    image boundary), and grid enough that the other kernels would not split k."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if (kh, kw, sh, sw, ph, pw) != (3, 3, 1, 1, 1, 1) or columns > 64 or \
            (c if gemm == "forward" else o) % kind.halo_channels:
        return False
    return window_rows(HALO_ROWS, h, wd) * (wd + 2) <= HALO_SLOTS and \
        cdiv(n * h * wd, HALO_ROWS) * cdiv(columns, 64) >= (BF16_SPLIT_TARGET if kind is BF16 else SPLIT_TARGET)


def wgrad_halo(geometry, kind):
    """Whether a backward-weight of `kind` runs its halo kernel (WGRAD_HALO): a 3x3 convolution of stride 1 and
    padding 1, 64 output channels or fewer (above 64 the 128 x 128 tile reads 64 FLOPs a byte already in BF16,
    32 in TF32), input channels a multiple of WGRAD_HALO_CHANNELS (a block's), and the window of a stage's pixels
    within the kernel's slots."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    halo_ = WGRAD_HALO[kind.family]
    return (kh, kw, sh, sw, ph, pw) == (3, 3, 1, 1, 1, 1) and o <= 64 and c % WGRAD_HALO_CHANNELS == 0 and \
        window_rows(halo_.pixels, h, wd) * (wd + 2) <= halo_.slots


def window_rows(pixels, h, wd):
    """The most padded rows (of W + 2 slots) of the window of `pixels` consecutive output pixels of a 3x3,
    stride-1 convolution of H x W images: those the pixels span, a row above and below, two of padding
    at each image boundary they cross (tc_conv.cuh's halo_load_window)."""
    return (pixels - 1) // wd + 2 + 2 + 2 * ((pixels - 1) // (h * wd) + 1)


def splits(k, blocks, bk, target, min_split):
    """(parts, k per part) for a GEMM of `blocks` blocks summing over `k` in stages of `bk`: a grid of
    fewer than `target` blocks splits its k into parts of at least `min_split` (whole stages) until it
    has that many blocks, or parts that short. From the shapes alone, so that every run adds the same
    partials."""
    parts = 1 if blocks >= target else max(1, min(cdiv(target, blocks), k // min_split))
    chunk = max(bk, k // parts // bk * bk) if parts > 1 else cdiv(max(k, 1), bk) * bk
    return cdiv(max(k, 1), chunk), chunk


def group_size(parts):
    """The parts per group of a split k's two-level sum: all of them up to ONE_LEVEL_PARTS, else
    about sqrt(parts), which balances the two levels."""
    return parts if parts <= ONE_LEVEL_PARTS else math.isqrt(parts - 1) + 1


class Statistics(typing.NamedTuple):
    """What a forward computes for the training batch norm that follows it, in its epilogue
    (tc_conv.cuh's tc_batch_stats): the batch's mean and invstd of each output channel, with the
    norm's eps, and the running pair (running_mean, running_var, float32, moved in place with
    `momentum`; (None, None): none)."""
    eps: float
    running: tuple
    momentum: float


def forward(be, x, w_krsc, b, geometry, statistics=None, fold=None, w_tf32=False):
    """y (N, OH, OW, O) = conv(x (N, H, W, C), w_krsc (O, KH, KW, C)) + b (may be None), y of x's dtype;
    with `statistics` (Statistics), (y, mean, invstd): y's batch statistics per channel, from the
    kernel's epilogue. With `fold` = (gamma, beta, mean, invstd) (float32 (C,), TF32 where `folds`), the
    convolution of relu(the batch norm of x with them), applied as x is loaded. w_tf32: float32 w_krsc
    holds TF32 values already (see tf32_values)."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    kind = kind_of(x.dtype)
    if conv_sm90.chosen(be, geometry):   # Hopper's, the statistics over its tiles' boxes
        p = conv_sm90.plan(geometry, dtype=x.dtype)
        stats, mean, invstd = statistics_arguments(be, statistics, p.boxes, p.filter_tiles, o, n * oh * ow)
        y = conv_sm90.forward(be, x, tf32_values(be, w_krsc, w_tf32), b, geometry, stats=stats, fold=fold)
        return y if statistics is None else (y, mean, invstd)
    p = plan("forward", geometry, kind, fold=fold is not None)
    x, w_krsc = aligned(x), aligned(tf32_values(be, w_krsc, w_tf32))
    y = be.xp.empty((n, oh, ow, o), x.dtype)
    # the statistics' counters follow the split's in the backend's set
    stats, mean, invstd = statistics_arguments(be, statistics, p.grid[0], p.grid[1], o, n * oh * ow, _counters(p))
    _launch(be, p, (x, w_krsc, b), y, geometry, tail=stats + (fold_arguments(be, fold) if kind is TF32 else ()))
    return y if statistics is None else (y, mean, invstd)


def fold_arguments(be, fold):
    """conv_tc.cu's TC_FOLD_PARAMS of a batch norm's (gamma, beta, mean, invstd) (None: nulls): the NaN that
    the padding is copied from and the four arrays, 16-byte aligned (each thread loads 4 channels at once)."""
    if fold is None:
        return (None,) * 5
    gamma, beta, mean, invstd = (aligned(a) for a in fold)
    return be.nan_chunk(), mean, invstd, gamma, beta


def statistics_arguments(be, statistics, tiles, channel_tiles, channels, values, offset=0):
    """(BN_STATS_PARAMS, mean, invstd) of a forward that computes `statistics` (Statistics; None: the
    parameters that ask for none, and no arrays) for `channels` channels of `values` values each, in
    `tiles` tiles along the values by `channel_tiles` along the channels (bn_stats.cuh): the tiles'
    moments, their counters (which follow the first `offset` of the backend's set), the group of the
    two-level merge, the new mean and invstd, the running pair, eps, momentum and the correction of the
    running variance."""
    if statistics is None:
        return NO_STATISTICS, None, None
    mean, invstd = be.xp.empty((2, channels), np.float32)
    correction = values / (values - 1) if values > 1 else 1.0
    return (*tile_merge_arguments(be, tiles, channel_tiles, channels, offset), mean, invstd,
            *statistics.running, float(statistics.eps), float(statistics.momentum),
            float(correction)), mean, invstd


def tile_merge_arguments(be, tiles, channel_tiles, channels, offset):
    """(partial, counters, group) of per-channel values merged across `tiles` tiles (bn_stats.cuh's
    bn_tile_merge), for `channel_tiles` tiles of `channels`: the slots of each tile and group, their
    counters (after the first `offset` of the backend's set) and the tiles per group."""
    group = group_size(tiles)
    groups = cdiv(tiles, group)
    slots = tiles + (groups if groups > 1 else 0)
    return (be.xp.empty((slots, 2, channels), np.float32), be.counters(offset + channel_tiles * (groups + 1))[offset:],
            group)


def backward_data(be, dy, w_krsc, geometry, into=None, norm=None, sums=None, w_tf32=False, dy_tf32=False):
    """dx (N, H, W, C), of dy's dtype, from dy (N, OH, OW, O) and w_krsc (O, KH, KW, C); added to
    `into` (a C-contiguous (N, H, W, C) array of that dtype), in place, when given. With `norm` = (y, x,
    mean, invstd, gamma, beta), the batch norm (with its relu or residual join) whose output is this
    convolution's input (y and x C-contiguous (N, H, W, C) arrays of dx's dtype; y None and its relu's mask
    recomputed from x where gamma and beta are given), also that norm's backward sums of dx, into `sums` =
    (dgamma, dbeta), float32 (C,): sum(g * xhat) and sum(g), g = dx (after the add into `into`) where
    y > 0, from the kernel's epilogue, over the tiles of every stride phase. w_tf32: as forward's; dy_tf32:
    float32 dy holds TF32 values already (see tf32_values)."""
    n, c, h, wd = geometry[:4]
    if conv_sm90.chosen_dgrad(be, geometry):   # Hopper's, the sums over its tiles' boxes
        p = conv_sm90.dgrad_plan(geometry, dy.dtype)
        tail = NO_SUMS if norm is None else (*norm, *tile_merge_arguments(be, p.boxes * p.phases, p.filter_tiles, c,
                                                                          0), *sums)
        return conv_sm90.backward_data(be, tf32_values(be, dy, dy_tf32), tf32_values(be, w_krsc, w_tf32), geometry,
                                       into, sums=tail)
    p = plan("dgrad", geometry, kind_of(dy.dtype))
    dy, w_krsc = aligned(tf32_values(be, dy, dy_tf32)), aligned(tf32_values(be, w_krsc, w_tf32))
    if p.kernel in (f"conv_tc_dgrad_halo<{TF32.halo}>", PHASE_KERNEL):
        w_krsc = mirrored_weights(be, w_krsc, geometry[4], c)
    dx = be.xp.empty((n, h, wd, c), dy.dtype) if into is None else into
    if norm is None:
        _launch(be, p, (dy, w_krsc), dx, geometry, (int(into is not None),), tail=NO_SUMS)
        return dx
    phases = geometry[7] * geometry[8]
    tail = (*norm, *tile_merge_arguments(be, p.grid[0] * phases, p.grid[1], c, _counters(p)), *sums)
    _launch(be, p, (dy, w_krsc), dx, geometry, (int(into is not None),), tail=tail)
    return dx


def tf32_values(be, a, rounded):
    """What TF32's GEMMs read for the weights, and backward-data for dy: they read them as they are, TF32
    values (tf32.cuh's tf32_value), as a flat buffer's TF32 copy of the weights holds them (nn.modules.
    FlatParameters, kept by the optimizer's update) and a batch norm's backward makes dy (round_tf32):
    `rounded`; others are rounded by a launch of round_tf32 first. BF16's operands as they are."""
    return a if rounded or a.dtype != np.float32 else round_tf32(be, a)


def mirrored_weights(be, w_krsc, o, c):
    """The weights (O, 3, 3, C) of a 3x3 convolution as TF32's halo backward-data reads them, (C, 3, 3, O)
    [ci][tap][co] = w_krsc[co][8 - tap][ci] (conv_geometry.cuh's mirrored_weights)."""
    out = be.xp.empty((c, 3, 3, o), np.float32)
    launch(be, "conv_tc", "mirrored_weights<float>", (cdiv(out.size, 256),), (w_krsc, out, o, 9, c), block=(256,))
    return out


def backward_weight(be, dy, x, geometry, dw, db, fold=None, dy_tf32=False, raw=None):
    """dw (float32) from dy (N, OH, OW, O) and x (N, H, W, C), into `dw` (O, C, KH, KW): C-contiguous, or
    channels-last (O, KH, KW, C memory); and the bias gradient, dy summed per channel, into `db`
    (O,) unless it is None; at any alignment (the kernel stores single floats). `fold`: x is a batch
    norm's input, as forward's. dy_tf32: as backward_data's; raw: the dy that dy's TF32 values were rounded
    from (conv2d_backward's, rounded once for both GEMMs), whose sums the bias gradient is (default: dy)."""
    kind = kind_of(dy.dtype)
    # TF32's GEMM reads TF32 values; its bias gradient is the sum of dy as given (raw, or dy): the halo kernel sums
    # what the GEMM reads, conv_tc_wgrad's blocks that sum it read the given dy, which they round as it lands
    as_read = kind is BF16 or db is None or dy_tf32 and (raw is None or raw is dy)
    dy, x = aligned(dy), aligned(x)
    p = plan("wgrad", geometry, kind, fold=fold is not None, windows=as_read)
    inputs = (dy, x)
    if kind is TF32:
        read = tf32_values(be, dy, dy_tf32)
        halo_ = p.kernel.startswith(WGRAD_HALO["conv_tc"].kernel[:-1])
        inputs = (read, x) if halo_ else (read, dy if raw is None else aligned(raw), x)
    o = geometry[4]
    partial = be.xp.empty((partial_slots(p), o), np.float32) if p.splits > 1 and db is not None else None
    oh, ow = geometry[11:]
    _launch(be, p, inputs, memory(dw), geometry, (int(is_channels_last(dw)), db), (partial,),
            (*fast_divmod(oh * ow), *fast_divmod(ow), *(fold_arguments(be, fold) if kind is TF32 else ())))
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


def _counters(p):
    """The counters of a Plan's tiles (see tc_finish): per tile, its groups' and its own."""
    return p.grid[0] * p.grid[1] * (p.grid[2] // p.splits) * (_groups(p) + 1)


def _launch(be, p, inputs, out, geometry, extra=(), partials=(), tail=()):
    """Launch the Plan on `inputs` into `out`, then the kernel's `extra` arguments, the partial
    output of each part of a split k, the kernel's other `partials`, the counters of its tiles
    (see conv_tc.cu's tc_finish), the geometry, the k per part and the parts per group, and the
    kernel's `tail` arguments."""
    partial = be.xp.empty((partial_slots(p), out.size), np.float32) if p.splits > 1 else None
    kernel = for_device(be, p.kernel)
    launch(be, p.family, kernel, p.grid,
           (*inputs, out, *extra, partial, *partials, be.counters(_counters(p)), *geometry, p.chunk, p.group, *tail),
           block=(threads(kernel),), shared_mem=dynamic_shared(kernel))


def for_device(be, kernel):
    """The kernel that runs `kernel` (a name expression) on the current GPU (for_shared_memory of its SM's)."""
    return for_shared_memory(kernel, device_property(be, "sharedMemPerMultiprocessor"))


def for_shared_memory(kernel, shared):
    """The kernel that runs `kernel` (a name expression) on an SM of `shared` bytes of shared memory (None: none, the
    emulator's own backend): TF32's 128 x 128 tile's with a ring of 2 stages (RING2) under SQUARE_RING_SM bytes, else
    `kernel`."""
    if tile_of(kernel) == "Tc128x128" and shared is not None and shared < SQUARE_RING_SM:
        return kernel.replace("Tc128x128", RING2, 1)
    return kernel


def dynamic_shared(kernel):
    """The bytes of dynamic shared memory a block of `kernel` (a name expression) asks for: a halo
    backward-weight's (WGRAD_HALO), with or without the norm applied, the projection backward's
    (PROJECTION_SHARED), the stride-2 backward-data's from windows (PHASE_SHARED), a TF32 GEMM's ring of
    stages past STATIC_RING bytes (ring_bytes); 0 for the others (static alone)."""
    if kernel.partition("<")[0] in GEMMS and ring_bytes(kernel) > STATIC_RING:
        return ring_bytes(kernel)
    if kernel in PROJECTION_KERNELS:
        return PROJECTION_SHARED
    if kernel == PHASE_KERNEL:
        return PHASE_SHARED
    return next((halo_.dynamic_shared for halo_ in WGRAD_HALO.values() if kernel.startswith(halo_.kernel[:-1])), 0)


def ring_bytes(kernel):
    """The bytes of the ring of stages (conv_tc.cu's TcStages) of TF32's GEMM `kernel` (a name expression of
    GEMMS): STAGES[tile] stages of A and of B, each a stage of BK k of its rows (m or n): [rows][BK + 4] floats
    where its rows run along k (the forward's two, backward-data's A), else [BK][rows + 8]."""
    gemm, tile = kernel.partition("<")[0].removeprefix("conv_tc_"), tile_of(kernel)
    rows, columns, bk = TF32.tile(tile)
    a_k_major, b_k_major = {"forward": (True, True), "dgrad": (True, False), "wgrad": (False, False)}[gemm]
    stage = [width * (bk + 4) if k_major else bk * (width + 8)
             for width, k_major in ((rows, a_k_major), (columns, b_k_major))]
    return STAGES[tile] * sum(stage) * 4
