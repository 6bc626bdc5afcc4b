"""The batch-norm reductions over rows of channels (kernels/cuda/batchnorm.cu's bn_stats_rows and
bn_backward_sums_rows), which the launchers pick for channels-last memory (and 1x1 images) whose C is a
multiple of 32, on the emulator.

- Every op that runs them (the training forward with its running statistics, the sums of synchronised
  batch norm, the training backward with and without its relu mask, the inference backward) against the
  float64 references of tests/reference.py, for C = 32, 64 and 96 (one, two and three 32-channel groups),
  on channels-last x and on NCHW 1x1 images; with one split of the rows, fewer splits than the block that
  adds them has warps, more but not a multiple of them, and a split per row. C = 48 keeps the
  block-per-channel kernels, checked the same way. The inputs are random, their means far from zero (what
  the shift is for), and new arrays start as NaN (conftest's poisoned_empty), so an element a kernel forgets
  to write fails. The emulator runs the threads and blocks in each order: the last block of a group is
  another one in each, and the results must not differ by a bit.
- Each 32-byte sector of x and dy is read once, whole, as emu.traffic() counts the loads; the
  block-per-channel kernels read a sector per 4 bytes they use there; bench/bn_plan.py measures as much.
- The grids at the batch-256 ResNet-18 shapes fill an H200's 132 SMs.
"""
import numpy as np
import pytest

import kernels
import reference as R
from helpers import reproduce_hint, rng, validate
from kernels import emu
from kernels.cuda import batchnorm
from kernels.cuda import launch as cuda_launch

EPS = 1e-5
pytestmark = pytest.mark.usefixtures("poisoned_empty")

# (x's shape, its memory): C = 32, 64, 96 by rows; 48, not a multiple of 32, a block per channel
SHAPES = [pytest.param(shape, memory, id=f"{'x'.join(map(str, shape))}-{memory}")
          for shape, memory in (((3, 32, 5, 7), "channels-last"), ((3, 64, 5, 7), "channels-last"),
                                ((3, 96, 5, 7), "channels-last"), ((5, 64, 1, 1), "NCHW"),
                                ((3, 48, 5, 7), "channels-last"))]
# MIN_SPLIT_LENGTH, in elements (a row of a 32-channel group holds 32): for 105 rows, one split; 3, fewer than
# the 8 warps of the block that adds them; 10, more and not a multiple of 8; a split per row
SPLITS = {"one split": cuda_launch.MIN_SPLIT_LENGTH, "3 splits": 32 * 35, "10 splits": 32 * 10,
          "a split per row": 4}
REDUCTIONS = ("bn_stats", "bn_backward_sums")


@pytest.fixture
def be():
    return kernels._device_backend("emu")


@pytest.fixture(params=SPLITS)
def splits(request, monkeypatch):
    monkeypatch.setattr(cuda_launch, "MIN_SPLIT_LENGTH", SPLITS[request.param])
    return request.param


@pytest.fixture
def launched(monkeypatch):
    """[(kernel, grid)] of the reductions the test launches, as it goes."""
    grids = []

    def recording(be, family, kernel, grid, args, block=(cuda_launch.THREADS,)):
        if kernel.startswith(REDUCTIONS):
            grids.append((kernel, grid))
        return cuda_launch.launch(be, family, kernel, grid, args, block)
    monkeypatch.setattr(batchnorm, "launch", recording)
    return grids


def expect_kernels(launched, shape, *names):
    """The reductions launched were `names`, by rows where C is a multiple of 32 (every shape here lies in
    rows of channels)."""
    suffix = "_rows" if shape[1] % 32 == 0 else ""
    assert [kernel for kernel, _ in launched] == [f"{name}{suffix}<float>" for name in names]


def in_memory(be, a, memory):
    a = np.asarray(a, np.float32)
    return cuda_launch.to_channels_last(be, a) if memory == "channels-last" else np.ascontiguousarray(a)


def far_from_zero(shape):
    """Per-channel means of -300 to 300 and standard deviations of 1 to 3: without the shift, float32 sums of
    squares near 9e4 lose the variance."""
    g, c = rng(), shape[1]
    return g.standard_normal(shape) * g.uniform(1, 3, c)[:, None, None] + g.uniform(-300, 300, c)[:, None, None]


def draw(shape):
    return rng().standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape, memory", SHAPES)
def test_training_forward_and_its_running_statistics(be, order, splits, launched, shape, memory):
    x = in_memory(be, far_from_zero(shape), memory)
    c = shape[1]
    gamma, beta, running_mean = draw((3, c))
    running_var = rng().uniform(0.5, 2, c).astype(np.float32)
    moved = running_mean.astype(np.float64), running_var.astype(np.float64)
    y, mean, invstd = be.batch_norm_forward(x, gamma, beta, EPS, running=(running_mean, running_var), momentum=0.1)
    expect_kernels(launched, shape, "bn_stats")
    ref_y, ref_mean, ref_invstd = R.batch_norm_forward(x, gamma, beta, EPS)
    R.batch_norm_update_running(*moved, ref_mean, ref_invstd, x.size // c, 0.1, EPS)
    for got, ref, name in zip((y, mean, invstd, running_mean, running_var), (ref_y, ref_mean, ref_invstd, *moved),
                              ("y", "mean", "invstd", "running mean", "running var")):
        validate(got, ref, name)


@pytest.mark.parametrize("shape, memory", SHAPES)
def test_the_sums_synchronised_batch_norm_adds(be, order, splits, launched, shape, memory):
    """Both reductions into the sums replicas all-reduce: of x - shift and its square; of dy * xhat and dy."""
    x, dy = in_memory(be, far_from_zero(shape), memory), in_memory(be, draw(shape), memory)
    shift = (R.batch_norm_forward(x, np.ones(shape[1]), np.zeros(shape[1]), EPS)[1] + draw(shape[1])).astype(
        np.float32)
    mean, invstd = shift + draw(shape[1]) / 4, rng().uniform(0.3, 1, shape[1]).astype(np.float32)
    validate(be.batch_norm_sums(x, shift), R.batch_norm_sums(x, shift), "sums of x - shift and its square")
    validate(be.batch_norm_backward_sums(dy, x, mean, invstd), R.batch_norm_backward_sums(dy, x, mean, invstd),
             "sums of dy * xhat and dy")
    expect_kernels(launched, shape, "bn_stats", "bn_backward_sums")


@pytest.mark.parametrize("shape, memory", SHAPES)
@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
def test_training_backward(be, order, splits, launched, shape, memory, relu):
    """dgamma and dbeta from dy, masked where a fused relu's output y is 0, and the dx built on them."""
    x, dy = in_memory(be, far_from_zero(shape), memory), in_memory(be, draw(shape), memory)
    gamma = draw(shape[1])
    _, mean, invstd = R.batch_norm_forward(x, gamma, gamma, EPS)
    mean, invstd = mean.astype(np.float32), invstd.astype(np.float32)
    y = in_memory(be, np.maximum(draw(shape), 0), memory) if relu else None   # half of it 0
    dx, dgamma, dbeta = be.batch_norm_backward(dy, x, gamma, mean, invstd, y=y)
    expect_kernels(launched, shape, "bn_backward_sums")
    masked = dy if y is None else dy * (y > 0)
    refs = R.batch_norm_backward(masked, x, gamma, mean, invstd)
    for got, ref, name in zip((dgamma, dbeta), refs[1:], ("dgamma", "dbeta")):
        validate(got, ref, name)
    # dx: within float32's rounding of xhat, which the kernel makes as the forward does, x invstd - mean invstd,
    # terms of |x| invstd that cancel (far from zero, a few rows: a sizeable error), carried by dx's two sums
    per = lambda a: np.float64(a).reshape(1, -1, 1, 1)   # noqa: E731
    x64, dy64, m = np.float64(x), np.float64(masked), x.size // x.shape[1]
    xhat = (x64 - per(mean)) * per(invstd)
    e_xhat = 4 * 2.0**-24 * per(invstd) * (np.abs(x64) + np.abs(per(mean)))
    along = lambda a: a.sum(axis=(0, 2, 3)).reshape(1, -1, 1, 1)   # noqa: E731
    bound = np.abs(per(gamma)) * per(invstd) * (e_xhat * np.abs(along(dy64 * xhat)) +
                                                np.abs(xhat) * along(np.abs(dy64) * e_xhat)) / m
    err = np.abs(np.float64(dx) - refs[0]) - bound - 1e-4 * np.abs(refs[0]).max()
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] <= 0, f"dx beyond xhat's rounding at {worst}: ours {dx[worst]}, ref {refs[0][worst]}, " \
                            f"bound {bound[worst]:.3g}\n{reproduce_hint()}"


@pytest.mark.parametrize("shape, memory", SHAPES)
def test_inference_backward(be, order, splits, launched, shape, memory):
    x, dy = in_memory(be, far_from_zero(shape), memory), in_memory(be, draw(shape), memory)
    c = shape[1]
    gamma, running_mean = draw(c), (R.batch_norm_forward(x, np.ones(c), np.zeros(c), EPS)[1] + draw(c)).astype(
        np.float32)
    running_var = rng().uniform(0.5, 3, c).astype(np.float32)
    for got, ref, name in zip(be.batch_norm_inference_backward(dy, x, gamma, running_mean, running_var, EPS),
                              R.batch_norm_inference_backward(dy, x, gamma, running_mean, running_var, EPS),
                              ("dx", "dgamma", "dbeta")):
        validate(got, ref, name)
    expect_kernels(launched, shape, "bn_backward_sums")


@pytest.mark.parametrize("splits", ["10 splits", "a split per row"], indirect=True)
@pytest.mark.parametrize("shape, memory", SHAPES[1:3])
def test_the_bits_do_not_depend_on_which_block_finishes_last(be, splits, launched, shape, memory):
    """The blocks run in the other order, so another block of each group adds the splits: not a bit changes."""
    x, dy = in_memory(be, far_from_zero(shape), memory), in_memory(be, draw(shape), memory)
    y = in_memory(be, np.maximum(draw(shape), 0), memory)
    gamma, beta = draw((2, shape[1]))

    def step():
        _, mean, invstd = be.batch_norm_forward(x, gamma, beta, EPS)
        return (mean, invstd, *be.batch_norm_backward(dy, x, gamma, mean, invstd, y=y)[1:])

    results = {}
    for order in emu.ORDERS:
        with emu.thread_order(order):
            results[order] = step()
    assert all(grid[1] > 1 for _, grid in launched), launched
    for name, ascending, descending in zip(("mean", "invstd", "dgamma", "dbeta"), *results.values()):
        np.testing.assert_array_equal(ascending, descending, err_msg=f"{name}: the order of the blocks shows")


@pytest.mark.parametrize("c", [64, 96])
def test_each_sector_of_x_and_dy_is_read_once_and_whole(be, launched, c):
    """With one split (the per-split sums the launcher allocates lie where NumPy puts them, at 16 bytes, not
    at CuPy's 256) on arrays aligned as CuPy's, emu.traffic() counts every byte the reductions use once, in
    whole sectors: x and dy, and each warp's read of its 32 channels' shift, or mean and invstd."""
    rows = 40
    x, dy = (emu.aligned_empty((rows, c)) for _ in range(2))
    x[...], dy[...] = far_from_zero((rows, c, 1, 1))[:, :, 0, 0], draw((rows, c))
    mean, invstd = (emu.aligned_empty(c) for _ in range(2))
    mean[...], invstd[...] = x.mean(axis=0), 1 / x.std(axis=0)
    as_nchw = lambda a: a.reshape(rows, c, 1, 1)   # noqa: E731  (rows of channels: C-contiguous 1x1 images)
    with emu.traffic() as counted:
        be.batch_norm_sums(as_nchw(x), mean)
        be.batch_norm_backward_sums(as_nchw(dy), as_nchw(x), mean, invstd)
    warps = c // 32 * cuda_launch.THREADS // 32   # of the grid: each reads its channels' shift, or mean and invstd

    def whole(nbytes):   # in requests of a warp's 32 consecutive floats, 4 sectors each
        return emu.Traffic(requests=nbytes // 128, sectors=nbytes // 32, bytes=nbytes)
    assert [grid for _, grid in launched] == [(c // 32, 1)] * 2
    assert counted == {"bn_stats_rows<float>": whole(x.nbytes + 128 * warps),
                       "bn_backward_sums_rows<float>": whole(dy.nbytes + x.nbytes + 2 * 128 * warps)}


def test_the_block_per_channel_kernels_read_a_sector_per_4_bytes_of_rows(be):
    """The same count for the kernels that C = 48 keeps: each lane's value of x, and the channel's shift
    that all of them read, in a sector of its own."""
    x = emu.aligned_empty((256, 48))
    x[...] = draw(x.shape)
    with emu.traffic() as counted:
        be.batch_norm_sums(x.reshape(256, 48, 1, 1), np.zeros(48, np.float32))
    assert counted["bn_stats<float>"].sectors * 32 == 8 * counted["bn_stats<float>"].bytes
    assert counted["bn_stats<float>"].bytes == x.nbytes + 48 * cuda_launch.THREADS // 32 * 4


@pytest.mark.parametrize("c, size", [(64, 28), (128, 14), (256, 7), (512, 4)])
def test_the_grids_fill_an_h200_at_the_batch_256_shapes(c, size):
    """At least 2 blocks per SM of 132, each channel adding at most 256 splits."""
    rows = 256 * size * size
    suffix, (groups, splits), chunk = batchnorm.reduction(rows, c, 1)
    assert suffix == "_rows" and groups * 32 == c
    assert groups * splits >= 2 * 132 and splits <= 256 and (splits - 1) * chunk < rows <= splits * chunk


def test_bench_bn_plan_measures_8_bytes_from_l2_per_byte_used_before_and_1_after(capsys):
    """bench/bn_plan.py on a small shape: the ratios of its table, and the step's traffic it models from them."""
    from bench import bn_plan
    ratios = {(bn_plan.reduction_of(kernel), old, 64): t.sectors * 32 / t.bytes
              for old in (True, False) for kernel, t in bn_plan.measured(256, 64, old).items()}
    assert sorted(ratios) == sorted((name, old, 64) for name in bn_plan.REDUCTIONS for old in (True, False))
    for (name, old, _), ratio in ratios.items():
        assert (ratio == 8) if old else (1 <= ratio < 1.05), (name, old, ratio)
    _, (used, l2_old, l2_new) = bn_plan.per_step(256, ratios, 132)
    assert l2_old == pytest.approx(8 * used) and used <= l2_new < 1.05 * used
    assert bn_plan.main(["--rows", "256", "--channels", "64"]) == 0
    assert "`bn_backward_sums_rows<float>` | 64 |" in capsys.readouterr().out
