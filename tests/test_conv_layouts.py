"""What runs where under the tf32 precision, and conv.cu's FP32 kernels on channels-last memory.

- Under tf32 (kernels.precision(), the default) a convolution whose channel counts the tensor
  cores do not take (C or O not a multiple of 4, as ResNet-18's stem, C = 1) runs conv.cu's FP32
  kernels on the memory it is given: x, dy and w NCHW or channels-last, y and dx channels-last
  (NCHW views of NHWC memory, as the tensor-core path returns them), dw in w's layout or into the
  array given; y, dx, dw and db within float32's tolerance of the float64 reference
  (tests/reference.py), on the emulator in ascending and descending thread order, with the large
  tile and split reductions forced too. Only conv.cu's kernels launch, none of conv_tc.cu's, and
  they copy nothing (a record of their launches replays on new values); channel counts that are
  multiples of 4 still go to the tensor cores.
- The linear layer runs linear.cu's FP32 GEMMs under tf32 too.
- Under fp32 nothing changes: NCHW in (a channels-last input is copied), NCHW out.

Inputs are fresh random numbers (helpers.rng); new arrays start as NaN (conftest's
poisoned_empty), so an element a kernel forgets to write fails.
"""
import numpy as np
import pytest

import kernels
import reference as R
from helpers import rng, validate
from kernels.cuda import conv as cuda_conv
from kernels.cuda import launch as cuda_launch
from kernels.cuda.launch import is_channels_last

pytestmark = pytest.mark.usefixtures("poisoned_empty")

# (x shape, w shape, stride, padding): C or O not a multiple of 4, partial tiles on every side
ODD_CHANNELS = [
    ((2, 1, 7, 6), (4, 1, 3, 3), 1, 1),    # the stem: one input channel, 3x3, padding 1
    ((2, 3, 6, 5), (8, 3, 3, 3), 1, 1),    # three input channels
    ((2, 4, 5, 6), (6, 4, 3, 3), 1, 1),    # six output channels
    ((2, 3, 7, 7), (6, 3, 3, 3), 2, 1),    # stride 2 (backward-data by stride phases) on an odd size
    ((1, 6, 5, 5), (5, 6, 1, 1), 2, 0),    # 1x1 at stride 2
]
LAYOUTS = ("NCHW", "channels-last")


def draw(*shapes):
    g = rng()
    return [g.standard_normal(s).astype(np.float32) for s in shapes]


def as_layout(a, layout):
    """`a` (NCHW) as given, or its channels-last copy (an NCHW view of NHWC memory)."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) if layout == "channels-last" else a


def nhwc_memory(a):
    """Whether a 4-D array is an NCHW view of C-contiguous NHWC memory (which, with one channel or
    one pixel, is C-contiguous NCHW as well)."""
    return a.transpose(0, 2, 3, 1).flags.c_contiguous


@pytest.fixture(params=["ascending", "descending"])
def emu(request):
    """The emu backend, its threads in one order."""
    from kernels.emu import thread_order
    with thread_order(request.param):
        yield kernels._device_backend("emu")


@pytest.fixture(params=["default", "large tile", "split"])
def variant(request, monkeypatch):
    """conv.py's choices, or the large tile or split reductions (backward-weight's partials, the bias
    gradient's) forced, so that small shapes take those paths too."""
    if request.param == "large tile":
        monkeypatch.setattr(cuda_conv, "choose_tile", lambda rows, columns, dtype: "Tile128")
    elif request.param == "split":
        monkeypatch.setattr(cuda_launch, "MIN_SPLIT_LENGTH", 4)
    return request.param


@pytest.fixture
def launched():
    """The (family, kernel) of every launch of the emu backend, in order."""
    names = []
    with kernels._device_backend("emu").observing_launches(lambda family, name: names.append((family, name))):
        yield names


def families(launched):
    return {family for family, _ in launched}


def gemms(launched):
    """The kernels launched, without their template arguments."""
    return {name.partition("<")[0] for _, name in launched}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("x_shape, w_shape, stride, padding", ODD_CHANNELS)
def test_odd_channel_counts_run_the_fp32_kernels_on_channels_last_memory_under_tf32(
        emu, variant, launched, layout, x_shape, w_shape, stride, padding):
    x, w, b = draw(x_shape, w_shape, (w_shape[0],))
    name = f"conv {x_shape} * {w_shape} stride {stride} padding {padding}, {layout} inputs"
    with kernels.use_precision("tf32"):
        y = emu.conv2d_forward(as_layout(x, layout), as_layout(w, layout), b, stride, padding)
        (dy,) = draw(y.shape)
        dx, dw, db = emu.conv2d_backward(as_layout(dy, layout), as_layout(x, layout), as_layout(w, layout),
                                         stride, padding)
    validate(y, R.conv2d_forward(x, w, b, stride, padding), name + ": y")
    for got, ref, what in zip((dx, dw, db), R.conv2d_backward(dy, x, w, stride, padding), ("dx", "dw", "db")):
        validate(got, ref, f"{name}: {what}")
    for array, what in ((y, "y"), (dx, "dx")):
        assert nhwc_memory(array), f"{name}: {what} is not channels-last: strides {array.strides}"
    assert is_channels_last(dw) == is_channels_last(as_layout(w, layout)), f"{name}: dw strides {dw.strides}"
    assert families(launched) == {"conv"}, launched
    # a 3x3 of one input channel on channels-last dy (the stem's) as a reduction over the pixels, its blocks'
    # partials added by sum_partials; every other by the GEMM
    one_channel = x_shape[1] == 1 and w_shape[2:] == (3, 3) and layout == "channels-last"
    wgrad = "conv2d_wgrad_one_channel" if one_channel else "conv2d_wgrad"
    assert {"conv2d_forward", wgrad} <= gemms(launched) and "bias_grad" not in gemms(launched), launched
    assert gemms(launched) & {"conv2d_dgrad", "conv2d_dgrad_strided"}, launched


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradients_go_where_they_are_told_under_tf32(launched, layout):
    """dw and db into the arrays of out= (channels-last, as a flat buffer holds conv weights, or
    C-contiguous; NaN-filled: every element written), dx added to add_dx_to in place."""
    be = kernels._device_backend("emu")
    x, w, dy, total = draw((2, 3, 6, 6), (6, 3, 3, 3), (2, 6, 6, 6), (2, 3, 6, 6))
    dw_ref, db_ref = R.conv2d_backward(dy, x, w, 1, 1)[1:]
    dw, db = as_layout(np.full_like(w, np.nan), layout), np.full((6,), np.nan, np.float32)
    into = as_layout(total.copy(), layout)
    with kernels.use_precision("tf32"):
        got = be.conv2d_backward(as_layout(dy, layout), as_layout(x, layout), as_layout(w, layout), 1, 1,
                                 out=(dw, db), add_dx_to=into)
    assert got[0] is into and got[1] is dw and got[2] is db
    validate(into, total + R.conv2d_backward(dy, x, w, 1, 1)[0], f"{layout} add_dx_to + dx")
    validate(dw, dw_ref, f"dw into a {layout} array")
    validate(db, db_ref, "db")
    assert "conv_tc" not in families(launched), launched


@pytest.mark.parametrize("precision, layout, w_layout", [
    ("tf32", "NCHW", "NCHW"), ("tf32", "channels-last", "channels-last"), ("fp32", "NCHW", "NCHW")])
def test_the_fp32_kernels_copy_nothing_so_a_graph_replays_them(precision, layout, w_layout):
    """Each kernel reads and writes the very arrays it is given (under tf32 in either layout,
    weights and dw channels-last as a flat buffer holds them too; under fp32 NCHW ones): a record of
    the launches (kernels/cuda/graph.py on the emulator, which does not record NumPy copies),
    replayed after new values are written into the same arrays, computes what the eager ops compute
    from those values."""
    from kernels.cuda import graph
    be = kernels._device_backend("emu")
    x, w, b, dy = draw((2, 3, 6, 5), (6, 3, 3, 3), (6,), (2, 6, 6, 5))
    x, dy, w = as_layout(x, layout), as_layout(dy, layout), as_layout(w, w_layout)
    dw, db = as_layout(np.full_like(w, np.nan), w_layout), np.full((6,), np.nan, np.float32)

    def step():
        return be.conv2d_forward(x, w, b, 1, 1), be.conv2d_backward(dy, x, w, 1, 1, out=(dw, db))[0]
    with kernels.use_precision(precision):
        record, (y, dx) = graph.capture(be, step)
    for array, new in zip((x, w, b, dy), draw(x.shape, w.shape, b.shape, dy.shape)):
        array[...] = new
    record.launch()
    validate(y, R.conv2d_forward(x, w, b, 1, 1), "y replayed")
    for got, ref, what in zip((dx, dw, db), R.conv2d_backward(dy, x, w, 1, 1), ("dx", "dw", "db")):
        validate(got, ref, f"{what} replayed")


@pytest.mark.parametrize("precision, layout", [("tf32", "channels-last"), ("fp32", "NCHW")])
def test_backward_weight_and_the_bias_gradient_finish_in_one_launch_whichever_block_is_last(
        monkeypatch, precision, layout):
    """conv.cu's backward-weight split over the batch's pixels, two tiles of output channels and of
    columns: one launch computes dw and db (the bias from the dy that the first column of tiles
    loads), and the last block of each tile to finish adds the splits in order, so the bits do not
    depend on which block that is (the emulator's blocks run in both orders); dw and db start as
    NaN: every element written."""
    from kernels import emu as emu_module
    be = kernels._device_backend("emu")
    monkeypatch.setattr(cuda_launch, "MIN_SPLIT_LENGTH", 4)
    grids = []
    launch = cuda_conv.launch
    monkeypatch.setattr(cuda_conv, "launch", lambda be, family, kernel, grid, args, **kw: (
        grids.append((kernel, grid)), launch(be, family, kernel, grid, args, **kw))[1])
    x, w, dy = draw((2, 9, 9, 7), (66, 9, 3, 3), (2, 66, 9, 7))   # 81 columns, 66 channels: 2 x 2 tiles
    x, dy, w = as_layout(x, layout), as_layout(dy, layout), as_layout(w, "channels-last")
    results = []
    for order in emu_module.ORDERS:
        dw, db = as_layout(np.full_like(w, np.nan), "channels-last"), np.full((66,), np.nan, np.float32)
        with emu_module.thread_order(order), kernels.use_precision(precision):
            be.conv2d_backward(dy, x, w, 1, 1, need_dx=False, out=(dw, db))
        results.append((dw.copy(), db.copy()))
    assert [kernel.partition("<")[0] for kernel, _ in grids] == ["conv2d_wgrad"] * 2, grids
    assert all(grid[:2] == (2, 2) and grid[2] > 1 for _, grid in grids), grids
    for got, ref, what in zip(results[0], R.conv2d_backward(dy, x, w, 1, 1)[1:], ("dw", "db")):
        validate(got, ref, what)
    for ascending, descending, what in zip(*results, ("dw", "db")):
        np.testing.assert_array_equal(ascending, descending, err_msg=f"the order of the blocks shows in {what}")


@pytest.mark.parametrize("c, o, family", [(4, 8, "conv_tc"), (3, 8, "conv"), (4, 6, "conv"), (1, 4, "conv")])
def test_only_channel_counts_that_are_multiples_of_4_go_to_the_tensor_cores(launched, c, o, family):
    be = kernels._device_backend("emu")
    x, w = draw((1, c, 3, 3), (o, c, 1, 1))
    with kernels.use_precision("tf32"):
        y = be.conv2d_forward(x, kernels.cpu.round_tf32(w), None, 1, 0, w_tf32=True)   # no launch rounds w
    assert families(launched) == {family}, launched
    assert nhwc_memory(y), y.strides
    validate(y, R.conv2d_forward(x, w, None, 1, 0), f"{c} -> {o} channels", rtol=2e-3)   # TF32 for conv_tc


@pytest.mark.parametrize("n, i, o", [(4, 5, 3), (3, 512, 10), (70, 33, 65)])
def test_the_linear_layer_runs_the_fp32_gemms_under_tf32(emu, launched, n, i, o):
    x, w, b = draw((n, i), (o, i), (o,))
    with kernels.use_precision("tf32"):
        y = emu.linear_forward(x, w, b)
        (dy,) = draw(y.shape)
        dx, dw, db = emu.linear_backward(dy, x, w)
    name = f"linear {n} x {i} -> {o}"
    validate(y, R.linear_forward(x, w, b), name + ": y")
    for got, ref, what in zip((dx, dw, db), R.linear_backward(dy, x, w), ("dx", "dw", "db")):
        validate(got, ref, f"{name}: {what}")
    assert families(launched) == {"linear"} and "matmul" in gemms(launched), launched


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp32_takes_any_layout_and_gives_nchw(launched, layout):
    be = kernels._device_backend("emu")
    x, w, b = draw((2, 3, 6, 5), (8, 3, 3, 3), (8,))
    with kernels.use_precision("fp32"):
        y = be.conv2d_forward(as_layout(x, layout), w, b, 2, 1)
        (dy,) = draw(y.shape)
        dx, dw, db = be.conv2d_backward(as_layout(dy, layout), as_layout(x, layout), w, 2, 1)
    validate(y, R.conv2d_forward(x, w, b, 2, 1), "y")
    for got, ref, what in zip((dx, dw, db), R.conv2d_backward(dy, x, w, 2, 1), ("dx", "dw", "db")):
        validate(got, ref, what)
    assert y.flags.c_contiguous and dx.flags.c_contiguous and dw.flags.c_contiguous, (y.strides, dx.strides)
    assert families(launched) == {"conv"}, launched


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("emu", ["ascending", "descending"], indirect=True)
def test_the_stems_backward_weight_adds_its_blocks_in_order(emu, launched, monkeypatch, precision):
    """A 3x3 of one input channel on channels-last dy, 64 output channels (four groups of a block's threads a
    channel), in blocks of 16 pixels (forced: 21 of them, the last short): dw and db (NaN-filled: every element
    written) against float64 of the inputs as stored (bfloat16 under bf16), within float32's rounding of the sums."""
    monkeypatch.setattr(cuda_conv, "ONE_CHANNEL_PIXELS", 16)
    storage = kernels.bfloat16 if precision == "bf16" else np.float32
    x, dy = (a.astype(storage) for a in draw((3, 1, 9, 12), (3, 64, 9, 12)))
    w = draw((64, 1, 3, 3))[0]
    dw, db = np.full((64, 1, 3, 3), np.nan, np.float32), np.full(64, np.nan, np.float32)
    with kernels.use_precision(precision):
        emu.conv2d_backward(as_layout(dy, "channels-last"), x, w, 1, 1, need_dx=False, out=(dw, db))
    wide = [a.astype(np.float64) for a in (dy, x, w)]
    _, dw_ref, db_ref = R.conv2d_backward(*wide, 1, 1)
    _, dw_mag, db_mag = R.conv2d_backward(*(np.abs(a) for a in wide), 1, 1)
    for got, ref, magnitude, what in ((dw, dw_ref, dw_mag, "dw"), (db, db_ref, db_mag, "db")):
        excess = np.abs(got - ref) - (3 * 9 * 12 + 16) * 2.0**-24 * magnitude
        assert np.isfinite(got).all() and excess.max() <= 0, (what, float(excess.max()))
    assert ("conv", "conv2d_wgrad_one_channel<3, 3" + (", bf16>" if precision == "bf16" else ">")) in launched
    assert [name for _, name in launched].count("sum_partials") == 2
