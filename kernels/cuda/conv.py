"""The convolution ops. Under the tf32 and bf16 precisions (kernels.precision(); tf32 the default)
the network's activations are channels-last (NCHW views of NHWC memory): the convolutions whose
channel counts the tensor cores take (conv_tc.supports) run the GEMMs of conv_tc.cu (TF32) or
conv_bf16.cu (BF16); on a GPU of compute capability 9.0, those of stride 1 or 2 whose channel counts are multiples
of 64 conv_sm90.cu's (forward, backward-data, and backward-weight where the weights are channels-last; under TF32 a
norm applied as x loads too, in the forward and backward-weight); the others (ResNet-18's stem) conv.cu's FP32
kernels, which read x, dy and w in
whichever layout they come, write dw in its own and y and dx channels-last alike, so that nothing
copies. Under bf16 the activations, their gradients and the weights the products read are bfloat16
(kernels.storage_dtype(); a float32 one is rounded first, as autocast casts a convolution's inputs),
y and dx bfloat16 too, dw and db float32; conv.cu's kernels take that storage as well, computing in
float32. Under fp32, conv.cu's kernels on NCHW float32 arrays (copied if need be: the flat buffer's
channels-last weights are), NCHW out, dw in the layout it is given. conv.cu's launchers: forward,
backward-data and backward-weight (with the bias gradient) as FP32 implicit GEMMs (see the header
of conv.cu)."""
import numpy as np

import kernels
from kernels.cpu._util import output_size, pair

from . import conv_sm90, conv_tc
from .batchnorm import apply, backward_sums, relu_output, running_pair, sums_outputs
from .launch import STORAGE_TYPES, cdiv, dense, float32, gradient_outputs, in_place, is_channels_last, launch, \
    split, storage_argument, sum_partials

OPS = ("conv2d_forward", "conv2d_backward", "conv2d_folds", "conv2d_tf32")

# BM = BN of each tile of common.cuh; the kernel sizes with their own instantiation, (0, 0)
# being the one that takes any size at run time. On bfloat16 storage (the stem of the bf16 precision,
# and the convolutions whose channel counts the BF16 tensor cores do not take, at small widths) the
# small tile alone, and the stem's size.
TILES = {"Tile64": 64, "Tile128": 128}
SIZES = ((3, 3), (1, 1), (0, 0))
BF16_SIZES = ((3, 3), (0, 0))
GEMMS = ("conv2d_forward", "conv2d_dgrad", "conv2d_wgrad")
# The large tile does 4x the work per block: worth it only while the grid stays large.
LARGE_TILE_MIN_BLOCKS = 256


def _gemm(kernel, tile, kh, kw, storage="float"):
    return f"{kernel}<{tile}, {kh}, {kw}{storage_argument(storage)}>"


KERNELS = tuple(_gemm(k, t, *s, storage) for storage, tiles, sizes in (("float", TILES, SIZES),
                                                                      ("bf16", ("Tile64",), BF16_SIZES))
                for k in GEMMS for t in tiles for s in sizes) + tuple(
    f"conv2d_dgrad_strided<{t}>" for t in TILES) + ("conv2d_dgrad_strided<Tile64, bf16>",) + tuple(
    f"conv2d_wgrad_one_channel<3, 3{storage_argument(storage)}>" for storage in STORAGE_TYPES.values())
# Backward-weight of a 3x3 convolution of one input channel (the stem) on channels-last dy, as a reduction
# (conv2d_wgrad_one_channel): blocks of ONE_CHANNEL_PIXELS pixels (392 at batch 256, three waves of an H200's 132
# SMs, each reading 64 KB of dy), for output channels that divide 256 (the block's threads).
ONE_CHANNEL_PIXELS = 512


def choose_tile(rows, columns, dtype):
    """The tile for a (rows x columns) output of `dtype`: Tile128 when both sides fill it and the grid
    keeps at least LARGE_TILE_MIN_BLOCKS blocks (float32); else Tile64."""
    large = cdiv(rows, 128) * cdiv(columns, 128)
    return "Tile128" if min(rows, columns) >= 128 and large >= LARGE_TILE_MIN_BLOCKS and dtype == np.float32 \
        else "Tile64"


def conv2d_forward(be, x, w, b, stride, padding, *, statistics=None, normalize=None, w_tf32=False):
    """See kernels/cpu/conv.py. The statistics of a training batch norm that follows (statistics =
    (eps, running, momentum)) come from the forward kernel's epilogue (bn_stats.cuh), the tensor-core
    GEMMs' (conv_tc.forward) and conv.cu's alike. A batch norm before (normalize) is applied as the
    TF32 GEMM loads x where it can (conv_tc.folds), else by batch_norm_apply first. w_tf32: w holds TF32
    values, which the TF32 GEMMs read as they are (else they read it rounded: conv_tc.tf32_values)."""
    op = "conv2d_forward"
    x, w = _operands(be, op, x, w)
    (b,) = float32(be, op, b)
    geometry = _geometry(x, w, stride, padding, b)
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if statistics is not None:
        eps, running, momentum = statistics
        statistics = conv_tc.Statistics(eps, running_pair(be, op, running, o), momentum)
    x, fold = _normalized(be, op, x, normalize, "forward", geometry)
    kind = _tensor_cores(c, o)
    if kind:
        out = conv_tc.forward(be, nhwc(be, x), nhwc(be, w), b, geometry, statistics, fold, w_tf32)
        y, stats = (out, ()) if statistics is None else (out[0], out[1:])
        y = y.transpose(0, 3, 1, 2)
    else:
        y = _empty(be, (n, o, oh, ow), kernels.channels_last(), x.dtype)
        tile = choose_tile(o, n * oh * ow, x.dtype)
        grid = (cdiv(n * oh * ow, TILES[tile]), cdiv(o, TILES[tile]))
        arguments, *stats = conv_tc.statistics_arguments(be, statistics, *grid, o, n * oh * ow)
        launch(be, "conv", _kernel("conv2d_forward", tile, kh, kw, x), grid,
               (x, w, b, y, *geometry, *_layouts(x, w, y), *arguments))
    return y if statistics is None else (y, *stats)


def conv2d_folds(be, x, w, stride, padding):
    """See kernels/cpu/conv.py: under tf32, x channels-last and the convolution one whose forward and
    backward-weight have kernels that apply the norm (conv_tc.folds)."""
    geometry = _geometry(x, w, stride, padding)
    return _folds(x, "forward", geometry) and _folds(x, "wgrad", geometry)


def conv2d_tf32(be, w):
    """See kernels/cpu/conv.py: under tf32, channel counts that conv_tc's GEMMs take (multiples of 4); the
    others (the stem's one input channel) run conv.cu's FP32 kernels."""
    return _tensor_cores(w.shape[1], w.shape[0]) is conv_tc.TF32


def _folds(x, gemm, geometry):
    return kernels.precision() == "tf32" and _tensor_cores(geometry[1], geometry[4]) is conv_tc.TF32 and \
        x.dtype == np.float32 and is_channels_last(x) and conv_tc.folds(gemm, geometry)


def _normalized(be, op, x, normalize, gemm, geometry):
    """(x, fold): where a batch norm (normalize = (gamma, beta, mean, invstd), see kernels/cpu/conv.py) comes
    before the convolution, x and the norm for TF32's `gemm` to apply as it loads x (conv_tc.folds: x
    channels-last), else relu(the norm of x) computed (batch_norm_apply) and no fold; x and None without one."""
    if normalize is None:
        return x, None
    fold = float32(be, op, *normalize)
    if _folds(x, gemm, geometry):
        return x, fold
    return apply(be, x, *fold, relu=True), None


def conv2d_backward(be, dy, x, w, stride, padding, *, need_dx=True, out=None, add_dx_to=None, norm=None,
                    norm_out=None, normalize=None, w_tf32=False, dy_tf32=False):
    """See kernels/cpu/conv.py: dx (None unless need_dx), dw and db, written into out = (dw, db)
    (float32, the parameters' gradients, say) when given; a new dw takes w's layout. dx is added
    to add_dx_to in place (in the tensor-core backward-data kernel's epilogue) when it is given.
    With `norm` = (y, x, mean, invstd, gamma, beta) (gamma and beta None but for a relu alone, whose mask
    the epilogue then recomputes from x), the batch norm's backward sums of dx (after the add, when
    add_dx_to is given) as well (into norm_out), from the tensor-core backward-data's epilogue
    (channels-last y and x, dx added in place there), else from batchnorm.py's pass over dx. normalize: as
    conv2d_forward's, for backward-weight (backward-data does not read x). w_tf32: as conv2d_forward's;
    dy_tf32: dy holds TF32 values, which the TF32 GEMMs read as they are (else they read dy rounded by a launch
    of its own, conv_tc.tf32_values, and the bias gradient sums dy as given)."""
    if norm is not None and not need_dx:
        raise ValueError("conv2d_backward: a batch norm's sums (norm) need dx (need_dx)")
    sums = None if norm is None else sums_outputs(be, "conv2d_backward", norm_out, x.shape[1])
    dy, x, w = _operands(be, "conv2d_backward", dy, x, w)
    geometry = _geometry(x, w, stride, padding)
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if dy.shape != (n, o, oh, ow):
        raise ValueError(f"conv2d dy shape {dy.shape} does not match the forward output {(n, o, oh, ow)}")
    x, fold = _normalized(be, "conv2d_backward", x, normalize, "wgrad", geometry)
    dw, db = gradient_outputs(be, "conv2d_backward", out, (w.shape, w.shape[:1]))
    dw = _empty(be, w.shape, is_channels_last(w), np.float32) if dw is None else dw
    db = be.xp.empty((o,), np.float32) if db is None else db
    if add_dx_to is not None:
        in_place(be, "conv2d_backward", add_dx_to, dtype=dy.dtype)
        if add_dx_to.shape != x.shape or add_dx_to.dtype != dy.dtype:
            raise ValueError(f"conv2d_backward: add_dx_to is {add_dx_to.dtype} {add_dx_to.shape}, dx "
                             f"{dy.dtype} {x.shape}")
    epilogue = None   # the norm whose sums the tensor-core backward-data's epilogue computes
    kind = _tensor_cores(c, o)
    into = None if add_dx_to is None else add_dx_to.transpose(0, 2, 3, 1)   # its memory, if that is NHWC
    if kind is conv_tc.TF32 and need_dx and dy_tf32 and norm is None and fold is None and \
            conv_tc.projection(geometry) and (into is None or into.flags.c_contiguous):   # one read of dy for dx and dw
        dx = conv_tc.projection_backward(be, nhwc(be, dy), nhwc(be, x), nhwc(be, w), geometry, dw, db, into,
                                         w_tf32=w_tf32).transpose(0, 3, 1, 2)
        return (dx if into is None else add_dx_to), dw, db
    if kind:
        dy, x = nhwc(be, dy), nhwc(be, x)
        raw, dy = dy, conv_tc.tf32_values(be, dy, dy_tf32)   # TF32's GEMMs read it rounded: once for both
        dx = None
        if need_dx:
            if into is None or into.flags.c_contiguous:
                epilogue = _epilogue_norm(be, norm, dy.dtype)
                dx = conv_tc.backward_data(be, dy, nhwc(be, w), geometry, into, norm=epilogue, sums=sums,
                                           w_tf32=w_tf32, dy_tf32=True).transpose(0, 3, 1, 2)
                dx = dx if into is None else add_dx_to
            else:   # an NCHW add_dx_to: added by a kernel of its own
                dx = _added(be, add_dx_to, conv_tc.backward_data(be, dy, nhwc(be, w), geometry, w_tf32=w_tf32,
                                                                 dy_tf32=True).transpose(0, 3, 1, 2))
        if (kind is conv_tc.TF32 or fold is None) and conv_sm90.chosen_wgrad(be, geometry) and \
                dw.transpose(0, 2, 3, 1).flags.c_contiguous:
            # the model's channels-last weights (a 1x1 filter's are C-contiguous too); TF32's rounds dy as it lands,
            # and sums the bias of dy as given
            conv_sm90.backward_weight(be, raw, x, geometry, dw.transpose(0, 2, 3, 1), db, fold)
            grads = (dx, dw, db)
        else:
            grads = (dx, *conv_tc.backward_weight(be, dy, x, geometry, dw, db, fold, dy_tf32=True, raw=raw))
    else:
        dx = _added(be, add_dx_to, _backward_data(be, dy, w, geometry)) if need_dx else None
        grads = (dx, *_backward_weight(be, dy, x, geometry, dw, db))
    if norm is None:
        return grads
    if epilogue is None:
        y, x_norm, mean, invstd, gamma, beta = norm
        y = relu_output(be, y, dense(be, "conv2d_backward", x_norm),
                        *float32(be, "conv2d_backward", gamma, beta, mean, invstd))
        backward_sums(be, dx, y, x_norm, mean, invstd, "conv2d_backward", into=sums)
    return (*grads, *sums)


def _epilogue_norm(be, norm, dtype):
    """The NHWC memory of a batch norm's (y, x, mean, invstd, gamma, beta) (norm) for conv_tc.backward_data's
    epilogue, y None where gamma and beta are given (a relu alone, whose mask the epilogue recomputes
    from x), or None where it cannot take it: no norm, or y and x not channels-last arrays of dx's dtype
    (whose elements lie where dx's do)."""
    if norm is None:
        return None
    y, x, mean, invstd, gamma, beta = norm
    if any(a is not None and (a.dtype != dtype or not is_channels_last(a)) for a in (y, x)):
        return None
    return (None if beta is not None else y.transpose(0, 2, 3, 1), x.transpose(0, 2, 3, 1),
            *float32(be, "conv2d_backward", mean, invstd, gamma, beta))


def _tensor_cores(c, o):
    """The Kind of tensor-core GEMMs (conv_tc) that take a convolution of C and O channels under the
    current precision, or None: conv.cu's FP32 kernels then."""
    precision = kernels.precision()
    kind = {"tf32": conv_tc.TF32, "bf16": conv_tc.BF16}.get(precision)
    return kind if kind and conv_tc.supports(c, o, kind) else None


def _operands(be, op, *arrays):
    """The arrays the products read. Under tf32 dense float32 ones as they are (its kernels read NCHW
    and channels-last memory alike: no copies, so that a step is kernels only, which a graph replays on
    the emulator too); under bf16 dense bfloat16 ones, a float32 one rounded (the stem's images, a
    weight outside a flat buffer, say); under fp32 C-contiguous float32 ones (NCHW, copied if need be).
    conv.cu reads channels-last weights too, but its loads run along k, which they scatter: with them
    the forward's loads touch 2.4x the 32-byte sectors, backward-data's 1.6x (emu.traffic(), 64 and 128
    channels, 3x3), in every block that re-reads the weights, where the copy is one coalesced pass."""
    precision = kernels.precision()
    if precision == "fp32":
        return float32(be, op, *arrays)
    arrays = tuple(dense(be, op, a) for a in arrays)
    storage = kernels.storage_dtype()
    return tuple(a if a.dtype == storage else be.cast(a, storage) for a in arrays)


def _added(be, total, dx):
    """dx, or total += dx (in place, by the elementwise add) when total is given."""
    return dx if total is None else be.add(total, dx, out=total)


def _empty(be, shape, channels_last, dtype):
    """A new array of an NCHW shape: channels-last (an NCHW view of NHWC memory) or NCHW."""
    if channels_last:
        n, c, h, w = shape
        return be.xp.empty((n, h, w, c), dtype).transpose(0, 3, 1, 2)
    return be.xp.empty(shape, dtype)


def _layouts(*arrays):
    """conv.cu's layout flags of its arrays: 1 for channels-last, 0 for NCHW (C-contiguous)."""
    return tuple(int(is_channels_last(a)) for a in arrays)


def nhwc(be, x):
    """The C-contiguous NHWC array of a 4-D array: the memory of a channels-last one (or of one
    with a single channel) as it is, else a copy."""
    return be.xp.ascontiguousarray(x.transpose(0, 2, 3, 1))


def _backward_data(be, dy, w, geometry):
    """dx, of dy's dtype, channels-last or NCHW as the precision's activations are; at a stride above
    1, one GEMM per stride phase of the input cells (conv.cu)."""
    n, c, h, wd, o, kh, kw, sh, sw = geometry[:9]
    dx = _empty(be, (n, c, h, wd), kernels.channels_last(), dy.dtype)
    columns = n * cdiv(h, sh) * cdiv(wd, sw)   # of the largest phase
    tile = choose_tile(c, columns, dy.dtype)
    grid = (cdiv(columns, TILES[tile]), cdiv(c, TILES[tile]))
    if (sh, sw) == (1, 1):
        launch(be, "conv", _kernel("conv2d_dgrad", tile, kh, kw, dy), grid,
               (dy, w, dx, *geometry, *_layouts(dy, w, dx)))
    else:
        launch(be, "conv", f"conv2d_dgrad_strided<{tile}{storage_argument(STORAGE_TYPES[dy.dtype])}>", grid + (sh * sw,),
               (dy, w, dx, *geometry, *_layouts(dy, w, dx)))
    return dx


def _backward_weight(be, dy, x, geometry, dw, db):
    """(dw, db): dw into `dw` (C-contiguous or channels-last) and the bias gradient into `db`, in
    one launch, split over the N*OH*OW sum into partials (dw's in its layout) when the
    (O x C*KH*KW) grid is small, added in the same launch; a 3x3 of one input channel on channels-last dy
    (the stem under tf32 and bf16) by conv2d_wgrad_one_channel, its blocks' partials added by sum_partials."""
    n, c, h, wd, o, kh, kw, sh, sw, ph, pw, oh, ow = geometry
    if c == 1 and (kh, kw) == (3, 3) and 256 % o == 0 and is_channels_last(dy):
        blocks = cdiv(n * oh * ow, ONE_CHANNEL_PIXELS)
        partial_w, partial_b = be.xp.empty((blocks, o * kh * kw), np.float32), be.xp.empty((blocks, o), np.float32)
        launch(be, "conv", f"conv2d_wgrad_one_channel<3, 3{storage_argument(STORAGE_TYPES[dy.dtype])}>", (blocks,),
               (dy, x, partial_w, partial_b, *geometry, ONE_CHANNEL_PIXELS))
        sum_partials(be, "conv", partial_w, blocks, dw)
        sum_partials(be, "conv", partial_b, blocks, db)
        return dw, db
    columns = c * kh * kw
    tile = choose_tile(o, columns, dy.dtype)
    grid = (cdiv(columns, TILES[tile]), cdiv(o, TILES[tile]))
    splits, chunk = split(n * oh * ow, grid[0] * grid[1], multiple=16)   # whole K tiles of either tile
    partial, db_partial = ((be.xp.empty((splits, dw.size), np.float32), be.xp.empty((splits, o), np.float32))
                           if splits > 1 else (None, None))
    launch(be, "conv", _kernel("conv2d_wgrad", tile, kh, kw, dy), grid + (splits,),
           (dy, x, partial, db_partial, be.counters(grid[0] * grid[1]), dw, db, *geometry, chunk,
            *_layouts(dy, x, dw)))
    return dw, db


def _kernel(name, tile, kh, kw, storage):
    """The instantiation for this kernel size, or the run-time-size one, for the storage of the
    array `storage`."""
    sizes = SIZES if storage.dtype == np.float32 else BF16_SIZES
    return _gemm(name, tile, *((kh, kw) if (kh, kw) in sizes else (0, 0)), STORAGE_TYPES[storage.dtype])


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
