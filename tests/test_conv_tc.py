"""The tf32 precision: the tensor-core convolutions of conv_tc.cu (those whose channel counts are
multiples of 4; tests/test_conv_layouts.py covers the others, and the linear layer, which run the
FP32 kernels under tf32 too).

- On the CPU emulator, every output (y, dx, dw, db) at odd shapes and at every convolution of
  ResNet-18 (width 8) but the stem, against two float64 references:
  - of the TF32-rounded inputs (rounded here by frexp, independently of the kernels), within
    the float32 rounding of a K-term sum: |ours - ref| <= (K + 16) 2^-24 (|A| |B|), where
    |A| |B| is the same product of the inputs' magnitudes (elementwise);
  - of the raw inputs, within that plus TF32's rounding of both factors of every product,
    2 * 2^-11 (|A| |B|) (10 explicit mantissa bits, rounded to nearest).
  New arrays start as NaN (conftest's poisoned_empty), so an element a kernel forgets to write
  fails; the emulator runs its threads in ascending and in descending order, with the large
  tile and with split-K forced on small shapes too (its sums in two levels where the parts are
  many); channel counts that are multiples of 16 take the aligned iterators, other multiples of 4
  the gathered copies, multiples of 64 and 128 backward-weight's square tile, which copies runs of
  2 and 4 chunks from one address (planted: a run across two taps is refused).
- The stride-2 backward-data from windows of dy (3x3, even H and W: each phase a convolution of dy) against the
  same references, and its window within the kernel's slots (planted: a larger window admitted, refused).
- The projection backward (a 1x1 convolution of 64 -> 128 channels: dx, dw and db in one kernel) against the
  same references at strides 1 to 3, dx added in place, its split sums bit for bit in both block orders, a
  residual block's step on it, and its shared memory (planted: 2 KB short, refused by the sanitizer).
- The launch plan: split-K, backward-weight in two waves of an H200, FastDivmod's arithmetic.
- The layouts: NCHW and channels-last inputs give the same results; outputs and dx are
  channels-last.
- A training step of the whole ResNet-18 (width 8) on the emulator against NumPy in float32.
- The SASS of every tensor-core kernel, for sm_80 and sm_90, holds HMMA.1688.F32.TF32.
- Marked gpu: the same references on a GPU, and PyTorch (cuDNN with TF32, its default) beside.
- On one simulated GPU, in CI: check_conv through the GPU tests' fixture, whose copies keep the
  device arrays' layouts (planted: cupy.asnumpy's C-ordered copies, refused by name).
"""
import collections
import contextlib
import re

import numpy as np
import pytest

import kernels
import reference as R
from bench.layers import distinct, resnet18_layers
from helpers import reproduce_hint, rng, validate
from kernels import nvrtc
from kernels.cuda import conv_tc
from test_kernels_cuda import (OnDevice, PlainCopies, gpu_unavailable_reason, poisoned_device_empty,  # noqa: F401
                               resnet_step, simulated_gpu)   # (the last two fixtures)

pytestmark = pytest.mark.usefixtures("poisoned_empty", "tf32")
UNIT32, UNIT_TF32 = 2.0**-24, 2.0**-11   # unit roundoff of float32 and of TF32


@pytest.fixture
def tf32():
    with kernels.use_precision("tf32"):
        yield


def tf32_rounded(a):
    """float64 values of `a` rounded to TF32: 11 significant bits, to nearest, ties away from zero."""
    mantissa, exponent = np.frexp(np.asarray(a, np.float64))
    return np.ldexp(np.sign(mantissa) * np.floor(np.abs(mantissa) * 2**11 + 0.5) / 2**11, exponent)


def check_products(name, ours, inputs, op, terms, added=None):
    """ours (a tuple of outputs) against op(*inputs, added) in float64 on TF32-rounded and on raw
    inputs; terms: the length of each output's dot products; added (a bias, or None) is added
    in float32 by the kernels, not multiplied, and is never rounded."""
    rounded, raw = op(*map(tf32_rounded, inputs), added), op(*inputs, added)
    magnitude = op(*(np.abs(tf32_rounded(a)) for a in inputs), None if added is None else np.abs(added))
    for i, (got, tight, loose, size, mag) in enumerate(zip(ours, rounded, raw, terms, magnitude)):
        got = np.asarray(got, np.float64)
        assert got.shape == tight.shape, f"{name} output {i}: shape {got.shape}, expected {tight.shape}"
        assert np.isfinite(got).all(), f"{name} output {i}: {np.count_nonzero(~np.isfinite(got))} elements " \
                                       f"not finite (unwritten, or read before its copy landed)\n{reproduce_hint()}"
        accumulation = (size + 16) * UNIT32 * mag
        for ref, bound, against in ((tight, accumulation, "TF32-rounded"),
                                    (loose, accumulation + (2 * UNIT_TF32 + UNIT_TF32**2) * mag, "raw")):
            excess = np.abs(got - ref) - bound
            worst = np.unravel_index(np.argmax(excess), excess.shape)
            assert excess[worst] <= 0, (
                f"{name} output {i} against float64 of the {against} inputs: {np.count_nonzero(excess > 0)} of "
                f"{got.size} elements beyond the bound; worst at {tuple(map(int, worst))}: ours {got[worst]!r}, "
                f"ref {ref[worst]!r}, bound {bound[worst]:.3g}\n{reproduce_hint()}")


def draw(*shapes):
    g = rng()
    return [g.standard_normal(s).astype(np.float32) for s in shapes]


def check_conv(be, x_shape, w_shape, stride, padding, bias=True, channels_last=False, dy_tf32=False):
    """conv2d_forward and conv2d_backward of `be` under tf32 against the float64 references; dy_tf32: dy holds
    TF32 values, and conv2d_backward is told so (as the training step's batch norms hand it)."""
    x, w, b = draw(x_shape, w_shape, (w_shape[0],))
    b = b if bias else None
    if channels_last:
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    y = be.conv2d_forward(x, w, b, stride, padding)
    (dy,) = draw(y.shape)
    if dy_tf32:
        dy = kernels.cpu.round_tf32(dy)
    dx, dw, db = be.conv2d_backward(dy, x, w, stride, padding, dy_tf32=dy_tf32)
    n, c, kh, kw, o = x_shape[0], x_shape[1], w_shape[2], w_shape[3], w_shape[0]
    pixels = n * y.shape[2] * y.shape[3]
    name = f"conv {x_shape} * {w_shape} stride {stride} padding {padding}"
    check_products(name + " forward", (y,), [x, w], lambda x, w, b: (R.conv2d_forward(x, w, b, stride, padding),),
                   (c * kh * kw,), b)
    check_products(name + " backward", (dx, dw), [dy, x, w],
                   lambda dy, x, w, _: R.conv2d_backward(dy, x, w, stride, padding)[:2], (o * kh * kw, pixels))
    validate(db, R.conv2d_backward(dy, x, w, stride, padding)[2], name + " bias gradient")
    for array, what in ((y, "y"), (dx, "dx")):   # NCHW views of NHWC memory
        assert array.transpose(0, 2, 3, 1).flags.c_contiguous, f"{name}: {what} has strides {array.strides}"
    assert dw.flags.c_contiguous and db.flags.c_contiguous


@pytest.fixture(params=["ascending", "descending"])
def emu(request):
    """The emu backend, its threads in one order."""
    from kernels.emu import thread_order
    with thread_order(request.param):
        yield kernels._device_backend("emu")


VARIANTS = ("default", "large tile", "square tile", "split", "square tile split", "square tile ring2")


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """The launchers' choices, or the 128 x 64 or 128 x 128 tile (where the copies allow it, the latter with a ring of
    3 stages or, as an SM of 100 KB takes it, of 2) or many-way split-K forced, or both, so that small shapes exercise
    those code paths too."""
    if "tile" in request.param:   # the square tile has the aligned copies alone
        tile = "Tc128x64" if request.param == "large tile" else "Tc128x128"
        monkeypatch.setattr(conv_tc, "choose_tile", lambda rows, columns, aligned: tile if aligned else "Tc128x64")
        monkeypatch.setattr(conv_tc, "choose_wgrad_tile", lambda columns, align: tile if align else "Tc128x64")
    if request.param.endswith("ring2"):   # as on an SM of 100 KB of shared memory: 2 stages (conv_tc.for_device)
        monkeypatch.setattr(conv_tc, "device_property", lambda be, name: 100 * 1024)
    if request.param.endswith("split"):   # every GEMM in parts of one k step, in two levels past ONE_LEVEL_PARTS
        monkeypatch.setattr(conv_tc, "SPLIT_TARGET", 10**9)
        monkeypatch.setattr(conv_tc, "WGRAD_SPLIT_TARGET", collections.defaultdict(lambda: 10**9))
        monkeypatch.setattr(conv_tc, "MIN_SPLIT_K", conv_tc.BK)
        monkeypatch.setattr(conv_tc, "WGRAD_MIN_SPLIT_K", conv_tc.BK)
    conv_tc.plan.cache_clear()   # plans are cached by shape: none made under other choices
    yield request.param
    conv_tc.plan.cache_clear()


# Channel counts that are multiples of 4 (the gathered copies, ALIGN = 4), with partial tiles on
# every side.
VECTOR_SHAPES = [
    ((2, 12, 9, 7), (20, 12, 3, 3), 2, 1, True),
    ((3, 8, 6, 5), (68, 8, 3, 3), 1, 1, True),
    ((1, 4, 5, 5), (4, 4, 1, 1), 2, 0, False),
    ((2, 16, 3, 3), (8, 16, 3, 3), 3, 1, True),   # stride 3 at 3x3: every phase one tap
]


# Channel counts that are multiples of 16: the copies' addresses worked out before the loop
# (ALIGN = 16), at strides whose phases have one tap, several or none, 5x5 (25 taps), and 7x7,
# whose 49 taps take the ALIGN = 4 kernels.
ALIGNED_SHAPES = [
    ((2, 16, 9, 7), (32, 16, 3, 3), 2, 1, True),
    ((3, 32, 6, 5), (16, 32, 3, 3), 1, 1, False),
    ((2, 16, 7, 7), (48, 16, 1, 1), 2, 0, True),    # phases no tap reaches
    ((1, 16, 9, 7), (16, 16, 5, 5), 1, 2, False),
    ((2, 16, 6, 9), (16, 16, 2, 3), (2, 1), (0, 1), True),
    ((1, 16, 2, 7), (16, 16, 1, 3), (3, 2), (0, 1), False),   # fewer rows than the stride
    ((2, 16, 3, 3), (16, 16, 3, 3), 3, 1, True),
    ((1, 16, 8, 8), (16, 16, 7, 7), 1, 3, False),
    ((2, 16, 10, 10), (16, 16, 3, 3), 1, 1, True),   # 200 pixels: backward-weight's sum in two levels when split
]


# Channel counts that are multiples of 64 and of 128: backward-weight's square tile copies runs of 2 and 4 chunks
# from one address (conv_tc.WGRAD_SQUARE_ALIGNS), its rows across two taps (C = 64), a partial tile of columns
# (O = 192: the second tile's last run of dy past O), the padding, and the 1x1/2 projection.
SQUARE_WGRAD_SHAPES = [
    ((2, 64, 5, 5), (128, 64, 3, 3), 2, 1, True),
    ((1, 128, 4, 4), (128, 128, 3, 3), 1, 1, False),
    ((2, 64, 3, 4), (192, 64, 1, 1), 2, 0, True),
]


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, bias", VECTOR_SHAPES + ALIGNED_SHAPES + SQUARE_WGRAD_SHAPES)
def test_conv_at_odd_shapes(emu, variant, x_shape, w_shape, stride, padding, bias):
    check_conv(emu, x_shape, w_shape, stride, padding, bias)


@pytest.mark.parametrize("planted", [False, True])
def test_the_square_backward_weight_copies_runs_of_chunks(monkeypatch, planted):
    """The square tile's backward-weight at the ALIGN its channel counts allow (runs of 2 chunks at C = 64, 4
    at 128: SQUARE_WGRAD_SHAPES check their results) and, planted, at 128 for C = 64: a run then crosses into
    the next tap's channels (or past x), which the references (or the emulator's sanitizer) refuse."""
    launched, launch = [], conv_tc.launch
    monkeypatch.setattr(conv_tc, "launch", lambda be, family, kernel, grid, args, **k: launched.append(kernel) or
                        launch(be, family, kernel, grid, args, **k))
    if planted:
        monkeypatch.setattr(conv_tc, "square_wgrad_align", lambda c, o, taps: 128)
    conv_tc.plan.cache_clear()
    emu = kernels._device_backend("emu")
    try:
        for x_shape, w_shape in (((2, 64, 5, 5), (128, 64, 3, 3)), ((1, 128, 4, 4), (128, 128, 3, 3))):
            if planted and x_shape[1] == 64:
                with pytest.raises((AssertionError, kernels.emu.KernelError)):
                    check_conv(emu, x_shape, w_shape, 2, 1)
            else:
                check_conv(emu, x_shape, w_shape, 2, 1)
    finally:
        conv_tc.plan.cache_clear()
    want = ["conv_tc_wgrad<Tc128x128, 128>"] * 2 if planted else ["conv_tc_wgrad<Tc128x128, 64>",
                                                                  "conv_tc_wgrad<Tc128x128, 128>"]
    assert [name for name in launched if name.startswith("conv_tc_wgrad")] == want, launched


@pytest.mark.parametrize("gemm", ["forward", "dgrad", "wgrad"])
def test_the_square_tiles_ring_lies_in_the_dynamic_shared_memory_its_launch_asks_for(monkeypatch, gemm):
    """The 128 x 128 tile's ring of 3 stages (51 to 60 KB) lies in dynamic shared memory, its bytes the launcher's
    (conv_tc.ring_bytes). Planted: the launcher counting a stage fewer for one GEMM: the emulator's sanitizer refuses the GEMM's
    launch by name, a shared access past the bytes asked for. (Its twin, the stages counted right, runs clean in
    test_conv_at_odd_shapes' square tile.)"""
    monkeypatch.setattr(conv_tc, "choose_tile", lambda rows, columns, aligned: "Tc128x128" if aligned else "Tc128x64")
    kernel = "conv_tc_wgrad<Tc128x128, 64>" if gemm == "wgrad" else f"conv_tc_{gemm}<Tc128x128, 16>"
    ring_bytes = conv_tc.ring_bytes
    assert conv_tc.dynamic_shared(kernel) == ring_bytes(kernel) > 50 * 1024
    monkeypatch.setattr(conv_tc, "ring_bytes", lambda name: ring_bytes(name) * (2 if name == kernel else 3) // 3)
    conv_tc.plan.cache_clear()
    emu = kernels._device_backend("emu")
    try:
        with pytest.raises(kernels.emu.KernelError, match=re.escape(kernel) + r".*dynamic shared memory"):
            check_conv(emu, (2, 64, 5, 5), (128, 64, 3, 3), 2, 1) if gemm != "dgrad" else \
                check_conv(emu, (2, 128, 5, 5), (128, 128, 3, 3), 1, 1)
    finally:
        conv_tc.plan.cache_clear()


@pytest.mark.parametrize("shared, ring2", [(None, False), (228 * 1024, False), (164 * 1024, False),
                                           (100 * 1024, True)])
def test_the_square_tile_takes_a_ring_of_2_stages_where_an_sm_holds_two_blocks_of_those_alone(monkeypatch, shared,
                                                                                           ring2):
    """On an SM of 100 KB of shared memory (an RTX 3090's, 4090's, an L4's) two blocks of the 128 x 128 tile's 3-stage
    ring (51 to 60 KB each) do not fit, two of its 2-stage ring do (static shared memory); an H100's, an A100's and the
    emulator (no SM) keep 3 stages. The other tiles run as planned."""
    monkeypatch.setattr(conv_tc, "device_property", lambda be, name: shared)
    for kernel in conv_tc.KERNELS:
        if conv_tc.RING2 in kernel:
            continue
        got = conv_tc.for_device(None, kernel)
        square = conv_tc.tile_of(kernel) == "Tc128x128"
        assert got == (kernel.replace("Tc128x128", conv_tc.RING2) if square and ring2 else kernel)
        assert got in conv_tc.KERNELS
        if square:
            r = conv_tc.ring_bytes(got)
            assert (r <= conv_tc.STATIC_RING) == ring2 and conv_tc.dynamic_shared(got) == (0 if ring2 else r)
            assert shared is None or 2 * (r + 6 * 1024) <= shared


# The 1x1, padding-0 convolutions of 64 -> 128 channels that the projection backward takes (conv_tc.projection):
# ResNet-18's first projection; odd sizes; strides 1 to 3, with a last row and column of x that no cell of stride 3
# reads; a partial stage and a partial block of cells; 1078 cells, 9 parts of dw's sum added in two levels.
PROJECTION_SHAPES = [
    ((2, 64, 8, 8), 2),
    ((3, 64, 9, 7), 2),
    ((2, 64, 5, 6), 1),
    ((2, 64, 11, 10), 3),
    ((6, 64, 14, 14), 2),
    ((22, 64, 14, 14), 2),
]
PROJECTION_W = (128, 64, 1, 1)


def launched_names(monkeypatch):
    """The name expressions of the kernels conv_tc launches from now on."""
    names, launch = [], conv_tc.launch
    monkeypatch.setattr(conv_tc, "launch", lambda be, family, kernel, *a, **k: names.append(kernel) or
                        launch(be, family, kernel, *a, **k))
    return names


@pytest.mark.parametrize("x_shape, stride, dy_tf32", [(*shape, True) for shape in PROJECTION_SHAPES] +
                         [(*PROJECTION_SHAPES[1], False)], ids=lambda v: {True: "dy in tf32", False: "raw dy"}.get(v))
def test_a_projections_backward_reads_dy_once_for_dx_and_dw(emu, monkeypatch, x_shape, stride, dy_tf32):
    """With dy of TF32 values, as a batch norm's backward hands it: dx (zeros at the pixels no cell reads: they
    start as NaN), dw and db from the one kernel, against the references. A raw dy, whose bias gradient is the
    sum of dy as given, not of what the GEMMs read, takes the separate kernels."""
    names = launched_names(monkeypatch)
    check_conv(emu, x_shape, PROJECTION_W, stride, 0, channels_last=True, dy_tf32=dy_tf32)
    backward = [name.partition("<")[0] for name in names if not name.startswith("conv_tc_forward")]
    assert backward == (["conv_tc_projection_backward"] if dy_tf32 else ["conv_tc_dgrad", "conv_tc_wgrad"]), names


def test_a_projections_dx_is_added_to_the_gradient_there(emu, monkeypatch):
    """add_dx_to: dx added in place at the pixels the cells read, the others left as they were."""
    names = launched_names(monkeypatch)
    x, w, dy, total = draw((3, 64, 9, 7), PROJECTION_W, (3, 128, 5, 4), (3, 64, 9, 7))
    x, into = (np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) for a in (x, total.copy()))
    dy = kernels.cpu.round_tf32(dy)
    dx, dw, db = emu.conv2d_backward(dy, x, w, 2, 0, add_dx_to=into, dy_tf32=True)
    assert dx is into and names == ["conv_tc_projection_backward<true>"], names
    check_products("projection dx added", (dx,), [dy, w],
                   lambda dy, w, added: (R.conv2d_backward(dy, x, w, 2, 0)[0] + added,), (128,), total)
    check_products("projection dw", (dw,), [dy, x], lambda dy, x, _: (R.conv2d_backward(dy, x, w, 2, 0)[1],), (60,))


def test_the_projections_split_sums_do_not_depend_on_which_block_finishes_last(monkeypatch):
    """dx, dw and db bit for bit the same with the emulator's blocks in ascending and in descending order:
    another of the 9 parts of each group, and another group, finishes last."""
    from kernels.emu import thread_order
    be = kernels._device_backend("emu")
    x, w, dy = draw((22, 64, 14, 14), PROJECTION_W, (22, 128, 7, 7))
    x, dy = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2), kernels.cpu.round_tf32(dy)
    names = launched_names(monkeypatch)
    results = []
    for order in ("ascending", "descending"):
        with thread_order(order):
            results.append([np.array(a) for a in be.conv2d_backward(dy, x, w, 2, 0, dy_tf32=True)])
    assert names == ["conv_tc_projection_backward<false>"] * 2, names
    assert conv_tc.projection_plan((22, 64, 14, 14, 128, 1, 1, 2, 2, 0, 0, 7, 7)).splits == 9
    for what, first, second in zip(("dx", "dw", "db"), *results):
        assert np.array_equal(first, second), what


@pytest.mark.parametrize("planted", [False, True])
def test_the_projection_backward_asks_for_the_shared_memory_it_uses(monkeypatch, planted):
    """The launch asks for conv_tc.PROJECTION_SHARED bytes of dynamic shared memory, what the kernel's ring,
    pixels and bias sums take; planted: 2 KB short (the warps' bias sums), which the emulator's sanitizer
    refuses as the kernel writes past it."""
    if planted:
        monkeypatch.setattr(conv_tc, "PROJECTION_SHARED", conv_tc.PROJECTION_SHARED - 4 * 128 * 4)
    be = kernels._device_backend("emu")
    x, w, dy = draw((2, 64, 8, 8), PROJECTION_W, (2, 128, 4, 4))
    dy = kernels.cpu.round_tf32(dy)
    if planted:
        with pytest.raises(kernels.emu.KernelError, match="shared"):
            be.conv2d_backward(dy, x, w, 2, 0, dy_tf32=True)
    else:
        check_products("projection", be.conv2d_backward(dy, x, w, 2, 0, dy_tf32=True)[:2], [dy, x, w],
                       lambda dy, x, w, _: R.conv2d_backward(dy, x, w, 2, 0)[:2], (128, 32))


def test_a_residual_blocks_step_on_the_projection_and_stride_2_kernels(monkeypatch, halo_everywhere):
    """ResNet-18's first block with a projection (64 -> 128 at stride 2; one 28 x 28 image after a stem, its batch
    norm and relu) on the emulator under tf32, the kernels from windows wherever they apply: the projection's
    backward on the one kernel (its dy from bn2's backward, in TF32), conv1's backward-data from windows of dy
    (added to the projection's dx, with the stem's norm's sums), as near NumPy's float32 step as the step on the
    separate kernels (all the gradients together, in norm, within twice its distance: each a sum of roundings,
    in another order). (Both kernels' sums bit for bit in both block orders: the tests of each above, and the
    norm's sums through the stride-2 one in test_conv_statistics.)"""
    import nn
    import nn.functional as F
    from nn.resnet import Residual
    x = rng().random((1, 1, 28, 28)).astype(np.float32)
    labels = np.array([3], np.int32)
    names = halo_everywhere

    def step(emulated=True):
        nn.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                              Residual(64, 128, use_1x1conv=True, stride=2), nn.AdaptiveAvgPool2d((1, 1)),
                              nn.Flatten(), nn.Linear(128, 10))
        with kernels.emulate() if emulated else contextlib.nullcontext():
            loss = F.cross_entropy(model(nn.Tensor(x)), labels)
            loss.backward()
        return loss.numpy().copy(), [np.array(p.grad) for p in model.parameters()]
    loss, grads = step()
    new = ("conv_tc_projection_backward<false>", conv_tc.PHASE_KERNEL)
    assert [names.count(kernel) for kernel in new] == [1, 1], sorted(set(names))
    assert np.isfinite(loss)
    monkeypatch.setattr(conv_tc, "projection", lambda geometry: False)   # the separate kernels
    monkeypatch.setattr(conv_tc, "phase_windows", lambda geometry: False)
    conv_tc.plan.cache_clear()
    flat = lambda arrays: np.concatenate([a.ravel() for a in arrays]).astype(np.float64)   # noqa: E731
    separate, fp32 = flat(step()[1]), flat(step(emulated=False)[1])
    assert [names.count(kernel) for kernel in new] == [1, 1] and "conv_tc_dgrad<Tc128x64, 16>" in names, names
    off = lambda a: np.linalg.norm(a - fp32) / np.linalg.norm(fp32)   # noqa: E731
    assert off(flat(grads)) <= 2 * off(separate), (off(flat(grads)), off(separate))


# 3x3, stride-2, padding-1 convolutions of even H and W that backward-data's phases from windows of dy take
# (conv_tc.phase_windows, whatever the grid under halo_everywhere; the window of 192 cells fits its 304 slots at a
# dy of 14 x 14, 20 x 10, not at 12 x 12 or 16 x 16): ResNet-18's 64 -> 128, one image, 196 cells a phase, a
# partial second block; fewer channels, windows across images' ends; an odd number of chunks of dy's (48 = 3 x 16).
PHASE_SHAPES = [
    ((1, 64, 28, 28), (128, 64, 3, 3)),
    ((3, 16, 28, 28), (32, 16, 3, 3)),
    ((2, 32, 40, 20), (48, 32, 3, 3)),
]


@pytest.mark.parametrize("x_shape, w_shape", PHASE_SHAPES)
def test_stride_2_backward_data_from_windows_of_dy(emu, halo_everywhere, x_shape, w_shape):
    """dx of every phase (each cell of dx written: dx starts as NaN) against the references, with dy of TF32
    values as the step's (and, at the first shape, raw: rounded by a launch of its own, which backward-data
    then reads)."""
    for dy_tf32 in (True, False) if x_shape == PHASE_SHAPES[0][0] else (True,):
        check_conv(emu, x_shape, w_shape, 2, 1, channels_last=True, dy_tf32=dy_tf32)
    assert halo_everywhere.count(conv_tc.PHASE_KERNEL) == (2 if x_shape == PHASE_SHAPES[0][0] else 1), halo_everywhere
    assert "mirrored_weights<float>" in halo_everywhere


@pytest.mark.parametrize("planted", [False, True])
def test_the_stride_2_windows_fit_the_slots_the_kernel_has(monkeypatch, halo_everywhere, planted):
    """A block's window of dy within conv_tc.PHASE_SLOTS slots (phase_windows: 19 rows of 16 at 14 x 14, 304, the
    kernel's TC_PHASE_SLOTS); planted: the launcher's check at twice the slots, so that a 22 x 22 dy's windows (up
    to 14 rows of 24, 336 slots) pass the kernel's: the cells of the last rows then read the taps' weights beside
    the window, which the references refuse."""
    if planted:
        monkeypatch.setattr(conv_tc, "PHASE_SLOTS", 2 * conv_tc.PHASE_SLOTS)
    conv_tc.plan.cache_clear()
    emu = kernels._device_backend("emu")
    x_shape, w_shape = (2, 16, 44, 44), (16, 16, 3, 3)
    geometry = (2, 16, 44, 44, 16, 3, 3, 2, 2, 1, 1, 22, 22)
    assert conv_tc.phase_windows(geometry) == planted
    if planted:
        with pytest.raises((AssertionError, kernels.emu.KernelError)):
            check_conv(emu, x_shape, w_shape, 2, 1, channels_last=True, dy_tf32=True)
        assert conv_tc.PHASE_KERNEL in halo_everywhere
    else:
        check_conv(emu, (2, 16, 28, 28), w_shape, 2, 1, channels_last=True, dy_tf32=True)
        assert conv_tc.PHASE_KERNEL in halo_everywhere


def resnet18_convolutions(batch, width):
    """(x shape, w shape, stride, padding) of every distinct convolution of nn.resnet18 that the
    tensor cores take (all but the stem)."""
    return [(layer.x, layer.w, layer.stride, layer.padding) for layer, _ in distinct(resnet18_layers(batch, width))
            if layer.op == "conv2d" and conv_tc.supports(layer.w[1], layer.w[0])]


@pytest.mark.parametrize("variant", ["default", "square tile", "square tile ring2"], indirect=True)
@pytest.mark.parametrize("x_shape, w_shape, stride, padding", resnet18_convolutions(batch=2, width=8))
def test_conv_at_the_shapes_of_resnet18(monkeypatch, variant, x_shape, w_shape, stride, padding):
    """The launchers' choices, and the 128 x 128 tile forced where its copies take the convolution (at width 8 no
    GEMM has the more than 64 columns that choose it), with a ring of 3 stages or of 2 (an SM of 100 KB)."""
    launched, launch = [], conv_tc.launch
    monkeypatch.setattr(conv_tc, "launch", lambda be, family, kernel, *a, **k: launched.append(kernel) or
                        launch(be, family, kernel, *a, **k))
    check_conv(kernels._device_backend("emu"), x_shape, w_shape, stride, padding)
    square = {conv_tc.tile_of(kernel) for kernel in launched} & {"Tc128x128", conv_tc.RING2}
    if variant != "default" and x_shape[1] % 16 == 0:   # the aligned copies: every GEMM on the square tile
        assert square == {conv_tc.RING2 if variant.endswith("ring2") else "Tc128x128"}, launched


# 3x3, stride 1, padding 1, channels multiples of 16 where the window is read, 64 columns or fewer: the halo
# kernels (forward and backward-data, whatever the grid: halo_everywhere), with blocks across image
# boundaries (several images in the second), 4 and 6 chunks of channels (the last's backward-data has 96
# columns: not the halo's), a partial tile of columns (40: its backward-data, O % 16, not the halo's either).
HALO_SHAPES = [
    ((2, 16, 9, 7), (16, 16, 3, 3)),
    ((4, 16, 4, 4), (64, 16, 3, 3)),
    ((1, 64, 28, 28), (64, 64, 3, 3)),
    ((2, 96, 5, 6), (48, 96, 3, 3)),
    ((2, 16, 7, 6), (40, 16, 3, 3)),
]


@pytest.mark.parametrize("x_shape, w_shape", HALO_SHAPES)
def test_3x3_convolutions_from_windows_of_the_image(emu, halo_everywhere, x_shape, w_shape):
    check_conv(emu, x_shape, w_shape, 1, 1, channels_last=True)
    assert f"conv_tc_forward_halo<{conv_tc.TF32.halo}>" in halo_everywhere
    dgrad_halo = w_shape[0] % 16 == 0 and x_shape[1] <= 64   # dy's channels, and 64 columns (C) at most
    assert (f"conv_tc_dgrad_halo<{conv_tc.TF32.halo}>" in halo_everywhere) == dgrad_halo, halo_everywhere


# Backward-weight from windows of x (conv_tc_wgrad_halo: 32 input channels a block, 64 output channels or
# fewer, 56 pixels a stage): stages across image boundaries (several images in the second), two blocks of input
# channels, a partial tile of columns, the last stage part of one (all but the second).
WGRAD_HALO_SHAPES = [
    ((2, 32, 9, 7), (32, 32, 3, 3)),
    ((7, 64, 4, 4), (64, 64, 3, 3)),
    ((2, 32, 7, 6), (40, 32, 3, 3)),
]


@pytest.mark.parametrize("x_shape, w_shape", WGRAD_HALO_SHAPES)
def test_backward_weight_from_windows_of_x(emu, halo_everywhere, x_shape, w_shape):
    """With dy of TF32 values, as the step's: its bias gradient is their sum. A raw dy, whose bias gradient is
    the sum of dy as given, not of what the GEMM reads, takes conv_tc_wgrad (test_conv_at_odd_shapes)."""
    check_conv(emu, x_shape, w_shape, 1, 1, channels_last=True, dy_tf32=True)
    assert conv_tc.WGRAD_HALO["conv_tc"].kernel in halo_everywhere
    geometry = (x_shape[0], x_shape[1], *x_shape[2:], w_shape[0], 3, 3, 1, 1, 1, 1, *x_shape[2:])
    assert conv_tc.plan("wgrad", geometry, windows=False).kernel.startswith("conv_tc_wgrad<")
    del halo_everywhere[:]
    check_conv(emu, x_shape, w_shape, 1, 1, channels_last=True)
    assert not any(name.startswith("conv_tc_wgrad_halo") for name in halo_everywhere), halo_everywhere


@pytest.mark.parametrize("x_shape, w_shape", [((2, 32, 10, 10), (64, 32, 3, 3)), ((4, 32, 12, 12), (48, 32, 3, 3))])
def test_backward_weight_from_windows_split_over_the_pixels(emu, monkeypatch, halo_everywhere, x_shape, w_shape):
    """The halo backward-weight with its pixels split into parts of one stage (56 pixels): 4 parts, and 11 (added
    in two levels), the bias gradient's too."""
    monkeypatch.setattr(conv_tc, "WGRAD_HALO_SPLIT_TARGET", 10**9)
    monkeypatch.setattr(conv_tc, "WGRAD_HALO_MIN_SPLIT_K", 1)
    n, _, h, w = x_shape
    geometry = (n, x_shape[1], h, w, w_shape[0], 3, 3, 1, 1, 1, 1, h, w)
    assert conv_tc.plan("wgrad", geometry).splits == -(-n * h * w // conv_tc.WGRAD_HALO["conv_tc"].pixels)
    check_conv(emu, x_shape, w_shape, 1, 1, channels_last=True, dy_tf32=True)
    assert conv_tc.WGRAD_HALO["conv_tc"].kernel in halo_everywhere


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "bn1 applied"])
def test_the_halo_backward_weights_split_sums_do_not_depend_on_which_block_finishes_last(monkeypatch, normalize):
    """dw and db bit for bit the same with the emulator's blocks in ascending and in descending order (another
    part of each tile, and of each group, finishes last), its 11 parts added in two levels."""
    from kernels.emu import thread_order
    monkeypatch.setattr(conv_tc, "WGRAD_HALO_SPLIT_TARGET", 10**9)
    monkeypatch.setattr(conv_tc, "WGRAD_HALO_MIN_SPLIT_K", 1)
    conv_tc.plan.cache_clear()
    be = kernels._device_backend("emu")
    x, w, dy = draw((4, 32, 12, 12), (48, 32, 3, 3), (4, 48, 12, 12))
    x, dy = (np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) for a in (x, kernels.cpu.round_tf32(dy)))
    gamma, beta, mean = rng().standard_normal((3, 32)).astype(np.float32)
    norm = (gamma, beta, mean, (0.5 + rng().random(32)).astype(np.float32)) if normalize else None
    names, launch = [], conv_tc.launch
    monkeypatch.setattr(conv_tc, "launch", lambda be, family, kernel, *a, **k: names.append(kernel) or
                        launch(be, family, kernel, *a, **k))
    results = []
    try:
        for order in ("ascending", "descending"):
            with thread_order(order):
                results.append([np.array(a) for a in be.conv2d_backward(dy, x, w, 1, 1, dy_tf32=True, need_dx=False,
                                                                        normalize=norm)[1:]])
    finally:
        conv_tc.plan.cache_clear()
    halo = conv_tc.WGRAD_HALO["conv_tc"].kernel
    assert names == [halo[:-1] + ", true>" if normalize else halo] * 2, names
    for what, first, second in zip(("dw", "db"), *results):
        assert np.array_equal(first, second), what


def channels_last(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


@pytest.mark.parametrize("x_shape, w_shape, stride, padding", [((2, 8, 7, 6), (12, 8, 3, 3), 2, 1),
                                                               ((2, 16, 5, 5), (32, 16, 3, 3), 1, 1),
                                                               ((2, 4, 6, 6), (8, 4, 3, 3), 1, 1)])
def test_channels_last_inputs_give_the_same_results(variant, x_shape, w_shape, stride, padding):
    """Activations and weights (as a flat buffer holds them) NCHW or channels-last, and gradients
    written into channels-last or C-contiguous arrays (NaN-filled: every element written), agree
    bit for bit."""
    be = kernels._device_backend("emu")
    x, w, b = draw(x_shape, w_shape, (w_shape[0],))
    x_last, w_last = channels_last(x), channels_last(w)
    y = be.conv2d_forward(x, w, b, stride, padding)
    for x_, w_ in ((x_last, w), (x, w_last), (x_last, w_last)):
        assert np.array_equal(y, be.conv2d_forward(x_, w_, b, stride, padding))
    (dy,) = draw(y.shape)
    expected = be.conv2d_backward(dy, x, w, stride, padding)
    targets = [None, (np.full_like(w, np.nan), np.full_like(b, np.nan)),
               (channels_last(np.full_like(w, np.nan)), np.full_like(b, np.nan))]
    for out in targets:
        got = be.conv2d_backward(channels_last(dy), x_last, w_last, stride, padding, out=out)
        for a, b_, what in zip(expected, got, ("dx", "dw", "db")):
            assert np.array_equal(a, b_), f"{what} into {'new arrays' if out is None else out[0].strides}"
        assert out is None or (got[1] is out[0] and got[2] is out[1])


@pytest.mark.parametrize("x_shape, w_shape, stride, padding", [((2, 16, 10, 10), (16, 16, 3, 3), 1, 1),
                                                               ((2, 12, 9, 7), (20, 12, 3, 3), 2, 1),
                                                               ((2, 128, 6, 6), (128, 128, 3, 3), 1, 1)])
def test_split_sums_do_not_depend_on_which_block_finishes_last(variant, x_shape, w_shape, stride, padding):
    """y, dx, dw and db bit for bit the same whichever part of a tile finishes last (the emulator's
    blocks in ascending and in descending order): the parts, and the groups of the two-level sums,
    are added in a fixed order."""
    from kernels.emu import thread_order
    be = kernels._device_backend("emu")
    x, w, b = draw(x_shape, w_shape, (w_shape[0],))
    results = []
    for order in ("ascending", "descending"):
        with thread_order(order):
            y = be.conv2d_forward(x, w, b, stride, padding)
            results.append([np.array(a) for a in (y, *be.conv2d_backward(y, x, w, stride, padding))])
    for what, first, second in zip(("y", "dx", "dw", "db"), *results):
        assert np.array_equal(first, second), f"{what} under {variant}"


def test_small_grids_split_their_k_and_large_ones_do_not():
    """At batch 256: stage 4's 4096 output pixels give too few tiles for an H200 without split-K;
    stage 1's 200,704 give plenty (its forward and backward-data from windows of the image). Backward-weight
    splits at every layer, in two levels where the parts are many."""
    stage = {layer.label: (layer.x, layer.w, layer.stride, layer.padding)
             for layer, _ in distinct(resnet18_layers(256)) if layer.op == "conv2d"}

    def plans(label):
        (n, c, h, w), (o, _, kh, kw), s, p = stage[label]
        oh, ow = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
        return {gemm: conv_tc.plan(gemm, (n, c, h, w, o, kh, kw, s, s, p, p, oh, ow))
                for gemm in ("forward", "dgrad", "wgrad")}
    for gemm, p in plans("conv 3x3/1 512->512 4->4").items():
        tile = p.kernel.partition("<")[2].partition(",")[0]
        target = conv_tc.WGRAD_SPLIT_TARGET[tile] if gemm == "wgrad" else conv_tc.SPLIT_TARGET
        assert p.grid[0] * p.grid[1] * p.grid[2] >= target and p.splits > 1, (gemm, p)
        assert p.chunk % conv_tc.BK == 0
        assert p.chunk >= (conv_tc.WGRAD_MIN_SPLIT_K if gemm == "wgrad" else conv_tc.MIN_SPLIT_K)
    stage1 = plans("conv 3x3/1 64->64 28->28")
    assert stage1["forward"].splits == stage1["dgrad"].splits == 1
    assert stage1["forward"].kernel == "conv_tc_forward_halo<TcHalo128x64>"
    assert stage1["dgrad"].kernel == "conv_tc_dgrad_halo<TcHalo128x64>"
    wgrad = stage1["wgrad"]   # from windows of x: 2 blocks of 32 input channels, split to 264 blocks
    assert wgrad.kernel == conv_tc.WGRAD_HALO["conv_tc"].kernel and wgrad.grid[:2] == (2, 1)
    assert wgrad.grid[2] == wgrad.splits > conv_tc.ONE_LEVEL_PARTS and 2 * wgrad.splits >= conv_tc.WGRAD_HALO_SPLIT_TARGET
    assert wgrad.chunk % conv_tc.WGRAD_HALO["conv_tc"].pixels == 0
    assert 1 < wgrad.group < wgrad.splits and wgrad.chunk * (wgrad.splits - 1) < 256 * 28 * 28 <= wgrad.chunk * \
        wgrad.splits


def test_channel_counts_choose_the_copies():
    """Multiples of 16 (at most 32 taps) take the aligned iterators, other multiples of 4 the
    gathered copies; the others are not the tensor cores' (conv.py runs them on conv.cu)."""
    def kernel(c, o, k=3):
        return conv_tc.plan("forward", (2, c, 8, 8, o, k, k, 1, 1, k // 2, k // 2, 8, 8)).kernel
    assert kernel(64, 128).endswith(", 16>") and kernel(16, 16, 5).endswith(", 16>")
    assert kernel(16, 16, 7).endswith(", 4>") and kernel(8, 16).endswith(", 4>") and kernel(16, 12).endswith(", 4>")
    assert not conv_tc.supports(1, 64) and not conv_tc.supports(64, 10) and conv_tc.supports(4, 4)
    with pytest.raises(ValueError, match="multiples of 4"):
        conv_tc.plan("forward", (2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1, 8, 8))


def test_fast_divmod_divides_exactly():
    """conv_geometry.cuh's FastDivmod, (umulhi(n, m) + n) >> shift, with the launcher's multiplier
    and shift, against integer division, for divisors from 1 to 2^31 - 1 and dividends up to
    2^31 - 1, the ends of each divisor's range and random ones."""
    g = rng()
    divisors = np.unique(np.concatenate([np.arange(1, 300), [784, 196, 49, 28, 14, 7, 4, 2**16 + 1, 2**31 - 1],
                                         g.integers(1, 2**31, 200)]))
    for d in divisors.tolist():
        multiplier, shift = conv_tc.fast_divmod(d)
        n = np.unique(np.concatenate([g.integers(0, 2**31, 2000), np.arange(0, 4 * d + 2) if d < 1000 else [],
                                      [d - 1, d, d + 1, 2**31 - 1, (2**31 - 1) // d * d, (2**31 - 1) // d * d - 1]]))
        n = n[(n >= 0) & (n < 2**31)].astype(np.uint64)
        high = (n * np.uint64(multiplier)) >> np.uint64(32)
        quotient = (high + n) >> np.uint64(shift)
        assert np.array_equal(quotient, n // np.uint64(d)), d
    with pytest.raises(ValueError, match="divisors"):
        conv_tc.fast_divmod(0)


def test_inputs_at_an_odd_offset_are_copied_for_the_16_byte_copies():
    """A parameter is a view into the flat buffer, at any offset; the 16-byte cp.async needs 16."""
    be = kernels._device_backend("emu")
    (flat,) = draw(1 + 8 * 4)
    w = flat[1:33].reshape(8, 4, 1, 1)   # 4 bytes past 16
    (x,) = draw((2, 4, 5, 5))
    y = be.conv2d_forward(x, w, None, 1, 0)
    validate(y, R.conv2d_forward(x, w, None, 1, 0), "1x1 conv of a weight at an odd offset", rtol=2e-3)
    dx, dw, _ = be.conv2d_backward(y, x, w, 1, 0)
    validate(dx, R.conv2d_backward(y, x, w, 1, 0)[0], "dx", rtol=2e-3)


def test_round_tf32_rounds_as_the_reference_does():
    """round_tf32 (the flat buffer's TF32 copy, a weight outside one) on the emulator and on the CPU against
    tf32_rounded above: to nearest, ties away, the low 13 bits zero; infinity and NaN as they are; into a view
    at an odd offset, every element written, none past it."""
    g = rng()
    x = np.concatenate([g.standard_normal(300) * 10.0 ** g.integers(-30, 30, 300),
                        [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, 1.0 + 2.0**-11, -(1.0 + 2.0**-11),
                         1.0 + 2.0**-11 - 2.0**-23, 1.0 + 3 * 2.0**-11]]).astype(np.float32)
    for be in (kernels._device_backend("emu"), kernels.cpu):
        buffer = np.full(x.size + 2, np.nan, np.float32)
        be.round_tf32(x, out=buffer[1:-1])
        with np.errstate(over="ignore"):   # the largest float rounds to infinity
            want = tf32_rounded(x).astype(np.float32)
        np.testing.assert_array_equal(buffer[1:-1], want, err_msg=str(be))
        assert np.isnan(buffer[[0, -1]]).all(), "round_tf32 wrote outside its output"
        assert (buffer[1:-1].view(np.uint32) & 0x1FFF == 0).all()
        assert np.isnan(be.round_tf32(np.array([np.nan, -np.nan], np.float32))).all()
    with pytest.raises(TypeError, match="round_tf32: rounds float32, not float64"):
        kernels._device_backend("emu").round_tf32(x.astype(np.float64))


@pytest.mark.parametrize("x_shape, w_shape, stride, padding", [((2, 16, 9, 7), (32, 16, 3, 3), 2, 1),
                                                               ((2, 8, 6, 5), (12, 8, 3, 3), 1, 1),
                                                               ((2, 16, 6, 6), (16, 16, 3, 3), 1, 1)])
def test_operands_that_hold_tf32_values_are_read_as_they_are(emu, halo_everywhere, monkeypatch, x_shape, w_shape,
                                                             stride, padding):
    """The TF32 GEMMs read the weights, and backward-data dy, as they are, TF32 values (w_tf32: a flat buffer's
    TF32 copy; dy_tf32: batch norm's backward rounded it), and those that are not are rounded by a launch of
    round_tf32 first (the aligned copies, the gathered ones, the halo kernels), dy once for both backward
    GEMMs: the same bits either way. Planted: raw weights or a raw dy handed as TF32 values give other
    results (the tensor cores read their top 19 bits), so that it is the launch, not the kernels, that rounds."""
    rounds = []
    real = conv_tc.round_tf32
    monkeypatch.setattr(conv_tc, "round_tf32", lambda be, a: rounds.append(a.shape) or real(be, a))
    x, w = draw(x_shape, w_shape)
    y = emu.conv2d_forward(x, w, None, stride, padding)
    (dy,) = draw(y.shape)
    dx, dw, _ = emu.conv2d_backward(dy, x, w, stride, padding)
    assert len(rounds) == 3, rounds   # w for the forward, w and dy for backward-data
    w_tf32, dy_tf32 = kernels.cpu.round_tf32(w), kernels.cpu.round_tf32(dy)
    y_tf32 = emu.conv2d_forward(x, w_tf32, None, stride, padding, w_tf32=True)
    dx_tf32, dw_tf32, _ = emu.conv2d_backward(dy_tf32, x, w_tf32, stride, padding, w_tf32=True, dy_tf32=True)
    assert len(rounds) == 3, "no launch rounds what holds TF32 values"
    for ours, theirs in ((y_tf32, y), (dx_tf32, dx), (dw_tf32, dw)):
        np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(emu.conv2d_forward(x, w, None, stride, padding, w_tf32=True), y)
    assert not np.array_equal(emu.conv2d_backward(dy, x, w_tf32, stride, padding, w_tf32=True, dy_tf32=True)[0], dx)


def test_backward_weight_reads_dy_in_tf32_and_sums_the_bias_of_dy_as_given(emu):
    """Backward-weight's blocks of the first row of tiles (here the columns of the taps 0-7, 128 of 144) sum the
    bias gradient in a main loop of their own: one that reads dy as the caller gave it and rounds it as it
    lands, or, where dy holds TF32 values already (dy_tf32), one that sums them as they land; the others
    (tap 8) read dy's TF32 values as they are. The bias gradient is the sum of dy as given, within float32's
    rounding of the sum, where the sum of dy's TF32 values would not be; dw is the same bits whether dy comes
    rounded or not. Planted: raw dy handed as TF32 values changes the columns of both rows of tiles (nothing
    rounds it), not the bias gradient."""
    x_shape, w_shape = (2, 16, 9, 7), (32, 16, 3, 3)
    x, w = draw(x_shape, w_shape)
    (dy,) = draw((2, 32, 9, 7))

    def within_the_sums_rounding(db, dy):
        pixels = np.float64(dy).transpose(1, 0, 2, 3).reshape(32, -1)
        bound = (pixels.shape[1] + 16) * UNIT32 * np.abs(pixels).sum(axis=1)
        assert np.all(np.abs(db - pixels.sum(axis=1)) <= bound), np.abs(db - pixels.sum(axis=1)) / bound
        return pixels, bound
    _, dw, db = emu.conv2d_backward(dy, x, w, 1, 1)
    pixels, bound = within_the_sums_rounding(db, dy)
    assert np.any(np.abs(tf32_rounded(pixels).sum(axis=1) - pixels.sum(axis=1)) > bound), "the check can fail"
    dy_tf32 = kernels.cpu.round_tf32(dy)
    _, dw_rounded, db_rounded = emu.conv2d_backward(dy_tf32, x, w, 1, 1, dy_tf32=True)
    np.testing.assert_array_equal(dw_rounded, dw)
    within_the_sums_rounding(db_rounded, dy_tf32)
    _, dw_raw, db_raw = emu.conv2d_backward(dy, x, w, 1, 1, dy_tf32=True)   # planted
    np.testing.assert_array_equal(db_raw, db)
    assert not np.array_equal(dw_raw[:, :, 2, 2], dw[:, :, 2, 2])
    assert not np.array_equal(dw_raw[:, :, :2], dw[:, :, :2])


@pytest.mark.parametrize("backend", ["emu", "cpu"])
def test_batch_norm_backward_rounds_dx_and_the_shortcuts_gradient_where_asked(backend):
    """round_dx and round_g: dx and the shortcut's gradient g rounded to TF32 (round_tf32) where they are made,
    bit for bit round_tf32 of what the same call makes without them, the caller's dy left as it was."""
    be = kernels._device_backend("emu") if backend == "emu" else kernels.cpu
    g = rng()
    x, dy, y = (g.standard_normal((2, 8, 5, 3)).astype(np.float32) for _ in range(3))
    gamma, beta = g.standard_normal((2, 8)).astype(np.float32)
    mean, invstd = x.mean(axis=(0, 2, 3)), 1 / x.std(axis=(0, 2, 3))
    given = dy.copy()
    plain = be.batch_norm_backward(dy, x, gamma, mean, invstd, y=np.maximum(y, 0), shortcut=True)
    rounded = be.batch_norm_backward(dy, x, gamma, mean, invstd, y=np.maximum(y, 0), shortcut=True, round_dx=True,
                                     round_g=True)
    for ours, theirs in zip(rounded, plain):
        want = kernels.cpu.round_tf32(np.asarray(theirs)) if ours is rounded[0] or ours is rounded[3] else theirs
        np.testing.assert_array_equal(ours, want)
    assert not np.array_equal(rounded[0], plain[0]), "rounding changes dx"
    np.testing.assert_array_equal(dy, given)
    with pytest.raises(ValueError, match="round_g rounds the shortcut's gradient"):
        be.batch_norm_backward(dy, x, gamma, mean, invstd, round_g=True)


def test_a_batch_norm_hands_the_convolution_before_it_dy_in_tf32(monkeypatch):
    """ResNet-18's step under tf32: the gradient of every TF32 convolution's output is made whole by a batch
    norm's backward (its dx, or the residual join's shortcut gradient for the 1x1 projections), which rounds it
    to TF32 there, so that backward-data reads it as it is (dy_tf32) and no launch rounds it; the stem's
    (float32) is not rounded. Planted: a convolution whose output a second op reads too gets a gradient that is
    a sum, not rounded, and its backward-data rounds it by a launch."""
    import nn
    import nn.functional as F
    from kernels import emu
    rounds = []
    real = conv_tc.round_tf32
    monkeypatch.setattr(conv_tc, "round_tf32", lambda be, a: rounds.append(a.shape) or real(be, a))
    calls = []

    def recorded(be):
        backward = be.conv2d_backward
        monkeypatch.setattr(be, "conv2d_backward", lambda dy, x, w, *a, **k: calls.append(
            (w.shape, k.get("dy_tf32"))) or backward(dy, x, w, *a, **k))
    nn.manual_seed(0)
    model = nn.resnet18(width=8)
    opt = nn.SGD(model.parameters(), lr=0.1)
    x = rng().random((2, 1, 8, 8)).astype(np.float32)
    with kernels.emulate(), emu.sanitizer("off"):
        be = kernels.backend_of(opt.flat.data)
        recorded(be)
        F.cross_entropy(model(nn.Tensor(x)), np.array([1, 2], np.int32)).backward()
        assert len(calls) == 20 and all(tf32 == (shape[1] > 1) for shape, tf32 in calls), calls
        assert rounds == [], rounds
        conv, norm = model[0], model[1]
        inner = nn.Conv2d(8, 8, 3, padding=1)
        calls.clear()
        h = inner(conv(nn.Tensor(x)))
        joined = norm(h) + h   # planted: h read twice, its gradient a sum
        joined.backward(np.ones(joined.shape, np.float32))
    # its weight, outside a flat buffer, rounded by a launch in the forward and in backward-data; and its dy
    assert calls[0] == ((8, 8, 3, 3), False) and rounds == [(8, 3, 3, 8), (2, 8, 8, 8), (8, 3, 3, 8)], (calls, rounds)


def test_the_precision_is_a_setting_with_tf32_the_default():
    assert kernels.PRECISIONS == ("tf32", "bf16", "fp32")
    with kernels.use_precision("fp32"):
        assert kernels.precision() == "fp32"
        with pytest.raises(ValueError, match="unknown precision 'fp16'"):
            kernels.set_precision("fp16")
        assert kernels.precision() == "fp32"
    assert kernels.precision() == "tf32"


def test_fp32_runs_the_fp32_kernels_and_tf32_the_tensor_cores():
    be, launched = kernels._device_backend("emu"), []
    x, w, b = draw((2, 4, 5, 5), (8, 4, 3, 3), (8,))
    for precision in ("tf32", "fp32"):
        launched.clear()
        with kernels.use_precision(precision), be.observing_launches(lambda family, name: launched.append(name)):
            y = be.conv2d_forward(x, w, b, 1, 1)
            be.conv2d_backward(y, x, w, 1, 1)
            be.linear_backward(*draw((3, 6), (3, 5), (6, 5)))
        tensor_core = [name for name in launched if name.startswith("conv_tc_")]
        if precision == "tf32":   # the linear layer computes in float32 under both
            assert {name.partition("<")[0] for name in tensor_core} == set(conv_tc.GEMMS), launched
            assert not any(name.startswith("conv2d_") for name in launched), launched
            assert any(name.startswith("matmul") for name in launched), launched
        else:
            assert not tensor_core and any(name.startswith("matmul") for name in launched), launched


# ---- the whole network ---------------------------------------------------------------------

@pytest.mark.slow
def test_resnet18_training_step_on_the_emulator_in_tf32():
    """One SGD step of ResNet-18 (width 8, batch 2) with the tensor-core kernels against NumPy in
    float32. The network magnifies any rounding of its convolutions' inputs: NumPy alone, with
    those inputs rounded to TF32, moves this gradient by about 13% (measured at batches 2, 4 and
    16), so the bounds here are TF32's for the loss and that magnification's for the gradients;
    the kernels themselves are held to the tight bounds above."""
    loss, grad, params, stats = resnet_step(emulated=True)
    ref_loss, ref_grad, _, ref_stats = resnet_step()
    assert abs(loss - ref_loss) <= 4 * UNIT_TF32 * abs(ref_loss), (loss, ref_loss)
    error = np.linalg.norm(grad - ref_grad) / np.linalg.norm(ref_grad)
    assert error <= 0.3, f"gradient off by {error:.3g} of its norm\n{reproduce_hint()}"
    cosine = grad @ ref_grad / (np.linalg.norm(grad) * np.linalg.norm(ref_grad))
    assert cosine >= 0.95, cosine
    validate(stats, ref_stats, "batch-norm running statistics", rtol=1e-2)


# ---- the instructions ----------------------------------------------------------------------

def test_a_halo_kernels_window_loops_are_counted_apart():
    """bench/tc_plan.py's SASS loops: the main loop (a backward branch to an HMMA before it), and inside it the
    innermost loops without HMMA (a halo kernel's row of its window, run once per row): a loop around
    them (a thread's columns) is not counted again, nor a loop outside the main loop."""
    from bench import tc_plan
    sass = ["MOV R1, R2", "LDS R3, [R4]", "BRA 0x10",                     # 0-2: a loop before the main loop
            "HMMA.1688.F32.TF32 R8, R4, R6, R8",                           # 3: the main loop's first
            "IADD3 R1, R1, 0x1, RZ",                                       # 4: a thread's columns
            "LDGSTS.E.BYPASS.128 [R7], desc[UR8][R2.64], P0", "@!P0 BRA 0x50",   # 5-6: a row of the window
            "ISETP.GE.AND P1, PT, R1, R9, PT", "@!P1 BRA 0x40",           # 7-8: the columns' loop
            "LDS.128 R12, [R31]", "STS.128 [R31], R12", "@!P2 BRA 0x90",  # 9-11: a row landed
            "@P3 HMMA.1688.F32.TF32 R8, R4, R6, R8", "BRA 0x30", "EXIT"]   # 12-13: the main loop's end
    assert tc_plan.main_loop(sass) == (11, 2)
    assert tc_plan.window_loops(sass) == 2 + 3
    assert tc_plan.window_loops(["HMMA.1688.F32.TF32 R8, R4, R6, R8", "BRA 0x0"]) == 0
    assert tc_plan.window_loops(["NOP"]) == 0



def test_a_kernels_main_loops_are_its_innermost_loops_with_the_most_hmma():
    """bench/tc_plan.py's main loops: each loop with HMMA that holds no other (a backward-weight's lean loop and
    its bias loop, with as many HMMA or a fifth more), shortest first; not a loop around one (the ring's wrap),
    nor one with far fewer HMMA (a prologue's)."""
    from bench import tc_plan
    hmma = "HMMA.1688.F32.TF32 R8, R4, R6, R8"
    sass = [hmma, "BRA 0x0",                                # 0-1: a prologue's loop, 1 HMMA
            hmma, hmma, hmma, "FADD R1, R1, R2", "@P0 BRA 0x20",   # 2-6: the bias loop, 3 HMMA
            hmma, hmma, hmma, "@P1 BRA 0x70",              # 7-10: the lean loop
            "BRA 0x70",                                     # 11: around the lean loop
            "EXIT"]
    assert tc_plan.main_loops(sass) == [(4, 3), (5, 3)]
    assert tc_plan.main_loop(sass) == (4, 3)
    assert tc_plan.main_loops(["NOP", "BRA 0x0"]) == []
    # the stride-2 backward-data from windows: every innermost loop with HMMA, however few (its 1-tap phase's)
    assert tc_plan.phase_loops(sass) == [(2, 1), (4, 3), (5, 3)]


@pytest.mark.nvrtc("conv_tc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_every_tensor_core_kernel_runs_hmma(arch):
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    if nvrtc.cuobjdump() is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    from kernels.cuda.ptxas_report import compile_family
    compiled = compile_family("conv_tc", arch)
    sass = compiled.sass()
    gemms = [name for name in conv_tc.KERNELS if name.startswith("conv_tc_")]
    assert len(gemms) == 34   # forward and backward-data: 2 tiles x 2 copy paths and the square's aligned one;
    # backward-weight: 128 x 64's two and the square's at its two ALIGNs; the forward and backward-weight that
    # apply a batch norm to x as it lands, on the two large tiles (the square backward-weight at both ALIGNs); the
    # halo forward (with and without the norm), backward-data, and backward-weight (with and without the norm);
    # the projection backward (dx written, or added); the stride-2 backward-data from windows of dy; and the square
    # tile's 7 with a ring of 2 stages (conv_tc.RING2)
    for name in gemms:
        instructions = sass[compiled.lowered_names[name]]
        assert any(i.startswith("HMMA.1688.F32.TF32") for i in instructions), f"{name} for {arch}: no HMMA"
        assert any("LDGSTS" in i for i in instructions), f"{name} for {arch}: no cp.async (LDGSTS)"
        resources = compiled.resources()[compiled.lowered_names[name]]
        assert resources.spill_stores == resources.spill_loads == 0, f"{name} for {arch} spills"


# ---- GPU -----------------------------------------------------------------------------------

@pytest.fixture
def gpu_backend(request):
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(reason)
    request.getfixturevalue("poisoned_device_empty")
    return OnDevice(kernels._device_backend("cuda"))


@pytest.mark.parametrize("planted", [False, True], ids=["OnDevice", "planted: plain copies back"])
def test_check_conv_reads_the_layouts_of_the_device_arrays_on_a_simulated_gpu(simulated_gpu, request, planted):
    """The GPU tests' check_conv through gpu_backend on one simulated GPU, at a small shape: y and dx channels-last as
    the device holds them, the numbers compared. Planted, PlainCopies's C-ordered copies fail its layout assertion
    by name, as OnDevice's did on one H200."""
    x_shape, w_shape, stride, padding, _ = VECTOR_SHAPES[2]
    if planted:
        with pytest.raises(AssertionError, match=r": y has strides \(144, 36, 12, 4\)"):
            check_conv(PlainCopies(simulated_gpu), x_shape, w_shape, stride, padding, channels_last=True)
    else:
        check_conv(request.getfixturevalue("gpu_backend"), x_shape, w_shape, stride, padding, channels_last=True)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape, stride, padding", resnet18_convolutions(batch=2, width=16)
                         + [s[:4] for s in VECTOR_SHAPES + ALIGNED_SHAPES])
def test_gpu_conv_against_the_tf32_references(gpu_backend, x_shape, w_shape, stride, padding):
    check_conv(gpu_backend, x_shape, w_shape, stride, padding)


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape", HALO_SHAPES)
def test_gpu_halo_convolutions_against_the_tf32_references(gpu_backend, halo_everywhere, x_shape, w_shape):
    check_conv(gpu_backend, x_shape, w_shape, 1, 1, channels_last=True)
    assert f"conv_tc_forward_halo<{conv_tc.TF32.halo}>" in halo_everywhere


@pytest.mark.gpu
@pytest.mark.parametrize("x_shape, w_shape", WGRAD_HALO_SHAPES + [((8, 64, 28, 28), (64, 64, 3, 3))])
def test_gpu_halo_backward_weight_against_the_tf32_references(gpu_backend, halo_everywhere, x_shape, w_shape):
    """Its 96 KB of dynamic shared memory allowed on the device (Backend.function), and the first stage's shape."""
    check_conv(gpu_backend, x_shape, w_shape, 1, 1, channels_last=True, dy_tf32=True)
    assert conv_tc.WGRAD_HALO["conv_tc"].kernel in halo_everywhere


@pytest.mark.gpu
def test_gpu_conv_beside_cudnn_tf32(gpu_backend):
    """Our TF32 convolution and cuDNN's (PyTorch's default, allow_tf32) are both within TF32's
    error of float64, on a ResNet-18 stage-3 shape."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    x, w = draw((16, 128, 14, 14), (256, 128, 3, 3))
    ours = gpu_backend.conv2d_forward(x, w, None, 2, 1)
    ref = R.conv2d_forward(x, w, None, 2, 1)
    torch.backends.cudnn.allow_tf32 = True
    theirs = torch.nn.functional.conv2d(torch.tensor(x, device="cuda"), torch.tensor(w, device="cuda"), stride=2,
                                        padding=1).cpu().numpy()
    error = [np.linalg.norm(a - ref) / np.linalg.norm(ref) for a in (ours, theirs)]
    assert error[0] <= 2e-3 and error[0] <= 2 * error[1] + 1e-6, f"ours {error[0]:.3g}, cuDNN TF32 {error[1]:.3g}"


@pytest.mark.nvrtc("conv_tc")
def test_the_launch_plan_of_resnet18_covers_every_product():
    """bench/tc_plan.py: a plan for each GEMM of every convolution but the stem, with the kernel's
    occupancy from its registers and shared memory; backward-weight in at least two waves of the
    blocks that fit on an H200's 132 SMs at every layer on the 128 x 64 tile, one on the 128 x 128
    (conv_tc.WGRAD_SPLIT_TARGET)."""
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from bench import tc_plan
    rows, resources, fp32 = tc_plan.rows(256, "sm_90", 132, "tf32")
    products = [layer for layer, _ in distinct(resnet18_layers(256)) if layer.op in ("conv2d", "linear")]
    # and a residual block's conv2 of each stage again, its forward and backward-weight applying bn1
    assert len(rows) == 3 * (len(products) - 2 + 4) == 3 * 14
    folded = [row for row in rows if row["layer"].endswith("(bn1 applied)")]
    assert [row["kernel"].endswith(", true>") for row in folded] == [True, False, True] * 4, folded
    assert fp32 == ["conv 3x3/1 1->64 28->28", "linear 512->10"]
    assert all(1 <= row["resident"] <= 16 and row["blocks"] >= 1 for row in rows), rows
    assert all(resources[row["kernel"]].spill_stores == 0 for row in rows)
    assert all(row["waves"] >= (2 if "Tc128x64" in row["kernel"] else 1) for row in rows
               if row["gemm"] == "wgrad"), rows
