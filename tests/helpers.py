"""The one shared test helper: random inputs, result validation, op checks, numeric gradients.

- ``rng()`` gives fresh random numbers on every run. All of a session's draws derive from
  one seed, ``SESSION_SEED`` (printed in pytest's header, quoted in every failure); run again
  with ``TEST_SEED=<seed>`` to get the very same inputs back, for the whole suite or one test.
- ``validate(ours, ref, name)`` is llm.c's validate_result: the tolerance scales with the
  reference's magnitude, and the message names the worst element.
- ``check_op(inputs, reference_fn, our_fn, backward=...)`` is tinygrad's helper_test_op: it
  draws the inputs, runs forward (and backward on a random upstream gradient) in float32 and
  float64, and validates every output against the reference.
- ``numerical_grad(f, x)`` is central finite differences in float64, for gradient checks.
"""
import os
import zlib

import numpy as np

SESSION_SEED = int(os.environ.get("TEST_SEED") or np.random.SeedSequence().entropy % 2**32)

# (atol, rtol): an element passes when |ours - ref| <= atol + rtol * max|ref|. float64 kernels
# differ from the references only in summation order; float32 ones also in rounding each op.
TOLERANCES = {np.dtype(np.float32): (1e-6, 1e-4), np.dtype(np.float64): (1e-12, 1e-10)}

_draws_per_test = {}


def _current_test():
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def rng(seed=None):
    """A fresh numpy Generator; pass ``seed`` to pin it.

    Unpinned, the k-th call within a test is seeded by (SESSION_SEED, test id, k), so one
    test replays alone under ``TEST_SEED`` exactly as it ran within the whole suite.
    """
    if seed is not None:
        return np.random.default_rng(seed)
    test = _current_test()
    k = _draws_per_test.get(test, 0)
    _draws_per_test[test] = k + 1
    return np.random.default_rng([SESSION_SEED, zlib.crc32(test.encode()), k])


def reproduce_hint():
    test = _current_test()
    return f"reproduce with: TEST_SEED={SESSION_SEED}" + (f" python -m pytest '{test}'" if test else "")


def validate(ours, ref, name, atol=None, rtol=None):
    """Assert ``ours`` matches ``ref``: same shape, finite everywhere, and every element
    within atol + rtol * max|ref| (defaults by ours' dtype, see TOLERANCES); integer
    results must match exactly."""
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape}, expected {ref.shape}"
    if np.issubdtype(ref.dtype, np.integer):
        wrong = np.argwhere(ours != ref)
        assert wrong.size == 0, (
            f"{name}: {len(wrong)} of {ref.size} elements differ, first at "
            f"{tuple(wrong[0].tolist())}: {ours[tuple(wrong[0])]} vs {ref[tuple(wrong[0])]}\n"
            f"{reproduce_hint()}")
        return
    bad = np.argwhere(~np.isfinite(ours))
    assert bad.size == 0, (f"{name}: {len(bad)} of {ours.size} elements not finite, first at "
                           f"{tuple(bad[0].tolist())}: {ours[tuple(bad[0])]}\n{reproduce_hint()}")
    default_atol, default_rtol = TOLERANCES.get(ours.dtype, TOLERANCES[np.dtype(np.float32)])
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    tol = atol + rtol * scale
    err = np.abs(ours.astype(np.float64) - ref)
    if err.size == 0 or err.max() <= tol:
        return
    worst = tuple(int(i) for i in np.unravel_index(np.argmax(err), err.shape))
    raise AssertionError(
        f"{name}: {np.count_nonzero(err > tol)} of {err.size} elements off by more than "
        f"{tol:.3g} (atol {atol:g} + rtol {rtol:g} * max|ref| {scale:.3g}); worst at {worst}: "
        f"ours {ours[worst]!r}, ref {ref[worst]!r}, diff {err[worst]:.3g}\n{reproduce_hint()}")


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _cast(value, dtype):
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
        return value.astype(dtype)
    return value


def _run(fn, args, mutates_inputs, name):
    """Call fn on private copies of args; unless it may, check it left them untouched."""
    copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    outputs = _as_tuple(fn(*copies))
    if not mutates_inputs:
        for i, (before, after) in enumerate(zip(args, copies)):
            if isinstance(before, np.ndarray):
                assert np.array_equal(before, after, equal_nan=True), \
                    f"{name} overwrote its input {i}\n{reproduce_hint()}"
    return outputs


def _compare(ours, refs, name, dtype, tolerances):
    assert len(ours) == len(refs), f"{name}: {len(ours)} outputs, reference has {len(refs)}"
    for i, (o, r) in enumerate(zip(ours, refs)):
        label = f"{name} output {i} ({np.dtype(dtype).name})"
        if np.issubdtype(np.asarray(r).dtype, np.floating):
            got = np.asarray(o).dtype
            assert got == dtype, f"{label}: dtype {got}, expected {np.dtype(dtype)}"
            validate(o, r, label, *tolerances[np.dtype(dtype)])
        else:
            validate(o, r, label)


def check_op(inputs, reference_fn, our_fn, backward=None, dtypes=(np.float32, np.float64),
             tolerances=None, mutates_inputs=False, generator=None):
    """Check ``our_fn`` against ``reference_fn`` forward and, given ``backward``, backward.

    inputs: one entry per argument: a shape tuple (drawn standard normal, so non-zero), an
        array (used as given; floating ones cast to each dtype), or anything else (passed as is,
        e.g. None for a missing bias).
    reference_fn, our_fn: f(*inputs) -> array or tuple of arrays.
    backward: (reference_bwd, our_bwd), each called as bwd(dy, *inputs, *forward_outputs) with
        its own side's forward outputs and a random dy shaped like the first forward output;
        returns an array or a tuple, compared like the forward.
    tolerances: {dtype: (atol, rtol)} overriding TOLERANCES for the dtypes it names.
    mutates_inputs: allow our_fn to write its inputs (e.g. in-place updates); otherwise the
        check fails if it does.
    Each function gets its own copies of the inputs. Floating outputs must keep the dtype.
    """
    gen = generator if generator is not None else rng()
    tolerances = {**TOLERANCES, **{np.dtype(k): v for k, v in (tolerances or {}).items()}}
    drawn = [gen.standard_normal(a) if isinstance(a, tuple) else a for a in inputs]
    dy = None
    for dtype in dtypes:
        args = [_cast(a, dtype) for a in drawn]
        ours = _run(our_fn, args, mutates_inputs, "forward")
        refs = _run(reference_fn, args, True, "reference")
        _compare(ours, refs, "forward", dtype, tolerances)
        if backward is None:
            continue
        if dy is None:
            dy = gen.standard_normal(np.shape(refs[0]))
        reference_bwd, our_bwd = backward
        d = dy.astype(dtype)
        ours_b = _run(our_bwd, [d, *args, *ours], False, "backward")
        refs_b = _run(reference_bwd, [d, *args, *refs], True, "reference backward")
        _compare(ours_b, refs_b, "backward", dtype, tolerances)


def numerical_grad(f, x, eps=1e-6):
    """d f / d x by central differences in float64; f maps an array shaped like x to a scalar."""
    x = np.array(x, dtype=np.float64)
    grad = np.empty_like(x)
    for i in np.ndindex(x.shape):
        saved = x[i]
        x[i] = saved + eps
        up = float(f(x))
        x[i] = saved - eps
        down = float(f(x))
        x[i] = saved
        grad[i] = (up - down) / (2 * eps)
    return grad


def gradcheck_leaves(loss_fn, leaves, name, atol=1e-6, rtol=1e-5):
    """The autograd's gradient of ``loss_fn()`` (a scalar Tensor) with respect to each
    float64 leaf Tensor against central differences, perturbing each leaf in place."""
    for leaf in leaves:
        leaf.zero_grad()
    loss_fn().backward()
    for i, leaf in enumerate(leaves):
        assert leaf.grad is not None, f"{name}: leaf {i} got no gradient"
        analytic = np.array(leaf.grad, copy=True)

        def at(values, leaf=leaf):
            saved = leaf.data.copy()
            leaf.data[...] = values
            try:
                return loss_fn().data
            finally:
                leaf.data[...] = saved
        validate(analytic, numerical_grad(at, leaf.data), f"{name}: gradient of leaf {i} {leaf.shape}",
                 atol, rtol)


def gradcheck(fn, arrays, name, atol=1e-6, rtol=1e-5):
    """Gradients of ``fn`` (Tensors -> Tensor) at float64 ``arrays`` against central
    differences, through a fixed random projection of its output to a scalar."""
    from nn import Tensor
    leaves = [Tensor(np.asarray(a, dtype=np.float64), requires_grad=True) for a in arrays]
    projection = rng().standard_normal(fn(*leaves).shape)
    gradcheck_leaves(lambda: (fn(*leaves) * projection).sum(), leaves, name, atol, rtol)


# Convolutions (x shape, w shape, stride, padding, bias) whose GEMMs leave partial tiles on every
# side, for the CUDA backend's kernels of either precision.
CONV_SHAPES = [
    ((2, 3, 8, 8), (4, 3, 3, 3), 1, 1, True),          # the ResNet 3x3 conv
    ((2, 3, 9, 9), (5, 3, 3, 3), 2, 1, True),          # downsampling 3x3 on an odd size
    ((2, 4, 7, 7), (6, 4, 1, 1), 2, 0, True),          # 1x1 projection on an odd size
    ((3, 1, 5, 6), (4, 1, 3, 3), 1, 0, False),         # one input channel, no padding
    ((1, 2, 9, 7), (3, 2, 5, 5), 1, 2, False),         # batch 1, 5x5 (the run-time kernel size)
    ((2, 3, 6, 9), (2, 3, 2, 3), (2, 1), (0, 1), True),   # asymmetric kernel, stride, padding
    ((1, 17, 9, 9), (70, 17, 3, 3), 2, 1, True),       # two tiles of output channels, K over 9 tiles
    ((2, 5, 1, 1), (3, 5, 1, 1), 1, 0, True),          # 1x1 spatial
    ((2, 3, 5, 4), (4, 3, 2, 2), 3, 1, True),          # stride 3 over a 2x2 kernel: taps skip cells
    ((1, 2, 2, 7), (3, 2, 1, 3), (3, 2), (0, 1), False),   # fewer rows than the stride: empty phases
]


def write_idx(path, array):
    """A gzip-compressed IDX file of a uint8 array, as Fashion-MNIST ships them."""
    import gzip
    import struct
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def write_fashion_mnist(folder, n_train, n_test, seed=0):
    """Four IDX files of random images whose class shows in their brightness, so that
    a network can learn something from a few dozen of them."""
    from training import fashion_mnist as data
    gen = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        labels = gen.integers(0, 10, size=n).astype(np.uint8)
        images = gen.integers(0, 60, size=(n, 28, 28)) + labels[:, None, None] * 20
        images_file, labels_file = data.FILES[split]
        write_idx(folder / images_file, images.astype(np.uint8))
        write_idx(folder / labels_file, labels)
    return folder


def run_cli(data_dir, out, small, *flags):
    """train_resnet.py's command line (training.cli.main) on the IDX files in data_dir with the
    settings `small`, writing to `out` (None: no --out), and `flags` after them."""
    from training import cli
    return cli.main(["--data-dir", str(data_dir), *(["--out", str(out)] if out else []), *small, *map(str, flags)])


def one_line_error(capsys, run, *args, prog="train_resnet.py"):
    """The stderr of run(*args), which must stop with exit code 2 before it starts and say why in one line,
    ``<prog>: error: ...``: no traceback, and no usage (argparse's, for a command line it cannot read: an
    unknown flag, a missing value, a malformed number)."""
    import pytest
    with pytest.raises(SystemExit) as e:
        run(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
    return err


def usage_then_error(capsys, run, *args, prog="train_resnet.py"):
    """The stderr of run(*args), a command line argparse cannot read (an unknown flag, a missing value, a
    malformed number, a value outside a flag's choices): exit code 2, argparse's usage, then the one line of
    ``<prog>: error: ...``; that line."""
    import pytest
    with pytest.raises(SystemExit) as e:
        run(*args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: {prog} [-h]"), err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"{prog}: error: "), err
    return line


def batch_norm_over_replicas(m, x, gamma, beta, dy, cut, eps):
    """Training batch norm of the batch ``x`` as two replicas holding x[:cut] and x[cut:]
    compute it with the contract's parts (module ``m``), adding their per-channel sums
    where synchronised batch norm all-reduces them: (y, dx, dgamma, dbeta) of the whole."""
    parts = (slice(0, cut), slice(cut, None))
    count = x.size // x.shape[1]
    zero = np.zeros(x.shape[1], x.dtype)
    centre = sum(np.asarray(m.batch_norm_sums(x[p], zero)) for p in parts)[0] / count
    centre = centre.astype(x.dtype)
    sums = sum(np.asarray(m.batch_norm_sums(x[p], centre)) for p in parts).astype(x.dtype)
    mean, invstd = m.batch_norm_stats(sums, centre, count, eps)
    y = np.concatenate([m.batch_norm_apply(x[p], gamma, beta, mean, invstd) for p in parts])
    grads = sum(np.asarray(m.batch_norm_backward_sums(dy[p], x[p], mean, invstd)) for p in parts)
    grads = grads.astype(x.dtype)
    dx = np.concatenate([m.batch_norm_backward_dx(dy[p], x[p], gamma, mean, invstd, grads, count)
                         for p in parts])
    return y, dx, grads[0], grads[1]


def batch_norm_joins(m, eps):
    """(reference, ours) forward and backward functions for check_op of training batch norm with
    its fused joins, inputs (x, gamma, beta, residual or None): ours the contract's
    batch_norm_forward(..., relu=True, residual=residual) and batch_norm_backward(..., y=y,
    shortcut=...) of module ``m``; the reference relu(batch norm [+ residual]) composed from
    tests/reference.py's batch norm and relu, the shortcut's gradient being relu's."""
    import reference as R

    def reference(x, gamma, beta, residual):
        y, mean, invstd = R.batch_norm_forward(x, gamma, beta, eps)
        return R.relu_forward(y if residual is None else y + residual), mean, invstd

    def reference_backward(dy, x, gamma, beta, residual, y, mean, invstd):
        g = R.relu_backward(dy, y)
        return R.batch_norm_backward(g, x, gamma, mean, invstd) + ((g,) if residual is not None else ())

    def ours(x, gamma, beta, residual):
        return m.batch_norm_forward(x, gamma, beta, eps, relu=True, residual=residual)

    def ours_backward(dy, x, gamma, beta, residual, y, mean, invstd):
        return m.batch_norm_backward(dy, x, gamma, mean, invstd, y=y, shortcut=residual is not None)
    return (reference, ours), (reference_backward, ours_backward)


def free_port():
    """A TCP port that nothing here listens on (the kernel's choice of one)."""
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_idle(environment, timeout):
    """The state of the one-node Slurm cluster's node (sinfo, under ``environment``) once it is idle, or as
    it still is after ``timeout`` seconds: a cluster just started registers its node, and after a job the
    node stays COMPLETING while slurmd ends its processes (a job started meanwhile waits in the queue)."""
    import subprocess
    import time
    deadline = time.monotonic() + timeout
    while True:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30,
                               env=environment).stdout.strip()
        if state == "idle" or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def permissions_bind(tmp_path):
    """Whether a folder without write permission stops this process's writes (not root's, which the capability
    CAP_DAC_OVERRIDE lets write anywhere)."""
    folder = tmp_path / "probe"
    folder.mkdir(mode=0o555)
    try:
        (folder / "written").write_text("")
    except PermissionError:
        return True
    return False


def again_where_permissions_bind(request):
    """This test again, in a pytest of its own started under setpriv without the capabilities that override
    permissions (root, as CI runs the suite, is then refused as anyone else), and passed there; skipped,
    saying why, where setpriv is missing."""
    import pytest
    import shutil
    import subprocess
    import sys
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, whom permissions do not stop, and setpriv (util-linux) is not installed to "
                    "drop the capability that overrides them")
    done = subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m",
                           "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid], cwd=request.config.rootpath,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
