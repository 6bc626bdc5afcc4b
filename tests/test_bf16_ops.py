"""bfloat16 storage in the CUDA backend's kernels other than the products (elementwise.cu, batchnorm.cu,
pool.cu, optim.cu's copy), on the emulator, under the bf16 precision; and the CPU backend's side of the
contract's bfloat16 (cast, sgd_update's copy, global_avg_pool_backward's dtype).

- Inputs are random (never zeros), the bfloat16 ones drawn as float32 and rounded. Each op is checked
  against tests/reference.py's float64 of its bfloat16 inputs widened (exactly): a bfloat16 output must be
  the reference rounded to nearest even but where the float32 arithmetic, within `error` of the reference,
  may sit on the other side of a rounding boundary: rn(ref - error) <= out <= rn(ref + error), with
  `error` 0 for what moves values without arithmetic (relu, max pooling, casts), one float32 rounding for
  a sum of two or a division, float32's summation bound for max pooling's added gradients, and the float32
  tolerance that tests/test_kernels_cuda.py holds these very kernels to (helpers.TOLERANCES) where
  statistics enter. A float32 output is held to that tolerance.
- Each bfloat16 output is also bit for bit the same launch's float32 kernel, on the widened inputs, rounded
  once: the kernels widen what they load, compute as in float32, and round what they store once.
- New outputs start as NaN (conftest's poisoned_empty), so an element a kernel
  forgets to write fails; the emulator runs the threads in each order; the element-wise kernels run with
  VEC 4 (8-byte bfloat16 accesses) and, on arrays that start one element into their buffer, VEC 1;
  the activations come NCHW and channels-last, and the batch-norm reductions by block per channel and by
  rows of 32 channels, in one split and several.
"""
import numpy as np
import pytest

import kernels
import kernels.cpu as K
import reference as R
from helpers import TOLERANCES, reproduce_hint, rng, validate
from kernels.cuda import batchnorm, elementwise, optim, pool
from kernels.cuda import launch as cuda_launch
from test_kernels_cpu import MAX_POOLS

BF16, F32 = kernels.bfloat16, np.dtype(np.float32)
EPS = 1e-5
UNIT = 2.0 ** -24   # float32's unit roundoff: one rounding moves a value by at most this, relatively
LAYOUTS = ("NCHW", "channels-last")
WIDTHS = {"VEC 4": 0, "VEC 1": 1}   # the offset, in elements, of an array's start in its buffer
pytestmark = pytest.mark.usefixtures("bf16", "poisoned_empty")


@pytest.fixture
def bf16():
    with kernels.use_precision("bf16"):
        yield


@pytest.fixture
def be():
    return kernels._device_backend("emu")


@pytest.fixture
def launched(monkeypatch):
    """The name expressions of the kernels the test launches, in order."""
    names = []

    def recording(be, family, kernel, grid, args, block=(cuda_launch.THREADS,)):
        names.append(kernel)
        return cuda_launch.launch(be, family, kernel, grid, args, block)
    for module in (elementwise, batchnorm, pool, optim):
        monkeypatch.setattr(module, "launch", recording)
    return names


# ---- inputs and checks -------------------------------------------------------------------

def placed(values, layout="NCHW", offset=0):
    """`values` (NCHW when 4-D) in `layout`, `offset` elements into a buffer of their dtype: at 1, a start
    that no 4-element access may take."""
    memory = values.transpose(0, 2, 3, 1) if layout == "channels-last" else values
    buffer = np.empty(values.size + offset, values.dtype)
    a = buffer[offset:].reshape(memory.shape)
    a[...] = memory
    return a.transpose(0, 3, 1, 2) if layout == "channels-last" else a


def draw(shape, layout="NCHW", offset=0, dtype=BF16):
    """Standard normal values drawn as float32 and rounded to `dtype`, placed()."""
    return placed(rng().standard_normal(shape).astype(np.float32).astype(dtype), layout, offset)


def shifted(shape, layout="NCHW", offset=0):
    """bfloat16 activations whose channels have their own mean (-3 to 3) and spread (0.5 to 3)."""
    g, c = rng(), shape[1]
    x = g.standard_normal(shape) * g.uniform(0.5, 3, c)[:, None, None] + g.uniform(-3, 3, c)[:, None, None]
    return placed(x.astype(np.float32).astype(BF16), layout, offset)


def widened(a):
    """A bfloat16 array as float32, exactly, in its memory layout."""
    return None if a is None else a.astype(np.float32)


def float32_tolerance(ref):
    """What tests/test_kernels_cuda.py allows the float32 kernels against float64: atol + rtol * max|ref|."""
    atol, rtol = TOLERANCES[F32]
    return atol + rtol * float(np.max(np.abs(ref)))


def check_rounded(out, ref, error, out32, name):
    """`out` (bfloat16) is written everywhere, between the roundings of ref - error and ref + error (ref:
    float64; error: the float32 arithmetic's distance from it, at most), and bit for bit `out32`, the float32
    kernel's result on the same values, rounded once to nearest even."""
    assert out.dtype == BF16, f"{name}: dtype {out.dtype}, expected bfloat16"
    assert out.shape == ref.shape, f"{name}: shape {out.shape}, expected {ref.shape}"
    got = out.astype(np.float64)
    unwritten = np.argwhere(np.isnan(got))
    assert unwritten.size == 0, f"{name}: {len(unwritten)} elements not written, first at {tuple(unwritten[0])}"
    low, high = ((ref + sign * error).astype(BF16).astype(np.float64) for sign in (-1, 1))
    wrong = np.argwhere((got < low) | (got > high))
    if wrong.size:
        at = tuple(wrong[0])
        raise AssertionError(f"{name}: {len(wrong)} of {out.size} elements are not the reference rounded to bfloat16, "
                             f"first at {at}: {got[at]!r} where float64 gives {ref[at]!r}, which rounds to "
                             f"[{low[at]!r}, {high[at]!r}] within {np.broadcast_to(error, ref.shape)[at]:.3g}\n"
                             f"{reproduce_hint()}")
    rounded = np.asarray(out32).astype(BF16)
    differ = np.argwhere(out.view(np.uint16) != rounded.view(np.uint16))
    assert differ.size == 0, (f"{name}: {len(differ)} elements are not the float32 kernel's rounded once, first at "
                              f"{tuple(differ[0])}: {out[tuple(differ[0])]!r} vs {rounded[tuple(differ[0])]!r}\n"
                              f"{reproduce_hint()}")


def check_layout(out, layout, name):
    dense = cuda_launch.is_channels_last(out) if layout == "channels-last" else out.flags.c_contiguous
    assert dense, f"{name}: not {layout}, strides {out.strides} for shape {out.shape}"


def same_bits(ours, theirs, name):
    np.testing.assert_array_equal(np.asarray(ours).view(np.uint32), np.asarray(theirs).view(np.uint32), err_msg=name)


# ---- element-wise ------------------------------------------------------------------------

SHAPE = (2, 6, 3, 4)   # 144 elements: a multiple of 4, and channels that are not
# op: (arity, its error against float64: the float32 sum of two rounds once)
ELEMENTWISE = {"add": (2, lambda ref: UNIT * np.abs(ref)), "relu_forward": (1, lambda ref: 0.0),
               "relu_backward": (2, lambda ref: 0.0), "add_relu_forward": (2, lambda ref: UNIT * np.abs(ref))}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise(be, order, launched, name, layout, width):
    arity, error = ELEMENTWISE[name]
    inputs = [draw(SHAPE, layout, WIDTHS[width]) for _ in range(arity)]   # relu_backward's y: half negative
    out = getattr(be, name)(*inputs)
    ref = getattr(R, name)(*inputs)
    check_rounded(out, ref, error(ref), getattr(be, name)(*map(widened, inputs)), name)
    check_layout(out, layout, name)
    assert launched[0] == f"{name}<{4 if width == 'VEC 4' else 1}, bf16>"


def test_add_accumulates_in_place(be, order):
    a, b = draw(SHAPE, "channels-last"), draw(SHAPE, "channels-last")
    expected = R.add(a, b)
    expected32 = be.add(widened(a), widened(b))
    assert be.add(a, b, out=a) is a
    check_rounded(a, expected, UNIT * np.abs(expected), expected32, "a += b")


def test_elementwise_refuses_mixed_dtypes(be):
    a, b = draw(SHAPE), draw(SHAPE)
    with pytest.raises(TypeError, match=r"add: takes activations of one dtype, float32 or bfloat16, got bfloat16, "
                                        r"float32"):
        be.add(a, widened(b))
    with pytest.raises(TypeError, match=r"relu_backward: takes activations of one dtype"):
        be.relu_backward(widened(a), b)
    with pytest.raises(TypeError, match=r"add_relu_forward: takes activations of one dtype"):
        be.add_relu_forward(a, widened(b))
    with pytest.raises(TypeError, match=r"add: the emu backend takes bfloat16 numpy arrays here, got numpy.ndarray of "
                                        r"float32"):
        be.add(a, b, out=widened(a))


# ---- cast --------------------------------------------------------------------------------

def with_ties(size):
    """float32 values, half of them exactly halfway between two bfloat16 (which round to the even one), the
    others random."""
    g = rng()
    # significands of 8 bits and a half: a bfloat16's 8 bits, and half a unit of the last
    ties = (g.integers(128, 256, size) + 0.5) * 2.0 ** g.integers(-12, 0, size) * g.choice([-1, 1], size)
    return np.where(np.arange(size) % 2 == 0, ties, g.standard_normal(size)).astype(np.float32)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("source, target", [(F32, BF16), (BF16, F32), (BF16, BF16), (F32, F32)],
                         ids=["float32 to bfloat16", "bfloat16 to float32", "bfloat16", "float32"])
def test_cast_of_a_flat_buffer(be, order, launched, source, target, width):
    values = with_ties(4 * 37)
    a = placed(values.astype(source), offset=WIDTHS[width])
    out = be.cast(a, target)
    assert out.dtype == target and out.shape == a.shape
    if target == BF16:
        check_rounded(out, a.astype(np.float64), 0.0, a.astype(F32), "cast")
    else:
        same_bits(out, a.astype(F32), "cast")
    types = cuda_launch.STORAGE_TYPES
    assert launched == [f"cast<{4 if width == 'VEC 4' else 1}, {types[source]}, {types[target]}>"]


def test_cast_into_the_views_of_a_flat_buffer(be, order, launched):
    """The bfloat16 copy of a flat parameter buffer: each float32 parameter cast into its view of the copy,
    wherever it starts (misaligned views take the one-element kernel); the rest of the copy untouched."""
    flat = with_ties(64)
    copy = np.full(flat.size, np.nan, BF16)
    written = np.zeros(flat.size, bool)
    for piece in (slice(0, 8), slice(9, 29), slice(32, 40), slice(41, 64)):
        view = copy[piece]
        assert be.cast(flat[piece], BF16, out=view) is view
        written[piece] = True
    check_rounded(copy[written], flat[written].astype(np.float64), 0.0, flat[written], "the copy")
    assert np.isnan(copy[~written].astype(np.float32)).all(), "cast wrote outside its view"
    assert launched == ["cast<4, float, bf16>", "cast<1, float, bf16>", "cast<4, float, bf16>",
                        "cast<1, float, bf16>"]


@pytest.mark.parametrize("into", ["a new array", "NCHW out", "channels-last out"])
def test_cast_keeps_the_layout_it_is_given(be, into):
    x = draw(SHAPE, "channels-last", dtype=F32)
    out = None if into == "a new array" else placed(np.full(SHAPE, np.nan, BF16), into.split()[0])
    y = be.cast(x, BF16, out)
    assert out is None or y is out
    check_layout(y, "channels-last" if into == "a new array" else into.split()[0], "cast")
    check_rounded(y, x.astype(np.float64), 0.0, x, "cast")


def test_cast_refuses_what_it_cannot_convert(be):
    x = draw((4, 6), dtype=F32)
    with pytest.raises(TypeError, match=r"cast: converts to float32 or bfloat16, not float64"):
        be.cast(x, np.float64)
    with pytest.raises(TypeError, match=r"cast: the emu backend takes bfloat16 numpy arrays here, got numpy.ndarray "
                                        r"of float32"):
        be.cast(x, BF16, out=np.zeros((4, 6), np.float32))
    with pytest.raises(ValueError, match=r"cast operands differ in shape: \(4, 6\) and \(6, 4\)"):
        be.cast(x, BF16, out=np.zeros((6, 4), BF16))
    with pytest.raises(TypeError, match=r"float32"):
        be.cast(x.astype(np.float64), BF16)


# ---- batch normalisation -----------------------------------------------------------------

def split_into_many(monkeypatch):
    monkeypatch.setattr(cuda_launch, "MIN_SPLIT_LENGTH", 4)


# (shape, layout, join, width, splits): C = 32 channels-last by the _rows reductions, C = 5 by a block per
# channel, over NCHW and over rows (channels-last)
TRAINING = [pytest.param(*case, id="-".join(map(str, case))) for case in (
    ((3, 32, 4, 5), "channels-last", "plain", "VEC 4", "one split"),
    ((3, 32, 4, 5), "channels-last", "relu", "VEC 1", "one split"),
    ((3, 32, 4, 5), "channels-last", "residual", "VEC 4", "splits"),
    ((2, 5, 3, 4), "NCHW", "plain", "VEC 1", "splits"),
    ((2, 5, 3, 4), "NCHW", "residual", "VEC 1", "one split"),
    ((2, 5, 3, 4), "channels-last", "relu", "VEC 4", "splits"),
    ((2, 5, 3, 4), "channels-last", "residual", "VEC 1", "one split"))]


def expect_batch_norm_kernels(launched, shape, layout, names):
    """The bfloat16 kernels launched: `names` with the reductions' _rows where C is a multiple of 32 in rows."""
    rows = "_rows" if shape[1] % 32 == 0 and layout == "channels-last" else ""
    assert [k for k in launched if k.endswith("bf16>")] == [n.replace("{rows}", rows) for n in names]


@pytest.mark.parametrize("shape, layout, join, width, splits", TRAINING)
def test_batch_norm_training(be, order, launched, monkeypatch, shape, layout, join, width, splits):
    """Forward with its running statistics and its join, then backward masked by the join's output, the
    shortcut's gradient written beside dx."""
    if splits == "splits":
        split_into_many(monkeypatch)
    c, offset = shape[1], WIDTHS[width]
    x = shifted(shape, layout, offset)
    residual = draw(shape, layout, offset) if join == "residual" else None
    gamma, beta, running_mean = rng().standard_normal((3, c)).astype(np.float32)
    running_var = rng().uniform(0.5, 2, c).astype(np.float32)
    moved = running_mean.astype(np.float64), running_var.astype(np.float64)
    y, mean, invstd = be.batch_norm_forward(x, gamma, beta, EPS, running=(running_mean, running_var), momentum=0.1,
                                            relu=join != "plain", residual=residual)
    y32, mean32, invstd32 = be.batch_norm_forward(widened(x), gamma, beta, EPS, relu=join != "plain",
                                                  residual=widened(residual))
    ref_y, ref_mean, ref_invstd = R.batch_norm_forward(x, gamma, beta, EPS)
    if join != "plain":
        ref_y = R.relu_forward(ref_y if residual is None else ref_y + residual.astype(np.float64))
    R.batch_norm_update_running(*moved, ref_mean, ref_invstd, x.size // c, 0.1, EPS)
    for got, ref, name in ((mean, ref_mean, "mean"), (invstd, ref_invstd, "invstd"),
                           (running_mean, moved[0], "running mean"), (running_var, moved[1], "running var")):
        validate(got, ref, name)
    same_bits(mean, mean32, "mean of bfloat16 x and of float32 x")
    same_bits(invstd, invstd32, "invstd")
    check_rounded(y, ref_y, float32_tolerance(ref_y), y32, "y")
    check_layout(y, layout, "y")

    dy = draw(shape, layout)
    mask = None if join == "plain" else y
    dx, dgamma, dbeta, *shortcut = be.batch_norm_backward(dy, x, gamma, mean, invstd, y=mask,
                                                          shortcut=residual is not None)
    dx32, dgamma32, dbeta32, *shortcut32 = be.batch_norm_backward(widened(dy), widened(x), gamma, mean, invstd,
                                                                  y=widened(mask), shortcut=residual is not None)
    g = dy.astype(np.float64) if mask is None else R.relu_backward(dy, mask)
    ref_dx, ref_dgamma, ref_dbeta = R.batch_norm_backward(g, x, gamma, mean, invstd)
    validate(dgamma, ref_dgamma, "dgamma")
    validate(dbeta, ref_dbeta, "dbeta")
    same_bits(dgamma, dgamma32, "dgamma of bfloat16 and of float32")
    same_bits(dbeta, dbeta32, "dbeta of bfloat16 and of float32")
    check_rounded(dx, ref_dx, float32_tolerance(ref_dx), dx32, "dx")
    check_layout(dx, layout, "dx")
    if residual is not None:
        check_rounded(shortcut[0], g, 0.0, shortcut32[0], "the shortcut's gradient")
        check_layout(shortcut[0], layout, "the shortcut's gradient")
    vec = 4 if width == "VEC 4" else 1
    mode = {"plain": 0, "relu": 1, "residual": 2}[join]
    expect_batch_norm_kernels(launched, shape, layout, ["bn_stats{rows}<bf16>", f"bn_apply<{mode}, {vec}, bf16>",
                                                        "bn_backward_sums{rows}<bf16>", f"bn_backward_dx<{vec}, bf16>"])


PARTS = [pytest.param(shape, layout, id=f"{'x'.join(map(str, shape))}-{layout}")
         for shape, layout in (((3, 32, 4, 5), "channels-last"), ((2, 5, 3, 4), "NCHW"))]


@pytest.mark.parametrize("shape, layout", PARTS)
def test_batch_norm_in_the_parts_of_synchronised_batch_norm(be, order, launched, shape, layout):
    """sums of x - shift, the statistics from them, apply, the backward's sums and the dx from them."""
    c = shape[1]
    x, dy = shifted(shape, layout), draw(shape, layout)
    gamma, beta = rng().standard_normal((2, c)).astype(np.float32)
    _, ref_mean, ref_invstd = R.batch_norm_forward(x, gamma, beta, EPS)
    shift = (ref_mean + rng().standard_normal(c) / 4).astype(np.float32)
    sums = be.batch_norm_sums(x, shift)
    validate(sums, R.batch_norm_sums(x, shift), "sums of x - shift and its square")
    same_bits(sums, be.batch_norm_sums(widened(x), shift), "sums of bfloat16 and of float32")
    count = x.size // c
    mean, invstd = be.batch_norm_stats(sums, shift, count, EPS)
    y = be.batch_norm_apply(x, gamma, beta, mean, invstd)
    ref_y = R.batch_norm_forward(x, gamma, beta, EPS)[0]
    check_rounded(y, ref_y, float32_tolerance(ref_y), be.batch_norm_apply(widened(x), gamma, beta, mean, invstd), "y")
    check_layout(y, layout, "y")
    grads = be.batch_norm_backward_sums(dy, x, mean, invstd)
    validate(grads, R.batch_norm_backward_sums(dy, x, mean, invstd), "sums of dy * xhat and dy")
    same_bits(grads, be.batch_norm_backward_sums(widened(dy), widened(x), mean, invstd), "backward sums")
    dx = be.batch_norm_backward_dx(dy, x, gamma, mean, invstd, grads, count)
    ref_dx = R.batch_norm_backward(dy, x, gamma, mean, invstd)[0]
    check_rounded(dx, ref_dx, float32_tolerance(ref_dx),
                  be.batch_norm_backward_dx(widened(dy), widened(x), gamma, mean, invstd, grads, count), "dx")
    check_layout(dx, layout, "dx")
    expect_batch_norm_kernels(launched, shape, layout, ["bn_stats{rows}<bf16>", "bn_apply<0, 4, bf16>",
                                                        "bn_backward_sums{rows}<bf16>", "bn_backward_dx<4, bf16>"])


@pytest.mark.parametrize("shape, layout", PARTS)
def test_batch_norm_inference(be, order, launched, shape, layout):
    c = shape[1]
    x, dy = shifted(shape, layout), draw(shape, layout)
    gamma, beta, running_mean = rng().standard_normal((3, c)).astype(np.float32)
    running_var = rng().uniform(0.5, 3, c).astype(np.float32)
    stats = (running_mean, running_var, EPS)
    y = be.batch_norm_inference(x, gamma, beta, *stats)
    ref_y = R.batch_norm_inference(x, gamma, beta, *stats)
    check_rounded(y, ref_y, float32_tolerance(ref_y), be.batch_norm_inference(widened(x), gamma, beta, *stats), "y")
    check_layout(y, layout, "y")
    dx, dgamma, dbeta = be.batch_norm_inference_backward(dy, x, gamma, *stats)
    dx32, dgamma32, dbeta32 = be.batch_norm_inference_backward(widened(dy), widened(x), gamma, *stats)
    ref_dx, ref_dgamma, ref_dbeta = R.batch_norm_inference_backward(dy, x, gamma, *stats)
    check_rounded(dx, ref_dx, float32_tolerance(ref_dx), dx32, "dx")
    check_layout(dx, layout, "dx")
    for got, ref, peer, name in ((dgamma, ref_dgamma, dgamma32, "dgamma"), (dbeta, ref_dbeta, dbeta32, "dbeta")):
        validate(got, ref, name)
        same_bits(got, peer, name)
    expect_batch_norm_kernels(launched, shape, layout, ["bn_apply<0, 4, bf16>", "bn_backward_sums{rows}<bf16>",
                                                        "bn_inference_dx<bf16>"])


def test_batch_norm_refuses_activations_of_mixed_dtypes(be):
    shape, c = (2, 4, 3, 3), 4
    x, dy = draw(shape), draw(shape)
    gamma, mean, invstd = np.ones((3, c), np.float32)
    calls = [("batch_norm_forward", lambda: be.batch_norm_forward(x, gamma, mean, EPS, residual=widened(dy))),
             ("batch_norm_backward", lambda: be.batch_norm_backward(widened(dy), x, gamma, mean, invstd)),
             ("batch_norm_backward", lambda: be.batch_norm_backward(dy, x, gamma, mean, invstd, y=widened(x))),
             ("batch_norm_backward_sums", lambda: be.batch_norm_backward_sums(dy, widened(x), mean, invstd)),
             ("batch_norm_backward_dx", lambda: be.batch_norm_backward_dx(widened(dy), x, gamma, mean, invstd,
                                                                          np.ones((2, c), np.float32), 18)),
             ("batch_norm_inference_backward", lambda: be.batch_norm_inference_backward(dy, widened(x), gamma, mean,
                                                                                        invstd, EPS))]
    for op, call in calls:
        with pytest.raises(TypeError, match=f"{op}: takes activations of one dtype, float32 or bfloat16, got "
                                            f"bfloat16, float32"):
            call()


# ---- pooling -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("x_shape, kernel, stride, padding", MAX_POOLS[:3])
def test_max_pool2d(be, order, launched, x_shape, kernel, stride, padding, layout):
    """y is one of x's values and the argmax the reference's (bfloat16 makes ties likelier: the first wins);
    where windows overlap, a cell's gradients are added in float32 and rounded once."""
    x = draw(x_shape, layout)
    y, argmax = be.max_pool2d_forward(x, kernel, stride, padding)
    ref_y, ref_argmax = R.max_pool2d_forward(x, kernel, stride, padding)
    np.testing.assert_array_equal(argmax, ref_argmax)
    check_rounded(y, ref_y, 0.0, be.max_pool2d_forward(widened(x), kernel, stride, padding)[0], "y")
    dy = draw(y.shape)
    dx = be.max_pool2d_backward(dy, argmax, x.shape)
    ref_dx = R.max_pool2d_backward(dy, argmax, x.shape)
    # a float32 sum of m terms is off by at most (m - 1) * UNIT * the sum of their magnitudes
    terms, magnitudes = (R.max_pool2d_backward(v, argmax, x.shape) for v in (np.ones(dy.shape), np.abs(widened(dy))))
    check_rounded(dx, ref_dx, np.maximum(terms - 1, 0) * UNIT * magnitudes,
                  be.max_pool2d_backward(widened(dy), argmax, x.shape), "dx")
    assert launched == ["max_pool2d_forward<bf16>", "max_pool2d_forward<float>", "max_pool2d_backward<bf16>",
                        "max_pool2d_backward<float>"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (3, 40, 3, 5)])
def test_global_avg_pool(be, order, launched, shape, layout):
    """float32 means of bfloat16 x (for the float32 linear layer); a bfloat16 gradient from float32 dy."""
    x = draw(shape, layout)
    y = be.global_avg_pool_forward(x)
    assert y.dtype == F32
    validate(y, R.global_avg_pool_forward(x), "y")
    same_bits(y, be.global_avg_pool_forward(widened(x)), "y of bfloat16 and of float32")
    dy = draw(shape[:2], dtype=F32)
    dx = be.global_avg_pool_backward(dy, shape, dtype=BF16)
    ref_dx = R.global_avg_pool_backward(dy, shape)
    check_rounded(dx, ref_dx, UNIT * np.abs(ref_dx), be.global_avg_pool_backward(dy, shape), "dx")
    check_layout(dx, "channels-last", "dx")
    assert launched == ["global_avg_pool_forward<bf16>", "global_avg_pool_forward<float>",
                        "global_avg_pool_backward<bf16>", "global_avg_pool_backward<float>"]


@pytest.mark.parametrize("precision", kernels.PRECISIONS)
@pytest.mark.parametrize("dtype", [None, F32, BF16], ids=["None", "float32", "bfloat16"])
def test_global_avg_pool_backward_takes_the_activations_layout_and_the_dtype_asked(be, precision, dtype):
    dy = draw((2, 5), dtype=F32)
    with kernels.use_precision(precision):
        dx = be.global_avg_pool_backward(dy, (2, 5, 3, 3), dtype=dtype)
        check_layout(dx, "channels-last" if kernels.channels_last() else "NCHW", "dx")
    assert dx.dtype == (F32 if dtype is None else dtype)
    assert not np.isnan(dx.astype(np.float32)).any(), "dx not written everywhere"
    with pytest.raises(TypeError, match=r"global_avg_pool_backward: dx is float32 or bfloat16, not float64"):
        be.global_avg_pool_backward(dy, (2, 5, 3, 3), dtype=np.float64)


# ---- the optimiser's bfloat16 and TF32 copies ---------------------------------------------

@pytest.mark.parametrize("backend", ["emu", "cpu"])
@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 5e-4)])
def test_sgd_update_writes_the_bfloat16_copy_of_what_it_updates(be, order, backend, momentum, weight_decay):
    """Two steps: param and velocity bit for bit those of the update without a copy, the copy (a view into a
    flat buffer, one element in) the updated param rounded to nearest even, nothing else of the buffer written."""
    ops = be if backend == "emu" else K
    size = 1037
    param, grad, velocity = draw((3, size), dtype=F32)
    alone = param.copy(), velocity.copy()
    buffer = np.full(size + 2, np.nan, BF16)
    copy = buffer[1:-1]
    for lr in (0.1, 0.05):
        assert ops.sgd_update(param, grad, velocity, lr, momentum, weight_decay, copy=copy) is None
        ops.sgd_update(alone[0], grad, alone[1], lr, momentum, weight_decay)
        same_bits(param, alone[0], "param with and without a copy")
        same_bits(velocity, alone[1], "velocity with and without a copy")
        check_rounded(copy, param.astype(np.float64), 0.0, param, "the copy")
    assert np.isnan(buffer[[0, -1]].astype(np.float32)).all(), "sgd_update wrote outside the copy"


@pytest.mark.parametrize("backend", ["emu", "cpu"])
def test_sgd_update_writes_the_tf32_copy_of_what_it_updates(be, order, backend):
    """A float32 copy is TF32's: two steps, param and velocity bit for bit those of the update without a copy,
    the copy (a view into a flat buffer, one element in) round_tf32 of the updated param (the CPU's, checked
    against an independent model in tests/test_conv_tc.py), nothing else of the buffer written."""
    ops = be if backend == "emu" else K
    size = 1037
    param, grad, velocity = draw((3, size), dtype=F32)
    alone = param.copy(), velocity.copy()
    buffer = np.full(size + 2, np.nan, np.float32)
    for lr in (0.1, 0.05):
        assert ops.sgd_update(param, grad, velocity, lr, 0.9, 5e-4, copy=buffer[1:-1]) is None
        ops.sgd_update(alone[0], grad, alone[1], lr, 0.9, 5e-4)
        same_bits(param, alone[0], "param with and without a copy")
        same_bits(velocity, alone[1], "velocity with and without a copy")
        same_bits(buffer[1:-1], K.round_tf32(param), "the TF32 copy")
    assert np.isnan(buffer[[0, -1]]).all(), "sgd_update wrote outside the copy"


def test_sgd_update_refuses_a_copy_it_cannot_write(be):
    param, grad = draw((2, 40), dtype=F32)
    with pytest.raises(TypeError, match=r"sgd_update: the emu backend takes bfloat16 numpy arrays here, got "
                                        r"numpy.ndarray of float16"):   # a float32 copy is TF32's
        be.sgd_update(param, grad, None, 0.1, 0.0, 0.0, copy=param.astype(np.float16))
    with pytest.raises(ValueError, match=r"sgd param \(40,\) and copy \(39,\) differ in shape"):
        be.sgd_update(param, grad, None, 0.1, 0.0, 0.0, copy=np.zeros(39, BF16))
    with pytest.raises(ValueError, match=r"sgd_update: updates its arguments in place and needs dense arrays"):
        be.sgd_update(param, grad, None, 0.1, 0.0, 0.0, copy=np.zeros(80, BF16)[::2])


# ---- the CPU backend's bfloat16 ----------------------------------------------------------

def test_cpu_cast_is_astype_into_the_layout_asked():
    x = draw(SHAPE, "channels-last", dtype=F32)
    y = K.cast(x, BF16)
    check_layout(y, "channels-last", "cast")
    check_rounded(y, x.astype(np.float64), 0.0, x, "cast")
    out = np.zeros(SHAPE, np.float32)
    assert K.cast(y, np.float32, out) is out
    same_bits(out, y.astype(np.float32), "cast back")
    wide = rng().standard_normal(SHAPE)   # float64, rounded once, not through float32
    check_rounded(K.cast(wide, BF16), wide, 0.0, wide.astype(BF16).astype(np.float32), "cast of float64")
    with pytest.raises(ValueError, match=r"cast: out is float32 \(4, 6\), where bfloat16 \(2, 6, 3, 4\) is due"):
        K.cast(x, BF16, np.zeros((4, 6), np.float32))


@pytest.mark.parametrize("dtype", [None, BF16], ids=["None", "bfloat16"])
def test_cpu_global_avg_pool_backward_gives_the_dtype_asked(dtype):
    for dy in (draw((2, 5), dtype=F32), rng().standard_normal((2, 5))):
        dx = K.global_avg_pool_backward(dy, (2, 5, 3, 3), dtype=dtype)
        check_layout(dx, "channels-last", "dx")
        ref = R.global_avg_pool_backward(dy, (2, 5, 3, 3))
        if dtype is None:
            assert dx.dtype == dy.dtype
            validate(dx, ref, "dx")
        else:
            check_rounded(dx, ref, UNIT * np.abs(ref), np.broadcast_to(dy[:, :, None, None] / 9, ref.shape), "dx")


@pytest.mark.parametrize("index", [None, np.int32, np.int64])
def test_images_to_float_gives_the_storage_of_the_precision(be, order, index):
    """Under bf16 the images come out bfloat16: the float32 conversion rounded once."""
    images = rng().integers(0, 256, (3, 5, 6)).astype(np.uint8)
    idx = None if index is None else np.array([2, 0, 2, 1], index)
    x = be.images_to_float(images, idx)
    expected = K.images_to_float(images, idx).astype(BF16)
    assert x.dtype == BF16 and x.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes(), reproduce_hint()
