"""What a GPU punishes between streams and in CUDA graphs, refused by the simulated GPUs by name
(kernels/simulated/timeline.py and cuda.py), each shown with a planted mistake beside the
correct code:

- races between streams: a write by one stream to bytes another stream reads or writes, with no
  event or synchronize between them; two reads are fine; the legacy null stream and a blocking
  stream order each other, a non-blocking one does not; memory freed while another stream may
  still use it; and DataParallel with either of its two event waits taken out, in the trainer;
- capture rules: a copy to the host (``float()``, ``.item()``, ``.get()``) or from host memory,
  a synchronize of the device, a capturing stream or an event recorded in the capture, their
  queries, the legacy stream while a blocking stream captures, and a wait on an event recorded
  in a capture that has ended;
- graphs: array operations are recorded and replayed as CuPy's are; a replay that reaches memory
  freed since the capture fails; the capture's pool keeps what it allocated; a collective
  replayed in a graph on one rank and eager on another is an error on both.
"""
import re

import numpy as np
import pytest

import kernels
import sim_targets
from helpers import write_fashion_mnist
from kernels.simulated import nccl as sim_nccl
from kernels.simulated import timeline
from parallel import launch
from parallel.comm import NCCLCommunicator
from test_simulated_gpus import gpus, host, run_ranks  # noqa: F401  (gpus: the fixture)


def relu(x, out=None, stream=None):
    """relu_forward of kernels/cuda/elementwise.cu (const float* x, int total, float* y) on x, into out."""
    out = kernels.cupy_module().empty_like(x) if out is None else out
    kernels.backend_of(x).function("elementwise", "relu_forward<1>")((1,), (256,), (x, np.int32(x.size), out),
                                                                      stream=stream)
    return out


# ---- races between streams ------------------------------------------------------------------------

def test_a_write_and_a_read_on_two_streams_need_an_event_between_them(gpus):
    side = gpus.cuda.Stream(non_blocking=True)
    x = gpus.asarray(host())
    y = relu(x)                       # written on the null stream
    with pytest.raises(timeline.UnorderedAccess, match=r"race on device 0: kernel 'relu_forward<1>' \(argument 0 "
                                                       r"\(const float\* __restrict__ x\)\) on stream 0x[0-9a-f]+ of "
                                                       r"device 0 reads bytes 0-256 of an array of shape \(64,\) "
                                                       r"float32 .* which kernel 'relu_forward<1>' \(argument 2 "
                                                       r"\(float\* __restrict__ y\)\) on the null stream of device 0 "
                                                       r"wrote"):
        relu(y, stream=side)
    side.wait_event(gpus.cuda.get_current_stream().record())
    z = relu(y, stream=side)          # ordered by the event
    relu(x)
    w = relu(x, stream=side)          # two reads of x, unordered: fine (w is freed after the synchronize)
    with pytest.raises(timeline.UnorderedAccess, match="on the null stream of device 0 reads .* on stream 0x"):
        z.get()                       # the side stream wrote z
    side.synchronize()                # the host waited for it: what it queues next follows
    np.testing.assert_array_equal(z.get(), np.maximum(x.get(), 0))
    np.testing.assert_array_equal(w.get(), z.get())


def test_the_legacy_stream_and_a_blocking_stream_order_each_other(gpus):
    blocking = gpus.cuda.Stream()
    y = relu(gpus.asarray(host()))
    relu(y, stream=blocking)          # waits for the null stream's work, as CUDA's blocking streams do
    y2 = relu(y, stream=blocking)
    relu(y2)                          # and the null stream waits for it


def test_memory_freed_while_another_stream_may_use_it_is_a_race(gpus):
    side = gpus.cuda.Stream(non_blocking=True)
    x = gpus.asarray(host())
    side.wait_event(gpus.cuda.get_current_stream().record())
    y = relu(x, stream=side)
    del x                             # freed: the null stream's next allocation may get the memory
    with pytest.raises(timeline.UnorderedAccess, match=r"an array of shape \(64,\) float32 on device 0 was freed "
                                                       r"while kernel 'relu_forward<1>' \(argument 0 .* on stream "
                                                       r"0x[0-9a-f]+ of device 0, which reads bytes 0-256 of it"):
        gpus.zeros(4, np.float32)
    gpus.cuda.get_current_stream().wait_event(side.record())
    del y                             # ordered before the null stream's next work: fine
    gpus.zeros(4, np.float32)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 8, 4)


@pytest.mark.parametrize("which, race", [
    ("ready", r"NCCL allReduce of rank \d \(sendbuf\) on stream 0x[0-9a-f]+ of device \d reads .* which kernel "
              r"'\w+(<[^>]*>)?' \(argument \d \(float\* __restrict__ \w+\)\) on the null stream of device \d wrote"),
    ("done", r"kernel 'sgd_update' \(argument 1 \(const float\* __restrict__ grad\)\) on the null stream of device \d "
             r"reads .* which NCCL allReduce of rank \d \(recvbuf\) on stream 0x[0-9a-f]+ of device \d wrote")])
def test_data_parallel_without_either_event_wait_is_a_race(gpus, tiny_data, tmp_path, which, race):
    """The planted mistakes: the all-reduce of a bucket not waiting for the backward that wrote it
    ("ready"), and the optimizer step not waiting for the last all-reduce ("done")."""
    given = {"gpus": 2, "width": 2, "batch_size": 4, "limit": 4, "test_limit": 4, "epochs": 1,
             "data_dir": str(tiny_data), "out": str(tmp_path / "run"), "graph": False}
    with pytest.raises(launch.WorkerFailed) as failed:
        launch.run_workers(2, sim_targets.without_event_wait, (given, NCCLCommunicator.unique_id(), which))
    assert failed.value.reason.startswith("raised UnorderedAccess: simulated GPUs: a race on device")
    assert re.search(race, failed.value.reason), failed.value.reason


# ---- capture rules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("read", [float, lambda a: a.item(), lambda a: a.get(), lambda a: a.tolist(), bool])
def test_reading_a_device_value_during_a_capture_is_refused(gpus, read):
    x = gpus.asarray(np.float32(3.0))
    stream = gpus.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        y = x * 2
        with pytest.raises(gpus.cuda.runtime.CUDARuntimeError,
                           match=r"cudaErrorStreamCaptureUnsupported: .*\(a copy to the host\) during a stream "
                                 r"capture \(stream 0x[0-9a-f]+ of device 0 is capturing\): nothing captured has run"):
            read(y)
        stream.end_capture()
    read(x)   # after the capture, as before it


def test_synchronizing_and_querying_during_a_capture_are_refused(gpus):
    error = gpus.cuda.runtime.CUDARuntimeError
    stream = gpus.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        event = stream.record()
        for call, status in ((lambda: gpus.cuda.Device().synchronize(), "StreamCaptureUnsupported"),
                             (stream.synchronize, "StreamCaptureUnsupported"),
                             (lambda: stream.done, "StreamCaptureUnsupported"),
                             (event.synchronize, "CapturedEvent"), (lambda: event.done, "CapturedEvent"),
                             (lambda: gpus.asarray(host()), "StreamCaptureUnsupported")):
            with pytest.raises(error, match=f"cudaError{status}"):
                call()
        stream.end_capture()
    with pytest.raises(error, match="cudaErrorStreamCaptureIsolation"):
        gpus.cuda.get_current_stream().wait_event(event)   # recorded in a capture that has ended
    blocking = gpus.cuda.Stream()
    x = gpus.asarray(host())
    blocking.begin_capture()
    with pytest.raises(error, match=r"cudaErrorStreamCaptureImplicit: kernel 'relu_forward<1>' on the legacy null "
                                    r"stream while blocking stream 0x[0-9a-f]+ of device 0 captures"):
        relu(x)
    blocking.end_capture()
    relu(x)


# ---- graphs -----------------------------------------------------------------------------------------------

def capture(gpus, fn, pool=None):
    """(graph, fn()) captured on a non-blocking stream, arrays from `pool` when given."""
    stream = gpus.cuda.Stream(non_blocking=True)
    allocator = gpus.cuda.using_allocator(pool.malloc) if pool is not None else gpus.cuda.using_allocator()
    with allocator, stream:
        stream.begin_capture()
        result = fn()
        graph = stream.end_capture()
    return graph, result


def test_array_operations_are_captured_and_replayed(gpus):
    x = gpus.asarray(host())
    total = gpus.zeros(1, np.float32)
    pool = gpus.cuda.MemoryPool()
    graph, y = capture(gpus, lambda: relu(x * 2 - 1).copy(), pool)
    assert np.isnan(y.get()).all(), "nothing runs during the capture"
    for _ in range(2):
        x[...] = gpus.asarray(host())
        graph.launch()
        np.testing.assert_array_equal(y.get(), np.maximum(x.get() * 2 - 1, 0))
    graph, _ = capture(gpus, lambda: total.__iadd__(x.sum()), pool)
    graph.launch()
    graph.launch()
    np.testing.assert_allclose(total.get(), 2 * x.get().sum(), rtol=1e-6)


def test_a_replay_over_memory_freed_since_the_capture_fails(gpus):
    x, out = gpus.asarray(host()), gpus.zeros(64, np.float32)
    graph = capture(gpus, lambda: relu(x, out))[0]
    graph.launch()
    del out                           # the graph holds its address, not the array
    with pytest.raises(timeline.FreedMemory, match=r"kernel 'relu_forward<1>' \(argument 2 \(float\* __restrict__ "
                                                   r"y\)\) reaches an array of shape \(64,\) float32 on device 0, "
                                                   r"freed since the CUDA graph was captured"):
        graph.launch()


def test_the_pool_of_a_capture_keeps_what_the_capture_allocated(gpus):
    x = gpus.asarray(host())
    pool = gpus.cuda.MemoryPool()
    graph, _ = capture(gpus, lambda: relu(relu(x) * 3), pool)   # the temporaries are the pool's
    graph.launch()
    graph, _ = capture(gpus, lambda: relu(relu(x) * 3))          # without a pool they are freed
    with pytest.raises(timeline.FreedMemory):
        graph.launch()


def test_a_collective_replayed_on_one_rank_and_eager_on_another_is_an_error(gpus):
    def body(rank, comm):
        a = gpus.asarray(host())
        if rank == 0:
            graph, _ = capture(gpus, lambda: comm.all_reduce(a))
            graph.launch()
        else:
            comm.all_reduce(a)
    for e in run_ranks(gpus, body):
        assert isinstance(e, sim_nccl.NcclError), e
        assert "call 1 (allReduce of 64 float32 op 0) is replayed in a CUDA graph on rank(s) [0] and eager on " \
               "the others" in str(e)
