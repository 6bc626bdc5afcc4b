"""Batch norm's training statistics from the forward convolution (conv2d_forward(..., statistics=...)):
on a device backend, the forwards sum them in their epilogue (bn_stats.cuh): the tensor-core GEMMs
(TF32 and BF16, halo included: tc_conv.cuh's tc_batch_stats) and conv.cu's (the stem's: batch_stats);
the CPU backend as its batch_norm_forward does. A Sequential's convolution followed by a batch norm
computes the norm's statistics (the stem).

- On the CPU emulator, in both thread (and block) orders, with the launchers' plans and with split-K
  forced (the statistics then come from the tile as the finishing block stored it): mean, invstd and
  the moved running statistics against float64 of the stored y (biased variance for invstd, unbiased
  for the running variance, as PyTorch), within float32's rounding of the sums; y bit for bit what the
  forward without statistics stores; the statistics bit for bit the same in both orders. The shapes
  leave partial tiles of rows and columns, and many row tiles (merged in two levels).
- Inputs far from zero (mean 3 over a deviation of 1, in y much further): the shifted sums do not
  cancel.
"""
import numpy as np
import pytest

import kernels
from helpers import reproduce_hint, rng
from kernels.cuda import conv_tc
from kernels.emu import thread_order

EPS, MOMENTUM = 1e-5, 0.1
SHAPES = [
    ((2, 32, 9, 7), (64, 32, 3, 3), 1, 1),     # a partial last tile of rows
    ((2, 32, 6, 6), (160, 32, 3, 3), 1, 1),    # a partial tile of columns
    ((3, 32, 28, 28), (32, 32, 3, 3), 1, 1),   # 2352 rows: 19 row tiles, merged in groups; the halo forward
    ((1, 8, 5, 5), (200, 8, 3, 3), 2, 1),      # 9 rows; BF16's gathered copies
    ((2, 3, 6, 6), (8, 3, 3, 3), 1, 1),        # conv.cu's forward (3 channels: no tensor cores)
    ((2, 1, 28, 28), (72, 1, 3, 3), 1, 1),     # the stem's, at 72 channels: two tiles of them, 25 of pixels
    ((2, 32, 9, 9), (96, 32, 3, 3), 1, 1),     # 162 rows by 96 columns: TF32's 128 x 128 tile, unsplit by its plan
]


def force(variant, monkeypatch):
    """The launchers' plans; or every forward GEMM split over k in parts of a stage or two (the statistics
    from the tile as stored); or the halo forward wherever it applies (whatever the grid). Returns the
    names of the kernels launched."""
    if variant == "split":
        for name in ("SPLIT_TARGET", "BF16_SPLIT_TARGET"):
            monkeypatch.setattr(conv_tc, name, 10**9)
        monkeypatch.setattr(conv_tc, "MIN_SPLIT_K", 32)
        monkeypatch.setattr(conv_tc, "BF16_MIN_SPLIT_K", 64)
        monkeypatch.setattr(conv_tc, "HALO_SLOTS", 0)   # no halo forward: it does not split
    elif variant.startswith("halo"):
        for name in ("SPLIT_TARGET", "BF16_SPLIT_TARGET"):
            monkeypatch.setattr(conv_tc, name, 1)
    names, launch = [], conv_tc.launch
    monkeypatch.setattr(conv_tc, "launch", lambda be, family, kernel, grid, args, **k: names.append((kernel, grid)) or
                        launch(be, family, kernel, grid, args, **k))
    return names


def draw(x_shape, w_shape):
    g = rng()
    dtype = kernels.storage_dtype()
    x = (g.standard_normal(x_shape) + 3.0).astype(np.float32)
    x = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2).astype(dtype)   # channels-last
    w = (g.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32).astype(dtype)
    b = g.standard_normal(w_shape[0]).astype(np.float32)
    running = (g.standard_normal(w_shape[0]).astype(np.float32), g.uniform(0.5, 2, w_shape[0]).astype(np.float32))
    return x, w, b, running


def forward_with_statistics(order, x, w, b, running, stride, padding):
    running = tuple(r.copy() for r in running)
    with thread_order(order):
        be = kernels._device_backend("emu")
        y, mean, invstd = be.conv2d_forward(x, w, b, stride, padding, statistics=(EPS, running, MOMENTUM))
        plain = be.conv2d_forward(x, w, b, stride, padding)
    return y, plain, mean, invstd, running


@pytest.mark.parametrize("precision, variant", [("tf32", "plan"), ("tf32", "split"), ("tf32", "halo"),
                                                ("bf16", "plan"), ("bf16", "split"), ("bf16", "halo")])
@pytest.mark.parametrize("x_shape, w_shape, stride, padding", SHAPES)
def test_batch_statistics_from_the_forward(monkeypatch, precision, variant, x_shape, w_shape, stride, padding):
    launched = force(variant, monkeypatch)
    conv_tc.plan.cache_clear()
    try:
        with kernels.use_precision(precision):
            x, w, b, running = draw(x_shape, w_shape)
            runs = [forward_with_statistics(order, x, w, b, running, stride, padding)
                    for order in ("ascending", "descending")]
    finally:
        conv_tc.plan.cache_clear()
    name = f"{precision} {variant} conv {x_shape} * {w_shape}"
    tensor_cores = x_shape[1] % 4 == 0
    assert bool(launched) == tensor_cores, launched
    if tensor_cores and variant == "split" and x_shape[1] * w_shape[2] * w_shape[3] >= 2 * 64:   # k for 2 parts
        assert all(grid[2] > 1 for _, grid in launched), launched
    if variant == "halo" and x_shape[2:] == (28, 28):
        assert all("forward_halo" in kernel for kernel, _ in launched), launched
    check_statistics(name, runs, running)


def check_statistics(name, runs, running):
    """The statistics of forward_with_statistics's `runs` in the two thread orders: y bit for bit the forward's
    without them, the same bits in both orders, and against float64 of the stored y (from `running`, the pair
    before)."""
    (y, plain, mean, invstd, moved), other = runs[0], runs[1]
    assert np.asarray(y).tobytes() == np.asarray(plain).tobytes(), f"{name}: y differs with the statistics"
    for ours, theirs, what in zip(runs[0][2:], other[2:], ("mean", "invstd", "running")):
        assert np.asarray(ours).tobytes() == np.asarray(theirs).tobytes(), f"{name}: {what} differs between orders"
    stored = np.asarray(y).astype(np.float64)
    count = stored.size // stored.shape[1]
    exact_mean, exact_var = stored.mean(axis=(0, 2, 3)), stored.var(axis=(0, 2, 3))
    scale = np.abs(exact_mean) + np.sqrt(exact_var)
    bound = 64 * 2.0**-24   # float32's rounding of sums merged in a tree of a few hundred steps
    checks = [("mean", mean, exact_mean, scale),
              ("invstd", invstd, 1 / np.sqrt(exact_var + EPS), 1 / np.sqrt(exact_var + EPS)),
              ("running mean", moved[0], (1 - MOMENTUM) * running[0] + MOMENTUM * exact_mean,
               np.abs(running[0]) + scale),
              ("running var", moved[1], (1 - MOMENTUM) * running[1] + MOMENTUM * exact_var * count / (count - 1),
               running[1] + exact_var)]
    for what, ours, exact, magnitude in checks:
        ours = np.asarray(ours)
        assert ours.dtype == np.float32 and ours.shape == exact.shape, f"{name}: {what} {ours.dtype} {ours.shape}"
        excess = np.abs(ours - exact) - bound * magnitude
        worst = int(np.argmax(excess))
        assert excess[worst] <= 0, (f"{name}: {what} of channel {worst}: {ours[worst]!r}, float64 {exact[worst]!r} "
                                    f"({np.count_nonzero(excess > 0)} channels beyond)\n{reproduce_hint()}")


def test_the_cpu_backend_returns_its_batch_norms_statistics():
    """The CPU backend's statistics, summed a part of the images at a time as the convolution makes them, are
    batch_norm_forward's to a few roundings of float32, and move the running pair alike; the same bits again
    when computed again."""
    from kernels import cpu
    g = rng()
    x, w = g.standard_normal((2, 3, 6, 5)).astype(np.float32), g.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = None
    pairs = [tuple(np.full(4, v, np.float32) for v in (0.5, 2.0)) for _ in range(2)]
    y, mean, invstd = cpu.conv2d_forward(x, w, b, 1, 1, statistics=(EPS, pairs[0], MOMENTUM))
    _, bn_mean, bn_invstd = cpu.batch_norm_forward(cpu.conv2d_forward(x, w, b, 1, 1), np.ones(4, np.float32),
                                                   np.zeros(4, np.float32), EPS, running=pairs[1], momentum=MOMENTUM)
    for ours, theirs in ((mean, bn_mean), (invstd, bn_invstd)) + tuple(zip(pairs[0], pairs[1])):
        np.testing.assert_allclose(ours, theirs, rtol=4e-7, atol=4e-7 * np.abs(theirs).max())
    again = cpu.conv2d_forward(x, w, b, 1, 1, statistics=(EPS, None, MOMENTUM))
    assert again[1].tobytes() == mean.tobytes() and again[2].tobytes() == invstd.tobytes()


def test_running_statistics_of_the_wrong_shape_are_refused():
    with kernels.use_precision("bf16"):
        be = kernels._device_backend("emu")
        x, w, b, running = draw((1, 8, 4, 4), (8, 8, 3, 3))
        with pytest.raises(ValueError, match="running statistics"):
            be.conv2d_forward(x, w, b, 1, 1, statistics=(EPS, (running[0][:4], running[1]), MOMENTUM))


# ---- the backward's sums from backward-data ----------------------------------------------------------

BACKWARD_SHAPES = SHAPES[:3] + [
    ((2, 32, 9, 7), (32, 32, 3, 3), 2, 1),    # stride 2: four phases' tiles merged
    ((6, 32, 9, 9), (32, 32, 3, 3), 2, 1),    # phases of 150, 120, 120 and 96 cells: blocks past theirs merge zeros
    ((3, 32, 8, 8), (64, 32, 1, 1), 2, 0),    # a projection's: three phases no tap reaches, dx 0 there
    ((1, 32, 40, 20), (48, 32, 3, 3), 2, 1),  # even H and W, dy 20 x 10: the halo variants' phases from windows
]
WINDOWS = BACKWARD_SHAPES[-1]   # TF32's halo variants alone (tf32_skips; BF16 has no such kernel)


def channels_last(a):
    """An NCHW view of a's NHWC copy."""
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def norm_inputs(g, shape):
    """A batch norm's output y (a relu's: half zeros) and input x_norm (mean 2), channels-last in the precision's
    storage, and its mean and invstd, drawn from g."""
    storage = kernels.storage_dtype()
    y = channels_last(np.maximum(g.standard_normal(shape), 0).astype(np.float32)).astype(storage)
    x_norm = channels_last((g.standard_normal(shape) + 2).astype(np.float32)).astype(storage)
    return y, x_norm, g.standard_normal(shape[1]).astype(np.float32), g.uniform(0.5, 2, shape[1]).astype(np.float32)


def backward_with_sums(order, dy, x, w, norm, stride, padding, out, add, add_order="C"):
    """The backward with the norm's sums and without, each adding dx to a copy of `add` (None: no add) in
    `add_order` (numpy's: "C", an NCHW gradient, added by a launch of its own; "K", channels-last as `add` is,
    added in the epilogue)."""
    with thread_order(order):
        be = kernels._device_backend("emu")
        grads = be.conv2d_backward(dy, x, w, stride, padding, norm=norm, norm_out=out,
                                   add_dx_to=None if add is None else add.copy(order=add_order))
        plain = be.conv2d_backward(dy, x, w, stride, padding,
                                   add_dx_to=None if add is None else add.copy(order=add_order))
    return grads, plain


def check_sums(name, dx, y, x_norm, mean, invstd, sums):
    """The norm's backward sums (dgamma, dbeta) of dx against float64 of them (g = dx where y > 0), within
    64 units of float32's rounding of their magnitude."""
    masked = np.where(np.asarray(y).astype(np.float64) > 0, np.asarray(dx).astype(np.float64), 0.0)
    xhat = (np.asarray(x_norm).astype(np.float64) - mean[None, :, None, None]) * invstd[None, :, None, None]
    axes = (0, 2, 3)
    for what, ours, exact, magnitude in (("dgamma", sums[0], (masked * xhat).sum(axes),
                                          np.abs(masked * xhat).sum(axes)),
                                         ("dbeta", sums[1], masked.sum(axes), np.abs(masked).sum(axes))):
        excess = np.abs(ours - exact) - 64 * 2.0**-24 * magnitude
        worst = int(np.argmax(excess))
        assert excess[worst] <= 0, (f"{name}: {what} of channel {worst}: {ours[worst]!r}, float64 {exact[worst]!r}"
                                    f"\n{reproduce_hint()}")


BACKWARD_VARIANTS = [("tf32", "plan"), ("tf32", "split"), ("bf16", "plan"), ("bf16", "split"), ("bf16", "halo"),
                     ("tf32", "add"), ("bf16", "halo add"), ("tf32", "relu"), ("bf16", "halo relu"), ("tf32", "halo"),
                     ("tf32", "halo add"), ("tf32", "halo relu")]


def tf32_skips(variant, shape):
    """What TF32's variants leave out, for the suite's time: add and relu at 28 x 28 (the halo ones there are
    BF16's, and TF32's plain halo), the halo ones at stride 2 where no kernel from windows runs (odd H or W),
    and at the stride-2 shape of even H and W all but the halo ones (the other stride-2 shapes run them)."""
    big, strided = shape[0][2:] == (28, 28), shape[2] != 1
    windows = strided and not (shape[0][2] % 2 or shape[0][3] % 2)
    return variant in ("add", "relu", "halo add", "halo relu") and big or \
        variant.startswith("halo") and strided and not windows or windows and not variant.startswith("halo")


# every variant at every shape, but what tf32_skips says
@pytest.mark.parametrize("precision, variant, x_shape, w_shape, stride, padding", [
    (precision, variant, *shape) for shape in BACKWARD_SHAPES for precision, variant in BACKWARD_VARIANTS
    if not (precision == "tf32" and tf32_skips(variant, shape)) and not (precision == "bf16" and shape == WINDOWS)])
def test_batch_norm_sums_from_backward_data(monkeypatch, precision, variant, x_shape, w_shape, stride, padding):
    """conv2d_backward(..., norm=(y, x_norm, mean, invstd, None, None), norm_out=(dgamma, dbeta)): the sums of
    the batch norm (with its relu, or residual join) whose output the convolution reads, g = dx where y > 0:
    sum(g * xhat) and sum(g), into norm_out, against float64 of the stored dx; dx, dw and db bit for bit the
    backward's without them, the sums bit for bit the same in both orders. Variants "... add": dx added to a
    gradient already there (add_dx_to: the other readers' of a residual block's output), the sums those of
    the total. Variants "... relu": a relu alone, norm=(y, x_norm, mean, invstd, gamma, beta), y the
    emulator's own batch_norm_apply(..., relu=True) of x_norm, handed to the convolution as NaN: the mask
    is recomputed from x_norm, bit for bit the forward's, and y is not read."""
    launched = force(variant, monkeypatch)
    conv_tc.plan.cache_clear()
    try:
        name = f"{precision} {variant} conv {x_shape} * {w_shape} stride {stride}"
        check_backward_sums(name, precision, x_shape, w_shape, stride, padding, variant.endswith("add"),
                            variant.endswith("relu"))
    finally:
        conv_tc.plan.cache_clear()
    if stride == 1 and x_shape[1] % 4 == 0 and variant.startswith("halo") and x_shape[2:] == (28, 28):
        assert any("dgrad_halo" in kernel for kernel, _ in launched), launched
    if stride == 2 and w_shape[2:] == (3, 3) and precision == "tf32" and variant.startswith("halo"):
        assert any(kernel == conv_tc.PHASE_KERNEL for kernel, _ in launched), launched


def check_backward_sums(name, precision, x_shape, w_shape, stride, padding, add, relu, add_order="C"):
    """conv2d_backward on the emulator with a batch norm's sums, in `precision`, in both thread orders, as
    test_batch_norm_sums_from_backward_data says: `add`, dx added to a gradient (in add_order, see
    backward_with_sums); `relu`, a relu alone whose mask the epilogue recomputes from x_norm."""
    with kernels.use_precision(precision):
        x, w, _, _ = draw(x_shape, w_shape)
        g = rng()
        storage = kernels.storage_dtype()
        y, x_norm, mean, invstd = norm_inputs(g, x_shape)
        affine, handed_y = (None, None), y
        if relu:   # y as the forward made it; the convolution is handed NaN
            affine = tuple(g.standard_normal(x_shape[1]).astype(np.float32) for _ in range(2))
            y = kernels._device_backend("emu").batch_norm_apply(x_norm, *affine, mean, invstd, relu=True)
            handed_y = np.full_like(y, np.nan)
        out_shape = kernels._device_backend("emu").conv2d_forward(x, w, None, stride, padding).shape
        dy = channels_last(g.standard_normal(out_shape).astype(np.float32)).astype(storage)
        add = channels_last(g.standard_normal(x_shape).astype(np.float32)).astype(storage) if add else None
        runs = []
        for order in ("ascending", "descending"):
            out = tuple(np.full(x_shape[1], np.nan, np.float32) for _ in range(2))
            runs.append(backward_with_sums(order, dy, x, w, (handed_y, x_norm, mean, invstd, *affine), stride,
                                           padding, out, add, add_order) + (out,))
    (grads, plain, out), other = runs[0], runs[1]
    assert len(grads) == 5 and grads[3] is out[0] and grads[4] is out[1], f"{name}: the sums go to norm_out"
    for ours, theirs, what in zip(grads[:3], plain, ("dx", "dw", "db")):
        assert np.asarray(ours).tobytes() == np.asarray(theirs).tobytes(), f"{name}: {what} differs with the sums"
    for ours, theirs, what in zip(grads[3:], other[0][3:], ("dgamma", "dbeta")):
        assert ours.tobytes() == theirs.tobytes(), f"{name}: {what} differs between orders"
    check_sums(name, grads[0], y, x_norm, mean, invstd, out)


def test_the_cpu_backend_hands_over_its_batch_norms_sums():
    """The CPU backend's sums from conv2d_backward are batch_norm_backward's, bit for bit, and that takes them."""
    from kernels import cpu
    g = rng()
    x, w, dy = g.standard_normal((2, 3, 6, 5)), g.standard_normal((4, 3, 3, 3)), g.standard_normal((2, 4, 6, 5))
    y, x_norm = np.maximum(g.standard_normal(x.shape), 0), g.standard_normal(x.shape)
    gamma, mean, invstd = g.standard_normal(3), g.standard_normal(3), g.uniform(0.5, 2, 3)
    dx, _, _, dgamma, dbeta = cpu.conv2d_backward(dy, x, w, 1, 1, norm=(y, x_norm, mean, invstd, None, None))
    alone = cpu.batch_norm_backward(dx, x_norm, gamma, mean, invstd, y=y)
    handed = cpu.batch_norm_backward(dx, x_norm, gamma, mean, invstd, y=y, sums=(dgamma, dbeta))
    for ours, theirs in zip(handed, alone):
        assert ours.tobytes() == theirs.tobytes()


def test_sums_need_dx():
    with kernels.use_precision("bf16"):
        be = kernels._device_backend("emu")
        x, w, _, _ = draw((1, 8, 4, 4), (8, 8, 3, 3))
        with pytest.raises(ValueError, match="need dx"):
            be.conv2d_backward(x, x, w, 1, 1, need_dx=False, norm=(x, x, np.zeros(8, np.float32),
                                                                    np.ones(8, np.float32), None, None))


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_in_a_residual_network_every_norm_read_by_a_convolution_gets_its_sums_from_it(monkeypatch, precision):
    """ResNet-18's step on the emulator: the norms run no statistics pass and no backward-sums pass: bn1's
    sums come from conv2, each block's bn2's and the stem's from the next block's conv1 or conv3, whichever
    runs its backward last (dx added there to the other's), the last block's bn2's from the pool's
    backward (bn_pooled_backward); the stem's relu runs inside its norm (no relu kernel), its module still
    on the tape (its hooks run each way)."""
    import nn
    import nn.functional as F
    from kernels.cuda import batchnorm, elementwise
    from kernels.cuda import launch as cuda_launch
    names = []

    def recording(be, family, kernel, grid, args, block=(cuda_launch.THREADS,)):
        names.append(kernel)
        return cuda_launch.launch(be, family, kernel, grid, args, block)
    for module in (batchnorm, elementwise):
        monkeypatch.setattr(module, "launch", recording)
    nn.manual_seed(0)
    model = nn.resnet18(width=8)
    g = rng()
    events = []
    handle = nn.register_module_hook(lambda m, e: events.append((e, m)))
    try:
        with kernels.use_precision(precision), kernels.emulate():
            x = g.random((2, 1, 12, 12)).astype(np.float32)
            F.cross_entropy(model(nn.Tensor(x)), np.array([3, 7], np.int32)).backward()
    finally:
        handle.remove()
    count = lambda prefix: sum(name.startswith(prefix) for name in names)   # noqa: E731
    assert count("bn_stats") == 0 and count("bn_backward_sums") == 0 and count("bn_pooled_backward") == 1, names
    assert count("bn_backward_dx") == 17 and count("relu_") == 0, names
    relu = model[2]
    assert [e for e, m in events if m is relu] == ["forward_begin", "forward_end", "backward_begin", "backward_end"]


# (N, C, H, W) of the pooled activations: C a multiple of 32 (bn_pooled_backward, one split or several),
# or not (the pool's kernel, then batchnorm.py's pass)
POOLED_SHAPES = [(2, 64, 4, 4), (64, 32, 6, 6), (3, 24, 2, 2)]


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("shape", POOLED_SHAPES)
def test_batch_norm_sums_from_the_pools_backward(precision, shape):
    """global_avg_pool_backward(..., norm=(y, x, mean, invstd, None, None), norm_out=...): the sums of the batch norm
    whose output the pool read, g = dx where y > 0, against float64 of the stored dx; dx bit for bit the
    pool's backward without them; the sums bit for bit the same in both orders; the CPU backend's equal
    batch_norm_backward's own."""
    g = rng()
    with kernels.use_precision(precision):
        storage = kernels.storage_dtype()
        y, x_norm, mean, invstd = norm_inputs(g, shape)
        dy = g.standard_normal(shape[:2]).astype(np.float32)
        runs = []
        for order in ("ascending", "descending"):
            with thread_order(order):
                be = kernels._device_backend("emu")
                out = tuple(np.full(shape[1], np.nan, np.float32) for _ in range(2))
                norm = (y, x_norm, mean, invstd, None, None)
                runs.append((be.global_avg_pool_backward(dy, shape, dtype=storage, norm=norm, norm_out=out), out,
                             be.global_avg_pool_backward(dy, shape, dtype=storage)))
    (grads, out, plain), other = runs[0], runs[1][0]
    name = f"{precision} pool {shape}"
    assert len(grads) == 3 and grads[1] is out[0] and grads[2] is out[1], f"{name}: the sums go to norm_out"
    assert np.asarray(grads[0]).tobytes() == np.asarray(plain).tobytes(), f"{name}: dx differs with the sums"
    for ours, theirs, what in zip(grads[1:], other[1:], ("dgamma", "dbeta")):
        assert ours.tobytes() == theirs.tobytes(), f"{name}: {what} differs between orders"
    check_sums(name, grads[0], y, x_norm, mean, invstd, out)
    from kernels import cpu
    y64, x64 = np.asarray(y).astype(np.float64), np.asarray(x_norm).astype(np.float64)
    dx, dgamma, dbeta = cpu.global_avg_pool_backward(dy.astype(np.float64), shape,
                                                     norm=(y64, x64, mean, invstd, None, None))
    alone = cpu.batch_norm_backward(dx, x64, np.ones(shape[1]), mean, invstd, y=y64)
    assert dgamma.tobytes() == alone[1].tobytes() and dbeta.tobytes() == alone[2].tobytes()


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("shape, layout", [((2, 16, 5, 6), "channels-last"), ((3, 5, 3, 3), "nchw")])
def test_a_relu_alones_mask_is_recomputed_from_x(precision, shape, layout):
    """batch_norm_backward(..., y=y, beta=beta) on a device backend: the relu's mask from x (bn_affine, as
    batch_norm_apply computed y), y not read (handed as NaN): dx bit for bit the backward's that reads the
    true y, in 4-wide and 1-wide kernels; without y (an output not stored: conv2d's normalize) the same.
    beta with a shortcut is refused."""
    g = rng()
    with kernels.use_precision(precision):
        be = kernels._device_backend("emu")
        storage = kernels.storage_dtype()
        arrange = channels_last if layout == "channels-last" else np.ascontiguousarray
        x, dy = (arrange(g.standard_normal(shape).astype(np.float32)).astype(storage) for _ in range(2))
        gamma = g.standard_normal(shape[1]).astype(np.float32)
        beta, mean = (0.1 * g.standard_normal(shape[1]).astype(np.float32) for _ in range(2))   # half pass, or so
        invstd = g.uniform(0.5, 2, shape[1]).astype(np.float32)
        sums = tuple(g.standard_normal(shape[1]).astype(np.float32) for _ in range(2))
        y = be.batch_norm_apply(x, gamma, beta, mean, invstd, relu=True)
        assert 0.1 < np.mean(np.asarray(y).astype(np.float32) > 0) < 0.9
        read = be.batch_norm_backward(dy, x, gamma, mean, invstd, y=y, sums=sums)
        recomputed = be.batch_norm_backward(dy, x, gamma, mean, invstd, y=np.full_like(y, np.nan), beta=beta,
                                            sums=sums)
        assert np.asarray(recomputed[0]).tobytes() == np.asarray(read[0]).tobytes()
        unstored = be.batch_norm_backward(dy, x, gamma, mean, invstd, beta=beta, sums=sums)
        assert np.asarray(unstored[0]).tobytes() == np.asarray(read[0]).tobytes()
        with pytest.raises(ValueError, match="beta"):
            be.batch_norm_backward(dy, x, gamma, mean, invstd, sums=sums, y=y, beta=beta, shortcut=True)

