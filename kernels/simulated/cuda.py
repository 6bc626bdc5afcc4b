"""``cupy.cuda`` of the simulated GPUs: devices, streams, events, ``runtime`` and ``nvtx``; stream
capture into a ``Graph``, and the ``MemoryPool`` that a capture allocates from.

Work runs at once, in program order, so streams and events only keep CUDA's rules: each
belongs to the device that was current when it was made; an event recorded on a stream of
another device, or a stream made current on another device, is refused as CUDA refuses it.
``CUDA_VISIBLE_DEVICES`` selects and renumbers the machine's ``KERNELS_SIMULATED_GPUS`` GPUs,
as the driver does. The current device and stream are per host thread, as in CUDA.

Stream capture: between ``begin_capture()`` and ``end_capture()`` a stream records the kernel
launches and NCCL calls queued on it instead of running them (``enqueue``), and a ``Graph``
runs the record on ``launch()``. A stream that waits on an event recorded during the capture
joins it, and must be joined back (the capturing stream waiting on an event recorded after its
last work) before the capture ends, or ``end_capture`` fails as CUDA does. Array operations
(copies, fills, element-wise CuPy kernels) during a capture are refused: the simulator does not
record them, so a captured step must launch only RawModule kernels and NCCL calls.
"""
import collections
import contextlib
import functools
import itertools
import os
import threading
import time
import types

ENVIRONMENT = "KERNELS_SIMULATED_GPUS"
_handles = itertools.count(0x5100)  # stream and event handles: nonzero, unlike the null stream
_local = threading.local()
# what this process did: allocations and RawModule launches on each device (visible index), which a
# test reads to see where work went; and the array operations by name (each a kernel, a memset or a
# copy on a GPU) with the bytes of the arrays they write, which bench/launches.py counts
ledger = {"allocations": collections.Counter(), "launches": collections.Counter(),
          "operations": collections.Counter(), "operation_bytes": collections.Counter()}


class CUDARuntimeError(RuntimeError):
    """cupy.cuda.runtime.CUDARuntimeError: what CUDA would answer, with the call named."""

    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status = status


def physical_devices():
    """The machine's simulated GPUs that this process sees, by their physical index: all of
    them, or those ``CUDA_VISIBLE_DEVICES`` lists, in its order, up to its first invalid entry."""
    return _visible(os.environ.get(ENVIRONMENT, ""), os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.lru_cache(maxsize=None)
def _visible(count, visible):
    if not count.strip().isdigit():
        raise RuntimeError(f"{ENVIRONMENT}={count!r}: give the number of GPUs to simulate, e.g. {ENVIRONMENT}=2")
    machine = range(int(count))
    if visible is None:
        return tuple(machine)
    chosen = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry.isdigit() or int(entry) not in machine or int(entry) in chosen:
            break
        chosen.append(int(entry))
    return tuple(chosen)


def _state():
    if not hasattr(_local, "device"):
        _local.device, _local.streams = 0, {}
    return _local


def getDeviceCount():
    return len(physical_devices())


def getDevice():
    return _state().device


def setDevice(device):
    _check_device(device, "cudaSetDevice")
    _state().device = device


def getDeviceProperties(device):
    _check_device(device, "cudaGetDeviceProperties")
    return {"name": f"Simulated GPU {physical_devices()[device]} (CPU emulator)".encode(), "major": 9, "minor": 0,
            "multiProcessorCount": 132, "totalGlobalMem": 141 * 2**30}


def _check_device(device, call):
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError("cudaErrorInvalidDevice", f"invalid device ordinal: {call}({device}) with "
                                                         f"{getDeviceCount()} simulated GPU(s) visible")


runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError, getDeviceCount=getDeviceCount,
                                getDevice=getDevice, setDevice=setDevice, getDeviceProperties=getDeviceProperties)
nvtx = types.SimpleNamespace(available=False, RangePush=lambda message, id_color=-1: None, RangePop=lambda: None)


class Device:
    """cupy.cuda.Device: ``use()`` makes it current; ``with Device(n):`` does so until the block ends."""

    def __init__(self, device=None):
        self.id = getDevice() if device is None else int(device)
        self._previous = []

    def use(self):
        setDevice(self.id)

    def synchronize(self):
        _check_device(self.id, "cudaDeviceSynchronize")

    def __enter__(self):
        self._previous.append(getDevice())
        setDevice(self.id)
        return self

    def __exit__(self, *exc):
        setDevice(self._previous.pop())

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(self.id)

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


class Stream:
    """cupy.cuda.Stream: ``Stream.null`` (the current device's default stream) or a stream of
    the device current when it was made."""
    null = None
    ptds = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        if null or ptds:
            self.ptr, self.device_id = (0 if null else 2), -1  # 2: cudaStreamPerThread
        else:
            self.ptr, self.device_id = next(_handles), getDevice()
        self._capture, self._queued = None, 0   # the capture it records into; its work queued in it
        _streams[self.ptr] = self

    def device(self):
        """The device the stream's work goes to: its own, or the current one for the null stream."""
        return getDevice() if self.device_id == -1 else self.device_id

    def _check_current(self, call):
        if self.device_id not in (-1, getDevice()):
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) does not match with "
                               f"the current device ({getDevice()}) ({call})")

    def use(self):
        self._check_current("Stream.use")
        _state().streams.setdefault(getDevice(), [Stream.null])[-1:] = [self]
        return self

    def __enter__(self):
        self._check_current("with Stream")
        _state().streams.setdefault(getDevice(), [Stream.null]).append(self)
        return self

    def __exit__(self, *exc):
        _state().streams[getDevice()].pop()

    def record(self, event=None):
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event):
        if not isinstance(event, Event):
            raise TypeError(f"Stream.wait_event takes a cupy.cuda.Event, got {type(event).__name__}")
        if event._captured is not None:
            capture, source, queued = event._captured
            if self._capture is None:
                self._capture = capture   # it joins the capture
            capture.joined_back[source] = queued

    def synchronize(self):
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "Stream.synchronize on a capturing stream")

    def begin_capture(self, mode=None):
        if self.ptr in (0, 1):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState", "begin_capture on a stream that is capturing already")
        self._capture = _Capture(self)

    def end_capture(self):
        capture = self._capture
        if capture is None or capture.origin is not self:
            raise CUDARuntimeError("cudaErrorIllegalState", "end_capture on a stream that did not begin a capture")
        joined = [s for s in _streams.values() if s._capture is capture]
        for s in joined:
            s._capture = None
        unjoined = [s for s in joined if s is not self and capture.joined_back.get(s, -1) != s._queued]
        if unjoined:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnjoined",
                                   f"end_capture: stream(s) {', '.join(hex(s.ptr) for s in unjoined)} joined the "
                                   f"capture and were not joined back (wait on an event recorded after their work)")
        return Graph(capture.work)

    def is_capturing(self):
        return self._capture is not None

    @property
    def done(self):
        return True

    def __repr__(self):
        return f"<Stream {self.ptr} (device {self.device_id})>"


_streams = {}
Stream.null, Stream.ptds = Stream(null=True), Stream(ptds=True)


def get_current_stream(device_id=-1):
    device = getDevice() if device_id == -1 else device_id
    return _state().streams.get(device, [Stream.null])[-1]


def stream_of(pointer, call):
    """The Stream of a raw handle (what NCCL is given), or an error naming the call."""
    if pointer not in _streams:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle", f"{call}: {pointer:#x} is not a stream")
    return _streams[pointer]


class Event:
    """cupy.cuda.Event of the device current when it was made; it keeps the host time of its
    last record, for get_elapsed_time."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self.ptr, self.device_id = next(_handles), getDevice()
        self._timing, self._recorded, self._captured = not disable_timing, None, None

    def record(self, stream=None):
        stream = get_current_stream() if stream is None else stream
        if stream.device() != self.device_id:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                   f"Event.record: the event was made on device {self.device_id}, the stream "
                                   f"{stream.ptr:#x} belongs to device {stream.device()}")
        self._recorded = time.perf_counter()
        self._captured = None if stream._capture is None else (stream._capture, stream, stream._queued)

    def synchronize(self):
        pass

    @property
    def done(self):
        return True


def get_elapsed_time(start_event, end_event):
    for event in (start_event, end_event):
        if not event._timing or event._recorded is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                   "get_elapsed_time: an event made with disable_timing=True, or never recorded")
    if start_event.device_id != end_event.device_id:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                               f"get_elapsed_time: events of devices {start_event.device_id} and {end_event.device_id}")
    return (end_event._recorded - start_event._recorded) * 1e3


# ---- stream capture -------------------------------------------------------------------------------
class _Capture:
    """What a stream capture records, in order; and, for each stream that joined it, how much of its
    work the capturing streams have waited for (what end_capture checks)."""

    def __init__(self, origin):
        self.origin, self.work, self.joined_back = origin, [], {}


def enqueue(stream, work):
    """Run work() now, as the simulated GPUs run everything, or, when `stream` is capturing,
    record it for the graph's replays."""
    if stream._capture is None:
        work()
        return
    stream._capture.work.append(work)
    stream._queued += 1


def refuse_during_capture(call):
    """An array operation on the current stream: refused while it captures (see the module's docstring)."""
    stream = get_current_stream()
    if stream._capture is not None:
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                               f"{call} during a stream capture: the simulated GPUs record only RawModule kernels "
                               f"and NCCL calls (a GPU would capture it too, but here a replay would not run it)")


class Graph:
    """cupy.cuda.Graph: the work of a capture, run again, in order, by each launch()."""

    def __init__(self, work):
        self._work = work

    def launch(self, stream=None):
        for work in self._work:
            work()

    def upload(self, stream=None):
        pass


class MemoryPool:
    """cupy.cuda.MemoryPool: simulated arrays live in host memory and need none; using_allocator
    accepts its malloc."""

    def __init__(self, allocator=None):
        pass

    def malloc(self, size):
        raise NotImplementedError("the simulated GPUs allocate host memory, not from a pool")


@contextlib.contextmanager
def using_allocator(allocator=None):
    yield
