"""``cupy.cuda`` of the simulated GPUs: devices, streams, events, ``runtime`` and ``nvtx``; stream
capture into a ``Graph``, and the ``MemoryPool`` that a capture allocates from.

Work runs when it is queued, but in the order CUDA guarantees and no more: kernel launches, array
operations, NCCL calls and copies go through ``enqueue`` to ``timeline``, which checks that work
of two streams touching the same bytes is ordered by an event or a synchronize (see timeline.py).
Streams and events keep CUDA's rules: each belongs to the device that was current when it was
made; an event recorded on a stream of another device, or a stream made current on another
device, is refused as CUDA refuses it. ``CUDA_VISIBLE_DEVICES`` selects and renumbers the
machine's ``KERNELS_SIMULATED_GPUS`` GPUs, as the driver does. The current device and stream are
per host thread, as in CUDA.

Stream capture: between ``begin_capture()`` and ``end_capture()`` a stream records what is queued
on it (kernels, array operations, NCCL calls) instead of running it, and a ``Graph`` replays the
record on ``launch()``: the capturing stream's work on the stream it is launched on, each stream
that joined the capture on a branch of its own, ordered as the events of the capture ordered
them, after the graph's previous launch (CUDA orders the launches of one graph), and the
stream's later work after all of it. A stream that waits on an event recorded during the capture
joins it, and its work must be joined back (the origin stream's last work depending on it, through
events, directly or through other joined streams) before the capture ends, or ``end_capture``
fails as CUDA does. What CUDA refuses during a capture is refused by name: a copy to the host or
from host memory on the capturing stream, or on any stream while a capture in global mode (or in
thread-local mode, on its own host thread) runs; a synchronize of the device, of a capturing
stream or of an event recorded in the capture, a query of either; work on the legacy null stream
while a blocking stream of its device captures; a wait in a capture on an event recorded outside
it or in another capture. A capture's arrays come from the pool ``using_allocator`` names, which
the graph keeps; a graph holds addresses, not arrays, so a replay that reaches memory freed since
the capture fails. ``Stream.done`` and ``Event.done`` answer as timeline.query models a GPU's
progress, and ``get_elapsed_time`` wants both events complete.
"""
import collections
import contextlib
import functools
import itertools
import os
import threading
import time
import types

from . import timeline

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
    if not hasattr(_local, "device"):   # the thread's per-thread default stream is its own
        _local.device, _local.streams, _local.per_thread = 0, {}, next(_handles)
    return _local


def getDeviceCount():
    return len(physical_devices())


def getDevice():
    return _state().device


def setDevice(device):
    _check_device(device, "cudaSetDevice")
    _state().device = device


# The shared memory of an SM by compute capability (an H200's, an A100's, an RTX 3090's, an RTX 4090's or L4's,
# a T4's, a V100's), as cudaDeviceProp's sharedMemPerMultiprocessor gives it
SHARED_MEMORY_PER_SM = {(9, 0): 228 * 1024, (8, 0): 164 * 1024, (8, 6): 100 * 1024, (8, 9): 100 * 1024,
                        (7, 5): 64 * 1024, (7, 0): 96 * 1024}


def getDeviceProperties(device):
    _check_device(device, "cudaGetDeviceProperties")
    major, minor = compute_capability()
    return {"name": f"Simulated GPU {physical_devices()[device]} (CPU emulator)".encode(), "major": major,
            "minor": minor, "multiProcessorCount": 132, "totalGlobalMem": 141 * 2**30,
            "sharedMemPerMultiprocessor": SHARED_MEMORY_PER_SM.get((major, minor), 100 * 1024)}


CAPABILITY = "KERNELS_SIMULATED_COMPUTE_CAPABILITY"


def compute_capability():
    """(major, minor) of every simulated GPU: an H200's 9.0, or ``KERNELS_SIMULATED_COMPUTE_CAPABILITY``
    as CuPy writes it (75 for a T4's 7.5), so that the choices and errors that depend on it run here. A
    module compiled for a GPU below 8.0 cannot use the tensor-core instructions of sm_80 (tensor_core.cuh
    refuses them under EMU_COMPUTE_CAPABILITY, as ptxas does)."""
    value = os.environ.get(CAPABILITY, "90").strip()
    if not value.isdigit() or not 50 <= int(value) <= 129:
        raise RuntimeError(f"{CAPABILITY}={value!r}: give a compute capability as CuPy writes it, e.g. 75 for 7.5")
    return int(value) // 10, int(value) % 10


def _check_device(device, call):
    if not 0 <= device < getDeviceCount():
        raise CUDARuntimeError("cudaErrorInvalidDevice", f"invalid device ordinal: {call}({device}) with "
                                                         f"{getDeviceCount()} simulated GPU(s) visible")


def deviceGetPCIBusId(device):
    _check_device(device, "cudaDeviceGetPCIBusId")
    return f"0000:{physical_devices()[device]:02X}:00.0"


runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError, getDeviceCount=getDeviceCount,
                                getDevice=getDevice, setDevice=setDevice, getDeviceProperties=getDeviceProperties,
                                deviceGetPCIBusId=deviceGetPCIBusId, streamCaptureModeGlobal=0,
                                streamCaptureModeThreadLocal=1, streamCaptureModeRelaxed=2)
_MODES = {0: "cudaStreamCaptureModeGlobal", 1: "cudaStreamCaptureModeThreadLocal", 2: "cudaStreamCaptureModeRelaxed"}
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
        if _capturing(self.id):
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                   f"Device.synchronize while stream {_capturing(self.id)[0].ptr:#x} of device "
                                   f"{self.id} captures (it would wait for work that does not run)")
        timeline.host_waits(*timeline.keys_of(self.id))

    @property
    def compute_capability(self):
        """As CuPy gives it: '90' for 9.0."""
        _check_device(self.id, "cudaDeviceGetAttribute")
        return "".join(map(str, compute_capability()))

    @property
    def pci_bus_id(self):
        """The PCI bus id of the simulated GPU: its physical index as the bus number."""
        return runtime.deviceGetPCIBusId(self.id)

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
    """cupy.cuda.Stream: ``Stream.null`` (the current device's legacy default stream),
    ``Stream.ptds`` (the per-thread default stream: one object, and on each host thread the current
    device's stream of that thread) or a stream of the device current when it was made (blocking
    unless ``non_blocking``: a blocking stream, a per-thread one included, and the legacy stream
    wait for each other's work)."""
    null = None
    ptds = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        if null or ptds:
            self.ptr, self.device_id = (0 if null else 2), -1  # 2: cudaStreamPerThread
        else:
            self.ptr, self.device_id = next(_handles), getDevice()
        self.non_blocking = bool(non_blocking) and not (null or ptds)
        self._capture = None   # the capture it records into
        _streams[self.ptr] = self

    def device(self):
        """The device the stream's work goes to: its own, or the current one for the null stream."""
        return getDevice() if self.device_id == -1 else self.device_id

    def key(self):
        """The stream in timeline's terms: (device, handle), known to it; the per-thread default
        stream's handle is the current host thread's."""
        if self.ptr == 2:
            key, thread = (self.device(), ("per-thread", _state().per_thread)), threading.current_thread().name
            timeline.stream(key, "blocking", lambda: f"the per-thread default stream of host thread {thread} on "
                                                     f"device {key[0]}")
            return key
        key = (self.device(), self.ptr)
        kind = "legacy" if self.ptr == 0 else "non-blocking" if self.non_blocking else "blocking"
        timeline.stream(key, kind, lambda: f"the null stream of device {key[0]}" if self.ptr == 0 else
                        f"stream {self.ptr:#x} of device {key[0]}")
        return key

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
            capture, record, before = event._captured
            if capture.ended:
                raise CUDARuntimeError("cudaErrorStreamCaptureIsolation", "Stream.wait_event on an event last "
                                                                          "recorded in a stream capture that has ended")
            if self._capture not in (None, capture):
                raise CUDARuntimeError("cudaErrorStreamCaptureMerge",
                                       f"Stream.wait_event: stream {self.ptr:#x} captures into the capture begun on "
                                       f"stream {self._capture.origin.ptr:#x}, and the event was recorded in the "
                                       f"capture begun on stream {capture.origin.ptr:#x} (it would merge two captures)")
            self._capture = capture   # a stream that was not capturing joins the capture
            capture.wait(self, record, before)
        elif self._capture is not None:
            if event._clock is not None:
                raise CUDARuntimeError("cudaErrorStreamCaptureIsolation",
                                       f"Stream.wait_event: stream {self.ptr:#x} captures, and the event was recorded "
                                       f"outside the capture (a dependency across the capture's boundary, where only "
                                       f"a stream's own order may cross)")
        elif event._clock is not None:
            timeline.wait(self.key(), event._clock)

    def synchronize(self):
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "Stream.synchronize on a capturing stream")
        timeline.host_waits(self.key())

    def begin_capture(self, mode=None):
        if self.ptr in (0, 1):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState", "begin_capture on a stream that is capturing already")
        self._capture = _Capture(self, runtime.streamCaptureModeRelaxed if mode is None else mode)   # CuPy's default

    def end_capture(self):
        capture = self._capture
        if capture is None or capture.origin is not self:
            raise CUDARuntimeError("cudaErrorIllegalState", "end_capture on a stream that did not begin a capture")
        for s in capture.streams:
            s._capture = None
        capture.ended = True
        unjoined = capture.unjoined()
        if unjoined:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnjoined",
                                   f"end_capture: the work of stream(s) {', '.join(hex(s.ptr) for s in unjoined)}, "
                                   f"which joined the capture, was not joined back into stream {self.ptr:#x} that "
                                   f"began it (make it wait on an event recorded after that work)")
        return Graph(capture.nodes, self)

    def is_capturing(self):
        return self._capture is not None

    @property
    def done(self):
        """Whether the stream's work is complete (timeline.query: not before the host waited for it, or
        asked twice)."""
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "Stream.done (a query) on a capturing stream")
        key = self.key()
        return timeline.query(key, timeline.work_of(key))

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
    last record, for get_elapsed_time, and what that record stands for (timeline's clock, or the
    capture it was recorded in)."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self.ptr, self.device_id = next(_handles), getDevice()
        self._timing, self._recorded, self._captured, self._clock = not disable_timing, None, None, None

    def record(self, stream=None):
        stream = get_current_stream() if stream is None else stream
        if stream.device() != self.device_id:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                   f"Event.record: the event was made on device {self.device_id}, the stream "
                                   f"{stream.ptr:#x} belongs to device {stream.device()}")
        self._recorded = time.perf_counter()
        capture = stream._capture
        if capture is None:
            _refuse_legacy_during_capture(stream, "Event.record")
            self._captured, self._clock = None, timeline.snapshot(stream.key())
        else:
            self._captured, self._clock = (capture, *capture.record(stream)), None

    def synchronize(self):
        self._refuse_captured("Event.synchronize")
        timeline.host_waits(clock=self._clock)

    @property
    def done(self):
        """Whether the work before the event's record is complete (timeline.query)."""
        self._refuse_captured("Event.done (a query)")
        return timeline.query(("event", self.ptr), self._clock or {})

    def _refuse_captured(self, call):
        if self._captured is not None:
            raise CUDARuntimeError("cudaErrorCapturedEvent", f"{call} on an event recorded in a stream capture")


def get_elapsed_time(start_event, end_event):
    for event in (start_event, end_event):
        if not event._timing or event._recorded is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                   "get_elapsed_time: an event made with disable_timing=True, or never recorded")
    if start_event.device_id != end_event.device_id:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                               f"get_elapsed_time: events of devices {start_event.device_id} and {end_event.device_id}")
    for which, event in (("start", start_event), ("end", end_event)):
        if not timeline.complete(event._clock):
            raise CUDARuntimeError("cudaErrorNotReady", f"get_elapsed_time: the {which} event has not completed "
                                                        f"(synchronize with it, or the stream or device it was "
                                                        f"recorded on, first)")
    return (end_event._recorded - start_event._recorded) * 1e3


# ---- work, and stream capture --------------------------------------------------------------------
class _Capture:
    """What a stream capture records, in order: ("work", stream, Work), ("record", stream, None) and
    ("wait", stream, index of the record waited for); the graph's edges, as CUDA builds them: for
    each stream in the capture the work nodes its next work depends on, for each work node those it
    depends on; its mode, and the host thread that began it."""

    def __init__(self, origin, mode):
        self.origin, self.mode, self.thread, self.nodes, self.ended = origin, mode, threading.get_ident(), [], False
        self.after = {origin: frozenset()}   # a stream of the capture -> the work nodes its next work depends on
        self.edges = {}                      # a work node -> the work nodes it depends on

    @property
    def streams(self):
        return list(self.after)

    def work(self, stream, work):
        self.edges[len(self.nodes)], self.after[stream] = self.after[stream], frozenset([len(self.nodes)])
        self.nodes.append(("work", stream, work))

    def record(self, stream):
        """(index of the record, the work nodes it stands for)."""
        self.nodes.append(("record", stream, None))
        return len(self.nodes) - 1, self.after[stream]

    def wait(self, stream, record, before):
        self.after[stream] = self.after.get(stream, frozenset()) | before
        self.nodes.append(("wait", stream, record))

    def unjoined(self):
        """The streams with work that the origin stream's last work does not depend on, directly or
        through other work: CUDA's end of capture requires every fork joined back into the origin."""
        reached, todo = set(), list(self.after[self.origin])
        while todo:
            node = todo.pop()
            if node not in reached:
                reached.add(node)
                todo.extend(self.edges[node])
        return list(dict.fromkeys(stream for i, (kind, stream, _) in enumerate(self.nodes)
                                  if kind == "work" and i not in reached))


def enqueue(stream, work):
    """Queue ``work`` (a timeline.Work) on ``stream``: run it now, its accesses checked against the
    other streams', or, when the stream is capturing, record it for the graph's replays."""
    if stream._capture is not None:
        stream._capture.work(stream, work)
        return
    _refuse_legacy_during_capture(stream, work.label)
    timeline.perform(stream.key(), work)


def _capturing(device):
    return [s for s in list(_streams.values()) if s._capture is not None and s.device() == device]


def _refuse_legacy_during_capture(stream, call):
    if stream.ptr == 0:
        blocking = [s for s in _capturing(stream.device()) if not s.non_blocking]
        if blocking:
            raise CUDARuntimeError("cudaErrorStreamCaptureImplicit",
                                   f"{call} on the legacy null stream while blocking stream {blocking[0].ptr:#x} of "
                                   f"device {stream.device()} captures (the null stream would wait for it)")


def refuse_during_capture(call, stream):
    """Refuse ``call`` (a copy to the host, or from host memory, on ``stream``) on a capturing stream:
    CUDA refuses such copies there, and the values a capture would read are not computed yet (the
    captured work runs only when the graph is launched). On another stream it is refused only where
    the capture's mode forbids calls that are unsafe during a capture, a synchronous copy among
    them: a capture begun in global mode, on any host thread, or in thread-local mode on this one;
    CuPy's default, relaxed, allows them."""
    if stream._capture is not None:
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                               f"{call} during a stream capture (stream {stream.ptr:#x} of device {stream.device()} "
                               f"is capturing): nothing captured has run yet, and CUDA allows no copy between "
                               f"host and device there")
    for other in list(_streams.values()):
        capture = other._capture
        if capture is not None and capture.origin is other and (
                capture.mode == runtime.streamCaptureModeGlobal or
                capture.mode == runtime.streamCaptureModeThreadLocal and capture.thread == threading.get_ident()):
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                   f"{call} while stream {other.ptr:#x} of device {other.device()} captures in "
                                   f"{_MODES[capture.mode]}, which forbids calls that are unsafe during a capture, "
                                   f"such as a synchronous copy (CuPy's default mode, relaxed, allows them)")


_replaying = threading.local()


def replaying():
    """Whether the work running now is a graph's replay (NCCL's calls must be alike on every rank)."""
    return getattr(_replaying, "graph", False)


class Graph:
    """cupy.cuda.Graph: the work of a capture, replayed by each launch() on the stream given (or
    the current one), each stream that joined the capture on a branch of its own."""
    _ids = itertools.count(1)

    def __init__(self, nodes, origin):
        self._nodes, self._origin, self._device = nodes, origin, origin.device()
        self._id = next(Graph._ids)
        self._branches = {}   # a joined stream -> its branch's timeline key, the same for every replay
        self._finished = None   # timeline's clock of the end of its last launch, which the next one follows

    def _branch(self, stream):
        if stream not in self._branches:
            key = (self._device, ("graph", self._id, len(self._branches)))
            timeline.stream(key, "graph", lambda: f"the branch of CUDA graph {self._id} captured from stream "
                                                  f"{stream.ptr:#x} of device {self._device}")
            self._branches[stream] = key
        return self._branches[stream]

    def launch(self, stream=None):
        stream = get_current_stream() if stream is None else stream
        if stream.device() != self._device or getDevice() != self._device:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle",
                                   f"Graph.launch: a graph of device {self._device} on stream {stream.ptr:#x} of "
                                   f"device {stream.device()} while device {getDevice()} is current")
        if stream._capture is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "simulated GPUs: a graph launched into a "
                                                                         "stream capture is not simulated")
        _refuse_legacy_during_capture(stream, f"the launch of CUDA graph {self._id}")
        key = stream.key()
        lanes = {self._origin: key}
        marks = {}
        timeline.wait(key, self._finished)   # CUDA orders the launches of a graph, on any streams
        timeline.perform(key, timeline.Work(f"the launch of CUDA graph {self._id}", [], None))
        _replaying.graph = True
        try:
            for index, (kind, source, item) in enumerate(self._nodes):
                lane = lanes.get(source) or lanes.setdefault(source, self._branch(source))
                if kind == "work":
                    timeline.perform(lane, item)
                elif kind == "record":
                    marks[index] = timeline.snapshot(lane)
                else:
                    timeline.wait(lane, marks[item])
        finally:
            _replaying.graph = False
            timeline.join(key, lanes.values())   # the stream's later work follows the whole graph
            self._finished = timeline.snapshot(key)

    def upload(self, stream=None):
        pass


class MemoryPool:
    """cupy.cuda.MemoryPool: while ``using_allocator(pool.malloc)`` is in effect, new arrays belong
    to the pool, which keeps their memory until it goes itself (a graph keeps its capture's pool);
    the default pool (``get_default_memory_pool``) is the device memory every other array comes from."""

    def __init__(self, allocator=None):
        self._blocks = []   # the raw memory of the arrays made from it

    def malloc(self, size):
        raise NotImplementedError("simulated GPUs: arrays are made by the array functions, which put them in "
                                  "the pool of using_allocator; malloc itself is not simulated")

    def used_bytes(self):
        return timeline.pool_bytes(getDevice())[0] if self is _DEFAULT_POOL else sum(b.nbytes for b in self._blocks)

    def free_bytes(self):
        return timeline.pool_bytes(getDevice())[1] if self is _DEFAULT_POOL else 0

    def total_bytes(self):
        return self.used_bytes() + self.free_bytes()

    def free_all_blocks(self, stream=None):
        """The current device's free blocks go back (of every stream: ``stream`` is not simulated)."""
        if self is _DEFAULT_POOL:
            timeline.release_free(getDevice())


_DEFAULT_POOL = MemoryPool()


def get_default_memory_pool():
    """cupy.get_default_memory_pool()."""
    return _DEFAULT_POOL


@contextlib.contextmanager
def using_allocator(allocator=None):
    state = _state()
    previous = getattr(state, "allocator", None)
    state.allocator = allocator
    try:
        yield
    finally:
        state.allocator = previous


def current_pool():
    """The MemoryPool whose malloc ``using_allocator`` made the allocator of this thread, or None."""
    owner = getattr(getattr(_state(), "allocator", None), "__self__", None)
    return owner if isinstance(owner, MemoryPool) else None
