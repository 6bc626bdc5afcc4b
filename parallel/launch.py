"""Starting ranks: one worker process per GPU on this node, or the ranks of mpiexec.

``run_workers(n, target, args)`` starts n processes, each calling
``target(rank, n, *args)``, and waits for them. If one raises, exits with an error
or a signal, or stops calling ``heartbeat()`` for longer than the watchdog allows, the
others are stopped (first the callbacks they registered with ``on_stop``, such as
aborting their NCCL communicator, then SIGTERM, then SIGKILL) and ``WorkerFailed``
names the worker and what happened. Ctrl-C stops every worker too, and a worker whose
parent dies (even by SIGKILL) runs its callbacks and ends.

Under ``mpiexec`` each rank learns its place from MPI's environment (Open MPI's
OMPI_COMM_WORLD_*, MPICH's PMI_* and MPI_LOCAL*), and several ranks share one
machine's cores: ``limit_threads()`` gives each rank's BLAS and OpenMP pools its
share, which only works before NumPy is first imported, so this module imports
nothing heavy.
"""
import collections
import json
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback

World = collections.namedtuple("World", "rank size local_rank local_size")


class LaunchError(ValueError):
    """How the ranks were started does not fit what the flags ask for."""

# (rank, size, local rank, local size) variables of each MPI implementation
_ENVIRONMENTS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def mpi_world(environ=None):
    """This rank's World when started by mpiexec, else None. LaunchError when the variables are not
    numbers that fit (a rank below 0 or not below the size)."""
    environ = os.environ if environ is None else environ
    for names in _ENVIRONMENTS:
        rank, size, local_rank, local_size = names
        if rank in environ and size in environ:
            try:
                r, n = int(environ[rank]), int(environ[size])
                world = World(r, n, int(environ.get(local_rank, r)), int(environ.get(local_size, n)))
            except ValueError:
                world = None
            if world is None or not 0 <= world.rank < world.size or not 0 <= world.local_rank < world.local_size:
                said = ", ".join(f"{name}={environ[name]!r}" for name in names if name in environ)
                raise LaunchError(f"the MPI environment does not make sense ({said}): start the ranks with mpiexec, "
                                  f"or unset these variables")
            return world
    return None


def slurm_world(environ=None):
    """This task's World when Slurm's srun started it, one task of a step of several, else None: rank
    SLURM_PROCID of the step's SLURM_STEP_NUM_TASKS (SLURM_NTASKS outside a step), and SLURM_LOCALID of
    the tasks of this node (SLURM_STEP_TASKS_PER_NODE, "2(x3),1", at SLURM_NODEID). LaunchError when the
    variables make no sense."""
    environ = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in environ:   # the batch script, or salloc's shell: not one of srun's tasks
        tasks = environ.get("SLURM_NTASKS", "1")
        if tasks.strip().isdigit() and int(tasks) > 1:
            raise LaunchError(f"this Slurm job has SLURM_NTASKS={tasks} tasks, and this process is not one of "
                              f"them (no job step): start them with srun (srun python train_resnet.py ...), or ask "
                              f"for one task")
        return None
    size = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    if size is None or "SLURM_PROCID" not in environ:
        return None
    names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
             "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    try:
        per_node = []
        for part in environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", size)).split(","):
            count, _, times = part.partition("(x")
            per_node += [int(count)] * (int(times.rstrip(")")) if times else 1)
        rank, size, local_rank = int(environ["SLURM_PROCID"]), int(size), int(environ.get("SLURM_LOCALID", 0))
        world = World(rank, size, local_rank, per_node[int(environ.get("SLURM_NODEID", 0))])
    except (ValueError, IndexError):
        world = None
    if world is None or not 0 <= world.rank < world.size or not 0 <= world.local_rank < world.local_size:
        said = ", ".join(f"{name}={environ[name]!r}" for name in names if name in environ)
        raise LaunchError(f"Slurm's environment does not make sense ({said}): start the tasks with srun")
    return world


def first_node(environ=None):
    """The first host of the step's nodes (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), whose list
    Slurm compresses ("gpu[01-04,7],login2"): where rank 0 runs."""
    environ = os.environ if environ is None else environ
    nodes = environ.get("SLURM_STEP_NODELIST", environ.get("SLURM_JOB_NODELIST", "localhost"))
    head, bracket, rest = nodes.partition("[")
    if "," in head or not bracket:
        return head.split(",")[0]
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return head + first


RENDEZVOUS_SECONDS = 300.0   # for every task of a step to reach rank 0 (they start within seconds of each other)


def rendezvous(world, payload=None, place=None, environ=None, timeout=RENDEZVOUS_SECONDS):
    """Rank 0's ``payload`` (bytes: the NCCL id) on every rank of ``world`` (srun's tasks, which share no
    MPI), over TCP to the first node of the step, as torchrun's and PyTorch Lightning's rendezvous do:
    rank 0 listens on MASTER_PORT (else a port of the job and step), the others connect, each saying
    its rank and ``place`` (where its GPU is: two ranks on one GPU are refused here, for all of them).
    LaunchError, naming the ranks, when some never arrive within ``timeout`` seconds, or rank 0 never
    answers."""
    environ = os.environ if environ is None else environ
    port = int(environ.get("MASTER_PORT") or 20000 + (int(environ.get("SLURM_JOB_ID", 0)) * 7 +
                                                         int(environ.get("SLURM_STEP_ID", 0) or 0)) % 20000)
    deadline = time.monotonic() + timeout
    if world.rank == 0:
        return _serve(world, payload, place, port, deadline)
    host = environ.get("MASTER_ADDR") or first_node(environ)
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())) as peer:
                _send(peer, json.dumps([world.rank, place]).encode())
                answer = _receive(peer)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise LaunchError(f"rank {world.rank} of {world.size}: rank 0 never answered at {host}:{port} within "
                                  f"{timeout:g} s (did every task start? is the port free?)") from None
            time.sleep(0.2)
    if answer.startswith(b"error: "):
        raise LaunchError(answer[7:].decode())
    return answer


def _serve(world, payload, place, port, deadline):
    places, peers = {0: place}, {}
    with socket.create_server(("", port), reuse_port=False) as server:
        try:
            while len(peers) < world.size - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    peer, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, world.size)) - set(peers))
                    raise LaunchError(f"rank(s) {', '.join(map(str, missing))} of {world.size} never reached rank 0 "
                                      f"on port {port}: did every task start?") from None
                peer.settimeout(10)
                rank, places[rank] = json.loads(_receive(peer))
                peers[rank] = peer
            shared = one_gpu_each([places[rank] for rank in range(world.size)],
                                  "srun --ntasks-per-node=G --gpus-per-node=G")
            if shared:
                for peer in peers.values():
                    _send(peer, b"error: " + shared.encode())
                raise LaunchError(shared)
            for peer in peers.values():
                _send(peer, payload)
        finally:
            for peer in peers.values():
                peer.close()
    return payload


def one_gpu_each(places, start):
    """The first two ranks of ``places`` (each rank's (host, PCI bus id), or None) that hold one GPU, in
    words, else None: NCCL needs a GPU of its own for each rank; ``start`` says how to start them."""
    first = {}
    for rank, place in enumerate(places):
        if place is None:
            continue
        place = tuple(place)
        if place in first:
            return (f"ranks {first[place]} and {rank} both use the GPU at PCI bus {place[1]} of {place[0]}: NCCL "
                    f"needs a GPU of its own for each rank ({start}, each rank seeing all of the node's GPUs or, "
                    f"through CUDA_VISIBLE_DEVICES, only its own)")
        first[place] = rank
    return None


def _send(peer, data):
    peer.sendall(len(data).to_bytes(4, "big") + data)


def _receive(peer):
    size = int.from_bytes(_exactly(peer, 4), "big")
    return _exactly(peer, size)


def _exactly(peer, size):
    data = b""
    while len(data) < size:
        chunk = peer.recv(size - len(data))
        if not chunk:
            raise OSError("the connection closed")
        data += chunk
    return data


def cores_per_rank(local_size):
    """The cores each of ``local_size`` ranks on this machine may use: those it is bound
    to when mpiexec bound it to fewer than all, else an equal share of the machine."""
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if available < (os.cpu_count() or available):
        return max(1, available)
    return max(1, (os.cpu_count() or 1) // max(1, local_size))


def limit_threads(environ=None):
    """Under mpiexec, set the thread pools to this rank's cores, unless the user set them;
    returns the number set, or None. Call before NumPy is imported."""
    environ = os.environ if environ is None else environ
    try:
        world = mpi_world(environ)
    except LaunchError:   # the command says so, once it can
        return None
    if world is None or world.size == 1:
        return None
    threads = cores_per_rank(world.local_size)
    for name in THREAD_VARIABLES:
        environ.setdefault(name, str(threads))
    return threads


class _ForgivingStream:
    """stdout or stderr, kept from stopping the run when what reads it goes away (``| head -1``, a log
    reader that died, ``2>&-``): a job's output is not its work. The first write that fails for that
    sends the stream's file to /dev/null, and the other stream says so once; a text the encoding cannot
    hold (a path that is not UTF-8, under a strict UTF-8 stdout) is written with backslash escapes."""

    def __init__(self, stream, name):
        self._stream, self._name, self._gone = stream, name, stream is None
        if stream is not None and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass

    def write(self, text):
        if not self._gone:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ValueError):   # a closed pipe, or a closed file
                self._go()
        return len(text)

    def flush(self):
        if not self._gone:
            try:
                self._stream.flush()
            except (BrokenPipeError, ValueError):
                self._go()

    def isatty(self):
        try:
            return not self._gone and self._stream.isatty()
        except ValueError:
            return False

    def _go(self):
        self._gone = True
        try:   # what is still buffered, and the flush at exit, go nowhere instead of failing again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        other = sys.stderr if self._name == "stdout" else sys.stdout
        if other is not self:
            other.write(f"{self._name} was closed (what read it went away): the run goes on without it\n")
            other.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def forgiving_streams():
    """Make sys.stdout and sys.stderr forgiving (_ForgivingStream), once per process: the command's
    and each --gpus worker's."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _ForgivingStream):
            setattr(sys, name, _ForgivingStream(stream, name))


def flush_quietly():
    """stdout and stderr flushed, as far as they can be: nothing on the way to stopping a job may
    depend on them being writable (a closed pipe, say)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or file
            pass


def say(message):
    """``message`` on stderr, after what stdout holds; never raises (see flush_quietly)."""
    flush_quietly()
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def fail(comm, code, message):
    """End this process with ``code`` after printing ``message``: in a world of several
    ranks, the message names the rank and the whole job is aborted, since the others would
    wait for this one in their next collective forever; returns ``code`` otherwise."""
    if comm.world_size > 1:
        # the MPI runtime sends SIGTERM to every rank once one aborts, this one included: it must end
        # this process with its code, not raise into the failure in progress
        exit_on_sigterm(code)
        say(f"rank {comm.rank} of {comm.world_size}: {message.strip()}")
        comm.abort(code)
    say(message)
    return code


def exit_on_sigterm(code):
    """From now on SIGTERM ends this process with ``code``, quietly: a rank that is failing, which
    the MPI runtime's SIGTERM may reach while it says why, must not raise into that."""
    def leave(signum, frame):
        flush_quietly()
        os._exit(code)
    try:
        signal.signal(signal.SIGTERM, leave)
    except ValueError:   # not the main thread: the handler stays
        pass


# ---- one process per GPU ------------------------------------------------------------------

GRACE_SECONDS = 5.0   # for a stopped worker to end by itself, then again after SIGTERM
_beat = None          # this worker's heartbeat clock, shared with the parent
_stop = None          # set by the parent when the job is stopped
_on_stop = []         # what to do then, before the signals come


class WorkerFailed(RuntimeError):
    """``rank``, ``reason``, and when the worker raised, ``trace``, its traceback, and ``error``, the
    exception itself (None if it could not be sent), so that the caller can tell a user's mistake
    found in a worker from a crash."""

    def __init__(self, rank, reason, trace=None, error=None):
        super().__init__(f"worker {rank} {reason}")
        self.rank, self.reason, self.trace, self.error = rank, reason, trace, error


def heartbeat():
    """Tell the parent's watchdog that this worker is making progress (the trainer calls
    it every step); nothing outside a worker."""
    if _beat is not None:
        _beat.value = time.monotonic()


def on_stop(fn):
    """Call ``fn()`` on the worker's watchdog thread when the parent stops the job, so that
    a worker blocked in a collective for a peer that is gone gets out of it (the NCCL
    communicator registers its abort); nothing outside a worker."""
    if _stop is not None:
        _on_stop.append(fn)


def _watchdog(parent):
    """The worker's watchdog thread: when the parent stops the job, or dies without doing
    so, run the on_stop callbacks; when the parent is gone, end the worker too."""
    # a polled flag, not a multiprocessing Event: setting an Event blocks for ever when a
    # process that waited on it has died, which is what happens here
    while not _stop.value and os.getppid() == parent:
        time.sleep(0.1)
    for fn in _on_stop:
        try:
            fn()
        except Exception:  # one callback's failure must not keep the others, or the exit, from running
            pass
    if os.getppid() != parent:
        say(f"worker of parent {parent}: the parent is gone; ending")
        os._exit(1)


def _worker(rank, world_size, target, args, beat, stop, errors, parent):
    global _beat, _stop
    _beat, _stop = beat, stop
    forgiving_streams()
    threading.Thread(target=_watchdog, args=(parent,), name="watchdog", daemon=True).start()
    heartbeat()
    try:
        target(rank, world_size, *args)
    except SystemExit as e:
        if e.code not in (None, 0):
            errors.put((rank, f"exited with {e.code}", "", None))
        raise
    except BaseException as e:  # KeyboardInterrupt too: the parent must hear
        sent = e
        try:
            pickle.dumps(e)
        except Exception:   # an exception that cannot travel: its text and traceback do
            sent = None
        errors.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc(), sent))
        errors.close()
        errors.join_thread()
        sys.exit(1)


def run_workers(world_size, target, args=(), watchdog=None, poll=0.05):
    """Run ``target(rank, world_size, *args)`` in ``world_size`` new processes (spawned:
    CUDA does not survive fork); returns when all have ended well, else stops them all
    and raises WorkerFailed. ``watchdog``: seconds without a heartbeat after which a
    worker counts as hung (None: never)."""
    context = multiprocessing.get_context("spawn")
    stop, errors = context.Value("b", 0), context.Queue()
    beats = [context.Value("d", time.monotonic()) for _ in range(world_size)]
    workers = [context.Process(target=_worker, name=f"worker-{rank}",
                               args=(rank, world_size, target, args, beats[rank], stop, errors, os.getpid()))
               for rank in range(world_size)]
    for w in workers:
        w.start()
    try:
        failure = _watch(workers, beats, errors, watchdog, poll)
    except KeyboardInterrupt:
        _stop_all(workers, stop)
        raise
    if failure is not None:
        _stop_all(workers, stop)
        raise WorkerFailed(*failure)


def _watch(workers, beats, errors, watchdog, poll):
    """(rank, reason, traceback, exception) of the first worker to fail (the last two when it raised),
    or None when all succeed."""
    reported, ended = {}, {}
    while True:
        while not errors.empty():
            rank, message, trace, error = errors.get()
            reported[rank] = (message, trace, error)
        for rank, w in enumerate(workers):
            if w.exitcode is None or w.exitcode == 0:
                continue
            if w.exitcode < 0:
                return rank, f"was killed by signal {signal.Signals(-w.exitcode).name}", None
            if rank in reported:
                message, trace, error = reported[rank]
                return rank, (message if message.startswith("exited") else "raised " + message), trace or None, error
            # its report may still be in the pipe
            if time.monotonic() - ended.setdefault(rank, time.monotonic()) > 1.0:
                return rank, f"exited with code {w.exitcode}", None
        if all(w.exitcode == 0 for w in workers):
            return None
        if watchdog is not None:
            now = time.monotonic()
            late = [rank for rank, w in enumerate(workers) if w.exitcode is None and now - beats[rank].value > watchdog]
            if late:   # the one the others wait for: a stopped one (kill -STOP), late or not yet, else the
                # one silent longest
                live = [rank for rank, w in enumerate(workers) if w.exitcode is None]
                rank = min(live, key=lambda r: (not _stopped(workers[r].pid), r not in late, beats[r].value))
                how = "stopped (SIGSTOP): " if _stopped(workers[rank].pid) else "hung: "
                return rank, f"{how}no progress for {now - beats[rank].value:.0f} s (watchdog {watchdog:g} s)", None
        time.sleep(poll)


def _stopped(pid):
    """Whether process ``pid`` is stopped by a signal (Linux's /proc; False where it cannot tell)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop_all(workers, stop):
    """The workers' stop callbacks first, then SIGTERM, then SIGKILL, each after a grace."""
    stop.value = 1
    for signal_them in (lambda w: None, lambda w: w.terminate(), lambda w: w.kill()):
        deadline = time.monotonic() + GRACE_SECONDS
        for w in workers:
            if w.exitcode is None:
                signal_them(w)
        for w in workers:
            w.join(max(0.0, deadline - time.monotonic()))
        if all(w.exitcode is not None for w in workers):
            return
