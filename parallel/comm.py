"""Communicators: the collectives that data parallelism needs, behind one interface.

``Communicator`` is the interface: ``rank``, ``world_size``, ``local_rank`` and

    all_reduce(array, average=False)   sum over ranks, in place (then / world_size)
    broadcast(array, root=0)           root's values everywhere, in place
    barrier()
    abort(code)                        end every rank of the job now

Arrays are contiguous; every rank passes the same shape and dtype, and every rank
calls the same collectives in the same order (they block until all have).
``SingleProcess`` is a world of one that runs through the same code without MPI;
``MPICommunicator`` moves host (NumPy) arrays with mpi4py; the NCCL one moves CuPy
arrays. ``from_environment()`` picks MPI when the process was started by mpiexec.
"""
import os
import sys

import numpy as np

from .launch import mpi_world


class Communicator:
    rank = 0
    world_size = 1
    local_rank = 0

    def all_reduce(self, array, average=False):
        raise NotImplementedError

    def broadcast(self, array, root=0):
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def abort(self, code=1):
        raise NotImplementedError

    def all_gather_scalar(self, value, xp=np):
        """[value of rank 0, value of rank 1, ...] on every rank, through all_reduce
        (one slot per rank, the others zero), so that any communicator offers it.
        Values are float64: integers are exact below 2**53."""
        slots = xp.zeros(self.world_size, np.float64)
        slots[self.rank] = value
        self.all_reduce(slots)
        return [float(v) for v in (slots if xp is np else slots.get())]

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
        sys.stderr.flush()
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
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)


def from_environment():
    """MPI when this process is one rank of an mpiexec job, else a world of one."""
    world = mpi_world()
    if world is None or world.size == 1:
        return SingleProcess()
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
