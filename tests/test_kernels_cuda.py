"""The CUDA backend's kernels, with and without a GPU, under the fp32 precision (the tensor-core
convolutions of the tf32 precision are tests/test_conv_tc.py's).

- Every family's source compiles with NVRTC for sm_80 and sm_90, cleanly and without spills
  (needs only the NVRTC library; skipped with the reason when it is missing).
- Every op runs on the ``emu`` backend, the CUDA launchers and kernels on the CPU emulator,
  in float32, against the float64 references (check_op) and against kernels.cpu (each call
  is repeated there on copies of its arguments: outputs and in-place updates must agree);
  with the emulator's threads in ascending and in descending order, so that a missing
  __syncthreads() shows; on shapes that leave partial tiles on every side, stride 2 on odd
  sizes, channel counts that are not multiples of a tile, batch 1; with the large GEMM tile
  and with split reductions forced on those small shapes too. New output arrays start as NaN
  (conftest's poisoned_empty), so an element a kernel forgets to write fails.
- The same op tests, marked ``gpu``, on CuPy arrays through the ``cuda`` backend (skipped
  with the reason where there is no GPU), plus PyTorch float64 on the same GPU and a
  bit-for-bit determinism check. They call the ops with NumPy arrays through OnDevice, which
  copies each to the device in its own layout and each result back in the device array's, or
  as the caller's array where the op returns the device array it was given (out=), so that the
  layouts and identities the tests assert are the device arrays'.
- OnDevice and the GPU fixtures on one simulated GPU (KERNELS_SIMULATED_GPUS), in CI: layouts
  and identities kept, the gradients written into out= returned as the arrays given; planted,
  cupy.asarray's or cupy.asnumpy's C-ordered copies and new host arrays, refused by name.
"""
import functools
import inspect
import mmap

import numpy as np
import pytest

import kernels
import kernels.cpu as K
import reference as R
from helpers import CONV_SHAPES, batch_norm_joins, batch_norm_over_replicas, check_op, reproduce_hint, rng, validate
from kernels import cuda, emu, nvrtc
from kernels.cuda import conv as cuda_conv
from kernels.cuda import launch as cuda_launch

EPS = 1e-5
pytestmark = pytest.mark.usefixtures("poisoned_empty", "fp32")


@pytest.fixture
def fp32():
    """The FP32 kernels throughout: the tensor-core ones (the tf32 precision) are tests/test_conv_tc.py's."""
    with kernels.use_precision("fp32"):
        yield


# ---- backends ----------------------------------------------------------------------------

def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


class CrossChecked:
    """The ops of a device backend, each call repeated on kernels.cpu with copies of its
    arguments: the outputs and whatever the op updates in place must agree."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        ours, cpu = getattr(self.backend, name), getattr(K, name)

        def copied(a):   # tuples of arrays too: `running`, `out`
            return tuple(map(copied, a)) if isinstance(a, tuple) else a.copy() if isinstance(a, np.ndarray) else a

        def run(*args, **kwargs):
            copies, kwarg_copies = copied(args), {k: copied(v) for k, v in kwargs.items()}
            expected = cpu(*copies, **kwarg_copies)
            got = ours(*args, **kwargs)
            for i, (g, e) in enumerate(zip(_outputs(got), _outputs(expected))):
                if e is not None:
                    validate(g, e, f"{name} output {i} against kernels.cpu")
            flat = lambda a: [v for x in a for v in (flat(x) if isinstance(x, tuple) else [x])]  # noqa: E731
            for i, (a, c) in enumerate(zip(flat(args + tuple(kwargs.values())),
                                           flat(copies + tuple(kwarg_copies.values())))):
                if isinstance(a, np.ndarray):
                    validate(a, c, f"{name} argument {i} (after the call) against kernels.cpu")
            return got
        return run


def in_memory_order(a):
    """The axes of ``a`` (a host or a device array) from the largest stride to the smallest: transposed to them,
    an array of dense memory is C-contiguous (a channels-last NCHW array: 0, 2, 3, 1)."""
    return sorted(range(a.ndim), key=lambda axis: -a.strides[axis])


class OnDevice:
    """The ops of the cuda backend called with NumPy arrays. Each array argument is copied to the GPU in its own
    layout (one device array for each host array, however often it is passed), and copied back after the call
    (what the op wrote in place); each result is copied to a new host array in the layout of the device array,
    or, where the op returns a device array it was given (out=, add_dx_to=), is the caller's host array itself:
    the layouts and identities a test asserts on the host are those of the device arrays. (CuPy's copies,
    cupy.asarray and get, are C-ordered whatever the strides: each here copies the array transposed to
    in_memory_order, C-contiguous where its memory is dense, and transposes the copy back.)"""

    def __init__(self, backend):
        self.backend, self.cupy = backend, kernels.cupy_module()

    def device_array(self, a):
        axes = in_memory_order(a)
        return self.cupy.asarray(a.transpose(axes)).transpose(np.argsort(axes))

    def host_array(self, d):
        axes = in_memory_order(d)
        return d.transpose(axes).get().transpose(np.argsort(axes))

    def result(self, r, given):
        """A result on the host: ``given`` maps the ids of the device arrays passed to the host arrays copied there."""
        return given[id(r)] if id(r) in given else None if r is None else self.host_array(r)

    def __getattr__(self, name):
        op = getattr(self.backend, name)

        def run(*args, **kwargs):
            placed = {}   # id of a host array: (the host array, its device array)

            def to_device(a):   # tuples of arrays too: `running`, `out`
                if isinstance(a, tuple):
                    return tuple(map(to_device, a))
                if not isinstance(a, np.ndarray):
                    return a
                if id(a) not in placed:
                    placed[id(a)] = a, self.device_array(a)
                return placed[id(a)][1]

            result = op(*to_device(args), **{k: to_device(v) for k, v in kwargs.items()})
            for a, d in placed.values():
                a[...] = self.host_array(d)
            given = {id(d): a for a, d in placed.values()}
            outputs = tuple(self.result(r, given) for r in _outputs(result))
            return outputs if isinstance(result, tuple) else outputs[0]
        return run


class PlainCopies(OnDevice):
    """Planted: OnDevice's results as they came back before, cupy.asnumpy's copies: C-ordered whatever the device
    array's layout, and new arrays where the op returned a device array it was given."""

    def result(self, r, given):
        return None if r is None else self.cupy.asnumpy(r)


def gpu_unavailable_reason():
    try:
        if kernels.cupy_module().cuda.runtime.getDeviceCount() > 0:
            return None
        return "no CUDA device"
    except Exception as e:  # DeviceError without CuPy, or CuPy's error without a driver
        return f"no usable GPU ({type(e).__name__}: {e})"


@pytest.fixture
def poisoned_device_empty(monkeypatch):
    """cupy.empty / empty_like filled with NaN (integers: their minimum), like poisoned_empty."""
    cupy = kernels.cupy_module()

    def poison(array):
        if array.dtype.kind == "f":
            array.fill(np.nan)
        elif array.dtype.name == "bfloat16":
            array.view(np.uint16).fill(0x7FC0)   # NaN
        elif array.dtype.kind in "iu":
            array.fill(np.iinfo(array.dtype).min)
        return array

    empty, empty_like = cupy.empty, cupy.empty_like
    monkeypatch.setattr(cupy, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(cupy, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture(params=["emu-ascending", "emu-descending", pytest.param("cuda", marks=pytest.mark.gpu)])
def ours(request):
    """The op namespace under test: the emu backend in one thread order, or the GPU."""
    if request.param == "cuda":
        reason = gpu_unavailable_reason()
        if reason:
            pytest.skip(reason)
        request.getfixturevalue("poisoned_device_empty")
        yield OnDevice(kernels._device_backend("cuda"))
        return
    from kernels.emu import thread_order
    with thread_order(request.param.split("-")[1]):
        yield CrossChecked(kernels._device_backend("emu"))


VARIANTS = ("default", "large tile", "split")


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    """The launchers' default choices, or the large GEMM tile or many-way split reductions
    forced, so that small shapes exercise those code paths too."""
    if request.param == "large tile":
        monkeypatch.setattr(cuda_conv, "choose_tile", lambda rows, columns, dtype: "Tile128")
    elif request.param == "split":
        monkeypatch.setattr(cuda_launch, "MIN_SPLIT_LENGTH", 4)
    return request.param


def through(ours, op):
    """(reference, ours) from op(module, *args), which calls the kernel by name on `module`."""
    return functools.partial(op, R), functools.partial(op, ours)


def check(ours, inputs, op, backward=None, **kwargs):
    """check_op in float32, the only precision of the CUDA kernels."""
    check_op(inputs, *through(ours, op), backward=None if backward is None else through(ours, backward),
             dtypes=(np.float32,), **kwargs)


# ---- NVRTC -------------------------------------------------------------------------------

DEPRECATED = "architectures prior to '<compute/sm>_75' are deprecated"
# What CUDA 12's NVRTC (12.9), which compiles sm_70 here, spills (bytes, at most) where CUDA 13's spills
# nothing: the 128 x 128 fp32 backward-weight needs more than the 128 registers ptxas gives it for two
# blocks an SM (bench/RESULTS.md, "CUDA 12")
CUDA12_SPILLS = {("conv", "sm_70"): {"conv2d_wgrad<Tile128, 1, 1>": 16}}
# The shared memory a block may have, static and dynamic together, on each architecture (the CUDA
# programming guide's limits, with the opt-in that Backend.function makes for dynamic shared memory).
SHARED_PER_BLOCK = {"sm_70": 96 * 1024, "sm_75": 64 * 1024, "sm_80": 163 * 1024, "sm_86": 99 * 1024,
                    "sm_89": 99 * 1024, "sm_90": 227 * 1024}


@pytest.mark.nvrtc
@pytest.mark.parametrize("family, arch", [(family, arch) for arch in cuda.ARCHITECTURES
                                          for family in cuda.families_for(arch)])
def test_compiles_with_nvrtc(family, arch):
    """Every family for every GPU the project claims (README): the fp32 ones below sm_80 too, sm_70 with
    CUDA 12's NVRTC."""
    reason = nvrtc.unavailable_reason() or nvrtc.unsupported_reason(arch)
    if reason:
        pytest.skip(reason)
    from kernels.cuda.ptxas_report import compile_family
    compiled = compile_family(family, arch)
    warnings = [line for line in compiled.log.lower().splitlines() if "warning" in line and
                DEPRECATED not in line]   # NVRTC 12's notice for every sm_70 program
    assert not warnings, f"{family}.cu for {arch}:\n{compiled.log}"
    assert set(compiled.lowered_names) == set(cuda.launcher(family).KERNELS)
    spilling = {name: max(r.spill_stores, r.spill_loads) for name, r in compiled.named_resources().items()
                if r.spill_stores or r.spill_loads}
    allowed = CUDA12_SPILLS.get((family, arch), {}) if nvrtc.nvrtc_for(arch) is nvrtc.cuda12() else {}
    assert all(allowed.get(name, 0) >= spilled for name, spilled in spilling.items()), \
        f"{family}.cu for {arch} spills (bytes): {spilling}"
    # and every block's shared memory, with the dynamic its launches ask for (conv_tc's halo backward-weight), fits
    from kernels.cuda import conv_tc
    shared = {name: r.shared_bytes + conv_tc.dynamic_shared(name) for name, r in compiled.named_resources().items()}
    assert max(shared.values()) <= SHARED_PER_BLOCK[arch], f"{family}.cu for {arch}: shared memory (bytes) {shared}"


def test_the_device_backends_offer_the_whole_contract():
    contract = {name: fn for name, fn in vars(K).items() if inspect.isfunction(fn) and not name.startswith("_")}
    backend = kernels._device_backend("emu")
    for name, fn in contract.items():
        assert hasattr(backend, name), f"the cuda/emu backend lacks {name}"
        assert inspect.signature(getattr(backend, name)) == inspect.signature(fn), name
    assert {op for family in cuda.FAMILIES for op in cuda.launcher(family).OPS} == set(contract)


@pytest.mark.parametrize("where", ["emu", "simulated"])
def test_modules_built_without_the_sanitizer_serve_no_launch_under_it(where, monkeypatch):
    """A backend keeps the modules it compiled: the one that compiled a family without the sanitizer's
    instrumentation (CUDA_EMU_SANITIZE=off) is not the one later launches under it get, whatever ran first."""
    if where == "simulated":
        monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    name = "cuda" if where == "simulated" else "emu"
    with kernels.emulate():
        monkeypatch.setenv("CUDA_EMU_SANITIZE", "off")
        unchecked = kernels._device_backend(name).module("optim")   # an op looks its backend up, then compiles
        monkeypatch.setenv("CUDA_EMU_SANITIZE", "memcheck")
        checked = kernels._device_backend(name).module("optim")
        with emu.sanitizer("off"):
            assert kernels._device_backend(name).module("optim") is unchecked
    native = [m._module._module if where == "simulated" else m._module for m in (checked, unchecked)]
    assert native[0].sanitize and not native[1].sanitize


# ---- convolution -------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape, w_shape, stride, padding, bias", CONV_SHAPES)
def test_conv2d(ours, variant, x_shape, w_shape, stride, padding, bias):
    check(ours, [x_shape, w_shape, (w_shape[0],) if bias else None],
          lambda m, x, w, b: m.conv2d_forward(x, w, b, stride, padding),
          backward=lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, stride, padding))


def test_conv2d_long_sums_stay_close_to_float64(ours):
    """576-term dot products, as in ResNet-18's 3x3 convolutions with 64 channels."""
    check(ours, [(2, 64, 6, 6), (64, 64, 3, 3), (64,)], lambda m, x, w, b: m.conv2d_forward(x, w, b, 1, 1),
          backward=lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, 1, 1),
          tolerances={np.float32: (1e-7, 1e-5)})


# ---- batch normalisation -----------------------------------------------------------------

def shifted_batch(shape):
    """Activations whose channels have their own non-zero mean and non-unit spread."""
    g = rng()
    c = shape[1]
    return g.standard_normal(shape) * g.uniform(0.5, 3, c)[:, None, None] + g.uniform(-3, 3, c)[:, None, None]


BATCH_NORMS = [(4, 3, 5, 5), (1, 2, 3, 4), (6, 4, 1, 1), (2, 5, 7, 3), (3, 17, 2, 2)]


@pytest.mark.parametrize("shape", BATCH_NORMS)
def test_batch_norm_training(ours, variant, shape):
    check(ours, [shifted_batch(shape), (shape[1],), (shape[1],)],
          lambda m, x, gamma, beta: m.batch_norm_forward(x, gamma, beta, EPS),
          backward=lambda m, dy, x, gamma, beta, y, mean, invstd: m.batch_norm_backward(dy, x, gamma, mean, invstd))


@pytest.mark.parametrize("shape, cut", [((4, 3, 5, 5), 2), ((5, 2, 3, 4), 1), ((3, 17, 2, 2), 2)])
def test_batch_norm_in_parts_over_replicas_equals_the_whole_batch(ours, variant, shape, cut):
    """The parts synchronised batch norm runs, with two replicas' sums added between them."""
    g = rng()
    x, dy = shifted_batch(shape).astype(np.float32), g.standard_normal(shape).astype(np.float32)
    gamma, beta = g.standard_normal((2, shape[1])).astype(np.float32)
    y, dx, dgamma, dbeta = batch_norm_over_replicas(ours, x, gamma, beta, dy, cut, EPS)
    ref_y, mean, invstd = R.batch_norm_forward(x, gamma, beta, EPS)
    for got, ref, name in zip((y, dx, dgamma, dbeta), (ref_y, *R.batch_norm_backward(dy, x, gamma, mean, invstd)),
                              ("y", "dx", "dgamma", "dbeta")):
        validate(got, ref, name)


def test_batch_norm_sums(ours, variant):
    g = rng()
    x, dy = shifted_batch((3, 4, 5, 2)).astype(np.float32), g.standard_normal((3, 4, 5, 2)).astype(np.float32)
    mean, invstd = g.standard_normal(4).astype(np.float32), g.uniform(0.5, 2, 4).astype(np.float32)
    validate(ours.batch_norm_sums(x, mean), R.batch_norm_sums(x, mean), "batch_norm_sums")
    validate(ours.batch_norm_backward_sums(dy, x, mean, invstd), R.batch_norm_backward_sums(dy, x, mean, invstd),
             "batch_norm_backward_sums")


@pytest.mark.parametrize("shape", BATCH_NORMS[:3])
def test_batch_norm_inference(ours, variant, shape):
    c = shape[1]
    running_var = rng().uniform(0.3, 3.0, c)
    check(ours, [shifted_batch(shape), (c,), (c,), (c,), running_var],
          lambda m, x, gamma, beta, mean, var: m.batch_norm_inference(x, gamma, beta, mean, var, EPS),
          backward=lambda m, dy, x, gamma, beta, mean, var, y:
          m.batch_norm_inference_backward(dy, x, gamma, mean, var, EPS))


def test_batch_norm_update_running(ours):
    g = rng()
    x = shifted_batch((4, 3, 5, 2)).astype(np.float32)
    _, mean, invstd = K.batch_norm_forward(x, np.ones(3, np.float32), np.zeros(3, np.float32), EPS)
    start = [g.standard_normal(3), np.abs(g.standard_normal(3)) + 0.5]
    check(ours, [*start, mean, invstd],
          lambda m, rm, rv, mean, invstd: (m.batch_norm_update_running(rm, rv, mean, invstd, 40, 0.1, EPS), rm, rv)[1:],
          mutates_inputs=True)


def test_batch_norm_moves_the_running_statistics_in_its_forward(ours, variant):
    """running=(mean, var): bn_stats's last blocks move them, as batch_norm_update_running does."""
    g = rng()
    x = shifted_batch((4, 3, 5, 2)).astype(np.float32)
    gamma, beta = g.standard_normal((2, 3)).astype(np.float32)
    start = [g.standard_normal(3), np.abs(g.standard_normal(3)) + 0.5]
    check(ours, [x, gamma, beta, *start],
          lambda m, x, gamma, beta, rm, rv: (*m.batch_norm_forward(x, gamma, beta, EPS, running=(rm, rv),
                                                                   momentum=0.1), rm, rv)
          if m is not R else (*R.batch_norm_forward(x, gamma, beta, EPS), *_moved(rm, rv, x)),
          mutates_inputs=True)


def _moved(rm, rv, x):
    """The reference's running statistics after one training forward of x, momentum 0.1."""
    _, mean, invstd = R.batch_norm_forward(x, np.ones(x.shape[1]), np.zeros(x.shape[1]), EPS)
    rm, rv = np.array(rm, np.float64), np.array(rv, np.float64)
    R.batch_norm_update_running(rm, rv, mean, invstd, x.size // x.shape[1], 0.1, EPS)
    return rm, rv


@pytest.mark.parametrize("shape", [(4, 3, 5, 5), (2, 5, 7, 3), (3, 17, 2, 2)])
@pytest.mark.parametrize("residual", [False, True], ids=["relu", "residual"])
def test_batch_norm_with_its_relu_join(ours, variant, shape, residual):
    """relu(batch norm) and relu(batch norm + residual) in the forward's apply kernel; their backward
    masked by the output, the shortcut's gradient written by the dx kernel."""
    forward, backward = batch_norm_joins(ours, EPS)
    check_op([shifted_batch(shape), (shape[1],), (shape[1],), shape if residual else None],
             forward[0], forward[1], backward=backward, dtypes=(np.float32,))


def test_backwards_write_into_the_gradient_arrays_they_are_given(ours, variant):
    """out=(dw, db) or (dgamma, dbeta), NaN-filled: every element written, the arrays returned, the
    values those of a call without; need_dx=False: no dx."""
    write_into_the_gradient_arrays_given(ours)


def write_into_the_gradient_arrays_given(ours):
    """The test above's calls and checks, on the op namespace ``ours``."""
    g = rng()
    draw = lambda *shape: g.standard_normal(shape).astype(np.float32)  # noqa: E731
    x, w, dy = draw(2, 4, 6, 6), draw(8, 4, 3, 3), draw(2, 8, 6, 6)
    fresh = ours.conv2d_backward(dy, x, w, 1, 1)
    w_last = np.ascontiguousarray(w.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)   # as a flat buffer holds it
    for dw_target, weights in ((np.full_like(w, np.nan), w), (np.full_like(w_last, np.nan), w_last)):
        out = dw_target, np.full(8, np.nan, np.float32)
        dx, dw, db = ours.conv2d_backward(dy, x, weights, 1, 1, need_dx=False, out=out)
        assert dx is None, "need_dx=False gave a dx"
        assert dw is out[0] and db is out[1], f"conv2d_backward: dw is not out[0] or db not out[1], into strides " \
                                              f"{dw_target.strides}"
        for got, want, name in ((dw, fresh[1], "dw"), (db, fresh[2], "db")):
            np.testing.assert_array_equal(got, want, err_msg=f"{name} into strides {dw_target.strides}")
    x, w, dy = draw(6, 8), draw(4, 8), draw(6, 4)
    out = np.full_like(w, np.nan), np.full(4, np.nan, np.float32)
    _, dw, db = ours.linear_backward(dy, x, w, out=out)
    assert dw is out[0] and db is out[1], "linear_backward: dw is not out[0] or db not out[1]"
    np.testing.assert_array_equal(dw, ours.linear_backward(dy, x, w)[1])
    x, dy, gamma = shifted_batch((3, 5, 4, 4)).astype(np.float32), draw(3, 5, 4, 4), draw(5)
    _, mean, invstd = ours.batch_norm_forward(x, gamma, gamma, EPS)
    out = np.full(5, np.nan, np.float32), np.full(5, np.nan, np.float32)
    dx, dgamma, dbeta = ours.batch_norm_backward(dy, x, gamma, mean, invstd, out=out)
    assert dgamma is out[0] and dbeta is out[1], "batch_norm_backward: dgamma is not out[0] or dbeta not out[1]"
    fresh = ours.batch_norm_backward(dy, x, gamma, mean, invstd)
    np.testing.assert_array_equal(dx, fresh[0])
    out = np.full(5, np.nan, np.float32), None   # one gradient written there, the other new
    _, dgamma, dbeta = ours.batch_norm_backward(dy, x, gamma, mean, invstd, out=out)
    assert dgamma is out[0], "batch_norm_backward: dgamma is not out[0] (dbeta new)"
    np.testing.assert_array_equal(dgamma, fresh[1])
    np.testing.assert_array_equal(dbeta, fresh[2])


# ---- element-wise ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 10), (1, 1, 1, 7), (3, 700)])
def test_relu(ours, shape):
    check(ours, [shape], lambda m, x: m.relu_forward(x), backward=lambda m, dy, x, y: m.relu_backward(dy, y))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 700)])
def test_add(ours, shape):
    check(ours, [shape, shape], lambda m, a, b: m.add(a, b))


def test_add_in_place_on_the_emulator():
    g = rng()
    a, b = (g.standard_normal((5, 300)).astype(np.float32) for _ in range(2))
    expected = R.add(a, b)
    assert kernels._device_backend("emu").add(a, b, out=a) is a
    validate(a, expected, "a += b, in place")


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 10)])
def test_add_relu(ours, shape):
    check(ours, [shape, shape], lambda m, a, b: m.add_relu_forward(a, b),
          backward=lambda m, dy, a, b, y: m.relu_backward(dy, y))


def test_images_to_float(ours):
    images = rng().integers(0, 256, size=(3, 5, 4)).astype(np.uint8)
    images[0, 0, :2] = (0, 255)
    out = ours.images_to_float(images)
    assert out.dtype == np.float32 and out.shape == (3, 1, 5, 4)
    validate(out, R.images_to_float(images), "images_to_float")
    for dtype in (np.int32, np.int64):    # a batch of the shuffled order, gathered in the same kernel
        idx = np.array([2, 0, 2, 1, 0], dtype)
        validate(ours.images_to_float(images, idx), R.images_to_float(images)[[2, 0, 2, 1, 0]],
                 f"images_to_float of a batch, {np.dtype(dtype)} indices")


def test_take_gathers_a_batch_of_labels(ours):
    labels = rng().integers(0, 10, 300).astype(np.int32)
    for dtype in (np.int32, np.int64):
        idx = rng().integers(0, 300, 260).astype(dtype)
        np.testing.assert_array_equal(ours.take(labels, idx), labels[idx])


# ---- pooling -----------------------------------------------------------------------------

from test_kernels_cpu import MAX_POOLS  # noqa: E402  (the same shapes on every backend)


@pytest.mark.parametrize("x_shape, kernel, stride, padding", MAX_POOLS)
def test_max_pool2d(ours, x_shape, kernel, stride, padding):
    check(ours, [x_shape], lambda m, x: m.max_pool2d_forward(x, kernel, stride, padding),
          backward=lambda m, dy, x, y, argmax: m.max_pool2d_backward(dy, argmax, x.shape))


@pytest.mark.parametrize("x_shape, kernel, stride, padding", MAX_POOLS[1:3])
def test_max_pool2d_never_picks_padding(ours, x_shape, kernel, stride, padding):
    negative = -0.1 - np.abs(rng().standard_normal(x_shape))
    check(ours, [negative], lambda m, x: m.max_pool2d_forward(x, kernel, stride, padding))


def test_max_pool2d_ties_go_to_the_first_element(ours):
    x = np.ones((1, 2, 5, 5))
    x[0, 1, 1, 2] = x[0, 1, 2, 1] = 2.0   # a tie inside one window, in reading order
    check(ours, [x], lambda m, x: m.max_pool2d_forward(x, 3, 2, 1))


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (1, 5, 7, 3), (3, 2, 1, 1), (2, 9, 7, 7)])
def test_global_avg_pool(ours, shape):
    check(ours, [shape], lambda m, x: m.global_avg_pool_forward(x),
          backward=lambda m, dy, x, y: m.global_avg_pool_backward(dy, x.shape))


# ---- linear ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, fan_in, fan_out, bias", [
    (4, 5, 3, True), (1, 7, 2, False), (6, 16, 10, True), (3, 1, 4, False),
    (70, 33, 65, True),     # two tiles each way, K over three tiles
])
def test_linear(ours, n, fan_in, fan_out, bias):
    check(ours, [(n, fan_in), (fan_out, fan_in), (fan_out,) if bias else None],
          lambda m, x, w, b: m.linear_forward(x, w, b),
          backward=lambda m, dy, x, w, b, y: m.linear_backward(dy, x, w))


# ---- loss --------------------------------------------------------------------------------

@pytest.mark.parametrize("n, classes, scale, dtype", [
    (4, 10, 1.0, np.int64), (1, 3, 1.0, np.uint8), (7, 5, 4.0, np.int32),
    (8, 10, 1e3, np.int64),      # exp(1e3) overflows: only a max-shifted softmax survives
    (19, 40, 1.0, np.uint8),     # three blocks of rows, more classes than a warp has lanes
])
def test_softmax_cross_entropy(ours, n, classes, scale, dtype):
    g = rng()
    check(ours, [g.standard_normal((n, classes)) * scale, g.integers(0, classes, n).astype(dtype)],
          lambda m, logits, labels: m.softmax_cross_entropy_forward(logits, labels),
          backward=lambda m, dloss, logits, labels, loss, probs: m.softmax_cross_entropy_backward(dloss, probs, labels))


def test_softmax_cross_entropy_takes_a_host_dloss(ours):
    g = rng()
    logits = g.standard_normal((5, 4)).astype(np.float32)
    labels = g.integers(0, 4, 5)
    loss, probs = ours.softmax_cross_entropy_forward(logits, labels)
    assert loss.shape == () and loss.dtype == np.float32
    validate(ours.softmax_cross_entropy_backward(2.0, probs, labels),
             R.softmax_cross_entropy_backward(2.0, probs, labels), "dlogits")


def test_count_correct(ours):
    g = rng()
    logits = g.standard_normal((300, 10))       # two rounds of the block's 256 threads
    labels = g.integers(0, 10, size=300)
    labels[:5] = logits[:5].argmax(axis=1)      # some hits for certain
    logits[5, :2] = 7.0                         # a tie: the first largest counts
    labels[5] = 1
    for dtype in (np.uint8, np.int64):
        count = ours.count_correct(logits.astype(np.float32), labels.astype(dtype))
        assert count.dtype == np.int64 and count.shape == ()
        assert int(count) == R.count_correct(logits, labels) >= 5


# ---- optimiser ---------------------------------------------------------------------------

@pytest.mark.parametrize("momentum, weight_decay, with_velocity", [
    (0.0, 0.0, False), (0.0, 5e-4, True), (0.9, 0.0, True), (0.9, 5e-4, True)])
def test_sgd_update(ours, momentum, weight_decay, with_velocity):
    size, steps = 1037, 3
    g = rng()

    def run(m, param, velocity, *grads):
        for grad in grads:
            assert m.sgd_update(param, grad, velocity, 0.1, momentum, weight_decay) is None
        return (param, velocity) if momentum else param

    check(ours, [g.standard_normal(size), np.zeros(size) if with_velocity else None,
                 *g.standard_normal((steps, size))], run, mutates_inputs=True)


def test_sgd_reads_a_learning_rate_in_memory_as_it_runs(ours):
    """lr as a 1-element array (what a CUDA graph's replay reads anew): the same bits as the number."""
    g = rng()
    param, grad = g.standard_normal((2, 777)).astype(np.float32)
    by_value, by_memory = (param.copy(), np.zeros_like(param)), (param.copy(), np.zeros_like(param))
    for lr in (0.1, 0.0371):
        ours.sgd_update(by_value[0], grad, by_value[1], lr, 0.9, 5e-4)
        ours.sgd_update(by_memory[0], grad, by_memory[1], np.array([lr], np.float32), 0.9, 5e-4)
    np.testing.assert_array_equal(by_memory[0], by_value[0])
    np.testing.assert_array_equal(by_memory[1], by_value[1])


# ---- what the launchers refuse -----------------------------------------------------------

def test_float64_arrays_are_a_type_error():
    be = kernels._device_backend("emu")
    x = np.zeros((1, 1, 4, 4))
    with pytest.raises(TypeError, match="float32"):
        be.conv2d_forward(x, np.zeros((1, 1, 3, 3), np.float32), None, 1, 1)
    with pytest.raises(TypeError, match="float32"):
        be.relu_forward(x)
    with pytest.raises(TypeError, match="uint8"):
        be.images_to_float(np.zeros((1, 4, 4), np.float32))
    with pytest.raises(TypeError, match="integer"):
        be.softmax_cross_entropy_forward(np.zeros((2, 3), np.float32), np.zeros(2, np.float32))


def test_arrays_a_grid_stride_loop_cannot_index_are_refused():
    """A grid-stride loop's int index reaches the last element plus one stride of 4096 blocks of
    256 threads: past 2**31 - 2**20 elements it would overflow."""
    be = kernels._device_backend("emu")
    limit = 2**31 - cuda_launch.ELEMENTWISE_BLOCKS * cuda_launch.THREADS
    too_long = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (limit + 1,), (0,))  # no memory
    with pytest.raises(ValueError, match=r"relu_forward: arrays of more than 2146435072 \(2\*\*31 - 2\*\*20\)"):
        be.relu_forward(too_long)
    # uint8 images, contiguous, in memory that is reserved but never touched
    memory = mmap.mmap(-1, limit + 1)
    images = np.frombuffer(memory, np.uint8)
    assert cuda_launch.typed(be, "images_to_float", images[:limit], np.uint8) is not None
    with pytest.raises(ValueError, match=r"images_to_float: arrays of more than 2146435072"):
        cuda_launch.typed(be, "images_to_float", images, np.uint8)
    del images
    memory.close()


@pytest.mark.parametrize("backend", ["cpu", "emu"])
@pytest.mark.parametrize("shape", [(4, 0), (0, 10)])
def test_cross_entropy_without_classes_or_examples_is_refused(backend, shape):
    ops = K if backend == "cpu" else kernels._device_backend("emu")
    logits, labels = np.zeros(shape, np.float32), np.zeros(shape[0], np.int32)
    with pytest.raises(ValueError, match=r"at least one example and one class, got logits of shape"):
        ops.softmax_cross_entropy_forward(logits, labels)
    with pytest.raises(ValueError, match=r"at least one example and one class"):
        ops.count_correct(logits, labels)


def test_in_place_updates_need_contiguous_buffers():
    be = kernels._device_backend("emu")
    param = np.zeros(20, np.float32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        be.sgd_update(param, np.zeros(10, np.float32), None, 0.1, 0.0, 0.0)


def test_non_contiguous_inputs_are_copied():
    be = kernels._device_backend("emu")
    x = rng().standard_normal((2, 5, 4, 3)).astype(np.float32).transpose(0, 2, 1, 3)   # neither layout
    validate(be.relu_forward(x), R.relu_forward(x), "relu of a strided array")


def channels_last(shape):
    """Random float32 values, channels-last: an NCHW view of NHWC memory."""
    n, c, h, w = shape
    return rng().standard_normal((n, h, w, c)).astype(np.float32).transpose(0, 3, 1, 2)


# op: (4-D arguments, per-channel arguments) -> outputs; each call made once with channels-last
# 4-D arguments, once with the first one channels-last and the others NCHW
LAYOUT_OPS = {
    "relu": lambda m, x, y: m.relu_forward(x),
    "relu backward": lambda m, x, y: m.relu_backward(x, y),
    "add": lambda m, x, y: m.add(x, y),
    "add relu": lambda m, x, y: m.add_relu_forward(x, y),
    "batch norm": lambda m, x, y, g, b: m.batch_norm_forward(x, g, b, EPS),
    "batch norm backward": lambda m, x, y, g, b: m.batch_norm_backward(y, x, g, *m.batch_norm_forward(x, g, b, EPS)[1:]),
    "batch norm inference": lambda m, x, y, g, b: m.batch_norm_inference(x, g, b, b, g * g + 0.5, EPS),
    "batch norm inference backward": lambda m, x, y, g, b: m.batch_norm_inference_backward(y, x, g, b, g * g + 0.5, EPS),
    "global average pool": lambda m, x, y: m.global_avg_pool_forward(x),
}


@pytest.mark.parametrize("others", ["channels-last", "NCHW"])
@pytest.mark.parametrize("name", LAYOUT_OPS)
def test_channels_last_arrays_stay_channels_last(name, others):
    """What the tensor-core convolutions produce: each op takes it as it is, gives its 4-D results
    in its layout, and computes what kernels.cpu does."""
    be, op = kernels._device_backend("emu"), LAYOUT_OPS[name]
    shape = (3, 6, 5, 4)
    x = channels_last(shape)
    y = channels_last(shape) if others == "channels-last" else rng().standard_normal(shape).astype(np.float32)
    per_channel = [rng().standard_normal(shape[1]).astype(np.float32) for _ in range(2)]
    arguments = (x, y, *per_channel)[:len(inspect.signature(op).parameters) - 1]
    ours, theirs = _outputs(op(be, *arguments)), _outputs(op(K, *(a.copy() for a in arguments)))
    for i, (o, t) in enumerate(zip(ours, theirs)):
        validate(o, t, f"{name} output {i}")
        if o.ndim == 4:
            assert cuda_launch.is_channels_last(o), f"{name} output {i} is not channels-last: strides {o.strides}"


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_global_average_pool_backward_takes_the_layout_of_the_activations(precision):
    """Channels-last under tf32, as the convolutions' activations are, C-contiguous NCHW under fp32
    (new arrays start as NaN: every element written)."""
    be, dy = kernels._device_backend("emu"), rng().standard_normal((3, 6)).astype(np.float32)
    with kernels.use_precision(precision):
        dx = be.global_avg_pool_backward(dy, (3, 6, 5, 4))
    assert cuda_launch.is_channels_last(dx) if precision == "tf32" else dx.flags.c_contiguous, dx.strides
    validate(dx, K.global_avg_pool_backward(dy, (3, 6, 5, 4)), "global average pool backward")


# ---- GPU only ----------------------------------------------------------------------------

@pytest.fixture
def gpu():
    """(the cuda backend, cupy, torch) where a GPU and PyTorch with CUDA are at hand."""
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(reason)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA: no float64 peer on the GPU")
    return kernels._device_backend("cuda"), kernels.cupy_module(), torch


# name, inputs (shapes, drawn standard normal, or integer arrays), PyTorch's op of float64 tensors,
# our forward (outputs: the first is PyTorch's), our backward (dy, *inputs, *forward outputs) ->
# gradients of the floating inputs, and the bound on ||ours - torch|| / ||torch||.
TORCH_PEERS = [
    ("conv2d 3x3 stride 2", [(8, 64, 15, 15), (128, 64, 3, 3), (128,)],
     lambda F, x, w, b: F.conv2d(x, w, b, stride=2, padding=1),
     lambda m, x, w, b: m.conv2d_forward(x, w, b, 2, 1),
     lambda m, dy, x, w, b, y: m.conv2d_backward(dy, x, w, 2, 1), 1e-4),
    ("linear", [(256, 512), (10, 512), (10,)], lambda F, x, w, b: F.linear(x, w, b),
     lambda m, x, w, b: m.linear_forward(x, w, b), lambda m, dy, x, w, b, y: m.linear_backward(dy, x, w), 1e-4),
    ("batch norm", [(16, 64, 14, 14), (64,), (64,)],
     lambda F, x, gamma, beta: F.batch_norm(x, None, None, gamma, beta, training=True, eps=EPS),
     lambda m, x, gamma, beta: m.batch_norm_forward(x, gamma, beta, EPS),
     lambda m, dy, x, gamma, beta, y, mean, invstd: m.batch_norm_backward(dy, x, gamma, mean, invstd), 1e-4),
    ("relu", [(16, 64, 14, 14)], lambda F, x: F.relu(x), lambda m, x: m.relu_forward(x),
     lambda m, dy, x, y: m.relu_backward(dy, y), 1e-5),
    ("max pool", [(8, 16, 15, 15)], lambda F, x: F.max_pool2d(x, 3, 2, 1),
     lambda m, x: m.max_pool2d_forward(x, 3, 2, 1), lambda m, dy, x, y, argmax: m.max_pool2d_backward(dy, argmax, x.shape),
     1e-5),
    ("global avg pool", [(16, 512, 4, 4)], lambda F, x: x.mean(dim=(2, 3)), lambda m, x: m.global_avg_pool_forward(x),
     lambda m, dy, x, y: m.global_avg_pool_backward(dy, x.shape), 1e-5),
    ("softmax cross-entropy", [(256, 10), np.arange(256) % 10], lambda F, z, labels: F.cross_entropy(z, labels),
     lambda m, z, labels: m.softmax_cross_entropy_forward(z, labels),
     lambda m, dloss, z, labels, loss, probs: m.softmax_cross_entropy_backward(dloss, probs, labels), 1e-4),
]


def compare_with_torch(ours, torch, device, case):
    """One TORCH_PEERS case: our float32 op against PyTorch's float64 on the same inputs, each result within the
    case's bound of it (relative_error). A failure also says how far PyTorch's own float32 op is from the same
    float64 results: a kernel less accurate than float32 allows, or inputs that float32 cannot resolve."""
    name, inputs, torch_op, forward, backward, bound = case
    g = rng()
    arrays = [g.standard_normal(a).astype(np.float32) if isinstance(a, tuple) else a for a in inputs]
    outputs = _outputs(forward(ours, *arrays))
    dy = g.standard_normal(outputs[0].shape).astype(np.float32)
    expected = torch_results(torch, device, torch_op, arrays, dy)
    grads = _outputs(backward(ours, dy, *arrays, *outputs))
    assert len(grads) == len(expected) - 1, f"{name}: {len(grads)} gradients"
    labels = ("output", *(f"gradient {i}" for i in range(len(grads))))
    for i, (label, o, t) in enumerate(zip(labels, (outputs[0], *grads), expected)):
        error = relative_error(o, t)
        assert error < bound, (
            f"{name} {label}: relative error {error:.3g} >= {bound}; PyTorch's float32 on the same inputs: "
            f"{relative_error(torch_results(torch, device, torch_op, arrays, dy, torch.float32)[i], t):.3g}\n"
            f"{reproduce_hint()}")


def torch_results(torch, device, torch_op, arrays, dy, dtype=None):
    """PyTorch's op on `arrays` on `device`, the floating ones as `dtype` (float64 unless given; convolutions without
    TF32), the integer ones as int64: [its output, then, after its backward from dy, the gradients of the
    floating arrays], as NumPy arrays."""
    dtype = dtype or torch.float64
    tensors = [torch.tensor(a, device=device, dtype=dtype if a.dtype.kind == "f" else torch.int64,
                            requires_grad=a.dtype.kind == "f") for a in arrays]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        out = torch_op(torch.nn.functional, *tensors)
        out.backward(torch.tensor(dy, dtype=dtype, device=device))
    return [r.detach().cpu().numpy() for r in (out, *(t.grad for t in tensors if t.requires_grad))]


def relative_error(ours, ref):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("case", TORCH_PEERS, ids=[c[0] for c in TORCH_PEERS])
def test_gpu_against_torch_float64(gpu, poisoned_device_empty, case):
    be, _, torch = gpu
    compare_with_torch(OnDevice(be), torch, "cuda", case)


@pytest.mark.gpu
def test_gpu_results_are_bit_identical_run_to_run(gpu):
    """Split reductions add their partials in a fixed order: the same inputs, the same bits."""
    be, cp, _ = gpu
    g = rng()
    x, w, dy, gamma, beta = (cp.asarray(g.standard_normal(s).astype(np.float32))
                             for s in ((16, 32, 14, 14), (64, 32, 3, 3), (16, 64, 14, 14), (64,), (64,)))

    def step():
        _, mean, invstd = be.batch_norm_forward(dy, gamma, beta, EPS)
        return (*be.conv2d_backward(dy, x, w, 1, 1), mean, invstd,
                *be.batch_norm_backward(dy, dy, gamma, mean, invstd))

    for i, (a, b) in enumerate(zip(step(), step())):
        assert cp.array_equal(a, b), f"output {i} differs between two runs"


# ---- the GPU tests' copies, on a simulated GPU ----------------------------------------------

@pytest.fixture
def simulated_gpu(monkeypatch, request):
    """The cuda backend on one simulated GPU (kernels/simulated), where the GPU tests' fixtures find it
    (gpu_unavailable_reason, poisoned_device_empty); its kernels on the emulator without the sanitizer (each
    kernel's own tests run them under it): what a GPU test does with its arrays, checked in CI."""
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    monkeypatch.setenv("CUDA_EMU_SANITIZE", "off")
    assert gpu_unavailable_reason() is None
    request.getfixturevalue("poisoned_device_empty")
    yield kernels._device_backend("cuda")
    kernels.cupy_module().cuda.Device(0).synchronize()   # its work ordered before the next test's


def keep_layouts_and_identities(ours):
    """relu of a channels-last x comes back channels-last (the kernel writes its input's layout), of a C-ordered x
    C-ordered; add(a, b, out=a) returns a, a + b in it."""
    g = rng()
    for x in (channels_last((2, 3, 4, 5)), g.standard_normal((2, 3, 4, 5)).astype(np.float32)):
        y = ours.relu_forward(x)
        assert y.strides == x.strides, f"relu_forward of strides {x.strides} gave strides {y.strides}"
        validate(y, R.relu_forward(x), "relu_forward")
    a, b = g.standard_normal((2, 300)).astype(np.float32)
    expected = a + b
    assert ours.add(a, b, out=a) is a, "add(a, b, out=a) did not return a"
    np.testing.assert_array_equal(a, expected)


@pytest.mark.parametrize("planted", [None, "plain copies to the device", "plain copies back"])
def test_on_device_copies_keep_the_layouts_and_identities_of_the_arrays(simulated_gpu, planted):
    """OnDevice on one simulated GPU: an array goes to the device in its layout, and a result comes back in the
    device array's, or as the host array that was given. Planted: cupy.asarray's copy to the device (C-ordered,
    as CuPy copies a NumPy array), or PlainCopies's results."""
    ours = (PlainCopies if planted == "plain copies back" else OnDevice)(simulated_gpu)
    if planted == "plain copies to the device":
        ours.device_array = ours.cupy.asarray
    if planted is None:
        keep_layouts_and_identities(ours)
    else:
        with pytest.raises(AssertionError, match=r"relu_forward of strides \(240, 4, 60, 12\) gave strides "
                                                 r"\(240, 80, 20, 4\)"):
            keep_layouts_and_identities(ours)


@pytest.mark.parametrize("planted", [False, True], ids=["OnDevice", "planted: plain copies back"])
def test_the_backwards_return_the_arrays_given_on_a_simulated_gpu(simulated_gpu, planted):
    """test_backwards_write_into_the_gradient_arrays_they_are_given's GPU variant (OnDevice on the cuda backend) on
    one simulated GPU: each gradient written into out= is the host array given. Planted, PlainCopies's new host
    arrays fail its identity check, as OnDevice's did on one H200."""
    if planted:
        with pytest.raises(AssertionError, match=r"conv2d_backward: dw is not out\[0\]"):
            write_into_the_gradient_arrays_given(PlainCopies(simulated_gpu))
    else:
        write_into_the_gradient_arrays_given(OnDevice(simulated_gpu))


# ---- a whole ResNet-18 training step on the device backends against the NumPy backend ------------

def resnet_step(device="cpu", emulated=False):
    """Loss, flat gradient and parameters after one SGD step, and the batch-norm statistics,
    of ResNet-18 at width 8 on a batch of 2, from fixed weights and data."""
    import contextlib
    import nn
    import nn.functional as F
    nn.manual_seed(11)
    model = nn.resnet18(width=8).to(device)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    g = np.random.default_rng(12)
    xp = kernels.array_module_for(device)
    x = xp.asarray(g.random((2, 1, 28, 28)).astype(np.float32))
    y = xp.asarray(np.array([3, 7], np.int32))
    with kernels.emulate() if emulated else contextlib.nullcontext():
        loss = F.cross_entropy(model(nn.Tensor(x)), y)
        loss.backward()
        grad = opt.flat.grad.copy()
        opt.step()
    host = lambda a: a.get() if hasattr(a, "get") else np.asarray(a)  # noqa: E731
    stats = np.concatenate([host(b).ravel() for n, b in model.named_buffers() if "running" in n])
    return float(loss.data), host(grad), host(opt.flat.data), stats


def check_step_against_numpy(step, numpy_step):
    (loss, grad, params, stats), (ref_loss, ref_grad, ref_params, ref_stats) = step, numpy_step
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    # a conv bias before batch norm has a true gradient of zero, so errors are measured
    # against the norm of all gradients, not per tensor
    assert np.linalg.norm(grad - ref_grad) <= 1e-4 * np.linalg.norm(ref_grad)
    validate(params, ref_params, "parameters after one SGD step", rtol=1e-5)
    validate(stats, ref_stats, "batch-norm running statistics", rtol=1e-4)


@pytest.mark.slow
def test_resnet18_training_step_on_the_emulator_matches_numpy():
    check_step_against_numpy(resnet_step(emulated=True), resnet_step())


@pytest.mark.gpu
def test_resnet18_training_step_on_the_gpu_matches_numpy(gpu):
    check_step_against_numpy(resnet_step("cuda"), resnet_step())
    a, b = resnet_step("cuda"), resnet_step("cuda")
    assert np.array_equal(a[2], b[2]), "two runs with the same seed give bit-identical weights"


def test_element_wise_kernels_move_four_floats_only_where_alignment_allows(ours):
    """vector_width checks the addresses rather than assume them: a view one float into a buffer (a
    flat buffer's parameter, say) runs the one-float kernels, and both give NumPy's results."""
    from kernels.cuda.launch import vector_width
    g = rng()
    a, b = (g.standard_normal(4 * 101 + 1).astype(np.float32) for _ in range(2))   # NumPy: 16-byte aligned
    assert vector_width(404, a[:404], b[:404]) == 4 and vector_width(404, a[1:], b[1:]) == 1
    assert vector_width(403, a[:403]) == 1
    for lo in (0, 1):
        np.testing.assert_array_equal(ours.add(a[lo:lo + 404], b[lo:lo + 404]), a[lo:lo + 404] + b[lo:lo + 404])
