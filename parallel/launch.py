"""How this process was launched, and what that asks of it before NumPy loads.

Under ``mpiexec`` each rank learns its place from MPI's environment (Open MPI's
OMPI_COMM_WORLD_*, MPICH's PMI_* and MPI_LOCAL*), and several ranks share one
machine's cores: ``limit_threads()`` gives each rank's BLAS and OpenMP pools its
share, which only works before NumPy is first imported, so this module imports
nothing heavy.
"""
import collections
import os
import sys

World = collections.namedtuple("World", "rank size local_rank local_size")

# (rank, size, local rank, local size) variables of each MPI implementation
_ENVIRONMENTS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def mpi_world(environ=None):
    """This rank's World when started by mpiexec, else None."""
    environ = os.environ if environ is None else environ
    for rank, size, local_rank, local_size in _ENVIRONMENTS:
        if rank in environ and size in environ:
            r, n = int(environ[rank]), int(environ[size])
            return World(r, n, int(environ.get(local_rank, r)), int(environ.get(local_size, n)))
    return None


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
    world = mpi_world(environ)
    if world is None or world.size == 1:
        return None
    threads = cores_per_rank(world.local_size)
    for name in THREAD_VARIABLES:
        environ.setdefault(name, str(threads))
    return threads


def fail(comm, code, message):
    """End this process with ``code`` after printing ``message``: in a world of several
    ranks, the message names the rank and the whole job is aborted, since the others would
    wait for this one in their next collective forever; returns ``code`` otherwise."""
    if comm.world_size > 1:
        print(f"rank {comm.rank} of {comm.world_size}: {message.strip()}", file=sys.stderr, flush=True)
        comm.abort(code)
    print(message, file=sys.stderr)
    return code
