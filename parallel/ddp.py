"""Data parallelism as PyTorch DDP does it: replicate, scatter, all-reduce in buckets.

- Replicate: the flat parameter buffer, the floating buffers (batch-norm statistics)
  and any optimizer state given are broadcast from rank 0 at the start, then a checksum
  of the parameters is compared across ranks (``check_in_sync``; the trainer repeats it
  every ``--check-sync`` steps).
- Scatter: every rank draws the same global batch (one seeded permutation per epoch)
  and takes its own contiguous shard of it; shards differ by at most one image when the
  batch does not divide by the world size. A batch with fewer images than ranks (only a
  last, short one can be) is skipped by every rank: at most world_size - 1 images an epoch.
- All-reduce: the gradients are made global before they leave backward. ``backward``
  scales the loss gradient by this shard's share of the batch (local / global images),
  so that every rank's gradients are its share of the whole batch's mean-loss gradient
  and their sum is that gradient exactly, shard sizes equal or not. The sum is taken in
  buckets: slices of the flat gradient buffer holding whole parameters, filled in reverse
  registration order (the order backward finishes them) until each holds ``bucket_mb``.
  A parameter's gradient-final hook counts down its bucket; a bucket is all-reduced as
  soon as it is complete and every bucket before it has been, so every rank reduces the
  same slices in the same order; on GPUs it runs on the communicator's stream while
  backward goes on, and the optimizer step waits for the last one. Then every rank
  applies the same optimizer step.
- Batch norm: per-replica statistics by default; ``average_buffers()`` makes the running
  statistics the mean over ranks (the trainer calls it before every evaluation and
  checkpoint). ``sync_bn=True`` normalises over the whole batch instead (see
  nn.functional.synchronised_batch_norm), with this object as the group.
"""
import contextlib
import functools
import zlib

import numpy as np

from kernels import get_array_module
from nn.hooks import HookHandle
from nn.modules import synchronise_batch_norm
from . import launch

DEFAULT_BUCKET_MB = 25.0
_all_reduce_hooks = []


def register_all_reduce_hook(fn):
    """Call ``fn(name, stream)`` for each gradient bucket's all-reduce; it returns a context manager
    that is entered while the all-reduce is queued (``stream``: the CUDA stream it runs on, beside
    the backward; None when it blocks). The profiler subscribes to time the buckets. Returns a
    handle whose ``remove()`` unsubscribes."""
    return HookHandle(_all_reduce_hooks, fn)


class OutOfSync(RuntimeError):
    """The replicas' parameters differ."""


def shard_bounds(n, world_size, rank):
    """(lo, hi) of rank's contiguous share of ``n`` items: the first n % world_size ranks
    take one more than the others."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def plan_buckets(sizes, itemsize, bucket_bytes):
    """Buckets of parameter indices for parameters of ``sizes`` elements, in reverse
    registration order: a bucket closes once it holds at least ``bucket_bytes``, so it
    may exceed that by most of one parameter, and a parameter is never split."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        filled += sizes[i] * itemsize
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Bucket:
    def __init__(self, index, params, lo, hi, itemsize):
        self.index, self.params, self.lo, self.hi = index, params, lo, hi
        self.nbytes = (hi - lo) * itemsize
        self.pending = len(params)


class DataParallel:
    """One rank's replica of ``model`` in the world of ``comm`` (see the module's docstring)."""

    def __init__(self, model, comm, bucket_mb=DEFAULT_BUCKET_MB, sync_bn=False, state=()):
        """``state``: more arrays that must start equal on every rank (momentum buffers)."""
        self.model, self.comm = model, comm
        self.flat = model.flat_parameters()
        self.buffers = [b for _, b in model.named_buffers() if b.dtype.kind == "f"]
        self.rank, self.world_size = comm.rank, comm.world_size
        self.broadcast_state(state)
        self.check_in_sync("after the broadcast from rank 0")
        self._build_buckets(bucket_mb)
        self.batch_size = self.local_size = None
        self._shares = {}
        self.reduced = []  # (lo, hi) of each bucket in the order reduced, this step
        self._next = len(self.buckets)  # a backward outside self.backward reduces nothing
        if sync_bn:
            synchronise_batch_norm(model, self)

    # ---- replicate ----------------------------------------------------------------------

    def broadcast_state(self, state=()):
        """Rank 0's parameters, floating buffers and ``state`` on every rank. Only the float32 parameters
        travel: the flat buffer's rounded copy of the weights (bf16's and tf32's) is marked stale and remade
        from them when next read."""
        with self.flat.writing() as params:
            for array in [params, *self.buffers, *(s for s in state if s is not None)]:
                self.comm.broadcast(array, root=0)

    def check_in_sync(self, when):
        """OutOfSync on every rank, naming the ranks that differ from rank 0, when a
        checksum of the parameters is not the same everywhere."""
        data = self.flat.data
        host = data if isinstance(data, np.ndarray) else data.get()
        sums = self.comm.all_gather_scalar(zlib.crc32(host.view(np.uint8)))
        differ = [r for r, s in enumerate(sums) if s != sums[0]]
        if differ:
            raise OutOfSync(f"parameters differ across ranks {when}: rank(s) {differ} disagree with "
                            f"rank 0 (CRC-32 {[int(s) for s in sums]})")

    def average_buffers(self):
        """Running statistics: the mean over ranks, the same everywhere."""
        for b in self.buffers:
            self.comm.all_reduce(b, average=True)

    # ---- scatter --------------------------------------------------------------------------

    def scatter(self, batch):
        """This rank's shard of the global ``batch`` (indices), or None when the batch has
        fewer images than ranks and every rank skips it."""
        if len(batch) < self.world_size:
            return None
        lo, hi = shard_bounds(len(batch), self.world_size, self.rank)
        self.batch_size, self.local_size = len(batch), hi - lo
        return batch[lo:hi]

    def all_reduce(self, array):
        """The group interface of synchronised batch norm: add over ranks in place."""
        return self.comm.all_reduce(array)

    # ---- all-reduce -----------------------------------------------------------------------

    def _build_buckets(self, bucket_mb):
        params, offsets = self.flat.params, self.flat.offsets
        plan = plan_buckets([p.size for p in params], self.flat.data.itemsize, bucket_mb * 2 ** 20)
        self.buckets, self._bucket_of = [], {}
        for index, members in enumerate(plan):
            # reverse order: the slice runs from the last member's start to the first's end
            bucket = _Bucket(index, members, offsets[members[-1]], offsets[members[0] + 1], self.flat.data.itemsize)
            self.buckets.append(bucket)
            for i in members:
                self._bucket_of[id(params[i])] = bucket
                params[i].register_post_accumulate_grad_hook(self._grad_ready)

    def backward(self, loss):
        """loss.backward() for this shard's mean loss (after ``scatter``), with every
        bucket of gradients summed over ranks by the time it returns."""
        if self.batch_size is None:
            raise RuntimeError("DataParallel.backward before scatter: the shard sizes are unknown")
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self.reduced, self._next = [], 0
        loss.backward(self._share(loss.data))
        # parameters that took no part in this loss never fired their hook
        for bucket in self.buckets[self._next:]:
            bucket.pending = 0
        self._reduce_ready()
        self.comm.wait()  # the optimizer step comes after the last bucket's sum
        launch.heartbeat()

    def _share(self, loss):
        """This shard's share of the batch as the loss's gradient: a 0-d array of the loss's
        kind, made once per shard size (on a GPU, copying a new one from the host every
        step would wait for the step's kernels)."""
        key = (self.local_size, self.batch_size, loss.dtype)
        if key not in self._shares:
            self._shares[key] = get_array_module(loss).asarray(self.local_size / self.batch_size, dtype=loss.dtype)
        return self._shares[key]

    def _grad_ready(self, param):
        self._bucket_of[id(param)].pending -= 1
        self._reduce_ready()

    def _reduce_ready(self):
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            self.comm.start_all_reduce(self.flat.gradients(bucket.lo, bucket.hi), functools.partial(_observed, bucket))
            self.reduced.append((bucket.lo, bucket.hi))
            self._next += 1


@contextlib.contextmanager
def _observed(bucket, stream):
    """The all-reduce hooks around a bucket's all-reduce."""
    name = f"all-reduce bucket {bucket.index} ({bucket.nbytes / 2 ** 20:.1f} MB)"
    with contextlib.ExitStack() as hooks:
        for fn in list(_all_reduce_hooks):
            hooks.enter_context(fn(name, stream))
        yield
