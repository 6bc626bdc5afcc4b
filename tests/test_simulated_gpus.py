"""The GPU code paths on simulated GPUs (KERNELS_SIMULATED_GPUS, kernels/simulated), without a GPU.

- The stand-in itself: CuPy's signatures and NCCL's constants (checked against the installed
  CuPy), copies between the host and a device in the order asked, not the array's, as CuPy's,
  arrays that remember their device, and each thing a GPU punishes refused with the call
  named: an array of another device in a kernel or operation, a host array where a device array
  is needed, an event recorded on another device's stream, an NCCL buffer of another device, an
  NCCL call that differs between ranks, two ranks on one GPU; CUDA_VISIBLE_DEVICES.
- The project on it, end to end: ``train_resnet.py --gpus 2`` with --sync-bn against
  ``--gpus 1`` on the whole batch; where rank 1 puts its arrays and launches its kernels; a
  worker that raises or dies; --profile with two GPUs; one GPU per MPI rank through
  CUDA_VISIBLE_DEVICES, as Slurm starts them. The runs whose kernels the sanitizer has seen in
  the same shapes elsewhere (the precision's plumbing, the profile, the MPI ranks) run the emulator
  without it, a third of the time; --sync-bn on two GPUs and the placement run under memcheck.
"""
import ast
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import kernels
import nn
import sim_targets
from helpers import rng, write_fashion_mnist
from kernels import emu
from kernels.cuda import conv_tc
from kernels.simulated import cuda as sim_cuda
from kernels.simulated import nccl as sim_nccl
from parallel import launch
from parallel.comm import NCCLCommunicator
from training import checkpoint
from test_ddp import MPIEXEC, mpi_unavailable_reason
from test_profiler import check_timeline

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--width", "2", "--batch-size", "8", "--limit", "16", "--test-limit", "8", "--epochs", "1"]


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """Two simulated GPUs in this process (and in the processes it starts), device 0 current; the
    simulated NCCL's folders in the test's own temporary folder."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def simulate(count=2, visible=None):
        monkeypatch.setenv(kernels.SIMULATED_GPUS, str(count))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return kernels.cupy_module()
    cupy = simulate()
    cupy.simulate = simulate
    yield cupy
    simulate()
    for device in range(2):   # the test's end orders its work before the next test's, as a program's end does
        sim_cuda.Device(device).synchronize()
    sim_cuda.setDevice(0)


def host(shape=(64,)):
    return rng().standard_normal(shape).astype(np.float32)


# ---- fidelity to CuPy ------------------------------------------------------------------------------

def _real_cupy():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
            import cupy.cuda.nccl as nccl
    except ImportError:
        pytest.skip("CuPy is not installed (pip install -e '.[test]')")
    return cupy, nccl


def _parameters(obj):
    """[(name, kind, default)] of a callable: from inspect where CuPy's Cython allows it, else from
    the signature Cython embeds in the docstring (its C types dropped); None when neither has one."""
    try:
        parameters = list(inspect.signature(obj).parameters.values())
        if not any(p.name.startswith("_") for p in parameters):
            return [(p.name, p.kind.name, repr(p.default)) for p in parameters if p.name != "self"]
    except (TypeError, ValueError):
        pass
    first = (obj.__doc__ or "").strip().splitlines()[:1]
    match = re.match(r"^[\w.]*\((.*)\)\s*(->.*)?$", first[0]) if first else None
    if match is None:
        return None
    plain = [part.split("=")[0].split()[-1] + ("=" + part.split("=", 1)[1] if "=" in part else "")
             for part in match.group(1).split(",") if part.strip()]
    arguments = ast.parse(f"def f({', '.join(plain)}): pass").body[0].args
    names = [(a.arg, "POSITIONAL_OR_KEYWORD") for a in arguments.args]
    names += [("*" + arguments.vararg.arg, "VAR_POSITIONAL")] if arguments.vararg else []
    names += [(a.arg, "KEYWORD_ONLY") for a in arguments.kwonlyargs]
    names += [("**" + arguments.kwarg.arg, "VAR_KEYWORD")] if arguments.kwarg else []
    defaults = [None] * (len(arguments.args) - len(arguments.defaults)) + arguments.defaults
    values = [repr(ast.literal_eval(d)) if d is not None else repr(inspect.Parameter.empty) for d in defaults]
    values += [repr(inspect.Parameter.empty)] * bool(arguments.vararg)
    values += [repr(ast.literal_eval(d)) if d is not None else repr(inspect.Parameter.empty)
               for d in arguments.kw_defaults]
    values += [repr(inspect.Parameter.empty)] * bool(arguments.kwarg)
    return [(n.lstrip("*"), k, v) for (n, k), v in zip(names, values) if n != "self"]


def _ours(obj):
    return [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(obj).parameters.values()
            if p.name != "self"]


SIGNATURES = [f"{path}" for path in (
    "asarray", "ascontiguousarray", "asnumpy", "empty", "zeros", "ones", "empty_like", "zeros_like", "ones_like",
    "arange", "ndarray.get", "ndarray.fill", "ndarray.reshape", "ndarray.ravel", "ndarray.copy", "ndarray.astype",
    "ndarray.view", "ndarray.transpose", "ndarray.swapaxes", "ndarray.sum", "ndarray.max", "ndarray.item",
    "ndarray.tolist", "ndarray.__getitem__", "ndarray.__setitem__", "RawModule", "RawModule.get_function",
    "RawKernel.__call__", "cuda.Device", "cuda.Device.use", "cuda.Device.synchronize", "cuda.Stream",
    "cuda.Stream.use", "cuda.Stream.record", "cuda.Stream.wait_event", "cuda.Stream.synchronize",
    "cuda.Stream.begin_capture", "cuda.Stream.end_capture", "cuda.Stream.is_capturing", "cuda.Graph.launch",
    "cuda.Graph.upload", "cuda.MemoryPool", "cuda.MemoryPool.malloc", "cuda.MemoryPool.free_all_blocks",
    "cuda.MemoryPool.used_bytes", "cuda.MemoryPool.total_bytes", "get_default_memory_pool", "cuda.using_allocator", "cuda.Event",
    "cuda.Event.record", "cuda.Event.synchronize", "cuda.get_current_stream", "cuda.get_elapsed_time",
    "cuda.runtime.getDeviceCount", "cuda.runtime.getDevice", "cuda.runtime.setDevice",
    "cuda.runtime.getDeviceProperties", "cuda.nvtx.RangePush", "cuda.nvtx.RangePop", "nccl.get_unique_id",
    "nccl.NcclCommunicator", "nccl.NcclCommunicator.allReduce", "nccl.NcclCommunicator.bcast",
    "nccl.NcclCommunicator.abort", "nccl.NcclCommunicator.destroy")]


def _lookup(root, nccl, path):
    """``path`` under cupy (or cupy.cuda.nccl); ours has RawKernel, what get_function returns, in arrays."""
    obj = nccl if path.startswith("nccl.") else root
    for name in path.removeprefix("nccl.").split("."):
        obj = getattr(obj, name) if hasattr(obj, name) else getattr(obj.arrays, name)
    return obj


def test_the_stand_in_has_cupys_signatures(gpus):
    cupy, nccl = _real_cupy()
    if not nccl.available:
        pytest.skip("CuPy cannot load NCCL here (pip install nvidia-nccl-cu13): its signatures are not readable")
    unreadable, differ = [], []
    for path in SIGNATURES:
        ours = _ours(_lookup(gpus, gpus.cuda.nccl, path))
        theirs = _parameters(_lookup(cupy, nccl, path))
        if theirs is None:
            unreadable.append(path)
        elif ours != theirs:
            differ.append(f"{path}: ours {ours}, CuPy {cupy.__version__}'s {theirs}")
    assert not differ, "\n".join(differ)
    assert len(unreadable) <= 3, f"CuPy's signatures could not be read for {unreadable}"


def test_the_stand_in_offers_nothing_cupy_lacks(gpus):
    cupy, nccl = _real_cupy()
    for name in gpus.__all__:
        assert hasattr(cupy, name), name
    for name in ("Device", "Stream", "Event", "get_current_stream", "get_elapsed_time", "runtime", "nvtx", "Graph",
                 "MemoryPool", "using_allocator"):
        assert hasattr(cupy.cuda, name), name
    if not nccl.available:
        pytest.skip("CuPy cannot load NCCL here (pip install nvidia-nccl-cu13): its constants are not readable")
    ours = {k: v for k, v in vars(sim_nccl).items() if k.startswith("NCCL_")}
    assert ours == {k: getattr(nccl, k) for k in ours}, "NCCL's datatype and reduction codes differ"


def test_copies_between_the_host_and_a_device_are_in_the_order_asked_as_cupys(gpus):
    """As CuPy 14.2's (core.pyx's _array_default and ndarray.get): asarray of a host array is C-ordered (Fortran-
    ordered where it is only that), whatever its strides; get and asnumpy are C-ordered, or as order asks ('A': F
    where the device array is Fortran-contiguous); get(out=) takes a contiguous out alone. So a test that asserts
    a layout must read it from the device array (OnDevice, tests/test_kernels_cuda.py)."""
    x = host((2, 4, 5, 3)).transpose(0, 3, 1, 2)   # channels-last
    d = gpus.asarray(x)
    assert d.flags.c_contiguous, d.strides
    last = gpus.asarray(np.ascontiguousarray(x.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)
    for copy in (d.get(), last.get(), gpus.asnumpy(last), gpus.asnumpy(last, order="A")):
        assert copy.flags.c_contiguous, copy.strides
        np.testing.assert_array_equal(copy, x)
    assert gpus.asnumpy(last, order="F").flags.f_contiguous
    fortran = np.asfortranarray(host((3, 4)))
    f = gpus.asarray(fortran)
    assert f.flags.f_contiguous and not f.flags.c_contiguous, f.strides
    assert gpus.asnumpy(f).flags.c_contiguous and gpus.asnumpy(f, order="A").flags.f_contiguous
    np.testing.assert_array_equal(gpus.asnumpy(f, order="A"), fortran)
    with pytest.raises(RuntimeError, match="`out` cannot be specified when copying to non-contiguous ndarray"):
        last.get(out=np.empty_like(x))


def test_cupy_older_than_14_2_is_refused(monkeypatch):
    import types
    monkeypatch.delenv(kernels.SIMULATED_GPUS, raising=False)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__="13.6.0"))
    with pytest.raises(kernels.DeviceError, match=r"CuPy 13\.6\.0 is installed; this project needs CuPy 14\.2"):
        kernels.cupy_module()
    assert kernels.gpu_count() == 0


def test_the_extras_require_cupy_14_2():
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'"cupy-cuda1\dx>=([\d.]+)"', text)
    assert len(pins) == 3 and all(tuple(map(int, p.split("."))) >= kernels.MINIMUM_CUPY for p in pins), pins


# ---- arrays and devices ------------------------------------------------------------------------------

def test_new_arrays_are_filled_on_the_current_device(gpus):
    """zeros, ones and their _like forms (bench/op_times.py makes batch norm's running statistics with them)."""
    with gpus.cuda.Device(1):
        made = {"zeros": gpus.zeros((3, 5), np.float32), "ones": gpus.ones((3, 5), np.float32),
                "ones_like": gpus.ones_like(gpus.empty((3, 5), np.float32))}
    for name, array in made.items():
        assert array.device.id == 1 and array.dtype == np.float32 and array.shape == (3, 5), name
        np.testing.assert_array_equal(array.get(), np.full((3, 5), float(name != "zeros"), np.float32), err_msg=name)


def test_arrays_remember_their_device_and_cuda_never_switches_it(gpus):
    with gpus.cuda.Device(1):
        a = gpus.asarray(host())
        assert kernels.array_module_for("cuda") is gpus
        assert gpus.cuda.Device().id == 1, "array_module_for('cuda') switched the current device"
    assert gpus.cuda.Device().id == 0
    assert a.device.id == 1 and a[3:9].device.id == 1 and a.reshape(8, 8).device.id == 1
    with gpus.cuda.Device(1):
        b = a * 2
    assert b.device.id == 1
    np.testing.assert_array_equal(b.get(), a.get() * 2)
    copied = gpus.asarray(a)
    assert copied.device.id == 0, "asarray copies an array of another device to the current one"
    np.testing.assert_array_equal(copied.get(), a.get())
    assert kernels.array_module_for("cuda:1") is gpus and gpus.cuda.Device().id == 1, "cuda:N selects GPU N"


def test_model_to_cuda_n_puts_everything_on_gpu_n(gpus):
    import nn
    model = nn.resnet18(width=2).to("cuda:1")
    assert gpus.cuda.Device().id == 1
    assert {p.data.device.id for p in model.parameters()} == {1}
    assert {p.grad.device.id for p in model.parameters()} == {1}
    assert model.flat_parameters().data.device.id == 1


def test_an_array_of_another_device_is_refused_naming_the_call(gpus):
    with gpus.cuda.Device(1):
        x = gpus.asarray(host())
    with pytest.raises(ValueError, match=r"resides \(1\) is different from the current device \(0\).*multiply"):
        x * 2
    with pytest.raises(ValueError, match=r"resides \(1\).*kernel 'relu_forward<4>' argument 0 \(const float\*"):
        kernels.backend_of(x).relu_forward(x)
    with gpus.cuda.Device(1):
        np.testing.assert_array_equal(kernels.backend_of(x).relu_forward(x).get(), np.maximum(x.get(), 0))


def test_a_host_array_where_a_device_array_is_needed_is_refused(gpus):
    x, h = gpus.asarray(host()), host()
    with pytest.raises(TypeError, match="Only numpy.ndarrays of size one can be passed by value"):
        kernels.backend_of(x).function("elementwise", "relu_forward<1>")((1,), (64,), (h, 64, x))
    with pytest.raises(TypeError, match="Unsupported type"):
        x + h
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        x[...] = h
    x[...] = gpus.asarray(h)
    np.testing.assert_array_equal(x.get(), h)


# A kernel whose block fills `n` floats of dynamic shared memory and writes the last.
DYNAMIC_SHARED_KERNEL = r"""
extern __shared__ float big[];
extern "C" __global__ void last_of(float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) big[i] = float(i);
    __syncthreads();
    if (threadIdx.x == 0) out[0] = big[n - 1];
}
"""


def test_dynamic_shared_memory_past_48_kb_is_allowed_on_each_device_apart(gpus):
    """max_dynamic_shared_size_bytes is the function's attribute on each device, as in CUDA. Planted: set on
    device 0 alone, a launch on device 1 that asks for 64 KB fails, naming it; Backend.function, given the
    launch's dynamic shared memory, sets it on the device it runs on, and both devices run the kernel."""
    size = 64 * 1024
    module = gpus.RawModule(code=DYNAMIC_SHARED_KERNEL)
    kernel = module.get_function("last_of")
    kernel.max_dynamic_shared_size_bytes = size
    out = gpus.zeros(1, np.float32)
    kernel((1,), (128,), (out, size // 4), shared_mem=size)
    assert out.get()[0] == size // 4 - 1
    with gpus.cuda.Device(1):
        out = gpus.zeros(1, np.float32)
        with pytest.raises(gpus.cuda.runtime.CUDARuntimeError,
                           match="cudaErrorInvalidValue: kernel 'last_of' launched with shared_mem=65536 bytes of "
                                 "dynamic shared memory on device 1, where its max_dynamic_shared_size_bytes is 49152"):
            module.get_function("last_of")((1,), (128,), (out, size // 4), shared_mem=size)
    # the correct twin: TF32's halo backward-weight (96 KB of dynamic shared memory) on either device
    x, w, dy = (rng().standard_normal(shape).astype(np.float32) for shape in ((2, 32, 5, 5), (32, 32, 3, 3),
                                                                              (2, 32, 5, 5)))
    dy = kernels.cpu.round_tf32(dy)   # TF32 values, as the step's: the halo kernel sums the bias of what it reads
    names, launch = [], conv_tc.launch
    grads = []
    with kernels.use_precision("tf32"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv_tc, "launch", lambda be, family, kernel, *a, **k: names.append(kernel) or
                   launch(be, family, kernel, *a, **k))
        for device in (0, 1):
            with gpus.cuda.Device(device):
                args = [gpus.asarray(a) for a in (dy, x, w)]
                grads.append([g.get() for g in kernels.backend_of(args[0]).conv2d_backward(*args, 1, 1,
                                                                                            dy_tf32=True)])
    assert names.count(conv_tc.WGRAD_HALO["conv_tc"].kernel) == 2, names
    for got, want in zip(grads[1], grads[0]):
        np.testing.assert_array_equal(got, want)


def test_new_device_memory_is_poisoned(gpus):
    assert np.isnan(gpus.empty(5, np.float32).get()).all()
    assert (gpus.empty(3, np.int64).get() == np.iinfo(np.int64).min).all()


def test_streams_and_events_belong_to_their_device(gpus):
    with gpus.cuda.Device(1):
        stream, event = gpus.cuda.Stream(non_blocking=True), gpus.cuda.Event()
    with pytest.raises(gpus.cuda.runtime.CUDARuntimeError, match="made on device 1, the stream .* device 0"):
        event.record()  # the current (null) stream is device 0's
    with pytest.raises(gpus.cuda.runtime.CUDARuntimeError, match="made on device 0, the stream .* device 1"):
        gpus.cuda.Event().record(stream)
    with pytest.raises(RuntimeError, match=r"created on \(1\) does not match with the current device \(0\)"):
        stream.use()
    x = gpus.asarray(host())
    with pytest.raises(gpus.cuda.runtime.CUDARuntimeError, match="kernel 'relu_forward<1>' launched on stream"):
        kernels.backend_of(x).function("elementwise", "relu_forward<1>")((1,), (64,), (x, 64, x), stream=stream)
    with gpus.cuda.Device(1):
        start = stream.record()
        end = stream.record(gpus.cuda.Event())
    end.synchronize()
    assert gpus.cuda.get_elapsed_time(start, end) >= 0


def test_cuda_visible_devices_selects_and_renumbers(gpus):
    gpus.simulate(4, visible="2,0")
    assert kernels.gpu_count() == 2
    assert gpus.cuda.runtime.getDeviceProperties(0)["name"].startswith(b"Simulated GPU 2")
    gpus.simulate(4, visible="3,x,1")   # as CUDA: up to the first invalid entry
    assert kernels.gpu_count() == 1
    gpus.simulate(4, visible="")
    assert kernels.gpu_count() == 0


@pytest.mark.parametrize("visible, local_rank, local_size, expected", [
    (8, 3, 8, 3),      # every rank sees the node's GPUs: its own index
    (1, 3, 8, 0),      # the scheduler made one GPU visible per rank
    (1, 0, 1, 0),
    (4, 0, 2, 0),
])
def test_the_gpu_of_a_rank(monkeypatch, visible, local_rank, local_size, expected):
    monkeypatch.setattr(kernels, "gpu_count", lambda: visible)
    assert kernels.local_gpu(local_rank, local_size) == expected


def test_a_rank_without_a_gpu_of_its_own_is_an_error(monkeypatch):
    monkeypatch.setattr(kernels, "gpu_count", lambda: 2)
    with pytest.raises(kernels.DeviceError, match="local rank 3 of 4 sees 2 GPU"):
        kernels.local_gpu(3, 4)


# ---- NCCL between ranks (threads here; processes in the trainer below) ------------------------------

def run_ranks(gpus, body, devices=(0, 1), unique_id=None):
    """body(rank, comm) on one thread per rank, each on its device; [result or exception]."""
    unique_id = unique_id or NCCLCommunicator.unique_id()
    results = [None] * len(devices)

    def rank_main(rank):
        try:
            gpus.cuda.Device(devices[rank]).use()
            comm = NCCLCommunicator(rank, len(devices), unique_id)
            results[rank] = body(rank, comm)
        except Exception as e:  # handed back to the test
            results[rank] = e
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results


def test_nccl_collectives_have_nccls_semantics(gpus):
    values = [host((1000,)) for _ in range(2)]

    def body(rank, comm):
        a = gpus.asarray(values[rank])
        total = comm.all_reduce(a.copy())
        mean = comm.all_reduce(a.copy(), average=True)
        part = a.copy()
        comm.start_all_reduce(part[100:600])
        comm.wait()
        root = comm.broadcast(a.copy(), root=1)
        return total.get(), mean.get(), part.get(), root.get()
    results = run_ranks(gpus, body)
    for rank, (total, mean, part, root) in enumerate(results):
        np.testing.assert_array_equal(total, values[0] + values[1])
        np.testing.assert_array_equal(mean, (values[0] + values[1]) / np.float32(2))
        np.testing.assert_array_equal(part[100:600], (values[0] + values[1])[100:600])
        np.testing.assert_array_equal(part[:100], values[rank][:100])
        np.testing.assert_array_equal(root, values[1])


def test_all_gather_bytes_gives_every_rank_the_bytes_of_each(gpus):
    """Through a uint8 all-reduce on the GPUs; bytes of different lengths, none at all included."""
    data = [bytes(range(256)) * 3, b""]
    results = run_ranks(gpus, lambda rank, comm: comm.all_gather_bytes(data[rank]))
    assert results == [data, data]


def test_an_nccl_call_that_differs_between_ranks_is_an_error_on_every_rank(gpus):
    def body(rank, comm):
        comm.all_reduce(gpus.zeros(100 + rank, np.float32))
    results = run_ranks(gpus, body)
    for e in results:
        assert isinstance(e, sim_nccl.NcclError), e
        assert "call 1 differs between ranks (rank 0: allReduce of 100 float32 op 0; rank 1: allReduce of 101" \
            in str(e)


def test_an_nccl_buffer_of_another_device_is_refused(gpus):
    def body(rank, comm):
        with gpus.cuda.Device(1 - rank):
            elsewhere = gpus.zeros(10, np.float32)
        comm.all_reduce(elsewhere)
    for rank, e in enumerate(run_ranks(gpus, body)):
        assert isinstance(e, sim_nccl.NcclError) and f"communicator (rank {rank}) is on device {rank}" in str(e), e


def test_two_ranks_on_one_gpu_are_refused(gpus):
    for e in run_ranks(gpus, lambda rank, comm: None, devices=(1, 1)):
        assert isinstance(e, sim_nccl.NcclError) and "Duplicate GPU detected" in str(e), e


def test_abort_ends_a_wait_for_a_peer_that_is_gone(gpus):
    def body(rank, comm):
        if rank == 1:
            return comm  # gone, as a killed process is, without leaving: it never joins the all-reduce
        threading.Timer(0.5, comm.comm.abort).start()  # as the launcher's watchdog does
        comm.all_reduce(gpus.zeros(4, np.float32))
    began = time.monotonic()
    waited, gone = run_ranks(gpus, body)
    assert isinstance(waited, sim_nccl.NcclError) and "aborted while rank 0 waited" in str(waited), waited
    assert isinstance(gone, NCCLCommunicator) and 0.4 < time.monotonic() - began < 30


# ---- the project on simulated GPUs, end to end -----------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 32, 16)


def train_resnet(gpus, data_dir, out, *flags, sanitize=None, capability=None):
    """``KERNELS_SIMULATED_GPUS=gpus python train_resnet.py ...``: CompletedProcess; `sanitize`, the emulator's
    sanitizer for it (CUDA_EMU_SANITIZE; the simulated GPUs' memcheck unless given); `capability`, the GPUs'
    compute capability as CuPy writes it (an H200's 90 unless given)."""
    environment = {**os.environ, kernels.SIMULATED_GPUS: str(gpus), "TMPDIR": str(out.parent),
                   **({"CUDA_EMU_SANITIZE": sanitize} if sanitize else {}),
                   **({sim_cuda.CAPABILITY: str(capability)} if capability else {})}
    environment.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "train_resnet.py", "--data-dir", str(data_dir), "--out", str(out),
                           *SMALL, *flags], cwd=ROOT, capture_output=True, text=True, timeout=240, env=environment)


@pytest.mark.slow
def test_two_gpus_with_sync_bn_equal_one_gpu_with_the_whole_batch(data_dir, tmp_path):
    # an epoch of one step of momentum SGD at width 4, on 16 images: training this small network is
    # chaotic (a relative change of 1e-7 in the weights grows to about 5e-3 in three steps, in
    # float64 as in float32), so a longer run would compare amplified rounding. In fp32: under tf32,
    # rounding the convolutions' inputs to TF32 turns the two sums' float32 differences into
    # differences of TF32's size wherever an input lies near a rounding boundary
    flags = ["--sync-bn", "--width", "4", "--batch-size", "16", "--limit", "16", "--momentum", "0.9",
             "--weight-decay", "1e-4", "--precision", "fp32"]
    # the reference without the sanitizer (the two ranks run under it, each with its half of the batch)
    one = train_resnet(1, data_dir, tmp_path / "one", "--gpus", "1", *flags, sanitize="off")
    assert one.returncode == 0, one.stderr
    two = train_resnet(2, data_dir, tmp_path / "two", "--gpus", "2", *flags)
    assert two.returncode == 0, two.stderr
    assert "starting 2 worker processes" in two.stdout and "data parallel: 2 ranks" in two.stdout
    assert two.stdout.splitlines()[-1].startswith("test acc: ") and "on cuda, 2 ranks" in two.stdout
    assert one.stdout.splitlines()[-1].startswith("test acc: ") and "on cuda" in one.stdout
    a, b = (checkpoint.load(tmp_path / name)[0]["params"] for name in ("one", "two"))
    # the same step from the whole batch: the sums split over two ranks round differently
    assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), np.max(np.abs(a - b))
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())[0]["world_size"] == 2


@pytest.mark.slow
def test_a_gpu_run_multiplies_in_tf32_unless_told_fp32(data_dir, tmp_path):
    """The default precision on GPUs is tf32, recorded in the metrics of each epoch (also in the
    checkpoint's) and in the profile; --precision fp32 runs the fp32 kernels."""
    tiny = ["--batch-size", "4", "--limit", "8", "--test-limit", "4"]   # the precision, not the learning
    run = train_resnet(1, data_dir, tmp_path / "run", "--gpus", "1", *tiny, sanitize="off")
    assert run.returncode == 0, run.stderr
    assert "precision tf32" in run.stdout
    assert checkpoint.load(tmp_path / "run")[1]["metrics"][0]["precision"] == "tf32"
    done = train_resnet(1, data_dir, tmp_path / "profile", "--gpus", "1", "--profile", "--profile-steps", "1",
                        "--precision", "fp32", *tiny, sanitize="off")
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert document["config"]["precision"] == "fp32"
    conv = next(row for row in document["rows"] if row["kind"] == "Conv2d")
    assert any(name.startswith("conv2d_forward<") for name in conv["kernels"]["forward"]), conv["kernels"]


@pytest.mark.slow
def test_a_gpu_without_tf32_tensor_cores_trains_in_fp32_and_refuses_tf32(data_dir, tmp_path):
    """A T4 (compute capability 7.5): the default run computes in fp32 and says why in its first lines;
    --precision tf32 or bf16 is one line naming the GPU and its capability, before anything starts, for
    --gpus 2 too. The stand-in refuses the tensor-core families there, as the GPU's compiler does."""
    tiny = ["--batch-size", "4", "--limit", "8", "--test-limit", "4"]
    run = train_resnet(1, data_dir, tmp_path / "run", "--gpus", "1", *tiny, sanitize="off", capability=75)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == ("GPU 0 (Simulated GPU 0 (CPU emulator)) is of compute capability 7.5, "
                                          "without TF32 tensor cores: the step computes in fp32"), run.stdout
    assert "precision fp32" in run.stdout
    assert checkpoint.load(tmp_path / "run")[1]["metrics"][0]["precision"] == "fp32"
    for gpus, precision in ((1, "tf32"), (2, "bf16")):
        refused = train_resnet(gpus, data_dir, tmp_path / f"refused{gpus}", "--gpus", str(gpus), "--precision",
                               precision, *tiny, capability=75)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.strip().splitlines()[-1] == (
            f"train_resnet.py: error: --gpus {gpus}: --precision {precision} multiplies on the tensor cores of "
            f"compute capability 8.0 and later (Ampere): GPU 0 (Simulated GPU 0 (CPU emulator)) is of compute "
            f"capability 7.5; use --precision fp32 there"), refused.stderr
        assert "starting" not in refused.stdout and not (tmp_path / f"refused{gpus}" / "checkpoint.npz").exists()


def test_a_capture_gives_the_default_pools_cached_blocks_back_first(gpus):
    """The graph's arrays come from a pool of its own: what the default pool caches from the eager steps
    goes back before the capture, or the step would hold its memory twice (bench/launches.py reports both)."""
    import gc
    from kernels.cuda import graph
    pool = gpus.get_default_memory_pool()
    gpus.zeros(1 << 20, np.float32).fill(1.0)   # made and dropped: its block stays cached
    gc.collect()
    assert pool.free_bytes() >= 4 << 20
    graph.capture(kernels._device_backend("cuda"), lambda: None)
    assert pool.free_bytes() == 0


def test_the_stand_in_refuses_the_tensor_core_families_below_sm_80(gpus, monkeypatch):
    from kernels.cuda import source
    monkeypatch.setenv(sim_cuda.CAPABILITY, "75")
    with pytest.raises(emu.CompileError, match=r"mma\.sync \.tf32 requires \.target sm_80 or higher"):
        gpus.RawModule(code=source("conv_tc"), options=("--std=c++17",))
    monkeypatch.setenv(sim_cuda.CAPABILITY, "80")
    assert gpus.cuda.Device(0).compute_capability == "80"
    assert gpus.cuda.runtime.getDeviceProperties(0)["major"] == 8


@pytest.mark.slow
def test_every_array_and_kernel_of_rank_1_is_on_gpu_1(gpus, data_dir, tmp_path):
    given = {"gpus": 2, "width": 2, "batch_size": 16, "limit": 16, "test_limit": 8, "epochs": 1,
             "momentum": 0.9, "data_dir": str(data_dir), "out": str(tmp_path / "run")}
    launch.run_workers(2, sim_targets.placement, (given, NCCLCommunicator.unique_id(), tmp_path))
    for rank in range(2):
        ledger = json.loads((tmp_path / f"ledger{rank}.json").read_text())
        assert set(ledger["allocations"]) == {str(rank)}, f"rank {rank} allocated on {ledger['allocations']}"
        assert set(ledger["launches"]) == {str(rank)}, f"rank {rank} launched on {ledger['launches']}"


@pytest.mark.slow
@pytest.mark.parametrize("how, reason", [("raise", "raised RuntimeError: a fault in the backward of rank 1"),
                                         ("kill", "was killed by signal SIGKILL")])
def test_a_worker_that_raises_or_dies_ends_the_job_naming_it(gpus, data_dir, tmp_path, monkeypatch, how, reason):
    monkeypatch.setattr(launch, "GRACE_SECONDS", 2.0)
    given = {"gpus": 2, **{k: v for k, v in zip(("width", "batch_size", "limit", "test_limit"), (2, 16, 16, 8))},
             "data_dir": str(data_dir), "out": str(tmp_path / "run")}
    began = time.monotonic()
    with pytest.raises(launch.WorkerFailed) as e:
        launch.run_workers(2, sim_targets.fails_in_backward,
                           (given, NCCLCommunicator.unique_id(), 1, how), watchdog=60)
    assert (e.value.rank, e.value.reason) == (1, reason)
    assert time.monotonic() - began < 60


@pytest.mark.slow
def test_profile_with_two_gpus_has_a_span_per_gradient_bucket(data_dir, tmp_path):
    """And the timeline of both ranks in rank 0's profile.trace.json: each bucket's all-reduce on a
    track of its own (its stream's), beside the step's."""
    done = train_resnet(2, data_dir, tmp_path / "profile", "--gpus", "2", "--profile", "--profile-steps", "1",
                        "--bucket-mb", "0.01", "--batch-size", "4", sanitize="off")
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert document["config"]["world_size"] == 2 and document["config"]["backend"] == "cuda"
    names = [span["name"] for span in document["concurrent"]]
    indices = sorted(int(re.fullmatch(r"all-reduce bucket (\d+) \([\d.]+ MB\)", name).group(1)) for name in names)
    assert len(indices) >= 2 and indices == list(range(len(indices))), names
    assert str(tmp_path / "profile" / "profile.trace.json") in done.stdout
    events = json.loads((tmp_path / "profile" / "profile.trace.json").read_text())["traceEvents"]
    check_timeline(events, [name for name, _ in nn.resnet18(width=2).named_modules()], steps=1, ranks=(0, 1))
    labels = {(e["pid"], e["tid"], e["name"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    for rank in (0, 1):
        assert labels[rank, 0, "process_name"] == f"rank {rank} (cuda:{rank})"
        step = next(e for e in events if e["pid"] == rank and e["name"] == "step 0")
        buckets = [e for e in events if e["pid"] == rank and e.get("cat") == "allreduce"]
        assert sorted(e["name"] for e in buckets) == sorted(f"{name} backward" for name in names)
        assert step["tid"] == 0 and {e["tid"] for e in buckets} == {1}     # a track of their own
        assert labels[rank, 1, "thread_name"] == "allreduce stream"


@pytest.mark.slow
@pytest.mark.skipif(mpi_unavailable_reason() is not None, reason=str(mpi_unavailable_reason()))
def test_one_gpu_per_mpi_rank_made_visible_by_the_scheduler(data_dir, tmp_path):
    """As Slurm starts them: each rank sees only its own GPU, and --gpus is still the node's count."""
    command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe"]
    for rank in range(2):
        command += [":"] * (rank > 0) + ["-n", "1", "env", f"CUDA_VISIBLE_DEVICES={rank}",
                                         f"{kernels.SIMULATED_GPUS}=2", f"TMPDIR={tmp_path}", "CUDA_EMU_SANITIZE=off",
                                         sys.executable,
                                         "train_resnet.py",
                                         "--gpus", "2", "--data-dir", str(data_dir), "--out", str(tmp_path / "run"),
                                         *SMALL]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data parallel: 2 ranks" in done.stdout and done.stdout.splitlines()[-1].startswith("test acc: ")


@pytest.mark.slow
@pytest.mark.skipif(mpi_unavailable_reason() is not None, reason=str(mpi_unavailable_reason()))
def test_two_mpi_ranks_on_one_gpu_are_refused_naming_the_gpu(data_dir, tmp_path):
    """Both ranks see only GPU 0 (a scheduler's mistake): an error that says so, before NCCL's bare
    "invalid usage"."""
    command = [MPIEXEC, "--allow-run-as-root", "--oversubscribe", "-n", "2", "-x", "CUDA_VISIBLE_DEVICES=0",
               "-x", f"{kernels.SIMULATED_GPUS}=2", "-x", f"TMPDIR={tmp_path}", sys.executable, "train_resnet.py",
               "--gpus", "2", "--data-dir", str(data_dir), "--out", str(tmp_path / "run"), *SMALL]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert "error: ranks 0 and 1 both use the GPU at PCI bus 0000:00:00.0 of " in done.stderr, done.stderr
    assert "NCCL" in done.stderr and "Traceback" not in done.stderr, done.stderr
