"""Happens-before on the simulated GPUs: which work of which stream touches which bytes, and in what order.

Device memory is raw bytes (``register``: one uint8 NumPy array per allocation; arrays are typed
views of it), and every piece of work queued on a stream (``Work``: a kernel, an array operation,
an NCCL call, a copy to the host) names the elements it reads and writes (a ``Span``: a view's
bytes, or, for a strided view, only those of its elements): a kernel's pointer arguments (those
to const are read, the others may be written), an operation's operands, NCCL's buffers. Each
stream's work is ordered; an event recorded on one stream and waited on by another, or a
synchronize by the host, orders two streams (a vector clock per stream, one entry for each
stream; the host keeps one per thread, of what it has waited for, and a thread starts with what
the thread that started it knew and, once joined, hands what it knew to the thread that joined
it, as Python's start and join order them); the legacy null stream and the blocking streams of a
device wait for each other, as CUDA's do. The bytes of each allocation remember who touched them,
and a write by one stream to elements that another stream reads or writes, or a read of elements
that another stream writes, with nothing ordering the two, is refused (``UnorderedAccess``)
naming both pieces of work, their streams and the array. Two reads need no order.

Work is complete when the host has waited for it (``complete``): a query (``query``) of work the
host has not waited for answers False the first time it is asked, since a GPU may not have run
it yet, and True when asked again about the same work, after which the host counts it as waited
for; so a query taken for a wait leaves its work unordered, and a loop that polls ends.

Freeing memory is the same question, asked when the memory is used again: CuPy's pool keeps the
freed block in the free list of the stream that allocated it, and hands it, whole or split, to
that stream's next allocation that it fits best (``register``; memory.pyx's per-stream arenas,
in 512-byte units). The block's records go with it, so that the new array's first work must be
ordered after what other streams did to the old one; a block nothing reuses needs no order.
Memory of a capture's pool is freed with the pool, by a synchronous cudaFree, and needs no order.

A ``Span`` holds its memory weakly: a CUDA graph holds addresses, not arrays, and a replay that
reaches memory freed since the capture fails (``FreedMemory``) naming the work and the array.
"""
import bisect
import itertools
import math
import threading
import weakref

import numpy as np

_lock = threading.RLock()
_clocks = {}      # stream key -> vector clock {stream key: tick}: the work each stream's next work follows
_kinds = {}       # stream key -> "legacy", "blocking", "non-blocking" or "graph" (a replay's side branch)
_names = {}       # stream key -> how an error names it
_registry = {}    # id of an allocation's raw bytes -> Allocation
_free = {}        # stream key -> [(size, order, records, the Allocation freed)] by size: its arena in CuPy's pool
# among free blocks of one size CuPy's choice depends on where its bookkeeping lies in host memory;
# here the last freed is taken first (its order, negative, sorts it first): the block just freed
# is the one whose hazard a free followed by an allocation meets
_freeing = itertools.count()
_asked = {}       # what a query answered False about: what was queried -> the clock of the work it asked about
UNIT = 512        # CuPy's pool rounds each allocation up to a multiple of this (memory.pyx's ALLOCATION_UNIT_SIZE)


class UnorderedAccess(RuntimeError):
    """Two streams touch the same bytes, one of them writing, with nothing ordering them."""


class FreedMemory(RuntimeError):
    """A graph's replay reaches memory freed since its capture."""


# ---- host threads --------------------------------------------------------------------------------

def _host():
    """What the current host thread has waited for: kept on its Thread object, where start and join
    hand it on."""
    thread = threading.current_thread()
    host = thread.__dict__.get("_simulated_host")
    if host is None:
        host = thread._simulated_host = {}
    return host


_start, _join = threading.Thread.start, threading.Thread.join


def _started(thread):
    """Thread.start: the new thread knows what the thread that starts it has waited for."""
    thread._simulated_host = dict(_host())
    _start(thread)


def _joined(thread, timeout=None):
    """Thread.join: once the thread has ended, the joining thread knows what it waited for."""
    _join(thread, timeout)
    if not thread.is_alive():
        host_waits(clock=thread.__dict__.get("_simulated_host"))


# host threads order each other by start and join alone here: a lock, queue or event between them
# is not seen, and work queued after one is checked as if nothing ordered it
threading.Thread.start, threading.Thread.join = _started, _joined


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


def _merge(into, other):
    for key, tick in other.items():
        if into.get(key, 0) < tick:
            into[key] = tick


def _covers(clock, other):
    """Whether ``clock`` follows all the work of ``other``."""
    return all(clock.get(key, 0) >= tick for key, tick in other.items())


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
    """What an event recorded on stream ``key`` now stands for: the stream's work so far, and what
    that work waits for implicitly (a record is work of the stream: its later work follows it too)."""
    with _lock:
        return dict(_follows(key, _clocks.setdefault(key, {})))


def work_of(key):
    """The clock of stream ``key``'s work so far: what a synchronize of it waits for (not the work
    of other streams that its next work would wait for implicitly)."""
    with _lock:
        return dict(_clocks.get(key, {}))


def wait(key, clock):
    """Stream ``key``'s later work follows ``clock`` (an event's snapshot)."""
    with _lock:
        _merge(_clocks.setdefault(key, {}), clock or {})


def host_waits(*keys, clock=None):
    """The host has waited for the streams ``keys`` (a synchronize), or for an event's ``clock``."""
    with _lock:
        host = _host()
        for key in keys:
            _merge(host, work_of(key))
        _merge(host, clock or {})


def complete(clock):
    """Whether the work of ``clock`` is complete: the host thread has waited for it."""
    with _lock:
        return _covers(_host(), clock or {})


def query(what, clock):
    """A query (Stream.done, Event.done) of the work of ``clock``, ``what`` naming what is queried: a
    GPU may not have run work the host has not waited for, so the first query of it answers False
    and orders nothing; asked again about no more work than then, it answers True, and the host
    counts the work as waited for (a loop that polls ends; a query taken for a wait is a race)."""
    with _lock:
        if complete(clock):
            return True
        asked = _asked.get(what)
        if asked is None or not _covers(asked, clock):
            _asked[what] = clock
            return False
        del _asked[what]
        host_waits(clock=clock)
        return True


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
    array it was made for, its size in CuPy's pool (0: not the pool's), and who touched which of its
    bytes: records (lo, hi, writes, stream key, tick, label, geometry), none dominated by a later
    one; ``geometry`` (offset, shape, strides, dtype) names the elements of a strided view, None
    every byte from lo to hi."""
    __slots__ = ("raw", "identity", "_address", "size", "nbytes", "device", "key", "shape", "dtype", "records")

    def __init__(self, raw, device, key, shape, dtype, size):
        self.raw, self.identity, self._address, self.nbytes = weakref.ref(raw, self._freed), id(raw), None, raw.nbytes
        self.device, self.key, self.shape, self.dtype, self.size = device, key, shape, dtype, size
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
    ``shape`` and ``dtype`` (which errors name), from CuPy's pool: the block it is given, if a freed
    one, brings its records; ``pooled``: it belongs to a capture's pool instead (freed synchronously)."""
    size = 0 if pooled else -(-math.prod(shape) * np.dtype(dtype).itemsize // UNIT) * UNIT
    allocation = Allocation(raw, device, key, shape, dtype, size)
    if size:
        with _lock:
            allocation.records = _reuse(key, size)
    _registry[allocation.identity] = allocation
    return allocation


def _reuse(key, size):
    """The records of the block that CuPy's pool gives an allocation of ``size`` bytes on stream
    ``key``: the smallest freed block of its arena that holds it, split if larger (the rest stays
    free); none if no block fits (new memory)."""
    blocks = _free.get(key)
    index = bisect.bisect_left(blocks, (size,)) if blocks else 0
    if not blocks or index == len(blocks):
        return []
    block, order, records, freed = blocks.pop(index)
    if block > size:
        bisect.insort(blocks, (block - size, order, _piece(records, size, block), freed))
    since = f"in {freed.label}, freed before CuPy's pool gave its memory to this array"
    return [(*record[:5], f"{record[5]} ({since})", record[6]) for record in _piece(records, 0, size)]


def _piece(records, start, end):
    """``records`` of the bytes from ``start`` to ``end`` of a block, as records of a block of those
    bytes alone (a strided record that the cut divides keeps its whole byte range)."""
    piece = []
    for lo, hi, writes, key, tick, label, geometry in records:
        if start < hi and lo < end:
            if geometry is not None:
                offset, shape, strides, dtype = geometry
                geometry = (offset - start, shape, strides, dtype) if start <= lo and hi <= end else None
            piece.append((max(lo, start) - start, min(hi, end) - start, writes, key, tick, label, geometry))
    return piece


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
    """The elements of one NumPy view of device memory, holding the memory weakly: the bytes from
    ``lo`` to ``hi``, all of them unless ``geometry`` names those of a strided view's elements;
    ``view()`` makes the view again, or None once the memory is freed."""
    __slots__ = ("allocation", "offset", "shape", "strides", "dtype", "lo", "hi", "geometry")

    def __init__(self, array):
        self.allocation = allocation_of(array)
        self.offset = array.__array_interface__["data"][0] - self.allocation.address
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype
        self.geometry = None
        if array.size == 0:
            self.lo = self.hi = self.offset
        else:
            reach = [(n - 1) * s for n, s in zip(array.shape, array.strides)]
            self.lo = self.offset + sum(r for r in reach if r < 0)
            self.hi = self.offset + sum(r for r in reach if r > 0) + array.itemsize
            if self.hi - self.lo != array.nbytes:   # gaps between its elements
                self.geometry = (self.offset, array.shape, array.strides, array.dtype)

    def view(self):
        raw = self.allocation.raw()
        if raw is None:
            return None
        return np.ndarray(self.shape, self.dtype, buffer=raw, offset=self.offset, strides=self.strides)


def _elements(raw, lo, hi, geometry):
    """A NumPy view of the elements a record or span names, in the allocation's ``raw`` bytes."""
    if geometry is None:
        return raw[lo:hi]
    offset, shape, strides, dtype = geometry
    return np.ndarray(shape, dtype, buffer=raw, offset=offset, strides=strides)


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
    allocation, lo, hi, geometry = span.allocation, span.lo, span.hi, span.geometry
    if lo == hi:
        return
    kept = []
    for record in allocation.records:
        r_lo, r_hi, r_writes, r_key, r_tick, r_label, r_geometry = record
        if r_hi <= lo or hi <= r_lo:
            kept.append(record)
        elif not (r_key == key or clock.get(r_key, 0) >= r_tick):   # unordered
            raw = allocation.raw()
            if (writes or r_writes) and (geometry is None and r_geometry is None or np.shares_memory(
                    _elements(raw, lo, hi, geometry), _elements(raw, r_lo, r_hi, r_geometry))):
                raise UnorderedAccess(
                    f"simulated GPUs: a race on device {key[0]}: {label} on {describe(key)} "
                    f"{'writes' if writes else 'reads'} bytes {lo}-{hi} of {allocation.label}, which {r_label} on "
                    f"{describe(r_key)} {'wrote' if r_writes else 'read'}, and no event wait or synchronize orders "
                    f"the two (on a GPU they may run at the same time)")
            kept.append(record)
        # what any later work must be ordered after, this record implies: keep one of the two
        elif not (lo <= r_lo and r_hi <= hi and geometry in (None, r_geometry) and (writes or not r_writes)):
            kept.append(record)
    kept.append((lo, hi, writes, key, clock[key], label, geometry))
    allocation.records = kept


def pool_bytes(device):
    """(used, free) bytes of CuPy's pool on ``device``: its blocks in use, and those its free lists keep."""
    with _lock:
        used = sum(a.size for a in _registry.values() if a.device == device)
        free = sum(block[0] for key, blocks in _free.items() if key[0] == device for block in blocks)
    return used, free


def release_free(device):
    """CuPy's pool gives the free blocks of ``device`` back (free_all_blocks: a synchronous cudaFree), with
    what was done to them: no later allocation inherits it."""
    with _lock:
        for key in [key for key in _free if key[0] == device]:
            del _free[key]


def _freed(allocation):
    """An allocation's last array is gone: CuPy's pool keeps its block in the free list of the stream
    that allocated it, with what was done to it, for that stream's next allocations (register)."""
    with _lock:
        if _registry.get(allocation.identity) is allocation:
            del _registry[allocation.identity]
        if allocation.size:
            block = (allocation.size, -next(_freeing), allocation.records, allocation)
            bisect.insort(_free.setdefault(allocation.key, []), block)
