"""Happens-before on the simulated GPUs: which work of which stream touches which bytes, and in what order.

Device memory is raw bytes (``register``: one uint8 NumPy array per allocation; arrays are typed
views of it), and every piece of work queued on a stream (``Work``: a kernel, an array operation,
an NCCL call, a copy to the host) names the bytes it reads and writes: a kernel's pointer
arguments (those to const are read, the others may be written), an operation's operands, NCCL's
buffers. Each stream's work is ordered; an event recorded on one stream and waited on by another,
or a synchronize by the host, orders two streams (a vector clock per stream, one entry for each
stream; the host keeps one per thread, of what it has waited for); the legacy null stream and
the blocking streams of a device wait for each other, as CUDA's do. The bytes of each allocation
remember who touched them, and a write by one stream to bytes that another stream reads or
writes, or a read of bytes that another stream writes, with nothing ordering the two, is refused
(``UnorderedAccess``) naming both pieces of work, their streams and the array. Two reads need no
order.

Freeing memory is the same question: CuPy's pool hands freed memory out again to the next
allocation on the stream that allocated it, so what other streams did to it must be ordered
before that stream's next work. Memory is freed when its last array goes (a finaliser, which may
run anywhere), so an unordered free is reported by the device's next operation
(``raise_pending``), as a GPU reports a fault at a later call. Memory of a capture's pool is
freed with the pool, by a synchronous cudaFree, and needs no order.

A ``Span`` holds its memory weakly: a CUDA graph holds addresses, not arrays, and a replay that
reaches memory freed since the capture fails (``FreedMemory``) naming the work and the array.
"""
import collections
import threading
import weakref

import numpy as np

_lock = threading.RLock()
_local = threading.local()
_clocks = {}      # stream key -> vector clock {stream key: tick}: the work each stream's next work follows
_kinds = {}       # stream key -> "legacy", "blocking", "non-blocking" or "graph" (a replay's side branch)
_names = {}       # stream key -> how an error names it
_registry = {}    # id of an allocation's raw bytes -> Allocation
_pending = collections.defaultdict(list)   # device -> errors found when memory was freed


class UnorderedAccess(RuntimeError):
    """Two streams touch the same bytes, one of them writing, with nothing ordering them."""


class FreedMemory(RuntimeError):
    """A graph's replay reaches memory freed since its capture."""


# ---- streams -------------------------------------------------------------------------------------

def stream(key, kind, name):
    """Make a stream known: ``key`` is (device, anything hashable); ``kind`` says whom it waits for
    implicitly (CUDA's legacy null stream and its blocking streams wait for each other); ``name()``
    names it in errors."""
    if key not in _kinds:
        with _lock:
            _names.setdefault(key, name())
            _kinds.setdefault(key, kind)


def describe(key):
    return _names.get(key, repr(key))


def _host():
    if not hasattr(_local, "host"):
        _local.host = {}
    return _local.host


def _merge(into, other):
    for key, tick in other.items():
        if into.get(key, 0) < tick:
            into[key] = tick


def _follows(key, clock):
    """Merge into ``clock`` what the next work on stream ``key`` waits for implicitly: what the host
    has waited for (the host queues it), and for the legacy null stream and a blocking stream, each
    other's work so far."""
    kind = _kinds.get(key)
    if kind != "graph":   # a replay's branch follows only the graph's own order
        _merge(clock, _host())
    if kind == "legacy":
        for other, other_kind in _kinds.items():
            if other_kind == "blocking" and other[0] == key[0]:
                _merge(clock, _clocks.get(other, {}))
    elif kind == "blocking":
        _merge(clock, _clocks.get((key[0], 0), {}))
    return clock


def _advance(key):
    """The clock of the next work on stream ``key``."""
    clock = _follows(key, _clocks.setdefault(key, {}))
    clock[key] = clock.get(key, 0) + 1
    return clock


def snapshot(key):
    """What an event recorded on stream ``key`` now stands for: the stream's work so far."""
    with _lock:
        return _follows(key, dict(_clocks.get(key, {})))


def wait(key, clock):
    """Stream ``key``'s later work follows ``clock`` (an event's snapshot)."""
    with _lock:
        _merge(_clocks.setdefault(key, {}), clock or {})


def host_waits(*keys, clock=None):
    """The host has waited for the streams ``keys`` (a synchronize), or for an event's ``clock``."""
    with _lock:
        host = _host()
        for key in keys:
            _merge(host, _clocks.get(key, {}))
        _merge(host, clock or {})


def keys_of(device):
    with _lock:
        return [key for key, kind in _kinds.items() if key[0] == device and kind != "graph"]


def join(key, others):
    """Stream ``key``'s later work follows everything of ``others`` (the end of a graph's replay)."""
    with _lock:
        clock = _clocks.setdefault(key, {})
        for other in others:
            _merge(clock, _clocks.get(other, {}))


# ---- memory --------------------------------------------------------------------------------------

class Allocation:
    """One allocation's raw bytes (held weakly: ``_freed`` runs when they go), where it was made, the
    array it was made for, and who touched which of its bytes: records (lo, hi, writes, stream key,
    tick, label), none dominated by a later one."""
    __slots__ = ("raw", "identity", "_address", "nbytes", "device", "key", "shape", "dtype", "pooled", "records")

    def __init__(self, raw, device, key, shape, dtype, pooled):
        self.raw, self.identity, self._address, self.nbytes = weakref.ref(raw, self._freed), id(raw), None, raw.nbytes
        self.device, self.key, self.shape, self.dtype, self.pooled = device, key, shape, dtype, pooled
        self.records = []

    @property
    def address(self):
        """Where the raw bytes start (looked up when first needed: most arrays never need it)."""
        if self._address is None:
            raw = self.raw()
            self._address = -1 if raw is None else raw.__array_interface__["data"][0]
        return self._address

    @property
    def label(self):
        return f"an array of shape {self.shape} {self.dtype} on device {self.device}"

    def _freed(self, _):
        _freed(self)


def register(raw, device, key, shape, dtype, pooled=False):
    """Make ``raw`` (a new uint8 array) an allocation of ``device`` on stream ``key``, for an array of
    ``shape`` and ``dtype`` (which errors name); ``pooled``: it belongs to a capture's pool (freed
    synchronously)."""
    allocation = Allocation(raw, device, key, shape, dtype, pooled)
    _registry[allocation.identity] = allocation
    return allocation


def allocation_of(array):
    """The Allocation a NumPy view of device memory lies in."""
    owner = array
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    allocation = _registry.get(id(owner))
    if allocation is None or allocation.raw() is not owner:
        raise ValueError("simulated GPUs: an array that is not in device memory")
    return allocation


def allocation_at(pointer, nbytes):
    """(Allocation, offset) of the ``nbytes`` at a raw ``pointer``, or None."""
    with _lock:
        for allocation in list(_registry.values()):
            if allocation.address <= pointer and pointer + nbytes <= allocation.address + allocation.nbytes:
                return allocation, pointer - allocation.address
    return None


class Span:
    """The bytes of one NumPy view of device memory, holding the memory weakly; ``view()`` makes the
    view again, or None once the memory is freed."""
    __slots__ = ("allocation", "offset", "shape", "strides", "dtype", "lo", "hi")

    def __init__(self, array):
        self.allocation = allocation_of(array)
        self.offset = array.__array_interface__["data"][0] - self.allocation.address
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype
        if array.size == 0:
            self.lo = self.hi = self.offset
        else:
            reach = [(n - 1) * s for n, s in zip(array.shape, array.strides)]
            self.lo = self.offset + sum(r for r in reach if r < 0)
            self.hi = self.offset + sum(r for r in reach if r > 0) + array.itemsize

    def view(self):
        raw = self.allocation.raw()
        if raw is None:
            return None
        return np.ndarray(self.shape, self.dtype, buffer=raw, offset=self.offset, strides=self.strides)


class Work:
    """One piece of work for a stream: ``run(views)`` is given a NumPy view of each operand, in
    order; ``operands``: [(Span, writes, what)], ``what`` naming the operand in errors (a kernel's
    parameter, an NCCL buffer). ``run`` holds no array itself: a capture keeps the work, and a
    graph must not keep its memory alive."""
    __slots__ = ("label", "operands", "run")

    def __init__(self, label, operands, run):
        self.label, self.operands, self.run = label, operands, run


def perform(key, work):
    """Check ``work``'s accesses on stream ``key`` against every other stream's, record them, and run it."""
    raise_pending(key[0])
    with _lock:
        clock = _advance(key)
        views = []
        for span, writes, what in work.operands:
            view = span.view()
            if view is None:
                raise FreedMemory(f"{work.label} ({what}) reaches {span.allocation.label}, freed since the CUDA "
                                  f"graph was captured: a graph holds addresses, not arrays, and a replay writes "
                                  f"and reads memory that another allocation may now hold; keep what a graph "
                                  f"uses alive while the graph lives")
            _touch(span, writes, key, clock, f"{work.label} ({what})")
            views.append(view)
    if work.run is not None:
        work.run(views)


def _touch(span, writes, key, clock, label):
    allocation, lo, hi = span.allocation, span.lo, span.hi
    if lo == hi:
        return
    kept = []
    for record in allocation.records:
        r_lo, r_hi, r_writes, r_key, r_tick, r_label = record
        if r_hi <= lo or hi <= r_lo:
            kept.append(record)
            continue
        ordered = r_key == key or clock.get(r_key, 0) >= r_tick
        if not ordered and (writes or r_writes):
            raise UnorderedAccess(
                f"simulated GPUs: a race on device {key[0]}: {label} on {describe(key)} "
                f"{'writes' if writes else 'reads'} bytes {lo}-{hi} of {allocation.label}, which {r_label} on "
                f"{describe(r_key)} {'wrote' if r_writes else 'read'}, and no event wait or synchronize orders "
                f"the two (on a GPU they may run at the same time)")
        # what any later work must be ordered after, this record implies: keep one of the two
        if not (ordered and lo <= r_lo and r_hi <= hi and (writes or not r_writes)):
            kept.append(record)
    kept.append((lo, hi, writes, key, clock[key], label))
    allocation.records = kept


def _freed(allocation):
    """An allocation's last array is gone: what other streams did to it must be ordered before its
    own stream's next work, which may be given the memory."""
    with _lock:
        if _registry.get(allocation.identity) is allocation:
            del _registry[allocation.identity]
        if allocation.pooled or not allocation.records:
            return
        position = _follows(allocation.key, dict(_clocks.get(allocation.key, {})))
        for lo, hi, writes, key, tick, label in allocation.records:
            if key != allocation.key and position.get(key, 0) < tick:
                _pending[allocation.device].append(UnorderedAccess(
                    f"simulated GPUs: a race on device {allocation.device}: {allocation.label} was freed while "
                    f"{label} on {describe(key)}, which {'writes' if writes else 'reads'} bytes {lo}-{hi} of it, was "
                    f"not ordered before {describe(allocation.key)}, whose next allocation may be given the memory "
                    f"(wait on an event recorded after that work, or synchronize, before the last array goes)"))
                return


def raise_pending(device):
    """Raise the first error found when memory of ``device`` was freed, if any."""
    if _pending.get(device):
        errors = _pending.pop(device)
        raise errors[0]
