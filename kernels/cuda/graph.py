"""A training step captured once and replayed: CUDA graphs on the GPU, a record of the launches on
the CPU emulator.

``capture(be, fn)`` runs ``fn()`` under capture and returns ``(graph, result)``; ``graph.launch()``
replays what ``fn`` launched, on the current stream. During the capture nothing runs: the kernels
are recorded, with their grids, blocks and arguments (pointers and scalars) as they were given,
so that a replay reads and writes the very arrays the capture saw. What changes from step to step
must therefore be in device memory that the caller refills before a replay (the batch's indices,
the learning rate), never a kernel argument, and host code inside ``fn`` must not read device
values (they are not computed yet).

- ``cuda``: CuPy's stream capture (``Stream.begin_capture`` / ``end_capture``, relaxed mode) on a
  non-blocking stream of its own, every allocation of ``fn`` from a memory pool of its own that
  the graph keeps for its life (a replay writes those arrays again, so no one else may get their
  memory); element-wise CuPy operations, copies and NCCL calls are captured too, and a side
  stream that waits on an event of the capturing stream joins the capture until the capturing
  stream waits on it in turn.
- ``emu``: the kernels launched through ``be.function`` are recorded instead of run, and a replay
  runs the record; NumPy operations are not recorded, so a step meant for a graph launches only
  kernels (tests/test_graph.py compares replays with eager steps bit for bit, which shows any
  that is not).

Either way a graph holds addresses, so nothing it was captured on may be freed while it lives: it
keeps every array its kernels were given (the backend's counters, which Backend.counters replaces
when a later launch needs more, among them), and the arrays made during the capture are its
pool's. What else a step hands to captured work (NCCL's buffers, the operands of CuPy's
operations) is of the pool or of the model; the simulated GPUs fail a replay that reaches freed
memory.
"""


def capture(be, fn):
    """(graph, fn()) with fn's launches captured into graph (see the module's docstring)."""
    if be.name == "emu":
        record = LaunchRecord()
        result = _intercepted(be, fn, lambda *launch: record.launches.append(launch))
        return record, result
    return _capture_stream(be, fn)


def _intercepted(be, fn, launch):
    """fn(), each kernel launch through ``be.function`` handed to ``launch(kernel, grid, block, args,
    kwargs)`` instead of made."""
    function = be.function

    def intercepting(family, name, shared_mem=0):
        kernel = function(family, name, shared_mem)
        return lambda grid, block, args, **kwargs: launch(kernel, grid, block, args, kwargs)
    be.function = intercepting   # an instance attribute hides the method
    try:
        return fn()
    finally:
        del be.function


class LaunchRecord:
    """The kernels of a captured function on the emulator, in launch order."""

    def __init__(self):
        self.launches = []

    def launch(self):
        for kernel, grid, block, args, kwargs in self.launches:
            kernel(grid, block, args, **kwargs)

    def __len__(self):
        return len(self.launches)


class StreamGraph:
    """A CUDA graph, the memory pool its arrays came from and the arguments of its kernels, all of
    which it holds the addresses of."""

    def __init__(self, graph, pool, arguments):
        self.graph, self.pool, self.arguments = graph, pool, arguments

    def launch(self):
        self.graph.launch()   # on the current stream: ordered after what was queued there before


def _capture_stream(be, fn):
    cupy, arguments = be.xp, []
    # the capture's arrays come from a pool of its own: the blocks the default pool still caches from the
    # eager steps go back first, or the step would hold its memory twice (an A100-40GB at batch 4096)
    cupy.get_default_memory_pool().free_all_blocks()
    stream, pool = cupy.cuda.Stream(non_blocking=True), cupy.cuda.MemoryPool()

    def launch(kernel, grid, block, args, kwargs):
        arguments.append(args)
        kernel(grid, block, args, **kwargs)
    with cupy.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        try:
            result = _intercepted(be, fn, launch)
        except BaseException:
            try:
                stream.end_capture()   # the stream must leave capture mode; the graph is of no use
            except Exception:   # an invalidated capture fails here too: fn's error is the one to report
                pass
            raise
        graph = stream.end_capture()
    graph.upload(stream)
    stream.synchronize()
    return StreamGraph(graph, pool, arguments), result
