"""Communicators: the collectives that data parallelism needs, behind one interface.

``Communicator`` is the interface: ``rank``, ``world_size``, ``local_rank`` and

    all_reduce(array, average=False)   sum over ranks, in place (then / world_size)
    start_all_reduce(array), wait()    the same, begun now and finished by wait(), so that
                                       work queued meanwhile can overlap it
    broadcast(array, root=0)           root's values everywhere, in place
    barrier()
    abort(code)                        end every rank of the job now
    all_reduce_values(values)          a few Python numbers summed over ranks
    all_gather_scalar(value)           [value of rank 0, value of rank 1, ...]
    all_gather_bytes(data)             [bytes of rank 0, bytes of rank 1, ...], of any lengths
    broadcast_object(value, root=0)    root's JSON value everywhere

Arrays are contiguous, of the communicator's array module ``xp``; every rank passes
the same shape and dtype, and every rank calls the same collectives in the same order.
``SingleProcess`` is a world of one that runs through the same code without MPI;
``MPICommunicator`` moves host (NumPy) arrays with mpi4py; ``NCCLCommunicator``
moves CuPy arrays between GPUs. ``for_training(gpus)`` picks one from how the process
was launched.
"""
import contextlib
import json
import os
import socket

import numpy as np

from kernels import cupy_module, local_gpu, nccl_module
from . import launch
from .launch import mpi_world


class Communicator:
    rank = 0
    world_size = 1
    local_rank = 0
    xp = np

    def all_reduce(self, array, average=False):
        raise NotImplementedError

    def start_all_reduce(self, array, timed=None):
        """Begin summing ``array`` over ranks; it holds the sum after ``wait()``. Here it
        is done at once; the NCCL communicator overlaps it with later work. ``timed(stream)``:
        a context manager put around the all-reduce itself, given the stream it runs on
        (None: it blocks this thread), for a profiler's span."""
        with (timed or _untimed)(None):
            self.all_reduce(array)

    def wait(self):
        """Work queued after this waits for every started all-reduce."""

    def broadcast(self, array, root=0):
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def abort(self, code=1):
        raise NotImplementedError

    def all_reduce_values(self, values):
        """The sums over ranks of a few Python numbers, as floats (float64: integers are
        exact below 2**53), through all_reduce so that any communicator offers it."""
        array = self.xp.asarray(np.asarray(values, np.float64))
        self.all_reduce(array)
        return [float(v) for v in (array if self.xp is np else array.get())]

    def all_gather_scalar(self, value):
        """[value of rank 0, value of rank 1, ...] on every rank: one slot per rank,
        the others zero, summed."""
        slots = [0.0] * self.world_size
        slots[self.rank] = value
        return self.all_reduce_values(slots)

    def broadcast_object(self, value, root=0):
        """``root``'s ``value`` (a few JSON values: a folder's name, say) on every rank."""
        parts = self.all_gather_bytes(json.dumps(value).encode() if self.rank == root else b"")
        return json.loads(parts[root])

    def all_gather_bytes(self, data):
        """[data of rank 0, data of rank 1, ...] on every rank, bytes of any length: the lengths
        first, then one zeroed uint8 array in which each rank fills its own slice, summed over
        ranks (exact: at each position only one rank's byte is not zero)."""
        ends = np.cumsum([int(n) for n in self.all_gather_scalar(len(data))]).tolist()
        starts = [0] + ends[:-1]
        gathered = self.xp.zeros(ends[-1], np.uint8)
        gathered[starts[self.rank]:ends[self.rank]] = self.xp.asarray(np.frombuffer(data, np.uint8))
        self.all_reduce(gathered)
        host = gathered if self.xp is np else gathered.get()
        return [host[lo:hi].tobytes() for lo, hi in zip(starts, ends)]

    def __repr__(self):
        return f"{type(self).__name__}(rank {self.rank} of {self.world_size})"


class SingleProcess(Communicator):
    """The world of one process: every collective is the identity."""

    def all_reduce(self, array, average=False):
        return array

    def broadcast(self, array, root=0):
        _check_root(root, 1)
        return array

    def barrier(self):
        pass

    def abort(self, code=1):
        launch.flush_quietly()
        os._exit(code)


class MPICommunicator(Communicator):
    """Collectives over MPI on host arrays (the CPU backend's)."""

    def __init__(self, comm=None):
        from mpi4py import MPI
        self._mpi = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        world = mpi_world()
        self.local_rank = world.local_rank if world else self.rank

    def all_reduce(self, array, average=False):
        _check_host(array)
        self.comm.Allreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)
        if average:
            array /= self.world_size
        return array

    def broadcast(self, array, root=0):
        _check_host(array)
        _check_root(root, self.world_size)
        self.comm.Bcast(array, root=root)
        return array

    def barrier(self):
        self.comm.Barrier()

    def abort(self, code=1):
        launch.flush_quietly()
        self.comm.Abort(code)


class NCCLCommunicator(Communicator):
    """Collectives over NCCL on CuPy arrays of this process's GPU (one process per GPU).
    ``all_reduce``, ``broadcast`` and ``barrier`` run on the current stream (or the one
    given), in order with the kernels around them; ``start_all_reduce`` runs on the communicator's own stream,
    after what the current stream has queued so far, so that the kernels queued next
    (the rest of backward) overlap it, and ``wait()`` orders the current stream after
    all of them. When the launcher stops the job, ``abort`` on a watchdog thread ends a
    collective that waits for a peer that is gone."""

    def __init__(self, rank, world_size, unique_id, local_rank=None):
        cupy, nccl = cupy_module(), _nccl()
        self._cupy, self._nccl = cupy, nccl
        self.xp = cupy
        self.rank, self.world_size = rank, world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.comm = nccl.NcclCommunicator(world_size, unique_id, rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        # recorded again at every use: no event is created inside the training step
        self._ready, self._done = (cupy.cuda.Event(disable_timing=True) for _ in range(2))
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.uint8): nccl.NCCL_UINT8}
        launch.on_stop(self.comm.abort)

    @staticmethod
    def unique_id():
        """A new NCCL id, for the process that starts the others to hand to each."""
        return _nccl().get_unique_id()

    def _args(self, array):
        if not isinstance(array, self._cupy.ndarray) or not array.flags.c_contiguous:
            raise TypeError(f"the NCCL communicator moves contiguous CuPy arrays, got {type(array).__name__}")
        return array.data.ptr, array.size, self._types[array.dtype]

    def all_reduce(self, array, average=False, stream=None):
        ptr, count, dtype = self._args(array)
        op = self._nccl.NCCL_AVG if average else self._nccl.NCCL_SUM
        stream = stream or self._cupy.cuda.get_current_stream()
        self.comm.allReduce(ptr, ptr, count, dtype, op, stream.ptr)
        return array

    def start_all_reduce(self, array, timed=None):
        self.stream.wait_event(self._cupy.cuda.get_current_stream().record(self._ready))
        with (timed or _untimed)(self.stream):
            self.all_reduce(array, stream=self.stream)

    def wait(self):
        self._cupy.cuda.get_current_stream().wait_event(self.stream.record(self._done))

    def broadcast(self, array, root=0, stream=None):
        _check_root(root, self.world_size)
        ptr, count, dtype = self._args(array)
        stream = stream or self._cupy.cuda.get_current_stream()
        self.comm.bcast(ptr, count, dtype, root, stream.ptr)
        return array

    def barrier(self):
        self.all_reduce(self._cupy.zeros(1, np.float32))
        self._cupy.cuda.get_current_stream().synchronize()

    def abort(self, code=1):
        launch.flush_quietly()
        self.comm.abort()
        os._exit(code)


def _nccl():
    nccl = nccl_module()
    if not nccl.available:
        raise RuntimeError("CuPy cannot load NCCL: pip install '.[cuda13]' (or '.[cuda12]'), which brings nvidia-nccl")
    return nccl


def _untimed(stream):
    return contextlib.nullcontext()


def from_environment():
    """MPI when this process is one rank of an mpiexec job, else a world of one."""
    world = mpi_world()
    if world is None or world.size == 1:
        return SingleProcess()
    return _mpi(world)


def from_slurm(gpus):
    """The communicator of a task that Slurm's srun started, one of several of a step, without MPI (the
    pip-installed Open MPI is not wired to Slurm: under srun each task is an MPI world of one): NCCL
    between GPU ranks (``gpus`` per node, the GPU from SLURM_LOCALID, or the one CUDA_VISIBLE_DEVICES
    leaves), the NCCL id handed from rank 0 over TCP (launch.rendezvous); a world of one outside such a
    step. LaunchError for CPU ranks, which need MPI, and for a step whose tasks per node are not --gpus."""
    world = launch.slurm_world()
    if world is None or world.size == 1:
        return SingleProcess()
    if not gpus:
        raise launch.LaunchError(f"srun started {world.size} tasks, and MPI sees each of them alone: ranks on the "
                                 f"CPU exchange gradients over MPI (srun --mpi=pmix, or mpiexec inside the "
                                 f"allocation), ranks on GPUs over NCCL (--gpus G, one task per GPU)")
    place = _use_the_gpu_of(world, gpus, "srun", f"srun --ntasks-per-node={gpus}")
    unique_id = launch.rendezvous(world, NCCLCommunicator.unique_id() if world.rank == 0 else None, place)
    return NCCLCommunicator(world.rank, world.size, unique_id, world.local_rank)


def for_training(gpus, comm=None):
    """This process's communicator for ``--gpus``: under mpiexec, MPI between CPU ranks
    (gpus 0), or NCCL between GPU ranks (one GPU per rank: see kernels.local_gpu; the NCCL id
    goes from rank 0 to the others over MPI); else a world of one. ``comm``: this process's
    ``from_environment()``, made by the caller first, so that it can end the whole job when
    this fails on one rank."""
    world = mpi_world()
    comm = from_environment() if comm is None else comm
    if world is None or world.size == 1 or not gpus:
        return comm
    place = _use_the_gpu_of(world, gpus, "mpiexec", f"e.g. mpiexec -N {gpus}")
    # on every rank, when two ranks hold the same GPU: NCCL refuses that with a bare "invalid usage"
    shared = launch.one_gpu_each(comm.comm.allgather(place), "mpiexec -N <GPUs per node>")
    if shared:
        raise launch.LaunchError(shared)
    unique_id = comm.comm.bcast(NCCLCommunicator.unique_id() if world.rank == 0 else None, root=0)
    return NCCLCommunicator(world.rank, world.size, unique_id, world.local_rank)


def _use_the_gpu_of(world, gpus, launcher, advice):
    """Make this rank's GPU of the node current (kernels.local_gpu); its place, (host, PCI bus id).
    LaunchError when ``launcher`` started other than ``gpus`` ranks on this node."""
    if world.local_size != gpus:
        raise launch.LaunchError(f"--gpus {gpus} is the GPUs per node, but {launcher} started {world.local_size} "
                                 f"ranks on this node: start one rank per GPU ({advice})")
    cupy = cupy_module()
    cupy.cuda.Device(local_gpu(world.local_rank, world.local_size)).use()
    return socket.gethostname(), cupy.cuda.Device().pci_bus_id


def _mpi(world):
    try:
        return MPICommunicator()
    except ImportError:
        raise RuntimeError(f"this process is rank {world.rank} of an MPI job of {world.size}, but "
                           f"mpi4py is not installed: pip install '.[mpi]'") from None


def _check_host(array):
    if not isinstance(array, np.ndarray):
        raise TypeError(f"the MPI communicator moves NumPy arrays, got {type(array).__name__}; "
                        f"GPU arrays go through the NCCL communicator")
    if not array.flags.c_contiguous:
        raise ValueError("collectives need a contiguous array")


def _check_root(root, world_size):
    if not 0 <= root < world_size:
        raise ValueError(f"root {root} is not a rank of a world of {world_size}")
