"""Worker functions for the simulated-GPU tests: target(rank, world_size, ...), as ``--gpus N``
runs ``training.loop.gpu_worker``. A module of their own, so that a spawned worker imports little."""
import json
import os
import signal
from pathlib import Path


def placement(rank, world_size, given, unique_id, out):
    """gpu_worker, then what this process allocated and launched on each device."""
    from kernels.simulated import cuda
    from training import loop
    loop.gpu_worker(rank, world_size, given, unique_id)
    ledger = {what: {str(device): n for device, n in counts.items()} for what, counts in cuda.ledger.items()}
    (Path(out) / f"ledger{rank}.json").write_text(json.dumps(ledger))


def fails_in_backward(rank, world_size, given, unique_id, bad, how):
    """gpu_worker, where rank ``bad`` raises (how="raise") or is killed (how="kill") in its first
    backward, while the others wait for it in the gradient all-reduce."""
    from parallel import ddp
    from training import loop
    if rank == bad:
        def backward(self, loss):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"a fault in the backward of rank {rank}")
        ddp.DataParallel.backward = backward
    loop.gpu_worker(rank, world_size, given, unique_id)


def without_event_wait(rank, world_size, given, unique_id, which):
    """gpu_worker with one of the NCCL communicator's two event waits taken out (a planted mistake):
    "ready", the all-reduce of a bucket no longer waits for the backward that wrote its gradients;
    "done", the optimizer step no longer waits for the last all-reduce."""
    import contextlib
    from parallel.comm import NCCLCommunicator
    from training import loop
    if which == "ready":
        def start_all_reduce(self, array, timed=None):
            with (timed or (lambda stream: contextlib.nullcontext()))(self.stream):
                self.all_reduce(array, stream=self.stream)
        NCCLCommunicator.start_all_reduce = start_all_reduce
    else:
        NCCLCommunicator.wait = lambda self: None
    loop.gpu_worker(rank, world_size, given, unique_id)


def capture_fails(rank, world_size, given, unique_id, bad):
    """gpu_worker where rank ``bad``'s capture of the training step runs out of memory."""
    from kernels.cuda import graph
    from training import loop
    if rank == bad:
        def capture(be, fn):
            raise MemoryError("out of memory while the graph's pool grew")
        graph.capture = capture
    loop.gpu_worker(rank, world_size, given, unique_id)
