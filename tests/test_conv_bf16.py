"""The bf16 precision's convolutions: conv_bf16.cu's BF16 tensor-core GEMMs (channel counts that are
multiples of 8) and conv.cu's FP32 kernels on bfloat16 storage (the others: the stem).

- On the CPU emulator, every output (y, dx, dw, db) at odd shapes and at every convolution of
  ResNet-18 (width 8), against float64 of the bfloat16 inputs (exact: the products of bfloat16
  are exact in float32 and float64 alike), within the float32 rounding of a K-term sum,
  |sum - ref| <= (K + 16) 2^-24 (|A| |B|), and, for y and dx, which are stored as bfloat16, one
  rounding to nearest more: 2^-8 of the value. New arrays start as NaN (conftest's poisoned_empty),
  so an element a kernel forgets to write fails; the emulator runs its threads in ascending and in
  descending order, with the large tile and with split-K forced on small shapes too; multiples of
  32 take the aligned iterators, other multiples of 8 the gathered copies.
- dx added to a bfloat16 gradient in place (add_dx_to): rounded once, after the addition.
- The bf16 precision runs these kernels, no TF32 one, and the activations and dx it returns are
  bfloat16 and channels-last; the weight and bias gradients float32.
- The SASS of every BF16 kernel, for sm_80 and sm_90, holds HMMA.16816.F32.BF16, LDSM and LDGSTS;
  bench/tc_plan.py's plan covers every product of ResNet-18.
- Marked gpu: the same references on a GPU, and PyTorch (cuDNN on bfloat16 inputs) beside.
- On one simulated GPU, in CI: check_conv through the GPU tests' fixture, whose copies keep the
  device arrays' layouts (planted: cupy.asnumpy's C-ordered copies, refused by name).
"""
import numpy as np
import pytest

import kernels
import reference as R
from helpers import reproduce_hint, rng, validate
from kernels import bfloat16, nvrtc
from kernels.cuda import conv_tc
from test_conv_tc import emu, gpu_backend  # noqa: F401  (fixtures: the emu backend in each thread order, the GPU's)
from test_kernels_cuda import PlainCopies, poisoned_device_empty, simulated_gpu  # noqa: F401  (the last two fixtures)

pytestmark = pytest.mark.usefixtures("poisoned_empty", "bf16")
UNIT32, UNIT_BF16 = 2.0**-24, 2.0**-8   # unit roundoff of float32 and of bfloat16 (8 significant bits)


@pytest.fixture
def bf16():
    with kernels.use_precision("bf16"):
        yield


def draw(*shapes):
    """Fresh normal bfloat16 arrays (drawn in float32, rounded to nearest)."""
    g = rng()
    return [g.standard_normal(s).astype(np.float32).astype(bfloat16) for s in shapes]


def wide(a):
    return np.asarray(a).astype(np.float64)


def check_products(name, ours, inputs, op, terms, stored, added=None):
    """ours (a tuple of outputs) against op(*inputs, added) in float64 of the bfloat16 inputs; terms:
    the length of each output's dot products; stored: whether each output is bfloat16 (one more
    rounding); added (a float32 bias or None) is added in float32, not multiplied."""
    inputs = [wide(a) for a in inputs]
    exact = op(*inputs, added)
    magnitude = op(*(np.abs(a) for a in inputs), None if added is None else np.abs(added))
    for i, (got, ref, size, mag, rounded) in enumerate(zip(ours, exact, terms, magnitude, stored)):
        assert (got.dtype == bfloat16) == rounded, f"{name} output {i} is {got.dtype}"
        got = wide(got)
        assert got.shape == ref.shape, f"{name} output {i}: shape {got.shape}, expected {ref.shape}"
        assert np.isfinite(got).all(), f"{name} output {i}: {np.count_nonzero(~np.isfinite(got))} elements " \
                                       f"not finite (unwritten, or read before its copy landed)\n{reproduce_hint()}"
        bound = (size + 16) * UNIT32 * mag
        if rounded:
            bound = bound + UNIT_BF16 * (np.abs(ref) + bound)
        excess = np.abs(got - ref) - bound
        worst = np.unravel_index(np.argmax(excess), excess.shape)
        assert excess[worst] <= 0, (
            f"{name} output {i}: {np.count_nonzero(excess > 0)} of {got.size} elements beyond the bound; worst at "
            f"{tuple(map(int, worst))}: ours {got[worst]!r}, ref {ref[worst]!r}, bound {bound[worst]:.3g}\n"
            f"{reproduce_hint()}")


def check_conv(be, x_shape, w_shape, stride, padding, bias=True):
    """conv2d_forward and conv2d_backward of `be` under bf16 against the float64 references."""
    x, w = draw(x_shape, w_shape)
    b = rng().standard_normal(w_shape[0]).astype(np.float32) if bias else None
    y = be.conv2d_forward(x, w, b, stride, padding)
    (dy,) = draw(y.shape)
    dx, dw, db = be.conv2d_backward(dy, x, w, stride, padding)
    n, c, kh, kw, o = x_shape[0], x_shape[1], w_shape[2], w_shape[3], w_shape[0]
    pixels = n * y.shape[2] * y.shape[3]
    name = f"conv {x_shape} * {w_shape} stride {stride} padding {padding}"
    check_products(name + " forward", (y,), [x, w], lambda x, w, b: (R.conv2d_forward(x, w, b, stride, padding),),
                   (c * kh * kw,), (True,), b)
    check_products(name + " backward", (dx, dw), [dy, x, w],
                   lambda dy, x, w, _: R.conv2d_backward(dy, x, w, stride, padding)[:2], (o * kh * kw, pixels),
                   (True, False))
    validate(db, R.conv2d_backward(wide(dy), wide(x), wide(w), stride, padding)[2], name + " bias gradient")
    for array, what in ((y, "y"), (dx, "dx")):   # NCHW views of NHWC memory
        assert array.transpose(0, 2, 3, 1).flags.c_contiguous, f"{name}: {what} has strides {array.strides}"
    assert dw.dtype == db.dtype == np.float32 and dw.flags.c_contiguous and db.flags.c_contiguous


def force(variant, monkeypatch):
    """The launchers' choices ("default"), or the large tile or many-way split-K forced, so that small
    shapes exercise those code paths too."""
    if variant == "large tile":
        monkeypatch.setattr(conv_tc, "choose_bf16_tile", lambda columns, aligned: "Bf128x128" if aligned else "Bf128x64")
    elif variant == "split":   # every GEMM in parts of one k step, in two levels past ONE_LEVEL_PARTS
        monkeypatch.setattr(conv_tc, "BF16_SPLIT_TARGET", 10**9)
        monkeypatch.setattr(conv_tc, "BF16_WGRAD_SPLIT_TARGET", 10**9)
        monkeypatch.setattr(conv_tc, "WGRAD_HALO_SPLIT_TARGET", 10**9)
        monkeypatch.setattr(conv_tc, "BF16_MIN_SPLIT_K", 64)
        monkeypatch.setattr(conv_tc, "BF16_WGRAD_MIN_SPLIT_K", 64)
        monkeypatch.setattr(conv_tc, "WGRAD_HALO_MIN_SPLIT_K", 64)


@pytest.fixture(params=("default", "large tile", "split"))
def variant(request, monkeypatch):
    force(request.param, monkeypatch)
    conv_tc.plan.cache_clear()   # plans are cached by shape: none made under other choices
    yield request.param
    conv_tc.plan.cache_clear()


@pytest.fixture(params=[("ascending", "default"), ("descending", "default"), ("ascending", "large tile"),
                        ("descending", "split")], ids=lambda p: "-".join(p))
def ordered_variant(request, monkeypatch):
    """The launchers' choices in both thread orders, each forced variant in one: the orders find what
    depends on which thread runs first, the variants reach the code paths small shapes would not."""
    from kernels.emu import thread_order
    order, variant = request.param
    force(variant, monkeypatch)
    conv_tc.plan.cache_clear()
    with thread_order(order):
        yield kernels._device_backend("emu")
    conv_tc.plan.cache_clear()


# Multiples of 8, not all of 32 (the gathered copies, ALIGN = 8), with partial tiles on every side,
# and below 8 (conv.cu's FP32 kernels on bfloat16: the stem's one channel, 4).
GATHERED_SHAPES = [
    ((2, 8, 9, 7), (24, 8, 3, 3), 2, 1, True),
    ((3, 16, 6, 5), (72, 16, 3, 3), 1, 1, True),
    ((1, 8, 5, 5), (8, 8, 1, 1), 2, 0, False),
    ((2, 16, 3, 3), (8, 16, 3, 3), 3, 1, True),   # stride 3 at 3x3: every phase one tap
]
FP32_SHAPES = [((2, 1, 8, 8), (8, 1, 3, 3), 1, 1, True), ((2, 4, 6, 6), (8, 4, 3, 3), 2, 1, True)]

# Multiples of 32: the copies' addresses worked out before the loop (ALIGN = 32), at strides whose
# phases have one tap, several or none, 5x5 (25 taps), and 7x7, whose 49 taps take the gathered copies.
ALIGNED_SHAPES = [
    ((2, 32, 9, 7), (64, 32, 3, 3), 2, 1, True),
    ((3, 32, 6, 5), (32, 32, 3, 3), 1, 1, False),
    ((2, 32, 7, 7), (96, 32, 1, 1), 2, 0, True),    # phases no tap reaches
    ((1, 32, 7, 5), (32, 32, 5, 5), 1, 2, False),
    ((2, 32, 6, 9), (32, 32, 2, 3), (2, 1), (0, 1), True),
    ((1, 32, 2, 7), (32, 32, 1, 3), (3, 2), (0, 1), False),   # fewer rows than the stride
    ((1, 32, 6, 6), (32, 32, 7, 7), 1, 3, False),
    ((2, 32, 10, 10), (32, 32, 3, 3), 1, 1, True),   # 200 pixels: backward-weight's sum in two levels when split
]


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, bias", GATHERED_SHAPES + ALIGNED_SHAPES)
def test_conv_at_odd_shapes(ordered_variant, x_shape, w_shape, stride, padding, bias):
    check_conv(ordered_variant, x_shape, w_shape, stride, padding, bias)


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, bias", FP32_SHAPES)
def test_conv_of_channels_the_tensor_cores_do_not_take(emu, x_shape, w_shape, stride, padding, bias):
    check_conv(emu, x_shape, w_shape, stride, padding, bias)


def resnet18_convolutions(batch, width):
    """(x shape, w shape, stride, padding) of every distinct convolution of nn.resnet18."""
    from bench.layers import distinct, resnet18_layers
    return [(layer.x, layer.w, layer.stride, layer.padding) for layer, _ in distinct(resnet18_layers(batch, width))
            if layer.op == "conv2d"]


@pytest.mark.parametrize("x_shape, w_shape, stride, padding", resnet18_convolutions(batch=2, width=8))
def test_conv_at_the_shapes_of_resnet18(x_shape, w_shape, stride, padding):
    check_conv(kernels._device_backend("emu"), x_shape, w_shape, stride, padding)


# 3x3, stride 1, padding 1, channels multiples of 32 where the window is read, 64 columns or fewer: the
# halo kernels (the forward's and backward-data's once the grid need not be large: halo_everywhere), with
# blocks and stages across image boundaries (several in the second), 3 chunks of channels (whose
# backward-data has 96 columns: not the halo's; backward-weight three blocks of 32 input channels), a
# partial tile of columns, backward-weight's last stage part of one (all but the third).
HALO_SHAPES = [
    ((2, 32, 9, 7), (32, 32, 3, 3)),
    ((4, 32, 4, 4), (64, 32, 3, 3)),
    ((1, 64, 28, 28), (64, 64, 3, 3)),
    ((2, 96, 5, 6), (64, 96, 3, 3)),
    ((2, 32, 7, 6), (40, 32, 3, 3)),   # 40 columns: forward by the halo, backward-data (O % 32) not
]


@pytest.mark.parametrize("x_shape, w_shape", HALO_SHAPES)
def test_3x3_convolutions_from_windows_of_the_image(emu, halo_everywhere, x_shape, w_shape):
    check_conv(emu, x_shape, w_shape, 1, 1)
    assert "conv_bf16_forward_halo<Halo128x64>" in halo_everywhere
    dgrad_halo = w_shape[0] % 32 == 0 and x_shape[1] <= 64   # dy's channels, and 64 columns (C) at most
    assert ("conv_bf16_dgrad_halo<Halo128x64>" in halo_everywhere) == dgrad_halo, halo_everywhere
    assert conv_tc.WGRAD_HALO["conv_bf16"].kernel in halo_everywhere


@pytest.mark.parametrize("x_shape, w_shape", [HALO_SHAPES[1], HALO_SHAPES[2], ((2, 32, 10, 10), (64, 32, 3, 3))])
def test_backward_weight_from_windows_split_over_the_pixels(emu, monkeypatch, halo_everywhere, x_shape, w_shape):
    """The halo backward-weight with its pixels split into parts of one stage (48 pixels): 2, 17 (added in
    two levels) and 5 parts, the bias gradient's too."""
    monkeypatch.setattr(conv_tc, "WGRAD_HALO_SPLIT_TARGET", 10**9)
    monkeypatch.setattr(conv_tc, "WGRAD_HALO_MIN_SPLIT_K", 1)
    n, _, h, w = x_shape
    geometry = (n, x_shape[1], h, w, w_shape[0], 3, 3, 1, 1, 1, 1, h, w)
    assert conv_tc.plan("wgrad", geometry, conv_tc.BF16).splits == -(-n * h * w // conv_tc.WGRAD_HALO["conv_bf16"].pixels)
    check_conv(emu, x_shape, w_shape, 1, 1)
    assert conv_tc.WGRAD_HALO["conv_bf16"].kernel in halo_everywhere


@pytest.mark.parametrize("gemm, n, h, w, allowed", [
    ("forward", 256, 28, 28, True), ("forward", 3, 7, 6, True), ("forward", 9, 4, 4, True),
    ("forward", 5, 13, 3, True), ("forward", 2, 2, 60, False), ("forward", 2, 1, 50, False),
    ("wgrad", 256, 28, 28, True), ("wgrad", 3, 7, 6, True), ("wgrad", 9, 4, 4, True), ("wgrad", 5, 13, 3, True),
    ("wgrad", 9, 3, 2, True), ("wgrad", 2, 2, 60, False), ("wgrad", 1, 5, 31, False)])
def test_the_halo_window_the_plan_allows_holds_every_blocks(gemm, n, h, w, allowed):
    """The window rows a halo block reads for a block of the forward (128 pixels) or a stage of
    backward-weight (48; stages start at multiples of 48: the parts are whole stages) (those of its
    pixels, one above and one below each, two of padding at each image boundary: the kernel's count)
    never exceed the shared memory where the plan picks the kernel; it refuses a window that does not fit
    (60 columns), and, its bound being one for every block, one that only just fits (50, 31)."""
    geometry = (n, 32, h, w, 32, 3, 3, 1, 1, 1, 1, h, w)
    pixels = n * h * w
    step, slots = (conv_tc.HALO_ROWS, conv_tc.HALO_SLOTS) if gemm == "forward" else \
        (conv_tc.WGRAD_HALO["conv_bf16"].pixels, conv_tc.WGRAD_HALO["conv_bf16"].slots)
    padded = lambda m: m // (h * w) * (h + 2) + m % (h * w) // w   # noqa: E731  (the kernel's padded row)
    rows = max(padded(min(m0 + step, pixels) - 1) - padded(m0) + 3 for m0 in range(0, pixels, step))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv_tc, "BF16_SPLIT_TARGET", 1)
        chosen = conv_tc.halo(geometry, "forward", 32, conv_tc.BF16) if gemm == "forward" else \
            conv_tc.wgrad_halo(geometry, conv_tc.BF16)
        assert chosen == allowed
    assert rows * (w + 2) <= slots or not allowed, (rows, w)


def test_dx_added_in_place_is_rounded_once():
    """dx added to a bfloat16 gradient (a residual block's input's) in the epilogue: the float32 sum
    of what it holds and the product, rounded once."""
    be = kernels._device_backend("emu")
    x_shape, w_shape = (2, 32, 6, 6), (32, 32, 3, 3)
    x, w, dy, held = draw(x_shape, w_shape, (2, 32, 6, 6), x_shape)
    dy, held = (np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) for a in (dy, held))
    into = held.copy(order="K")   # channels-last, as the network's gradients are: added in the epilogue
    dx, _, _ = be.conv2d_backward(dy, x, w, 1, 1, add_dx_to=into)
    assert dx is into
    check_added(dx, held, dy, x, w)


@pytest.mark.usefixtures("halo_everywhere")
def test_dx_of_the_halo_kernel_added_in_place_is_rounded_once():
    be = kernels._device_backend("emu")
    x, w, dy, held = draw((2, 32, 6, 6), (32, 32, 3, 3), (2, 32, 6, 6), (2, 32, 6, 6))
    dy, held = (np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) for a in (dy, held))
    into = held.copy(order="K")
    dx, _, _ = be.conv2d_backward(dy, x, w, 1, 1, add_dx_to=into)
    assert dx is into
    check_added(dx, held, dy, x, w)


def check_added(dx, held, dy, x, w):
    ref = R.conv2d_backward(wide(dy), wide(x), wide(w), 1, 1)[0] + wide(held)
    magnitude = R.conv2d_backward(np.abs(wide(dy)), wide(x), np.abs(wide(w)), 1, 1)[0] + np.abs(wide(held))
    bound = (32 * 9 + 16) * UNIT32 * magnitude
    assert np.all(np.abs(wide(dx) - ref) <= bound + UNIT_BF16 * (np.abs(ref) + bound)), reproduce_hint()


def test_bf16_runs_the_bf16_kernels():
    """Under bf16 the convolutions of 8 or more channels launch conv_bf16.cu's GEMMs, none of
    conv_tc.cu's; the stem's (one channel) conv.cu's kernels on bfloat16; and float32 inputs (the
    images) are rounded to bfloat16 first."""
    be, launched = kernels._device_backend("emu"), []
    x, w = draw((2, 8, 5, 5), (8, 8, 3, 3))
    with be.observing_launches(lambda family, name: launched.append(name)):
        y = be.conv2d_forward(x, w, None, 1, 1)
        be.conv2d_backward(y, x, w, 1, 1)
    assert {name.partition("<")[0] for name in launched} == set(conv_tc.BF16_GEMMS), launched
    launched.clear()
    stem_x = rng().random((2, 1, 5, 5)).astype(np.float32)
    with be.observing_launches(lambda family, name: launched.append(name)):
        y = be.conv2d_forward(stem_x, draw((8, 1, 3, 3))[0], None, 1, 1)
    assert y.dtype == bfloat16 and all(name.endswith("bf16>") for name in launched if name.startswith("conv2d"))
    assert any(name.startswith("cast") for name in launched), launched


@pytest.mark.parametrize("x_shape, w_shape, stride, padding", [((2, 32, 10, 10), (32, 32, 3, 3), 1, 1),
                                                               ((2, 16, 9, 7), (24, 16, 3, 3), 2, 1)])
def test_split_sums_do_not_depend_on_which_block_finishes_last(variant, x_shape, w_shape, stride, padding):
    """y, dx, dw and db bit for bit the same whichever part of a tile finishes last."""
    from kernels.emu import thread_order
    be = kernels._device_backend("emu")
    x, w = draw(x_shape, w_shape)
    b = rng().standard_normal(w_shape[0]).astype(np.float32)
    results = []
    for order in ("ascending", "descending"):
        with thread_order(order):
            y = be.conv2d_forward(x, w, b, stride, padding)
            results.append([np.array(a) for a in (y, *be.conv2d_backward(y, x, w, stride, padding))])
    for what, first, second in zip(("y", "dx", "dw", "db"), *results):
        assert first.tobytes() == second.tobytes(), f"{what} under {variant}"


@pytest.mark.nvrtc("conv_bf16")
@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_every_bf16_kernel_runs_hmma(arch):
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    if nvrtc.cuobjdump() is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    from kernels.cuda.ptxas_report import compile_family
    compiled = compile_family("conv_bf16", arch)
    sass = compiled.sass()
    assert len(conv_tc.BF16_KERNELS) == 12
    for name in conv_tc.BF16_KERNELS:
        mangled = compiled.lowered_names[name]
        instructions = sass[mangled]
        for form in ("HMMA.16816.F32.BF16", "LDSM.16.M", "LDGSTS.E.BYPASS.128"):
            assert any(i.startswith(form) or form in i for i in instructions), f"{name} for {arch}: no {form}"
        resources = compiled.resources()[mangled]
        assert resources.spill_stores == resources.spill_loads == 0, f"{name} for {arch} spills"


@pytest.mark.nvrtc("conv_bf16")
def test_the_launch_plan_of_resnet18_covers_every_product():
    """bench/tc_plan.py under bf16: a plan for each GEMM of every convolution but the stem, with the
    kernel's occupancy from its registers and shared memory; backward-weight in at least one wave of
    the blocks that fit on an H200's 132 SMs at every layer; the FLOPs per L2 byte of each tile as its
    shape gives them (128 x 128: 64; 64 columns or rows: 42.7; the halo kernels of the first stage
    above 90)."""
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from bench import tc_plan
    from bench.layers import distinct, resnet18_layers
    rows, resources, fp32 = tc_plan.rows(256, "sm_90", 132, "bf16")
    products = [layer for layer, _ in distinct(resnet18_layers(256)) if layer.op in ("conv2d", "linear")]
    assert len(rows) == 3 * (len(products) - 2) == 3 * 10
    assert fp32 == ["conv 3x3/1 1->64 28->28", "linear 512->10"]
    assert all(1 <= row["resident"] <= 16 and row["blocks"] >= 1 for row in rows), rows
    assert all(resources[row["kernel"]].spill_stores == 0 for row in rows)
    assert all(row["waves"] >= 1 for row in rows if row["gemm"] == "wgrad"), rows
    for row in rows:
        if "_halo<" in row["kernel"]:   # the first stage's forward and backward-data: the window read once for 9 taps
            assert row["layer"] == "conv 3x3/1 64->64 28->28" and row["flops_per_byte"] > 90, row
            continue
        wide = "Bf128x128" in row["kernel"] and not (row["layer"].startswith("conv 1x1/2 64->") and row["gemm"] == "wgrad")
        assert row["flops_per_byte"] == pytest.approx(64.0 if wide else 2 * 128 * 64 / (192 * 2)), row


# ---- GPU -----------------------------------------------------------------------------------

@pytest.mark.parametrize("planted", [False, True], ids=["OnDevice", "planted: plain copies back"])
def test_check_conv_reads_the_layouts_of_the_device_arrays_on_a_simulated_gpu(simulated_gpu, request, planted):
    """The GPU tests' check_conv through gpu_backend on one simulated GPU, at a small shape: y and dx bfloat16 and
    channels-last as the device holds them, the numbers compared. Planted, PlainCopies's C-ordered copies fail its
    layout assertion by name, as OnDevice's did on one H200."""
    x_shape, w_shape, stride, padding, _ = GATHERED_SHAPES[2]
    if planted:
        with pytest.raises(AssertionError, match=r": y has strides \(144, 18, 6, 2\)"):
            check_conv(PlainCopies(simulated_gpu), x_shape, w_shape, stride, padding)
    else:
        check_conv(request.getfixturevalue("gpu_backend"), x_shape, w_shape, stride, padding)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape, stride, padding", resnet18_convolutions(batch=2, width=16)
                         + [s[:4] for s in GATHERED_SHAPES + ALIGNED_SHAPES])
def test_gpu_conv_against_the_bf16_references(gpu_backend, x_shape, w_shape, stride, padding):
    check_conv(gpu_backend, x_shape, w_shape, stride, padding)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape", HALO_SHAPES)
def test_gpu_halo_convolutions_against_the_bf16_references(gpu_backend, halo_everywhere, x_shape, w_shape):
    check_conv(gpu_backend, x_shape, w_shape, 1, 1)


@pytest.mark.gpu
def test_gpu_conv_beside_cudnn_bf16(gpu_backend):
    """Our BF16 convolution and cuDNN's on the same bfloat16 inputs (what PyTorch's autocast runs), both
    within bfloat16's rounding of the output of float64's, on a ResNet-18 stage-3 shape."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    x, w = draw((16, 128, 14, 14), (256, 128, 3, 3))
    ours = wide(gpu_backend.conv2d_forward(x, w, None, 2, 1))
    ref = R.conv2d_forward(wide(x), wide(w), None, 2, 1)
    as_torch = lambda a: torch.tensor(wide(a), device="cuda").to(torch.bfloat16)   # noqa: E731  (exact)
    theirs = torch.nn.functional.conv2d(as_torch(x), as_torch(w), stride=2, padding=1).float().cpu().numpy()
    error = [np.linalg.norm(a - ref) / np.linalg.norm(ref) for a in (ours, theirs)]
    assert error[0] <= 4e-3 and error[0] <= 2 * error[1] + 1e-6, f"ours {error[0]:.3g}, cuDNN BF16 {error[1]:.3g}"
