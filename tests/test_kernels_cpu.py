"""Every CPU kernel against the naive float64 references, forward and backward, on fresh random
inputs in float32 and float64 (check_op also asserts that float outputs keep the input dtype).

Each op is written once as ``op(module, ...)`` and run through both kernels.cpu and reference,
which share names and signatures. Every test runs under conftest's poisoned_empty, so an
output element a kernel forgets to write is NaN and fails rather than passing on leftover memory.
"""
import functools

import numpy as np
import pytest

import kernels.cpu as K
import reference as R
from helpers import batch_norm_joins, batch_norm_over_replicas, check_op, rng, validate

EPS = 1e-5
pytestmark = pytest.mark.usefixtures("poisoned_empty")


def through_both(op):
    """(reference, ours) from op(module, *args), which calls the kernel by name on `module`."""
    return functools.partial(op, R), functools.partial(op, K)


# ---- convolution -------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape, w_shape, stride, padding, bias", [
    ((2, 3, 8, 8), (4, 3, 3, 3), 1, 1, True),          # the ResNet 3x3 conv
    ((2, 3, 8, 8), (4, 3, 3, 3), 2, 1, True),          # downsampling 3x3
    ((2, 4, 7, 7), (6, 4, 1, 1), 2, 0, True),          # 1x1 projection on an odd size
    ((3, 1, 5, 6), (4, 1, 3, 3), 1, 0, False),         # no padding, one input channel
    ((2, 3, 7, 8), (5, 3, 3, 3), 2, 0, True),          # stride 2 that drops the last column
    ((1, 2, 9, 7), (3, 2, 5, 5), 1, 2, False),         # batch 1, 5x5, non-square
    ((2, 3, 6, 9), (2, 3, 2, 3), (2, 1), (0, 1), True),   # asymmetric kernel, stride, padding
    ((2, 2, 6, 5), (3, 2, 3, 2), (1, 2), (2, 0), True),
])
def test_conv2d(x_shape, w_shape, stride, padding, bias):
    check_op([x_shape, w_shape, (w_shape[0],) if bias else None],
             *through_both(lambda m, x, w, b: m.conv2d_forward(x, w, b, stride, padding)),
             backward=through_both(lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, stride, padding)))


@pytest.fixture
def winograd_everywhere(monkeypatch):
    """Winograd's F(2x2, 3x3) for every 3x3, stride-1, padding-1 convolution, whatever its channels (the
    kernels take it from 64), its filter transforms a filter a part (the kernels' parts hold 2 MB of them),
    and a record of which of its ways each call took."""
    from kernels.cpu import winograd
    monkeypatch.setattr(winograd, "_LEAST_CHANNELS", 1)
    monkeypatch.setattr(winograd, "_FILTER_PART_BYTES", 1)
    taken = []
    for name in ("every_tile", "gradients"):   # every_tile: products a position a thread; gradients: dw
        def spy(*args, _name=name, _fn=getattr(winograd, name)):
            taken.append(_name)
            return _fn(*args)
        monkeypatch.setattr(winograd, name, spy)
    yield taken


@pytest.mark.parametrize("x_shape, o, bias, ways", [
    ((2, 5, 14, 14), 6, True, {"gradients"}),         # 49 tiles an image: a part of the images a thread
    ((3, 4, 14, 16), 3, False, {"gradients"}),
    ((2, 3, 13, 15), 4, True, {"gradients"}),         # and odd sides
    ((3, 4, 7, 9), 5, True, {"every_tile", "gradients"}),   # odd sides: the last tiles overhang; a position a
    ((2, 3, 4, 4), 4, True, {"every_tile", "gradients"}),   # thread (dw's products too)
    ((4, 2, 1, 2), 3, False, {"every_tile", "gradients"}),  # one tile, mostly padding
])
def test_conv2d_by_winograd(winograd_everywhere, x_shape, o, bias, ways):
    check_op([x_shape, (o, x_shape[1], 3, 3), (o,) if bias else None],
             *through_both(lambda m, x, w, b: m.conv2d_forward(x, w, b, 1, 1)),
             backward=through_both(lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, 1, 1)))
    assert set(winograd_everywhere) == ways


def test_winograd_reads_no_workspace_it_did_not_write(winograd_everywhere, monkeypatch):
    """Every workspace the transforms take comes back NaN-filled and of its exact size: the borders, the
    overhanging tiles' zeros and every product must be written before they are read. And its planted twin:
    a transform with two of B^T's rows swapped, which the references refuse."""
    from kernels.cpu import winograd

    def poisoned(name, shape, dtype):
        return np.full(shape, np.nan, dtype)
    monkeypatch.setattr(winograd, "workspace", poisoned)
    for x_shape in ((3, 4, 7, 9), (2, 3, 13, 15)):   # both ways, odd sides
        check_op([x_shape, (5, x_shape[1], 3, 3), (5,)], *through_both(lambda m, x, w, b: m.conv2d_forward(x, w, b, 1, 1)),
                 backward=through_both(lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, 1, 1)))
    assert set(winograd_everywhere) == {"every_tile", "gradients"}
    right = winograd._transformed

    def swapped(d, out):
        right(d, out)
        out[1], out[2] = out[2].copy(), out[1].copy()
    monkeypatch.setattr(winograd, "_transformed", swapped)
    with pytest.raises(AssertionError):
        check_op([(2, 3, 8, 8), (4, 3, 3, 3), None], *through_both(lambda m, x, w, b: m.conv2d_forward(x, w, b, 1, 1)))


@pytest.fixture
def cpu_threads():
    """kernels/cpu/_parallel.py's threads(), set back after the test (the suite's workers run one each)."""
    from kernels.cpu import _parallel
    before = _parallel.threads()
    yield _parallel.threads
    _parallel.threads(before)


@pytest.mark.parametrize("x_shape, w_shape, stride, padding, winograd, w_channels_last", [
    ((7, 8, 10, 10), (12, 8, 3, 3), 1, 1, False, False),      # backward-data as a convolution of dy
    ((7, 8, 10, 9), (12, 8, 3, 3), 2, 1, False, False),       # backward-data by col2im
    ((7, 8, 10, 10), (12, 8, 1, 1), 2, 0, False, False),      # a projection
    ((7, 8, 14, 13), (12, 8, 3, 3), 1, 1, True, False),       # Winograd a part of the images a thread (dw's sum)
    ((7, 8, 10, 10), (12, 8, 3, 3), 1, 1, True, False),       # Winograd a position a thread
    ((2, 8, 10, 10), (13, 8, 3, 3), 1, 1, False, False),      # two parts: dw half of the (odd) filters a thread
    ((2, 8, 10, 10), (13, 8, 3, 3), 1, 1, False, True),       # and written into a channels-last dw
])
def test_convolutions_in_parts_on_three_threads_equal_one_thread_bit_for_bit(cpu_threads, monkeypatch, x_shape,
                                                                              w_shape, stride, padding, winograd,
                                                                              w_channels_last):
    """Parts of three images (256 rows: _PART_BYTES made small; Winograd's, of one image), on 1 to 3 threads:
    the results of each thread count are the same bits, and near float64's. A layer of two parts or fewer
    takes its weight gradient by the filters (conv._backward_weight_by_filters), the others by the images."""
    from kernels.cpu import conv
    monkeypatch.setattr(conv, "_PART_BYTES", 1)
    monkeypatch.setattr(conv.winograd, "_LEAST_CHANNELS", 1 if winograd else 10 ** 9)
    by_filters = []
    monkeypatch.setattr(conv, "_backward_weight_by_filters",
                        lambda *a, _fn=conv._backward_weight_by_filters: by_filters.append(1) or _fn(*a))
    g = rng()
    x = np.ascontiguousarray(g.standard_normal(x_shape, dtype=np.float32).transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    w, b = g.standard_normal(w_shape, dtype=np.float32), g.standard_normal(w_shape[0], dtype=np.float32)
    if w_channels_last:
        w = np.ascontiguousarray(w.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    results = []
    for count in (1, 2, 3):
        cpu_threads(count)
        y = K.conv2d_forward(x, w, b, stride, padding)
        dy = np.cos(np.arange(y.size, dtype=np.float32)).reshape(y.shape)
        results.append((y, *K.conv2d_backward(dy, x, w, stride, padding)))
    oh, ow = y.shape[2:]
    assert bool(by_filters) == (not winograd and len(conv._parts(x_shape[0], oh * ow, w[0].size, 4)) <= 2)
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert a.tobytes() == c.tobytes()
    expected = (R.conv2d_forward(x, w, b, stride, padding), *R.conv2d_backward(dy, x, w, stride, padding))
    for got, want in zip(results[0], expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("winograd", [False, True])
def test_a_convolutions_batch_norm_sums_from_its_parts_stay_close_to_float64(cpu_threads, monkeypatch, winograd):
    """The statistics of the norm after a convolution, from parts of 3 images each (_PART_BYTES made small), on
    two threads: squares about each part's mean, moved to the whole's, keep their accuracy where y's mean is
    far from 0 (a bias of 300: squares about 0 would cancel to nothing in float32). And the backward sums of
    the norm before it, from the parts of dx (stride 1 and col2im), are masked_backward_sums' of the whole dx."""
    from kernels.cpu import conv
    monkeypatch.setattr(conv, "_PART_BYTES", 1)
    monkeypatch.setattr(conv.winograd, "_LEAST_CHANNELS", 1 if winograd else 10 ** 9)
    cpu_threads(2)
    g = rng()
    x = np.ascontiguousarray(g.standard_normal((10, 12, 10, 8), dtype=np.float32)).transpose(0, 3, 1, 2)
    w = g.standard_normal((16, 8, 3, 3), dtype=np.float32)
    b = np.full(16, 300, np.float32) + g.standard_normal(16, dtype=np.float32)
    y, mean, invstd = K.conv2d_forward(x, w, b, 1, 1, statistics=(EPS, None, 0.1))
    exact = R.conv2d_forward(x, w, b, 1, 1)   # float64, of the float32 inputs
    np.testing.assert_allclose(mean, exact.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(invstd, 1 / np.sqrt(exact.var(axis=(0, 2, 3)) + EPS), rtol=2e-4)
    gamma, beta = g.standard_normal(8, dtype=np.float32), g.standard_normal(8, dtype=np.float32)
    x_mean, x_invstd = K.batch_norm_sums(x, np.zeros(8, np.float32))[0] / 1200, np.ones(8, np.float32)
    relu = K.batch_norm_apply(x, gamma, beta, x_mean, x_invstd, relu=True)
    for stride in (1, 2):
        dy = g.standard_normal(K.conv2d_forward(relu, w, None, stride, 1).shape, dtype=np.float32)
        dx, _, _, dgamma, dbeta = K.conv2d_backward(dy, relu, w, stride, 1,
                                                    norm=(relu, x, x_mean, x_invstd, gamma, beta))
        whole = K.batch_norm_backward_sums(np.where(relu > 0, dx, 0), x, x_mean, x_invstd)
        np.testing.assert_allclose(dgamma, whole[0], rtol=1e-5, atol=1e-5 * np.abs(whole[0]).max())
        np.testing.assert_allclose(dbeta, whole[1], rtol=1e-5, atol=1e-5 * np.abs(whole[1]).max())


def test_a_part_that_fails_on_another_thread_raises_and_the_blas_threads_are_restored(cpu_threads):
    from threadpoolctl import threadpool_info
    from kernels.cpu._parallel import each
    cpu_threads(2)
    before, seen = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"], []

    def part(i):
        seen.append([lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"])
        if i == 5:
            raise ZeroDivisionError("part 5")
    with pytest.raises(ZeroDivisionError, match="part 5"):
        each(part, 8)
    assert all(counts == [1] * len(before) for counts in seen) and len(seen) >= 6
    assert [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"] == before

@pytest.mark.parametrize("threads", [1, 2, 3])
def test_parts_run_their_ufuncs_on_small_buffers_and_the_callers_setting_comes_back(cpu_threads, threads):
    """each() runs every part with NumPy's ufunc buffers of _UFUNC_BUFFER values (on every thread, whatever the
    count: the same buffers give the same sums), and leaves the caller's own setting as it was, a failed part
    too; a nested each() inside a part keeps them."""
    from kernels.cpu._parallel import _UFUNC_BUFFER, each
    cpu_threads(threads)
    seen, caller = {}, np.getbufsize()
    assert caller != _UFUNC_BUFFER

    def part(i):
        seen[i] = np.getbufsize()
        each(lambda j: seen.__setitem__((i, j), np.getbufsize()), 2)
        if i == 5:
            raise ZeroDivisionError("part 5")
    with pytest.raises(ZeroDivisionError, match="part 5"):
        each(part, 8)
    assert np.getbufsize() == caller
    assert seen and set(seen.values()) == {_UFUNC_BUFFER} and 5 in seen and (5, 1) in seen



def test_conv2d_channel_mismatch_is_a_value_error():
    g = rng()
    with pytest.raises(ValueError, match="(?i)channel"):
        K.conv2d_forward(g.standard_normal((2, 3, 5, 5)), g.standard_normal((4, 2, 3, 3)), None, 1, 1)


# ---- batch normalisation -----------------------------------------------------------------

def shifted_batch(shape):
    """Activations whose channels have their own non-zero mean and non-unit spread."""
    g = rng()
    c = shape[1]
    return g.standard_normal(shape) * g.uniform(0.5, 3, c)[:, None, None] + g.uniform(-3, 3, c)[:, None, None]


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 5, 7, 3)])
@pytest.mark.parametrize("residual", [False, True], ids=["relu", "residual"])
def test_batch_norm_with_its_relu_join(shape, residual):
    forward, backward = batch_norm_joins(K, EPS)
    check_op([shifted_batch(shape), (shape[1],), (shape[1],), shape if residual else None], *forward,
             backward=backward)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, "bfloat16"])
@pytest.mark.parametrize("channels_last", [True, False])
def test_the_gradient_through_a_relu_is_a_select(dtype, channels_last):
    """Where y <= 0 the gradient is 0, whatever dy holds there (NaN and infinity too, as a GPU's select
    gives), in dy's dtype and memory layout; where y > 0 it is dy, bit for bit."""
    import ml_dtypes
    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    g = rng()
    layout = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)) if channels_last \
        else np.ascontiguousarray
    y = layout(g.standard_normal((3, 5, 4, 6)).astype(dtype))
    y.reshape(-1)[0] = 0   # the border: y == 0 is not positive
    dy = layout(g.standard_normal(y.shape).astype(dtype))
    dy[(y <= 0) & (g.uniform(size=y.shape) < 0.3)] = np.nan
    dy[(y <= 0) & (g.uniform(size=y.shape) < 0.3)] = -np.inf
    x = layout(g.standard_normal(y.shape).astype(dtype))
    gamma, beta = (g.standard_normal(5).astype(np.float32) for _ in range(2))
    _, mean, invstd = K.batch_norm_forward(x.astype(np.float32), gamma, beta, EPS)
    dx, _, _, passed = K.batch_norm_backward(dy, x, gamma, mean, invstd, y=y, shortcut=True)
    assert passed.dtype == dy.dtype and passed.strides == dy.strides and np.isfinite(passed.astype(float)).all()
    expected = np.where(y > 0, dy, 0).astype(dy.dtype)   # the reference select
    np.testing.assert_array_equal(passed.astype(np.float64), expected.astype(np.float64))
    assert np.isfinite(dx.astype(float)).all()


def test_backwards_write_into_the_arrays_they_are_given():
    """out= (a parameter's gradient, say): written there and returned, the same values as without."""
    g = rng()
    x, w, dy = g.standard_normal((2, 3, 5, 5)), g.standard_normal((4, 3, 3, 3)), g.standard_normal((2, 4, 5, 5))
    fresh = K.conv2d_backward(dy, x, w, 1, 1)
    out = np.full_like(w, np.nan), np.full(4, np.nan)
    dx, dw, db = K.conv2d_backward(dy, x, w, 1, 1, need_dx=False, out=out)
    assert dx is None and dw is out[0] and db is out[1]
    np.testing.assert_array_equal(dw, fresh[1])
    np.testing.assert_array_equal(db, fresh[2])
    for stride, size in ((1, 5), (2, 3)):   # dx added to add_dx_to, that very array returned: stride 1 and col2im
        so_far = g.standard_normal(x.shape)
        into = so_far.copy()
        dx = K.conv2d_backward(dy[:, :, :size, :size], x, w, stride, 1, add_dx_to=into)[0]
        assert dx is into
        np.testing.assert_allclose(into, so_far + K.conv2d_backward(dy[:, :, :size, :size], x, w, stride, 1)[0])
    x2, w2, dy2 = g.standard_normal((6, 5)), g.standard_normal((3, 5)), g.standard_normal((6, 3))
    out = np.full_like(w2, np.nan), np.full(3, np.nan)
    _, dw2, db2 = K.linear_backward(dy2, x2, w2, out=out)
    assert dw2 is out[0] and db2 is out[1]
    np.testing.assert_array_equal(dw2, K.linear_backward(dy2, x2, w2)[1])
    _, mean, invstd = K.batch_norm_forward(dy, np.ones(4), np.zeros(4), EPS)
    out = np.full(4, np.nan), np.full(4, np.nan)
    _, dgamma, dbeta = K.batch_norm_backward(dy, dy, np.ones(4), mean, invstd, out=out)
    assert dgamma is out[0] and dbeta is out[1] and not np.isnan(dgamma).any()


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (1, 2, 3, 4), (6, 4, 1, 1), (2, 5, 7, 3)])
def test_batch_norm_training(shape):
    check_op([shifted_batch(shape), (shape[1],), (shape[1],)],
             *through_both(lambda m, x, gamma, beta: m.batch_norm_forward(x, gamma, beta, EPS)),
             backward=through_both(lambda m, dy, x, gamma, beta, y, mean, invstd:
                                   m.batch_norm_backward(dy, x, gamma, mean, invstd)))


@pytest.mark.parametrize("shape, cut", [((4, 3, 5, 5), 2), ((5, 2, 3, 4), 1), ((3, 4, 1, 1), 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_norm_in_parts_over_replicas_equals_the_whole_batch(shape, cut, dtype):
    """What synchronised batch norm computes: replicas add their sums between the parts."""
    g = rng()
    x, dy = shifted_batch(shape).astype(dtype), g.standard_normal(shape).astype(dtype)
    gamma, beta = g.standard_normal((2, shape[1])).astype(dtype)
    y, dx, dgamma, dbeta = batch_norm_over_replicas(K, x, gamma, beta, dy, cut, EPS)
    ref_y, mean, invstd = R.batch_norm_forward(x, gamma, beta, EPS)
    for ours, ref, name in zip((y, dx, dgamma, dbeta), (ref_y, *R.batch_norm_backward(dy, x, gamma, mean, invstd)),
                               ("y", "dx", "dgamma", "dbeta")):
        assert ours.dtype == dtype, name
        validate(ours, ref, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_norm_sums(dtype):
    g = rng()
    x, dy = shifted_batch((3, 4, 5, 2)).astype(dtype), g.standard_normal((3, 4, 5, 2)).astype(dtype)
    mean, invstd = g.standard_normal(4).astype(dtype), g.uniform(0.5, 2, 4).astype(dtype)
    validate(K.batch_norm_sums(x, mean), R.batch_norm_sums(x, mean), "batch_norm_sums")
    validate(K.batch_norm_backward_sums(dy, x, mean, invstd), R.batch_norm_backward_sums(dy, x, mean, invstd),
             "batch_norm_backward_sums")


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (1, 2, 3, 4), (3, 4, 1, 1)])
def test_batch_norm_inference(shape):
    c = shape[1]
    running_var = rng().uniform(0.3, 3.0, c)
    check_op([shifted_batch(shape), (c,), (c,), (c,), running_var],
             *through_both(lambda m, x, gamma, beta, mean, var:
                           m.batch_norm_inference(x, gamma, beta, mean, var, EPS)),
             backward=through_both(lambda m, dy, x, gamma, beta, mean, var, y:
                                   m.batch_norm_inference_backward(dy, x, gamma, mean, var, EPS)))


# ---- element-wise ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 10), (1, 1, 1, 7)])
def test_relu(shape):
    check_op([shape], *through_both(lambda m, x: m.relu_forward(x)),
             backward=through_both(lambda m, dy, x, y: m.relu_backward(dy, y)))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 10)])
def test_add(shape):
    check_op([shape, shape], *through_both(lambda m, a, b: m.add(a, b)))


def test_add_in_place():
    a, b = rng().standard_normal((2, 7)).astype(np.float32), rng().standard_normal((2, 7)).astype(np.float32)
    expected = R.add(a, b)
    assert K.add(a, b, out=a) is a
    validate(a, expected, "a += b")


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 7), (4,)])
def test_add_relu(shape):
    check_op([shape, shape], *through_both(lambda m, a, b: m.add_relu_forward(a, b)),
             backward=through_both(lambda m, dy, a, b, y: m.relu_backward(dy, y)))


# ---- pooling -----------------------------------------------------------------------------

MAX_POOLS = [
    ((2, 3, 8, 8), 2, 2, 0),
    ((2, 3, 7, 7), 3, 2, 1),            # overlapping windows: backward must accumulate
    ((1, 2, 9, 6), 3, 2, 1),
    ((2, 2, 5, 7), 2, 2, 0),            # odd sizes: the last row and column are dropped
    ((2, 2, 6, 7), (2, 3), (1, 2), (1, 0)),
]


@pytest.mark.parametrize("x_shape, kernel, stride, padding", MAX_POOLS)
def test_max_pool2d(x_shape, kernel, stride, padding):
    check_op([x_shape], *through_both(lambda m, x: m.max_pool2d_forward(x, kernel, stride, padding)),
             backward=through_both(lambda m, dy, x, y, argmax: m.max_pool2d_backward(dy, argmax, x.shape)))


@pytest.mark.parametrize("x_shape, kernel, stride, padding", MAX_POOLS)
def test_max_pool2d_pads_with_minus_infinity(x_shape, kernel, stride, padding):
    negative = -0.1 - np.abs(rng().standard_normal(x_shape))
    check_op([negative], *through_both(lambda m, x: m.max_pool2d_forward(x, kernel, stride, padding)))


def test_max_pool2d_ties_go_to_the_first_element():
    x = np.ones((1, 2, 5, 5))
    x[0, 1, 1, 2] = x[0, 1, 2, 1] = 2.0   # a tie inside one window, in reading order
    check_op([x], *through_both(lambda m, x: m.max_pool2d_forward(x, 3, 2, 1)))


def test_max_pool2d_argmax_is_int64():
    _, argmax = K.max_pool2d_forward(rng().standard_normal((1, 2, 4, 4)).astype(np.float32), 2, 2, 0)
    assert argmax.dtype == np.int64


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (1, 5, 7, 3), (3, 2, 1, 1)])
def test_global_avg_pool(shape):
    check_op([shape], *through_both(lambda m, x: m.global_avg_pool_forward(x)),
             backward=through_both(lambda m, dy, x, y: m.global_avg_pool_backward(dy, x.shape)))


# ---- linear ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, fan_in, fan_out, bias", [
    (4, 5, 3, True), (1, 7, 2, False), (6, 16, 10, True), (3, 1, 4, False)])
def test_linear(n, fan_in, fan_out, bias):
    check_op([(n, fan_in), (fan_out, fan_in), (fan_out,) if bias else None],
             *through_both(lambda m, x, w, b: m.linear_forward(x, w, b)),
             backward=through_both(lambda m, dy, x, w, b, y: m.linear_backward(dy, x, w)))


# ---- loss --------------------------------------------------------------------------------

@pytest.mark.parametrize("n, classes, scale", [
    (4, 10, 1.0), (1, 3, 1.0), (7, 5, 4.0),
    (8, 10, 1e3),           # exp(1e3) overflows float64: only a max-shifted softmax survives
])
def test_softmax_cross_entropy(n, classes, scale):
    g = rng()
    check_op([g.standard_normal((n, classes)) * scale, g.integers(0, classes, n)],
             *through_both(lambda m, logits, labels: m.softmax_cross_entropy_forward(logits, labels)),
             backward=through_both(lambda m, dloss, logits, labels, loss, probs:
                                   m.softmax_cross_entropy_backward(dloss, probs, labels)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_cross_entropy_by_hand(dtype):
    logits = np.array([[1000.0, 0.0], [0.0, 1000.0], [0.0, 0.0]], dtype=dtype)
    loss, probs = K.softmax_cross_entropy_forward(logits, np.array([0, 0, 1]))
    # Per row: 0 (sure and right), 1000 (sure and wrong), log 2 (undecided).
    validate(loss, np.float64((1000.0 + np.log(2.0)) / 3), "loss")
    validate(probs, np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]), "probs")


# ---- optimiser ---------------------------------------------------------------------------

LR = 0.1


def sgd_steps(module, param, grads, velocity, momentum, weight_decay):
    """Apply sgd_update once per gradient, in place; return the final (param, velocity)."""
    for grad in grads:
        assert module.sgd_update(param, grad, velocity, LR, momentum, weight_decay) is None
    return param, velocity


@pytest.mark.parametrize("momentum, weight_decay, with_velocity", [
    (0.0, 0.0, False), (0.0, 5e-4, False), (0.0, 5e-4, True), (0.9, 0.0, True), (0.9, 5e-4, True)])
def test_sgd_update(momentum, weight_decay, with_velocity):
    size, steps = 37, 3
    g = rng()
    param0, grads = g.standard_normal(size), g.standard_normal((steps, size))
    velocity0 = np.zeros(size) if with_velocity else None

    def run(m, param, velocity, *grads):
        # Only momentum makes the velocity part of the state; without it the buffer is unspecified.
        return sgd_steps(m, param, grads, velocity, momentum, weight_decay)[:2 if momentum else 1]

    check_op([param0, velocity0, *grads], *through_both(run), mutates_inputs=True)

    # The same three steps by hand, PyTorch's rule written out.
    param, velocity = param0.copy(), np.zeros(size)
    for grad in grads:
        velocity = momentum * velocity + grad + weight_decay * param
        param = param - LR * velocity
    ours, ours_velocity = sgd_steps(K, param0.copy(), grads, None if velocity0 is None else velocity0.copy(),
                                    momentum, weight_decay)
    validate(ours, param, "param")
    if momentum:
        validate(ours_velocity, velocity, "velocity")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sgd_update_by_hand(dtype):
    # param 1, constant gradient 0.5, lr 0.1, momentum 0.9, no weight decay:
    # velocity 0.5, 0.95, 1.355 -> param 0.95, 0.855, 0.7195.
    param, velocity = np.ones(3, dtype=dtype), np.zeros(3, dtype=dtype)
    sgd_steps(K, param, [np.full(3, 0.5, dtype=dtype)] * 3, velocity, 0.9, 0.0)
    validate(param, np.full(3, 0.7195), "param")
    validate(velocity, np.full(3, 1.355), "velocity")
    assert param.dtype == dtype and velocity.dtype == dtype


# ---- float32 accuracy at realistic sizes -------------------------------------------------

def test_float32_stays_close_to_the_float64_reference():
    """Long float32 sums (576 and 512 terms, as in ResNet-18) keep ~1e-5 of the exact answer."""
    tight = {np.float32: (1e-7, 1e-5)}
    check_op([(2, 64, 6, 6), (64, 64, 3, 3), (64,)],
             *through_both(lambda m, x, w, b: m.conv2d_forward(x, w, b, 1, 1)),
             dtypes=(np.float32,), tolerances=tight)
    check_op([(8, 512), (10, 512), (10,)], *through_both(lambda m, x, w, b: m.linear_forward(x, w, b)),
             backward=through_both(lambda m, dy, x, w, b, y: m.linear_backward(dy, x, w)),
             dtypes=(np.float32,), tolerances=tight)
    check_op([shifted_batch((8, 16, 6, 6)), (16,), (16,)],
             *through_both(lambda m, x, gamma, beta: m.batch_norm_forward(x, gamma, beta, EPS)),
             backward=through_both(lambda m, dy, x, gamma, beta, y, mean, invstd:
                                   m.batch_norm_backward(dy, x, gamma, mean, invstd)),
             dtypes=(np.float32,), tolerances=tight)


# ---- batch-norm running statistics and input conversion -----------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_norm_update_running(dtype):
    g = rng()
    x = shifted_batch((4, 3, 5, 2)).astype(dtype)
    _, mean, invstd = K.batch_norm_forward(x, np.ones(3, dtype), np.zeros(3, dtype), EPS)
    start = (g.standard_normal(3), np.abs(g.standard_normal(3)) + 0.5)
    ours, ref = [tuple(a.astype(dtype) for a in start) for _ in range(2)]
    K.batch_norm_update_running(*ours, mean, invstd, 40, 0.1, EPS)
    R.batch_norm_update_running(*ref, mean, invstd, 40, 0.1, EPS)
    for o, r, name in zip(ours, ref, ("running mean", "running var")):
        validate(o, r, name)
    validate(ours[1], 0.9 * start[1] + 0.1 * x.astype(np.float64).var(axis=(0, 2, 3), ddof=1),
             "running var against numpy's unbiased variance", rtol=1e-4 if dtype == np.float32 else 1e-9)
    folded = tuple(a.astype(dtype) for a in start)   # moved by the training forward itself
    K.batch_norm_forward(x, np.ones(3, dtype), np.zeros(3, dtype), EPS, running=folded, momentum=0.1)
    for o, r, name in zip(folded, ref, ("running mean, folded", "running var, folded")):
        validate(o, r, name)


def test_images_to_float():
    images = rng().integers(0, 256, size=(3, 5, 4)).astype(np.uint8)
    images[0, 0, :2] = (0, 255)
    out = K.images_to_float(images)
    assert out.dtype == np.float32 and out.shape == (3, 1, 5, 4)
    validate(out, R.images_to_float(images), "images_to_float")
    with pytest.raises(ValueError, match="uint8"):
        K.images_to_float(images.astype(np.float32))
    idx = np.array([2, 0, 2, 1])
    validate(K.images_to_float(images, idx), R.images_to_float(images)[[2, 0, 2, 1]], "images_to_float of a batch")


def test_take_gathers_a_batch_of_labels():
    labels = rng().integers(0, 10, 9).astype(np.int32)
    idx = np.array([8, 0, 3, 3])
    np.testing.assert_array_equal(K.take(labels, idx), [labels[8], labels[0], labels[3], labels[3]])
    with pytest.raises(ValueError, match="1-D integer indices"):
        K.take(labels, idx.astype(np.float32))


def test_count_correct():
    logits = rng().standard_normal((40, 10))
    labels = rng().integers(0, 10, size=40)
    labels[:5] = logits[:5].argmax(axis=1)  # some hits for certain
    logits[5, :2] = 7.0  # a tie: the first largest counts, as argmax picks it
    labels[5] = 1
    for dtype in (np.float32, np.float64):
        ours = K.count_correct(logits.astype(dtype), labels.astype(np.int32))
        assert ours.dtype == np.int64 and ours.shape == ()
        assert int(ours) == R.count_correct(logits, labels) >= 5


@pytest.mark.parametrize("environment, kept", [({}, True), ({"MALLOC_MMAP_THRESHOLD_": "131072"}, False)])
def test_freed_arrays_are_kept_for_the_next_ones_unless_the_user_set_mallocs_thresholds(environment, kept):
    """A step's activations, freed at its end, serve the next step's without faulting their pages in
    afresh (kernels.cpu asks glibc's malloc to keep freed memory); a user's own setting is left alone."""
    import os
    import subprocess
    import sys
    code = ("import resource, numpy as np, kernels.cpu\n"
            "def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "a = np.ones(2 << 20, np.float32); del a\n"   # 8 MB, as a batch's activation
            "before = faults(); b = np.ones(2 << 20, np.float32); print(faults() - before)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, **environment}, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    faults = int(done.stdout.split()[-1])
    assert (faults < 100) == kept, f"{faults} page faults for 8 MB allocated again"


def test_a_forked_child_runs_the_parts_on_threads_of_its_own(cpu_threads):
    """The pool's threads are the parent's: a child forked after they started makes its own."""
    import os
    from kernels.cpu._parallel import each
    cpu_threads(2)
    each(lambda i: None, 4)   # the parent's pool, started
    pid = os.fork()
    if pid == 0:   # the child: a part taken by another thread must run, or this waits forever
        seen = set()
        try:
            each(lambda i: seen.add(i), 8)
        finally:
            os._exit(0 if seen == set(range(8)) else 1)
    import signal
    import time
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's parts did not finish within 30 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0
