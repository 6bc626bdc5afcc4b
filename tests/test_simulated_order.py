"""What a GPU punishes between streams and in CUDA graphs, refused by the simulated GPUs by name
(kernels/simulated/timeline.py and cuda.py), each shown with a planted mistake beside the
correct code, and what a GPU allows, run clean beside its mistaken twin:

- races between streams: a write by one stream to elements another stream reads or writes, with
  no event or synchronize between them; two reads are fine, and so are two streams writing
  disjoint columns of one array; the legacy null stream and a blocking stream order each other,
  a non-blocking one does not; memory freed while another stream may still read it, once CuPy's
  pool hands it to the allocating stream's next allocation; the launches of one graph on two
  streams are ordered; a host thread that joins another knows what that one synchronized; a
  query is not a wait, nor get_elapsed_time before its events complete; a copy between devices
  is asynchronous; each host thread has its own per-thread default stream; and DataParallel with
  either of its two event waits taken out, in the trainer;
- capture rules: a copy to the host (``float()``, ``.item()``, ``.get()``) or from host memory
  on the capturing stream (on another stream only in global or thread-local mode, not CuPy's
  relaxed one), a synchronize of the device, a capturing stream or an event recorded in the
  capture, their queries, the legacy stream while a blocking stream captures, a wait on an event
  recorded in a capture that has ended, outside the capture or in another capture, and forks not
  joined back into the origin stream;
- graphs: array operations are recorded and replayed as CuPy's are; a replay that reaches memory
  freed since the capture fails; the capture's pool keeps what it allocated; a collective
  replayed in a graph on one rank and eager on another is an error on both;
- NCCL: an all-reduce whose buffers overlap without being the same; a collective that waits for
  a rank that destroyed its communicator.
"""
import re
import threading

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
    """relu_forward of kernels/cuda/elementwise.cu (const float* x, int total, float* y) on x, into out
    (new: allocated on the stream, whose work CuPy's pool orders its memory after)."""
    cupy = kernels.cupy_module()
    with stream or cupy.cuda.get_current_stream():
        out = cupy.empty_like(x) if out is None else out
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


def test_split_reductions_on_two_streams_share_the_devices_counters_and_race(gpus):
    """Every kernel that finishes a split reduction in its launch counts its blocks in the device's one
    counter array (Backend.counters): two such launches on unordered streams would corrupt each other's
    counts. Nothing does that today; the stand-ins refuse it, naming the counters, and the same two
    launches ordered by an event run clean."""
    from kernels.cuda import batchnorm
    be = kernels._device_backend("cuda")
    x = gpus.asarray(np.random.default_rng(1).standard_normal((4, 8, 6, 6)).astype(np.float32))
    side = gpus.cuda.Stream(non_blocking=True)
    shift = gpus.zeros(8, np.float32)
    gpus.cuda.Device(0).synchronize()         # x and shift are ready for every stream
    batchnorm.batch_norm_sums(be, x, shift)   # on the null stream
    with pytest.raises(timeline.UnorderedAccess, match=r"kernel 'bn_stats<float>' \(argument \d+ \(unsigned int\* "
                                                       r"counters\)\) on stream 0x[0-9a-f]+ of device 0 writes .* of an array of shape \(\d+,\) "
                                                       r"uint32 .* which kernel 'bn_stats<float>' .* on the null "
                                                       r"stream of device 0 wrote"):
        with side:
            batchnorm.batch_norm_sums(be, x, shift)
    side.wait_event(gpus.cuda.get_current_stream().record())
    with side:
        sums = batchnorm.batch_norm_sums(be, x, shift)
    side.synchronize()
    np.testing.assert_allclose(sums[0].get(), x.get().sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)


def test_the_legacy_stream_and_a_blocking_stream_order_each_other(gpus):
    blocking = gpus.cuda.Stream()
    y = relu(gpus.asarray(host()))
    relu(y, stream=blocking)          # waits for the null stream's work, as CUDA's blocking streams do
    y2 = relu(y, stream=blocking)
    relu(y2)                          # and the null stream waits for it


def test_memory_freed_while_another_stream_may_read_it_is_a_race_once_the_pool_hands_it_on(gpus):
    """CuPy's pool keeps a freed block in the free list of the stream that allocated it, for that
    stream's next allocation that it fits: the hazard is there, not at the free."""
    side, null = gpus.cuda.Stream(non_blocking=True), gpus.cuda.get_current_stream()
    for waits in (True, False):
        values = host()
        x = gpus.asarray(values)
        side.wait_event(null.record())
        y = relu(x, stream=side)          # the side stream reads x
        del x                             # freed while the side stream may still read it
        if waits:                         # correct: the null stream waits for the side stream before it allocates
            null.wait_event(side.record())
            z = gpus.zeros(64, np.float32)   # x's block
            np.testing.assert_array_equal(z.get(), np.zeros(64, np.float32))
            np.testing.assert_array_equal(y.get(), np.maximum(values, 0))
            continue
        gpus.zeros(1024, np.float32)      # larger than x's block: new memory, no hazard
        freed = (r"the array operation 'memset' \(its output\) on the null stream of device 0 writes bytes 0-16 of "
                 r"an array of shape \(4,\) float32 on device 0, which kernel 'relu_forward<1>' \(argument 0 .*\) "
                 r"\(in an array of shape \(64,\) float32 on device 0, freed before CuPy's pool gave its memory to "
                 r"this array\) on stream 0x[0-9a-f]+ of device 0 read")
        with pytest.raises(timeline.UnorderedAccess, match=freed):
            gpus.zeros(4, np.float32)     # handed x's block, with the side stream's read not ordered before


def test_one_graph_launched_on_two_streams_runs_its_launches_in_order(gpus):
    """CUDA orders the launches of one graph, whatever their streams; the same work queued eagerly on
    the two streams is a race."""
    values = host()
    x, out = gpus.asarray(values), gpus.zeros(64, np.float32)
    a, b = gpus.cuda.Stream(non_blocking=True), gpus.cuda.Stream(non_blocking=True)
    for stream in (a, b):
        stream.wait_event(gpus.cuda.get_current_stream().record())
    graph, _ = capture(gpus, lambda: out.__iadd__(x))
    graph.launch(a)
    graph.launch(b)                   # after the launch on a, with no event between the streams
    b.synchronize()
    np.testing.assert_array_equal(out.get(), 2 * values)
    with a:
        out += x
    with b, pytest.raises(timeline.UnorderedAccess, match=r"the array operation 'add' \(operand 0\) on stream "
                                                          r"0x[0-9a-f]+ of device 0 reads .* which the array operation "
                                                          r"'add' \(its output\) on stream 0x[0-9a-f]+ of device 0 "
                                                          r"wrote"):
        out += x


def test_two_streams_writing_disjoint_elements_of_one_array_need_no_order(gpus):
    """Strided views: what two streams touch is the elements of each, not the bytes between the first
    and the last; columns that overlap by one are a race."""
    m = gpus.zeros((16, 16), np.float32)
    a, b = gpus.cuda.Stream(non_blocking=True), gpus.cuda.Stream(non_blocking=True)
    for stream in (a, b):
        stream.wait_event(gpus.cuda.get_current_stream().record())
    with a:
        m[:, :8] += 1
    with b:
        m[:, 8:] += 2                 # disjoint columns: no order needed
    for stream in (a, b):
        gpus.cuda.get_current_stream().wait_event(stream.record())
    np.testing.assert_array_equal(m.get(), np.repeat([[1, 2]], 8, axis=1).repeat(16, axis=0))
    for stream in (a, b):
        stream.wait_event(gpus.cuda.get_current_stream().record())
    with a:
        m[:, :9] += 1
    with b, pytest.raises(timeline.UnorderedAccess, match=r"on stream 0x[0-9a-f]+ of device 0 (reads|writes) bytes "
                                                          r"32-1024 of an array of shape \(16, 16\) float32"):
        m[:, 8:] += 2                 # column 8 is both streams'


def test_a_stream_synchronized_on_a_joined_host_thread_orders_what_follows(gpus):
    """Host threads: what a thread waited for, the thread that joins it knows; before the join (here,
    before the other thread has synchronized at all) reading the stream's output is a race."""
    side = gpus.cuda.Stream(non_blocking=True)
    values = host()
    x = gpus.asarray(values)
    side.wait_event(gpus.cuda.get_current_stream().record())
    y = relu(x, stream=side)
    waiter = threading.Thread(target=side.synchronize)
    waiter.start()
    waiter.join()
    np.testing.assert_array_equal(y.get(), np.maximum(values, 0))
    side.wait_event(gpus.cuda.get_current_stream().record())
    z = relu(y, stream=side)
    go = threading.Event()
    waiter = threading.Thread(target=lambda: (go.wait(), side.synchronize()))
    waiter.start()
    try:
        with pytest.raises(timeline.UnorderedAccess, match=r"ndarray.get \(a copy to the host\) .* on the null stream "
                                                           r"of device 0 reads .* which kernel 'relu_forward<1>'"):
            z.get()
    finally:
        go.set()
        waiter.join()


def test_a_copy_on_another_stream_during_a_relaxed_capture_is_allowed(gpus):
    """CuPy captures in relaxed mode, in which other streams may copy between host and device; a
    capture in global mode forbids it on every host thread, one in thread-local mode on its own."""
    error = gpus.cuda.runtime.CUDARuntimeError
    values = host()
    x = gpus.asarray(values)
    for mode in (None, gpus.cuda.runtime.streamCaptureModeThreadLocal, gpus.cuda.runtime.streamCaptureModeGlobal):
        stream = gpus.cuda.Stream(non_blocking=True)
        stream.wait_event(gpus.cuda.get_current_stream().record())
        stream.begin_capture(mode)
        with stream:
            y = x * 2                 # captured
        seen = []
        reader = threading.Thread(target=lambda: seen.append(_outcome(lambda: x.get())))
        reader.start()
        reader.join()
        if mode == gpus.cuda.runtime.streamCaptureModeGlobal:
            for outcome in (_outcome(lambda: x.get()), seen[0]):
                assert isinstance(outcome, error) and re.search(
                    r"cudaErrorStreamCaptureUnsupported: ndarray.get \(a copy to the host\) while stream "
                    r"0x[0-9a-f]+ of device 0 captures in cudaStreamCaptureModeGlobal", str(outcome)), outcome
        else:                         # relaxed: allowed on any thread; thread-local: on the other thread
            np.testing.assert_array_equal(seen[0], values)
            if mode is None:
                np.testing.assert_array_equal(x.get(), values)
                np.testing.assert_array_equal(gpus.asarray(values).get(), values)
            else:
                with pytest.raises(error, match="captures in cudaStreamCaptureModeThreadLocal"):
                    x.get()
        graph = stream.end_capture()
        graph.launch(stream)
        gpus.cuda.get_current_stream().wait_event(stream.record())
        np.testing.assert_array_equal(y.get(), values * 2)


def _outcome(fn):
    """fn()'s value, or the exception it raised."""
    try:
        return fn()
    except Exception as e:  # handed back to the test
        return e


def test_a_query_is_not_a_wait(gpus):
    """Stream.done and Event.done answer False while the host has not waited for the work (a GPU may
    not have run it), so a query taken for a wait leaves a race; asked again, they answer True and
    order what follows, so a loop that polls ends. get_elapsed_time needs both events complete."""
    side = gpus.cuda.Stream(non_blocking=True)
    values = host()
    x = gpus.asarray(values)
    side.wait_event(gpus.cuda.get_current_stream().record())
    start = side.record()
    y = relu(x, stream=side)
    end = side.record()
    assert not side.done
    with pytest.raises(timeline.UnorderedAccess, match="on the null stream of device 0 reads .* on stream 0x"):
        y.get()
    with pytest.raises(gpus.cuda.runtime.CUDARuntimeError, match="cudaErrorNotReady: get_elapsed_time: the start "
                                                                 "event has not completed"):
        gpus.cuda.get_elapsed_time(start, end)
    assert side.done                  # asked again about the same work
    np.testing.assert_array_equal(y.get(), np.maximum(values, 0))
    assert gpus.cuda.get_elapsed_time(start, end) >= 0
    side.wait_event(gpus.cuda.get_current_stream().record())
    z = relu(y, stream=side)
    event = side.record()
    polls = 0
    while not event.done:             # a loop that polls: the first answer is False, the second True
        polls += 1
        with pytest.raises(timeline.UnorderedAccess):
            z.get()
    assert polls == 1
    np.testing.assert_array_equal(z.get(), np.maximum(values, 0))


def test_a_copy_between_devices_is_asynchronous_on_its_stream(gpus):
    """CuPy copies an array of another device with an asynchronous copy on the current stream: another
    stream that reads the copy must wait for it."""
    values = host()
    with gpus.cuda.Device(1):
        a = gpus.asarray(values)
        a.get()                       # the host waited for device 1's copy from the host
    copied = gpus.asarray(a)          # to device 0, on its null stream
    side = gpus.cuda.Stream(non_blocking=True)
    with pytest.raises(timeline.UnorderedAccess, match=r"kernel 'relu_forward<1>' \(argument 0 .*\) on stream "
                                                       r"0x[0-9a-f]+ of device 0 reads .* which the array operation "
                                                       r"'copy' \(its output\) on the null stream of device 0 wrote"):
        relu(copied, stream=side)
    side.wait_event(gpus.cuda.get_current_stream().record())
    out = relu(copied, stream=side)
    gpus.cuda.get_current_stream().wait_event(side.record())
    np.testing.assert_array_equal(out.get(), np.maximum(values, 0))


def test_the_per_thread_default_stream_is_one_stream_per_host_thread(gpus):
    """Stream.ptds is one object, and on each host thread that thread's own stream: work on it in two
    threads is ordered by an event, not by the name."""
    ptds = gpus.cuda.Stream.ptds
    values = host()
    y = relu(gpus.asarray(values), stream=ptds)   # a per-thread stream follows the legacy one
    written = ptds.record()
    outcomes = []

    def reader(waits):
        if waits:
            ptds.wait_event(written)
        outcomes.append(_outcome(lambda: relu(y, stream=ptds)))
    for waits in (False, True):
        thread = threading.Thread(target=reader, args=(waits,), name=f"reader-{waits}")
        thread.start()
        thread.join()
    race, out = outcomes
    assert isinstance(race, timeline.UnorderedAccess) and re.search(
        r"kernel 'relu_forward<1>' \(argument 0 .*\) on the per-thread default stream of host thread reader-False on "
        r"device 0 reads .* which kernel 'relu_forward<1>' \(argument 2 .*\) on the per-thread default stream of host "
        r"thread MainThread on device 0 wrote", str(race)), race
    np.testing.assert_array_equal(out.get(), np.maximum(values, 0))   # the legacy stream waits for both


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


def test_events_across_captures_and_forks_not_joined_back_are_refused(gpus):
    """CUDA's capture rules on events: a wait inside a capture on an event recorded outside it
    (cudaErrorStreamCaptureIsolation), a wait that would merge two captures (cudaErrorStreamCaptureMerge),
    and a fork whose work the origin stream's last work does not depend on at end_capture
    (cudaErrorStreamCaptureUnjoined: here two forked streams join each other and neither joins the
    origin); a fork joined back through another fork is joined, and replays right."""
    error = gpus.cuda.runtime.CUDARuntimeError
    values = host()
    x, first, second = gpus.asarray(values), gpus.zeros(64, np.float32), gpus.zeros(64, np.float32)
    origin, one, two = (gpus.cuda.Stream(non_blocking=True) for _ in range(3))
    outside = gpus.cuda.get_current_stream().record()
    origin.begin_capture()
    with pytest.raises(error, match=r"cudaErrorStreamCaptureIsolation: Stream.wait_event: stream 0x[0-9a-f]+ "
                                    r"captures, and the event was recorded outside the capture"):
        origin.wait_event(outside)
    one.begin_capture()
    with pytest.raises(error, match="cudaErrorStreamCaptureMerge: Stream.wait_event: stream 0x[0-9a-f]+ captures "
                                    "into the capture begun on stream 0x[0-9a-f]+, and the event was recorded in the "
                                    "capture begun on stream"):
        one.wait_event(origin.record())
    one.end_capture()
    origin.end_capture()
    for joined in (False, True):
        origin.wait_event(outside)    # outside a capture: an ordinary wait
        origin.begin_capture()
        fork = origin.record()
        one.wait_event(fork)
        two.wait_event(fork)
        relu(x, first, stream=one)
        relu(x, second, stream=two)
        one_done, two_done = one.record(), two.record()
        two.wait_event(one_done)       # two joins one
        if joined:
            origin.wait_event(two.record())   # and the origin joins two: one through two
            graph = origin.end_capture()
            graph.launch(origin)
            gpus.cuda.get_current_stream().wait_event(origin.record())
            for out in (first, second):
                np.testing.assert_array_equal(out.get(), np.maximum(values, 0))
        else:
            one.wait_event(two_done)   # one joins two; the origin neither
            with pytest.raises(error, match=r"cudaErrorStreamCaptureUnjoined: end_capture: the work of stream\(s\) "
                                            r"0x[0-9a-f]+, 0x[0-9a-f]+, which joined the capture, was not joined back"):
                origin.end_capture()


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


def test_an_all_reduce_whose_buffers_overlap_without_being_the_same_is_refused(gpus):
    """In place (sendbuf == recvbuf) and apart are NCCL's; a partial overlap is garbage on GPUs."""
    values = [host((128,)) for _ in range(2)]

    def body(rank, comm):
        a, stream = gpus.asarray(values[rank]), gpus.cuda.get_current_stream().ptr
        comm.comm.allReduce(a.data.ptr, a.data.ptr, 32, sim_nccl.NCCL_FLOAT32, sim_nccl.NCCL_SUM, stream)
        comm.comm.allReduce(a[32:].data.ptr, a[64:].data.ptr, 32, sim_nccl.NCCL_FLOAT32, sim_nccl.NCCL_SUM, stream)
        overlap = _outcome(lambda: comm.comm.allReduce(a.data.ptr, a[16:].data.ptr, 32, sim_nccl.NCCL_FLOAT32,
                                                       sim_nccl.NCCL_SUM, stream))
        return a.get(), overlap
    total = values[0] + values[1]
    for rank, (a, overlap) in enumerate(run_ranks(gpus, body)):
        np.testing.assert_array_equal(a[:32], total[:32])
        np.testing.assert_array_equal(a[64:96], total[32:64])
        np.testing.assert_array_equal(a[96:], values[rank][96:])
        assert isinstance(overlap, sim_nccl.NcclError) and re.search(
            r"NCCL_ERROR_INVALID_USAGE: allReduce: sendbuf 0x[0-9a-f]+ and recvbuf 0x[0-9a-f]+ of 128 bytes overlap "
            r"without being the same", str(overlap)), overlap


def test_a_collective_after_the_peer_destroyed_its_communicator_fails_naming_the_call(gpus, monkeypatch):
    """On GPUs a hang; here an error after LEFT_TIMEOUT, naming the call. Both ranks making the call
    before either destroys its communicator is the correct twin."""
    monkeypatch.setattr(sim_nccl, "LEFT_TIMEOUT", 0.5)

    def body(rank, comm, early):
        total = comm.all_reduce(gpus.ones(4, np.float32))
        if rank == 1 and early:
            comm.comm.destroy()
            return None
        again = comm.all_reduce(total.copy())
        comm.comm.destroy()
        return again.get()
    for early in (False, True):
        waited, gone = run_ranks(gpus, lambda rank, comm: body(rank, comm, early))
        if not early:
            np.testing.assert_array_equal(waited, np.full(4, 4, np.float32))
            np.testing.assert_array_equal(gone, waited)
            continue
        assert gone is None
        assert isinstance(waited, sim_nccl.NcclError) and "NCCL_ERROR_REMOTE_ERROR: call 2 (allReduce of 4 float32 " \
            "op 0) of rank 0 waited 0.5 s for rank 1, which left the communicator (destroyed or aborted it, or " \
            "ended) without making the call (on GPUs, a hang)" in str(waited), waited
