"""Hopper's bf16 convolutions (conv_sm90.cu: warpgroup MMA fed by TMA, mbarrier rings).

- On the CPU emulator, which runs sm90.cuh's instructions exactly and refuses their misuse (kernels/emu/README.md,
  "Hopper"): the forward of every stride-1 convolution of ResNet-18 (width 64) at batch 2, and odd shapes (7x7 and
  4x4 images, 1x1 filters, channels not a power of two, boxes past the images' edges, batches that do not fill a
  box), against float64 of the bfloat16 inputs within float32's rounding of the sum and one bfloat16 rounding
  (test_conv_bf16's check_products); new arrays start as NaN, so an output no one wrote fails; both thread orders.
- The plan: every box is 128 pixels, and at batch 256 no tile of ResNet-18's layers holds a row past the images.
- NVRTC compiles the family for sm_90a: its SASS holds HGMMA (warpgroup MMA) and UTMALDG (TMA loads), no spills,
  its shared memory fits a block of an H200.
- The epilogues, through conv2d's launchers (the emulator's backend taking the family where a Hopper would): the
  statistics of the batch norm that follows the forward, and the backward sums of the norm whose dy backward-data's
  dx is (after an add into a gradient, with the relu's mask recomputed), held to test_conv_statistics's checks:
  float64 of the stored output, bit for bit the launches without them, the same bits in both thread orders.
- On a simulated GPU of compute capability 9.0, the bf16 forward of such a layer runs this family (the statistics
  that follow it from its epilogue); on one of 8.0, conv_bf16.cu's.
- Marked gpu: the same references on a GPU.
"""
import numpy as np
import pytest

import kernels
import reference as R
from helpers import rng
from kernels import bfloat16, nvrtc
from kernels.cuda import conv_sm90
from test_conv_bf16 import check_products, draw
from test_conv_tc import emu, gpu_backend  # noqa: F401  (fixtures: the emu backend in each thread order, the GPU's)

pytestmark = pytest.mark.usefixtures("poisoned_empty")

# (x (N, C, H, W), w (O, C, KH, KW), padding): ResNet-18's stride-1 convolutions at width 64, batch 2
RESNET_LAYERS = [((2, 64, 28, 28), (64, 64, 3, 3), 1), ((2, 128, 14, 14), (128, 128, 3, 3), 1),
                 ((2, 256, 7, 7), (256, 256, 3, 3), 1), ((2, 512, 4, 4), (512, 512, 3, 3), 1)]
ODD = [((3, 64, 5, 9), (64, 64, 3, 3), 1),      # a batch and images no box fits
       ((1, 192, 7, 7), (128, 192, 3, 3), 1),   # channels not a power of two, the 7x7 stage
       ((5, 64, 4, 4), (192, 64, 1, 1), 0),     # a 1x1 filter, output channels 3 x 64 (the 64-column tile)
       ((2, 128, 6, 6), (64, 128, 3, 3), 0),    # no padding: the boxes start inside the image
       ((1, 64, 3, 3), (128, 64, 3, 3), 2)]     # padding beyond the filter's reach: zeros around


def geometry(x_shape, w_shape, padding, stride=1):
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    oh, ow = (h + 2 * padding - kh) // stride + 1, (w + 2 * padding - kw) // stride + 1
    return (n, c, h, w, o, kh, kw, stride, stride, padding, padding, oh, ow)


def on(be):
    """(put, get): a host array as `be`'s array, and back (the emulator's are the host's)."""
    return ((lambda a: a), np.asarray) if be.xp is np else (be.xp.asarray, be.xp.asnumpy)


def nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def check_forward(be, x_shape, w_shape, padding, bias=True, stride=1):
    put, get = on(be)
    x, w = draw(x_shape, w_shape)
    b = rng().standard_normal(w_shape[0]).astype(np.float32) if bias else None
    y = conv_sm90.forward(be, put(nhwc(x)), put(nhwc(w)), None if b is None else put(b),
                          geometry(x_shape, w_shape, padding, stride))
    name = f"conv_sm90 {x_shape} * {w_shape} padding {padding} stride {stride}"
    check_products(name, (get(y).transpose(0, 3, 1, 2),), [x, w],
                   lambda x, w, b: (R.conv2d_forward(x, w, b, stride, padding),), (np.prod(w_shape[1:]),), (True,), b)


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding", RESNET_LAYERS + ODD)
def test_forward_against_float64(emu, x_shape, w_shape, padding):
    check_forward(emu, x_shape, w_shape, padding, bias=x_shape[0] != 1)


def check_backward_data(be, x_shape, w_shape, padding, add, stride=1):
    """dx of the convolution, from conv_sm90.backward_data, against float64; `add`: into a bfloat16 gradient, in
    place, rounded once after the addition."""
    put, get = on(be)
    g = geometry(x_shape, w_shape, padding, stride)
    (w,) = draw(w_shape)
    (dy,) = draw((x_shape[0], w_shape[0], g[11], g[12]))
    into = draw(x_shape)[0] if add else None
    into_device = None if into is None else put(nhwc(into))
    dx = conv_sm90.backward_data(be, put(nhwc(dy)), put(nhwc(w)), g, into_device)
    if add:
        assert dx is into_device
    x = np.zeros(x_shape)
    name = f"conv_sm90 backward-data {x_shape} * {w_shape} padding {padding} stride {stride}" + \
        (" into a gradient" if add else "")
    check_products(name, (get(dx).transpose(0, 3, 1, 2),), [dy, w],
                   lambda dy, w, added: (R.conv2d_backward(dy, x, w, stride, padding)[0] +
                                         (0 if added is None else added),),
                   (w_shape[0] * w_shape[2] * w_shape[3],), (True,), None if into is None else into.astype(np.float32))


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding", [RESNET_LAYERS[0], RESNET_LAYERS[2], ODD[1], ODD[2], ODD[3]])
def test_backward_data_against_float64(emu, x_shape, w_shape, padding):
    check_backward_data(emu, x_shape, w_shape, padding, add=False)
    if x_shape == RESNET_LAYERS[0][0]:
        check_backward_data(emu, x_shape, w_shape, padding, add=True)


def check_backward_weight(be, x_shape, w_shape, padding, bias=True, stride=1):
    """dw (float32, channels-last weights) and the bias gradient from conv_sm90.backward_weight against float64; every
    element written (the outputs start as NaN)."""
    put, get = on(be)
    g = geometry(x_shape, w_shape, padding, stride)
    x, w = draw(x_shape, w_shape)
    (dy,) = draw((x_shape[0], w_shape[0], g[11], g[12]))
    o, c, kh, kw = w_shape
    dw = put(np.full((o, kh, kw, c), np.nan, np.float32))
    db = put(np.full(o, np.nan, np.float32)) if bias else None
    conv_sm90.backward_weight(be, put(nhwc(dy)), put(nhwc(x)), g, dw, db)
    name = f"conv_sm90 backward-weight {x_shape} * {w_shape} padding {padding} stride {stride}"
    check_products(name, (get(dw).transpose(0, 3, 1, 2),), [dy, x, w],
                   lambda dy, x, w, _: (R.conv2d_backward(dy, x, w, stride, padding)[1],), (x_shape[0] * g[11] * g[12],),
                   (False,))
    if bias:
        check_products(name + " bias", (get(db),), [dy], lambda dy, _: (dy.sum(axis=(0, 2, 3)),),
                       (x_shape[0] * g[11] * g[12],), (False,))


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding", [RESNET_LAYERS[0], RESNET_LAYERS[3], ODD[0], ODD[1], ODD[2]])
def test_backward_weight_against_float64(emu, x_shape, w_shape, padding):
    check_backward_weight(emu, x_shape, w_shape, padding, bias=x_shape != ODD[1][0])


# (x, w, padding) of stride-2 convolutions: ResNet-18's first of a stage and its projection (width 64, batch 2), odd
# images (x's pixels of the two parities unequal in number), no padding, and an image of two rows and columns
STRIDED = [((2, 64, 28, 28), (128, 64, 3, 3), 1), ((2, 64, 28, 28), (128, 64, 1, 1), 0),
           ((3, 64, 7, 9), (64, 64, 3, 3), 1), ((1, 128, 8, 8), (64, 128, 3, 3), 0), ((2, 64, 2, 2), (64, 64, 3, 3), 1)]


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding", STRIDED)
def test_stride_2_against_float64(emu, x_shape, w_shape, padding):
    """Forward and backward-weight: x's pixels of each parity a tensor map of a strided view, the taps' boxes moved in
    them (Sm90Tap). Backward-data: a GEMM a phase of dx (Sm90Phase, Sm90Taps), also added into a gradient (a phase no
    tap reaches, the projection's three, adds zeros)."""
    check_forward(emu, x_shape, w_shape, padding, bias=x_shape[0] != 1, stride=2)
    check_backward_weight(emu, x_shape, w_shape, padding, bias=x_shape[0] != 1, stride=2)
    for add in (False, True):
        check_backward_data(emu, x_shape, w_shape, padding, add, stride=2)


def check_tf32(be, x_shape, w_shape, padding, stride=1, add=False):
    """TF32 (float32 operands): the forward and backward-data against test_conv_tc's float64 references of the
    TF32-rounded and of the raw inputs, w and dy handed over as TF32 values (as the network holds them: the flat
    buffer's TF32 copy, the batch norm's backward), x raw (its stages rounded as they land); dx also added into a
    gradient (add)."""
    from test_conv_tc import check_products as check_tf32_products
    put, get = on(be)
    g = geometry(x_shape, w_shape, padding, stride)
    draw32 = rng()
    x, b = (draw32.standard_normal(shape).astype(np.float32) for shape in (x_shape, w_shape[:1]))
    w, dy = (kernels.cpu.round_tf32(draw32.standard_normal(shape).astype(np.float32))
             for shape in (w_shape, (x_shape[0], w_shape[0], g[11], g[12])))
    name = f"conv_sm90 tf32 {x_shape} * {w_shape} padding {padding} stride {stride}"
    y = conv_sm90.forward(be, put(nhwc(x)), put(nhwc(w)), put(b), g)
    check_tf32_products(name, (get(y).transpose(0, 3, 1, 2),), [x, w],
                        lambda x, w, b: (R.conv2d_forward(x, w, b, stride, padding),), (np.prod(w_shape[1:]),), b)
    held = draw32.standard_normal(x_shape).astype(np.float32) if add else None
    into = None if held is None else put(nhwc(held))
    dx = conv_sm90.backward_data(be, put(nhwc(dy)), put(nhwc(w)), g, into)
    check_tf32_products(name + " backward-data" + " into a gradient" * add, (get(dx).transpose(0, 3, 1, 2),), [dy, w],
                        lambda dy, w, added: (R.conv2d_backward(dy, np.zeros(x_shape), w, stride, padding)[0] +
                                              (0 if added is None else added),),
                        (w_shape[0] * w_shape[2] * w_shape[3],), held)
    return x, w, b, y


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding, stride", [RESNET_LAYERS[0] + (1,), ODD[0] + (1,), ODD[2] + (1,),
                                                               STRIDED[0] + (2,), STRIDED[2] + (2,)])
def test_tf32_forward_and_backward_data_against_float64(emu, x_shape, w_shape, padding, stride):
    """wgmma_tf32 (m64nNk8) on 128-byte lines of 32 float32 channels, every stride-1 and stride-2 shape kind."""
    check_tf32(emu, x_shape, w_shape, padding, stride, add=x_shape == ODD[0][0])


def folded_norm(g, x):
    """A batch norm of x's channels drawn from g, as `fold` = (gamma, beta, mean, invstd) takes it, and relu(x * scale
    + shift) (scale = gamma invstd, shift = beta - mean scale, each rounded to float32 as bn_affine's two fmaf are),
    the input a convolution that applies it as x lands multiplies (rounded to TF32); the shifts drawn so that half are
    positive, where relu(shift) would be the norm of the padding's zero."""
    c = x.shape[1]
    gamma, beta, mean = (g.standard_normal(c).astype(np.float32) for _ in range(3))
    invstd = g.uniform(0.5, 2, c).astype(np.float32)
    scale = gamma * invstd
    shift = (-mean.astype(np.float64) * scale + beta).astype(np.float32)   # one rounding, as fmaf
    normed = np.maximum((x.astype(np.float64) * scale[:, None, None] + shift[:, None, None]).astype(np.float32), 0)
    return (gamma, beta, mean, invstd), normed


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding, stride", [((2, 64, 6, 6), (64, 64, 3, 3), 1, 1),
                                                               ((3, 64, 7, 9), (128, 64, 3, 3), 1, 2)])
def test_the_tf32_forward_applies_a_batch_norm_as_x_lands(emu, x_shape, w_shape, padding, stride):
    """fold: the convolution of relu(the norm of x) (folded_norm), rounded to TF32, against test_conv_tc's references
    of that input; the padding stays 0 (x's maps fill NaN past the image, which the relu makes 0)."""
    from test_conv_tc import check_products as check_tf32_products
    g = rng()
    x = g.standard_normal(x_shape).astype(np.float32)
    w = kernels.cpu.round_tf32(g.standard_normal(w_shape).astype(np.float32))
    fold, normed = folded_norm(g, x)
    y = conv_sm90.forward(emu, nhwc(x), nhwc(w), None, geometry(x_shape, w_shape, padding, stride), fold=fold)
    check_tf32_products(f"conv_sm90 tf32 {x_shape} * {w_shape} with a norm", (y.transpose(0, 3, 1, 2),), [normed, w],
                        lambda x, w, _: (R.conv2d_forward(x, w, None, stride, padding),), (np.prod(w_shape[1:]),))


def check_tf32_backward_weight(be, x_shape, w_shape, padding, stride=1, bias=True, fold=False):
    """TF32's backward-weight (conv_sm90_wgrad_tf32: its stages transposed as they land): dw against test_conv_tc's
    float64 references of the TF32-rounded and of the raw inputs, dy and x raw (the kernel rounds both), or x the input
    of a batch norm applied as it lands (fold, folded_norm); the bias gradient the sum of dy as given (float32's
    rounding of the sum alone); every element written (the outputs start as NaN)."""
    from test_conv_tc import check_products as check_tf32_products
    put, get = on(be)
    g = geometry(x_shape, w_shape, padding, stride)
    draw32 = rng()
    x, dy = (draw32.standard_normal(shape).astype(np.float32) for shape in (x_shape, (x_shape[0], w_shape[0], g[11],
                                                                                      g[12])))
    norm, normed = folded_norm(draw32, x) if fold else (None, x)
    o, c, kh, kw = w_shape
    dw = put(np.full((o, kh, kw, c), np.nan, np.float32))
    db = put(np.full(o, np.nan, np.float32)) if bias else None
    conv_sm90.backward_weight(be, put(nhwc(dy)), put(nhwc(x)), g, dw, db,
                              None if norm is None else tuple(put(a) for a in norm))
    name = f"conv_sm90 tf32 backward-weight {x_shape} * {w_shape} padding {padding} stride {stride}" + \
        " with a norm" * fold
    pixels = x_shape[0] * g[11] * g[12]
    check_tf32_products(name, (get(dw).transpose(0, 3, 1, 2),), [dy, normed],
                        lambda dy, x, _: (R.conv2d_backward(dy, x, np.zeros(w_shape), stride, padding)[1],), (pixels,))
    if bias:
        check_products(name + " bias", (get(db),), [dy], lambda dy, _: (dy.sum(axis=(0, 2, 3)),), (pixels,), (False,))


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding, stride", [RESNET_LAYERS[0] + (1,), RESNET_LAYERS[1] + (1,),
                                                               ODD[0] + (1,), ODD[2] + (1,), STRIDED[0] + (2,),
                                                               STRIDED[2] + (2,)])
def test_tf32_backward_weight_against_float64(emu, x_shape, w_shape, padding, stride):
    """Both tiles (64 x 64, 128 x 128), boxes past the images, a 1x1 filter, stride 2 (x's parity maps)."""
    check_tf32_backward_weight(emu, x_shape, w_shape, padding, stride, bias=x_shape != ODD[2][0])


@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, padding, stride", [((2, 64, 6, 6), (64, 64, 3, 3), 1, 1),
                                                               ((3, 64, 7, 9), (128, 64, 3, 3), 1, 2)])
def test_tf32_backward_weight_applies_a_batch_norm_as_x_lands(emu, x_shape, w_shape, padding, stride):
    """fold: dw of relu(the norm of x) (folded_norm), the padding 0 (NaN filled, made 0 by the relu)."""
    check_tf32_backward_weight(emu, x_shape, w_shape, padding, stride, fold=True)


def test_tf32_backward_weight_rounds_both_operands_as_they_land():
    """The products are of dy and x rounded to TF32 (to nearest): the same dw whether dy and x hold TF32 values
    already or are rounded as they land, bit for bit; dy truncated (its low 13 bits cleared) gives other numbers."""
    be = kernels._device_backend("emu")
    x_shape, w_shape, padding = ODD[0]
    g = geometry(x_shape, w_shape, padding)
    draw32 = rng()
    x, dy = (nhwc(draw32.standard_normal(shape).astype(np.float32)) for shape in (x_shape, (3, 64, 5, 9)))
    results = []
    for dy_, x_ in ((dy, x), (kernels.cpu.round_tf32(dy), kernels.cpu.round_tf32(x)),
                    ((dy.view(np.uint32) & np.uint32(0xffffe000)).view(np.float32), x)):
        dw = np.full((64, 3, 3, 64), np.nan, np.float32)
        conv_sm90.backward_weight(be, dy_, x_, g, dw, None)
        results.append(dw)
    assert np.array_equal(results[0], results[1])
    assert not np.array_equal(results[0], results[2])


def test_the_tf32_forward_rounds_x_as_it_lands():
    """The products are of x rounded to TF32 (to nearest), as conv_tc.cu's: told that x holds TF32 values already
    (x_tf32), the same raw x gives other numbers (the tensor cores truncate what they read)."""
    be = kernels._device_backend("emu")
    x_shape, w_shape, padding = ODD[0]
    x, w, b, y = check_tf32(be, x_shape, w_shape, padding)
    truncated = conv_sm90.forward(be, nhwc(x), nhwc(w), b, geometry(x_shape, w_shape, padding), x_tf32=True)
    assert not np.array_equal(truncated.transpose(0, 3, 1, 2), y.transpose(0, 3, 1, 2))


def test_backward_weight_in_parts_adds_them_in_order(monkeypatch):
    """Many parts of few boxes (forced): the same references, the parts' partials added by sum_partials."""
    monkeypatch.setattr(conv_sm90, "WGRAD_MIN_BOXES", 1)
    assert conv_sm90.wgrad_plan(geometry(*ODD[0][:2], 1)).parts > 2
    for x_shape, w_shape, padding in RESNET_LAYERS + ODD + [((256, 64, 28, 28), (64, 64, 3, 3), 1)]:
        g = geometry(x_shape, w_shape, padding)   # every part has boxes: the kernel's blocks assume one at least
        p = conv_sm90.wgrad_plan(g)
        total = np.prod([-(-size // side) for size, side in zip((g[0], g[11], g[12]), p.box)])
        assert (p.parts - 1) * p.boxes < total <= p.parts * p.boxes, (x_shape, p)
    check_backward_weight(kernels._device_backend("emu"), *ODD[0])


@pytest.fixture
def emulated_hopper(monkeypatch):
    """The emulator's backend takes this family where a Hopper would (conv_sm90.available), through conv2d's
    launchers; returns the names of the family's launches."""
    names, launch = [], conv_sm90.launch
    monkeypatch.setattr(conv_sm90, "available", lambda be: True)
    monkeypatch.setattr(conv_sm90, "launch", lambda be, family, kernel, *a, **k: names.append(kernel) or
                        launch(be, family, kernel, *a, **k))
    return names


# (x, w, padding, stride): the forward's statistics and backward-data's sums merged across boxes, some past the images
# (their pixels counted by the boxes' own), in two levels where there are many (3 x 28 x 28: 19 boxes); at stride 2,
# backward-data's over the boxes of dx's four phases (the projection's: three no tap reaches)
EPILOGUE_SHAPES = [((2, 64, 28, 28), (64, 64, 3, 3), 1, 1), ((3, 64, 5, 9), (128, 64, 3, 3), 1, 1),
                   ((3, 64, 28, 28), (64, 64, 1, 1), 0, 1), ((3, 64, 9, 7), (64, 64, 3, 3), 1, 2),
                   ((2, 64, 8, 8), (128, 64, 1, 1), 0, 2)]


@pytest.mark.parametrize("x_shape, w_shape, padding, stride", EPILOGUE_SHAPES)
def test_batch_statistics_from_the_forwards_epilogue(emulated_hopper, x_shape, w_shape, padding, stride):
    """conv2d_forward(..., statistics=...) through this family: mean, invstd and the moved running pair against
    float64 of the stored y, y bit for bit the forward's without them, the same bits in both thread orders
    (test_conv_statistics's checks)."""
    from test_conv_statistics import check_statistics, forward_with_statistics
    from test_conv_statistics import draw as draw_far_from_zero
    with kernels.use_precision("bf16"):
        x, w, b, running = draw_far_from_zero(x_shape, w_shape)
        runs = [forward_with_statistics(order, x, w, b, running, stride, padding)
                for order in ("ascending", "descending")]
    assert emulated_hopper and all(name.startswith("conv_sm90_forward") for name in emulated_hopper), emulated_hopper
    check_statistics(f"conv_sm90 {x_shape} * {w_shape}", runs, running)


@pytest.mark.parametrize("x_shape, w_shape, padding, stride", EPILOGUE_SHAPES)
@pytest.mark.parametrize("add, relu", [(False, False), (True, False), (False, True)])
def test_batch_norm_sums_from_backward_datas_epilogue(emulated_hopper, x_shape, w_shape, padding, stride, add, relu):
    """conv2d_backward(..., norm=..., norm_out=...) through this family: the sums of the batch norm whose dy dx is,
    of dx after an add into a channels-last gradient in the epilogue (add), the relu's mask recomputed from x (relu),
    against float64; dx, dw and db bit for bit the backward's without them, the same bits in both orders
    (test_conv_statistics's checks)."""
    from test_conv_statistics import check_backward_sums
    check_backward_sums(f"conv_sm90 {x_shape} * {w_shape} stride {stride}" + " add" * add + " relu" * relu, "bf16",
                        x_shape, w_shape, stride, padding, add, relu, add_order="K")
    assert f"conv_sm90_forward<{conv_sm90.choose_tile(x_shape[1])}, {str(add).lower()}>" in emulated_hopper


def test_backward_data_needs_a_filter_that_covers_the_padding():
    assert conv_sm90.supports_dgrad(geometry((2, 64, 8, 8), (64, 64, 3, 3), 2))
    assert not conv_sm90.supports_dgrad(geometry((2, 64, 8, 8), (64, 64, 3, 3), 3))
    assert not conv_sm90.supports_dgrad(geometry((2, 64, 8, 8), (64, 64, 1, 1), 1))


def test_every_box_is_a_tile_and_resnet_wastes_no_row_at_batch_256():
    for n, size in ((256, 28), (256, 14), (256, 7), (256, 4), (2, 28), (3, 5)):
        box_i, box_h, box_w = conv_sm90.choose_box(n, size, size)
        assert box_i * box_h * box_w == conv_sm90.ROWS
        if n == 256:
            tiles = -(-n // box_i) * -(-size // box_h) * -(-size // box_w)
            assert tiles * conv_sm90.ROWS == n * size * size, (n, size, (box_i, box_h, box_w))


def test_only_what_the_family_computes_is_given_to_it():
    assert conv_sm90.supports(geometry((2, 64, 8, 8), (64, 64, 3, 3), 1))
    assert conv_sm90.supports(geometry((2, 64, 8, 8), (64, 64, 3, 3), 1, 2))
    assert not conv_sm90.supports(geometry((2, 64, 9, 9), (64, 64, 3, 3), 1, 3))   # stride 3
    assert not conv_sm90.supports((2, 64, 8, 8, 64, 3, 3, 1, 2, 1, 1, 8, 4))      # strides unequal
    assert not conv_sm90.supports(geometry((2, 64, 1, 8), (64, 64, 1, 1), 0, 2))   # no row of the odd parity
    assert conv_sm90.supports_dgrad(geometry((2, 64, 8, 8), (64, 64, 3, 3), 1, 2))
    tiles = lambda p: (p.boxes, p.filter_tiles, p.phases)   # noqa: E731
    assert tiles(conv_sm90.dgrad_plan(geometry((2, 64, 9, 7), (64, 64, 3, 3), 1, 2))) == (1, 1, 4)   # 2 x 5 x 4: a box
    assert tiles(conv_sm90.dgrad_plan(geometry((4, 64, 33, 15), (64, 64, 3, 3), 1, 2))) == (5, 1, 4)   # 4 x 17 x 8
    assert tiles(conv_sm90.dgrad_plan(geometry((4, 64, 33, 15), (64, 64, 3, 3), 1, 1)))[2] == 1
    assert not conv_sm90.supports(geometry((2, 32, 8, 8), (64, 32, 3, 3), 1))     # C not a multiple of 64
    assert not conv_sm90.supports(geometry((2, 64, 8, 8), (32, 64, 3, 3), 1))     # O not a multiple of 64
    with pytest.raises(ValueError, match="convolutions of stride 1 or 2 of bfloat16 or float32 .TF32. operands alike"):
        conv_sm90.forward(kernels._device_backend("emu"), np.zeros((1, 8, 8, 32), bfloat16),
                          np.zeros((64, 3, 3, 32), bfloat16), None, geometry((1, 32, 8, 8), (64, 32, 3, 3), 1))


@pytest.mark.nvrtc("conv_sm90")
def test_sass_holds_warpgroup_mma_and_tma_loads():
    reason = nvrtc.unavailable_reason() or nvrtc.unsupported_reason("sm_90a")
    if reason:
        pytest.skip(reason)
    if nvrtc.cuobjdump() is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    from kernels.cuda.ptxas_report import compile_family
    compiled = compile_family("conv_sm90", "sm_90")
    sass, lowered = compiled.sass(), compiled.lowered_names
    resources = compiled.named_resources()
    for kernel in (k for k in conv_sm90.KERNELS if k.startswith("conv_sm90_")):   # the GEMMs
        opcodes = {line.split()[1 if line.startswith("@") else 0].split(".")[0] for line in sass[lowered[kernel]]}
        assert {"HGMMA", "UTMALDG", "SYNCS"} <= opcodes, f"{kernel}: {sorted(opcodes)}"
        assert "HMMA" not in opcodes, kernel
        r = resources[kernel]
        assert r.spill_stores == r.spill_loads == 0, f"{kernel} spills"
        assert r.shared_bytes + conv_sm90.dynamic_shared(kernel) <= 227 * 1024, kernel


def test_a_simulated_hopper_runs_the_family_and_an_ampere_does_not(monkeypatch):
    """conv2d_forward with the statistics of the norm that follows, and conv2d_backward, of a stride-1 convolution of
    64 channels under bf16: on a simulated GPU of compute capability 9.0 through this family (forward, backward-data
    as a forward of the mirrored weights, backward-weight into the channels-last weights' gradient), on one of 8.0,
    or of 9.0 under KERNELS_HOPPER=0, through conv_bf16.cu's; the numbers the same references either way."""
    monkeypatch.setenv("KERNELS_SIMULATED_GPUS", "1")
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "memcheck")
    x, w, dy = draw((2, 64, 6, 6), (64, 64, 3, 3), (2, 64, 6, 6))
    b = rng().standard_normal(64).astype(np.float32)
    wide = [a.astype(np.float64) for a in (x, w, b, dy)]
    y_ref = R.conv2d_forward(*wide[:3], 1, 1)
    dx_ref, dw_ref, db_ref = R.conv2d_backward(wide[3], wide[0], wide[1], 1, 1)
    for capability, hopper, disabled in (("90", True, "1"), ("80", False, "1"), ("90", False, "0")):
        monkeypatch.setenv("KERNELS_SIMULATED_COMPUTE_CAPABILITY", capability)
        monkeypatch.setenv(conv_sm90.DISABLE, disabled)
        be = kernels._device_backend("cuda")
        xp = be.xp
        names = []
        device = [xp.asarray(np.ascontiguousarray(a.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2) for a in (x, w, dy)]
        with kernels.use_precision("bf16"), be.observing_launches(lambda family, name: names.append(name)):
            y, mean, invstd = be.conv2d_forward(device[0], device[1], xp.asarray(b), 1, 1,
                                                statistics=(1e-5, None, 0.1))
            dx, dw, db = be.conv2d_backward(device[2], device[0], device[1], 1, 1)
        used = {name for name in names if name.startswith(("conv_sm90", "mirrored_weights<bf16>", "conv_bf16"))}
        expected = {"conv_sm90_forward<Sm90x64, false>", "mirrored_weights<bf16>", "conv_sm90_wgrad<Sm90Wgrad64>"} \
            if hopper else set()
        assert expected <= used and (hopper or not any(n.startswith("conv_sm90") for n in used)), (capability, used)
        assert not any(name.startswith("bn_stats") for name in names), f"{capability}: the statistics from the epilogue"
        for got, ref, what in ((y, y_ref, "y"), (dx, dx_ref, "dx"), (dw, dw_ref, "dw"), (db, db_ref, "db")):
            got = xp.asnumpy(got).astype(np.float64)
            assert np.abs(got - ref).max() <= 2**-7 * np.abs(ref).max(), (capability, what)
        assert np.allclose(xp.asnumpy(mean), xp.asnumpy(y).astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-4,
                           atol=1e-5), capability


def test_a_simulated_hopper_runs_tf32s_convolutions(monkeypatch):
    """Under tf32 on a simulated GPU of compute capability 9.0: conv2d_forward of a 64-channel convolution, its
    backward-data (the weights and dy rounded to TF32 values first, as conv_tc.cu's GEMMs read them) and its
    backward-weight (dy as given: the bias gradient its sum) through this family in TF32, none through conv_tc.cu's;
    the numbers test_conv_tc's references."""
    from test_conv_tc import check_products as check_tf32_products
    monkeypatch.setenv("KERNELS_SIMULATED_GPUS", "1")
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "memcheck")
    monkeypatch.setenv("KERNELS_SIMULATED_COMPUTE_CAPABILITY", "90")
    g = rng()
    x, w, dy = (g.standard_normal(shape).astype(np.float32) for shape in ((2, 64, 6, 6), (64, 64, 3, 3), (2, 64, 6, 6)))
    be = kernels._device_backend("cuda")
    xp, names = be.xp, []
    device = [xp.asarray(np.ascontiguousarray(a.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2) for a in (x, w, dy)]
    with kernels.use_precision("tf32"), be.observing_launches(lambda family, name: names.append(name)):
        y = be.conv2d_forward(device[0], device[1], None, 1, 1)
        dx, dw, db = be.conv2d_backward(device[2], device[0], device[1], 1, 1)
    assert names.count("conv_sm90_forward<Sm90Tf32x64, false>") == 2 and "mirrored_weights<float>" in names, names
    assert "conv_sm90_wgrad_tf32<Sm90Tf32Wgrad64>" in names and not any(n.startswith("conv_tc") for n in names), names
    check_tf32_products("tf32 forward", (xp.asnumpy(y),), [x, w], lambda x, w, _: (R.conv2d_forward(x, w, None, 1, 1),),
                        (64 * 9,))
    check_tf32_products("tf32 backward", (xp.asnumpy(dx), xp.asnumpy(dw)), [dy, x, w],
                        lambda dy, x, w, _: R.conv2d_backward(dy, x, w, 1, 1)[:2], (64 * 9, 2 * 36))
    check_products("tf32 bias", (xp.asnumpy(db),), [dy], lambda dy, _: (dy.sum(axis=(0, 2, 3)),), (2 * 36,), (False,))


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_a_step_on_hoppers_kernels_replayed_as_a_graph_equals_eager_steps(monkeypatch, precision):
    """On one simulated GPU of compute capability 9.0, under the sanitizer's memcheck: a network whose convolutions of
    64 and 128 channels run this family (forward, backward-data, backward-weight; under tf32 the second of a block's
    forward and backward-weight applying the first's norm as x lands; the stem conv.cu's), trained for steps whose
    learning rate changes, eagerly and as a CUDA graph captured once and replayed: the same losses, parameters,
    momenta and statistics, bit for bit (the tensor maps are kernel arguments the capture keeps, by value)."""
    import nn
    from nn.resnet import Residual
    from parallel.comm import SingleProcess
    from parallel.ddp import DataParallel
    from test_graph import assert_same, host
    from training.step import GraphedStep, train_step
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "memcheck")
    xp = kernels.cupy_module()
    g, steps, batch = np.random.default_rng(7), 3, 2
    images = xp.asarray(g.integers(0, 256, (steps * batch, 12, 12)).astype(np.uint8))
    labels = xp.asarray(g.integers(0, 10, steps * batch).astype(np.int32))
    order = xp.asarray(g.permutation(steps * batch))
    launched = []
    results = []
    with kernels.use_precision(precision):
        be = kernels._device_backend("cuda")
        for graphed in (False, True):
            nn.manual_seed(5)
            model = nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), Residual(64, 64),
                                  Residual(64, 128, use_1x1conv=True, stride=2), nn.AdaptiveAvgPool2d((1, 1)),
                                  nn.Flatten(), nn.Linear(128, 10)).to("cuda")
            opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
            ddp, schedule = DataParallel(model, SingleProcess()), nn.CosineAnnealingLR(opt, steps)
            step = GraphedStep(model, opt, ddp, images, labels, batch, warn=pytest.fail) if graphed else \
                (lambda idx: train_step(model, opt, ddp, images, labels, idx))
            outputs = []
            with be.observing_launches(lambda family, name: launched.append((family, name))):
                for i in range(steps):
                    opt.lr = schedule.lr_at(i)
                    outputs.append(tuple(float(host(v)) for v in step(ddp.scatter(order[i * batch:(i + 1) * batch]))))
            state = [host(opt.flat.data), host(opt.velocity)] + [host(b) for _, b in model.named_buffers()]
            results.append((outputs, state, step))
    families = [family for family, _ in launched]
    assert families.count("conv_sm90") >= 2 * 3 * 2, "the 64- and 128-channel convolutions ran Hopper's kernels"
    assert not any(name.startswith(("conv_tc_forward", "conv_bf16_forward", "conv_tc_wgrad", "conv_bf16_wgrad"))
                   for _, name in launched), \
        "every forward and backward-weight but the stem's ran Hopper's, those that apply a norm as x lands too"
    assert_same(*results)


@pytest.fixture
def hopper(gpu_backend):
    """The cuda backend of a GPU of compute capability 9.0 (the backend, not the tests' OnDevice wrapper)."""
    if not conv_sm90.available(gpu_backend.backend):
        pytest.skip("conv_sm90 runs on GPUs of compute capability 9.0")
    return gpu_backend.backend


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape, padding", RESNET_LAYERS + ODD)
def test_the_gemms_on_the_gpu(hopper, x_shape, w_shape, padding):
    check_forward(hopper, x_shape, w_shape, padding)
    if conv_sm90.supports_dgrad(geometry(x_shape, w_shape, padding)):
        for add in (False, True):
            check_backward_data(hopper, x_shape, w_shape, padding, add)
        check_tf32(hopper, x_shape, w_shape, padding, add=True)
    check_backward_weight(hopper, x_shape, w_shape, padding)
    check_tf32_backward_weight(hopper, x_shape, w_shape, padding)
    check_tf32_backward_weight(hopper, x_shape, w_shape, padding, fold=True)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape, padding", STRIDED)
def test_the_stride_2_gemms_on_the_gpu(hopper, x_shape, w_shape, padding):
    check_forward(hopper, x_shape, w_shape, padding, stride=2)
    for add in (False, True):
        check_backward_data(hopper, x_shape, w_shape, padding, add, stride=2)
    check_backward_weight(hopper, x_shape, w_shape, padding, stride=2)
    check_tf32(hopper, x_shape, w_shape, padding, stride=2)
    check_tf32_backward_weight(hopper, x_shape, w_shape, padding, stride=2)


def test_a_gpus_tensor_map_is_encoded_as_cuda_h_orders_it(monkeypatch):
    """launch.tensor_map on a GPU: cuTensorMapEncodeTiled (here a stand-in that records its arguments) gets the
    dims and box innermost first, the byte strides of all but the innermost dimension, CUDA's enums of bfloat16
    and of the 128-byte swizzle, and a 64-byte aligned place for the map; the 128 bytes it writes come back as one
    element that CuPy passes by value, holding on to the tensor."""
    from types import SimpleNamespace

    from kernels.cuda import launch
    calls = []

    def encode(out, dtype, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, fill):
        calls.append((out % 64, dtype, rank, address, list(dims[:rank]), list(strides[:rank - 1]), list(box[:rank]),
                      list(element_strides[:rank]), interleave, swizzle, fill))
        import ctypes
        ctypes.memmove(out, bytes(range(128)), 128)
        return 0
    monkeypatch.setattr(launch, "_cu_tensor_map_encode_tiled", lambda: encode)
    host = np.zeros((3, 5, 7, 64), bfloat16)
    device = SimpleNamespace(dtype=host.dtype, ndim=4, shape=host.shape, strides=host.strides, flags=host.flags,
                             data=SimpleNamespace(ptr=0x7000))
    be = SimpleNamespace(xp=SimpleNamespace(cuda=None))   # CuPy's module: no tensor_map of the simulated GPUs
    encoded = launch.tensor_map(be, device, (2, 4, 4, 64))
    assert calls == [(0, 9, 4, 0x7000, [64, 7, 5, 3], [64 * 2, 7 * 64 * 2, 5 * 7 * 64 * 2], [64, 4, 4, 2], [1, 1, 1, 1], 0, 3, 0)]
    assert encoded.shape == (1,) and encoded.dtype.itemsize == 128 and encoded.tobytes() == bytes(range(128))
    assert encoded.tensor is device
    calls.clear()   # a view of every other row and column (stride 2's x_maps), and a dimension of one element, whose
    view = host[:, 1::2, ::2][:, :, :1]   # stride NumPy leaves as it was: the one a dense layout would have
    strided = SimpleNamespace(dtype=view.dtype, ndim=4, shape=view.shape, strides=view.strides, flags=view.flags,
                              data=SimpleNamespace(ptr=0x7000 + 7 * 64 * 2))
    launch.tensor_map(be, strided, (1, 2, 1, 64))
    assert calls[0][4:6] == ([64, 1, 2, 3], [64 * 2, 2 * 7 * 64 * 2, 5 * 7 * 64 * 2]), calls
    calls.clear()   # NaN past the tensor: CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
    launch.tensor_map(be, device, (2, 4, 4, 64), nan_fill=True)
    assert calls[0][-1] == 1
    with pytest.raises(ValueError, match="rank 2 to 5"):
        launch.tensor_map(be, SimpleNamespace(dtype=np.dtype(np.int32), ndim=2, shape=(4, 4), strides=(16, 4),
                                              flags=host.flags), (4, 4))


@pytest.mark.nvrtc("conv_sm90")
def test_bench_tc_plan_reports_the_structure_of_hoppers_launches():
    """bench/tc_plan.py's Hopper table: ResNet-18's convolutions but the stem, their three GEMMs each (backward-weight
    in bf16 and TF32), a grid of whole
    boxes at batch 256 (no row computed past the images; backward-data of stride 2 by phases of dx, where the 7 x 7
    phases' boxes are not whole), the kernels' resources from ptxas."""
    reason = nvrtc.unavailable_reason() or nvrtc.unsupported_reason("sm_90a")
    if reason:
        pytest.skip(reason)
    from bench import tc_plan
    rows, resources = tc_plan.hopper_rows(256, 132)
    assert [(row["count"], row["gemm"]) for row in rows] == [
        (n, gemm) for n in [4] + [1, 3, 1] * 3 for gemm in ("forward", "dgrad", "wgrad", "wgrad tf32")]
    assert all(row["blocks"] == np.prod(row["grid"]) for row in rows)
    assert all(row["padded"] == 1.0 for row in rows if row["gemm"] != "dgrad" or "/1 " in row["layer"]), rows
    assert set(resources) == set(conv_sm90.KERNELS)
