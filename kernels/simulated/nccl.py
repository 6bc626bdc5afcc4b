"""``cupy.cuda.nccl`` of the simulated GPUs: the collectives between processes, with NCCL's semantics.

A unique id names a folder in the temporary directory; each collective call is numbered, and
every rank posts its part of call k there as a file (a JSON header, then the bytes of its
buffer), waits for the others' and computes the result itself, adding in rank order. What NCCL
refuses is refused with the call named: a buffer that is not on the communicator's device (the
device current when it was made), a stream of another device, two ranks on one GPU; and what
NCCL leaves undefined (a hang, or garbage) is an error here too: a call whose kind, count,
datatype, reduction or root differs between ranks, or that is replayed in a CUDA graph on some ranks
and eager on others (NCCL requires graph capture to be uniform over ranks). A call is work on its
stream (cuda.enqueue): a capture records it, and its buffers' accesses are ordered against other
streams' as a kernel's are, and an all-reduce's buffers must be the same (in place) or apart.
``abort()`` ends a wait for a peer that is gone; a call that waits for a rank that has left the
communicator (destroyed or aborted it, or ended) without making it fails after LEFT_TIMEOUT,
naming the call, where GPUs would hang.
A rank deletes its post of call k - 2 once it has read all of call k - 1 (every peer has read
it by then); the folder goes when the last rank's communicator is destroyed or its process exits.
"""
import json
import os
import secrets
import shutil
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from . import arrays, cuda, timeline

available = True
NCCL_INT8, NCCL_CHAR, NCCL_UINT8, NCCL_INT32, NCCL_INT, NCCL_UINT32 = 0, 0, 1, 2, 2, 3
NCCL_INT64, NCCL_UINT64, NCCL_FLOAT16, NCCL_HALF, NCCL_FLOAT32, NCCL_FLOAT = 4, 5, 6, 6, 7, 7
NCCL_FLOAT64, NCCL_DOUBLE = 8, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
           7: np.float32, 8: np.float64}
_REDUCTIONS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum, NCCL_AVG: np.add}
_ID_BYTES = 128
# how long a call waits for a rank that has left the communicator without making it, before it
# fails: long enough for the launcher, which names the rank that failed first, to stop the job
LEFT_TIMEOUT = 5.0
_PREFIX = b"simulated-nccl "


class NcclError(RuntimeError):
    """cupy.cuda.nccl.NcclError: ``status`` is NCCL's name of the error."""

    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status = status


def get_unique_id():
    return (_PREFIX + secrets.token_hex(16).encode()).ljust(_ID_BYTES, b"\0")


class NcclCommunicator:
    """One rank of a communicator of ``ndev`` ranks, on the current device."""

    def __init__(self, ndev, commId, rank, config=None):
        if len(commId) != _ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {_ID_BYTES}.")
        if not commId.startswith(_PREFIX):
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT", "not a unique id of the simulated NCCL")
        if not 0 <= rank < ndev:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT", f"rank {rank} is not a rank of {ndev}")
        cuda.Device().synchronize()  # the current device exists
        self._device, self._rank, self._size = cuda.getDevice(), rank, ndev
        self._folder = Path(tempfile.gettempdir()) / f"simulated-nccl-{commId[len(_PREFIX):].rstrip(bytes(1)).decode()}"
        self._folder.mkdir(exist_ok=True)
        self._calls, self._aborted = 0, False
        self._finalizer = weakref.finalize(self, _leave, self._folder, rank, ndev)
        gpus = [h["gpu"] for h, _ in self._collective("init", {}, local={"gpu": cuda.physical_devices()[self._device]})]
        for r, gpu in enumerate(gpus):
            if gpu in gpus[:r]:
                raise NcclError("NCCL_ERROR_INVALID_USAGE", f"Duplicate GPU detected: rank {gpus.index(gpu)} and "
                                                            f"rank {r} both on CUDA device {gpu}")

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        dtype = self._check("allReduce", datatype, stream, op=op)
        source = self._buffer(sendbuf, count, dtype, "allReduce sendbuf")
        target = self._buffer(recvbuf, count, dtype, "allReduce recvbuf")
        if sendbuf != recvbuf and np.shares_memory(source, target):
            raise NcclError("NCCL_ERROR_INVALID_USAGE",
                            f"allReduce: sendbuf {sendbuf:#x} and recvbuf {recvbuf:#x} of {count * dtype.itemsize} "
                            f"bytes overlap without being the same (in place, NCCL takes sendbuf == recvbuf; a "
                            f"partial overlap it does not check: on GPUs, garbage)")

        def run(views):
            source, target = views
            posts = self._collective("allReduce", {"count": count, "datatype": datatype, "op": op}, bytes(source))
            values = [np.frombuffer(payload, dtype) for _, payload in posts]
            result = values[0].copy()
            for value in values[1:]:
                result = _REDUCTIONS[op](result, value)
            if op == NCCL_AVG:
                result = (result / self._size if dtype.kind == "f" else result // self._size).astype(dtype)
            target[:] = result.view(np.uint8)
        cuda.enqueue(cuda.stream_of(stream, "NCCL allReduce"),   # a capture records it
                     timeline.Work(f"NCCL allReduce of rank {self._rank}",
                                   [(timeline.Span(source), False, "sendbuf"), (timeline.Span(target), True, "recvbuf")],
                                   run))

    def bcast(self, buff, count, datatype, root, stream):
        dtype = self._check("bcast", datatype, stream)
        if not 0 <= root < self._size:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT", f"bcast: root {root} is not a rank of {self._size}")
        target = self._buffer(buff, count, dtype, "bcast buff")

        def run(views):
            posts = self._collective("bcast", {"count": count, "datatype": datatype, "root": root},
                                     bytes(views[0]) if self._rank == root else b"")
            if self._rank != root:
                views[0][:] = np.frombuffer(posts[root][1], np.uint8)
        cuda.enqueue(cuda.stream_of(stream, "NCCL bcast"),
                     timeline.Work(f"NCCL bcast of rank {self._rank}",
                                   [(timeline.Span(target), self._rank != root, "buff")], run))

    def abort(self):
        self._aborted = True
        self._finalizer()  # as ncclCommAbort, it frees the communicator: this rank leaves the folder

    def destroy(self):
        self._finalizer()

    # ---- the checks NCCL makes ----------------------------------------------------------------
    def _check(self, call, datatype, stream, op=NCCL_SUM):
        if not self._finalizer.alive:
            raise NcclError("NCCL_ERROR_INVALID_USAGE", f"{call} on a communicator that was aborted or destroyed")
        if datatype not in _DTYPES or op not in _REDUCTIONS:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT", f"{call}: datatype {datatype} or reduction {op} unknown")
        owner = cuda.stream_of(stream, f"NCCL {call}").device()
        if owner != self._device:
            raise NcclError("NCCL_ERROR_UNHANDLED_CUDA_ERROR",
                            f"{call} on a stream of device {owner}; the communicator is on device {self._device}")
        return np.dtype(_DTYPES[datatype])

    def _buffer(self, pointer, count, dtype, what):
        device, view = arrays.memory_at(pointer, count * dtype.itemsize, f"NCCL {what}")
        if device != self._device:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT", f"{what} {pointer:#x} is on device {device}; the "
                                                           f"communicator (rank {self._rank}) is on device {self._device}")
        return view

    # ---- the exchange -------------------------------------------------------------------------
    def _collective(self, kind, header, payload=b"", local=None):
        """[(header, payload) of every rank] of the next call, after checking that every rank made
        the same call; ``local``: header entries that may differ between ranks."""
        call, self._calls = self._calls, self._calls + 1
        post = self._folder / f"{call}.{self._rank}"
        tmp = self._folder / f".{call}.{self._rank}.tmp"
        header = {"kind": kind, **header, "graph": cuda.replaying(), **(local or {})}
        tmp.write_bytes(json.dumps(header).encode() + b"\n" + payload)
        os.replace(tmp, post)
        (self._folder / f"{call - 2}.{self._rank}").unlink(missing_ok=True)
        posts = [self._wait(r, call, header) for r in range(self._size)]
        shared = [{k: v for k, v in h.items() if k not in (local or {})} for h, _ in posts]
        graphed = [r for r, s in enumerate(shared) if s["graph"]]
        if graphed and len(graphed) < self._size:
            raise NcclError("NCCL_ERROR_INVALID_USAGE",
                            f"call {call} ({_describe(shared[0])}) is replayed in a CUDA graph on rank(s) {graphed} "
                            f"and eager on the others: whether a collective is graph-captured must be the same on "
                            f"every rank (on GPUs, undefined: in practice a hang)")
        if any(s != shared[0] for s in shared):
            described = "; ".join(f"rank {r}: {_describe(s)}" for r, s in enumerate(shared))
            raise NcclError("NCCL_ERROR_INVALID_USAGE", f"call {call} differs between ranks ({described})")
        return posts

    def _wait(self, rank, call, header):
        """Rank ``rank``'s post of call ``call`` (this rank's ``header``), once it is there; an error if
        this rank is aborted meanwhile, or if ``rank`` left the communicator without posting it
        (destroyed or aborted it, or ended: its post would have come before its leaving) and
        LEFT_TIMEOUT has passed since this rank saw it gone."""
        post, left = self._folder / f"{call}.{rank}", self._folder / f"exit.{rank}"
        delay, seen_gone = 1e-4, None
        while True:
            gone = left.exists()
            try:
                head, _, payload = post.read_bytes().partition(b"\n")
                return json.loads(head), payload
            except FileNotFoundError:
                if self._aborted:
                    raise NcclError("NCCL_ERROR_REMOTE_ERROR",
                                    f"call {call} aborted while rank {self._rank} waited for its peers") from None
                if gone:
                    seen_gone = seen_gone or time.monotonic()
                    if time.monotonic() - seen_gone > LEFT_TIMEOUT:
                        raise NcclError("NCCL_ERROR_REMOTE_ERROR",
                                        f"call {call} ({_describe(header)}) of rank {self._rank} waited "
                                        f"{LEFT_TIMEOUT:g} s for rank {rank}, which left the communicator (destroyed "
                                        f"or aborted it, or ended) without making the call (on GPUs, a hang)") from None
                time.sleep(delay)
                delay = min(2 * delay, 0.01)


def _describe(header):
    header = dict(header)
    kind = header.pop("kind")
    header.pop("graph", None)
    dtype = np.dtype(_DTYPES[header.pop("datatype")]).name if "datatype" in header else None
    count = header.pop("count", None)
    return " ".join(filter(None, [kind, f"of {count} {dtype}" if count is not None else None,
                                  *(f"{k} {v}" for k, v in header.items())]))


def _leave(folder, rank, size):
    """This rank is done with the folder; the last one to leave removes it."""
    try:
        (folder / f"exit.{rank}").touch()
        if all((folder / f"exit.{r}").exists() for r in range(size)):
            shutil.rmtree(folder, ignore_errors=True)
    except OSError:
        pass
