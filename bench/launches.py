"""What one training step launches on a GPU, and what its host side costs, without a GPU.

  PYTHONPATH=. python -m bench.launches [--width 64] [--batch 256] [--json out.json]

Runs training steps of ResNet-18 (bench/train_times.py's step: gather the batch on the device,
convert it, forward, cross-entropy, backward, SGD) on one simulated GPU (kernels/simulated)
whose RawModule kernels are stubbed out: each launch is recorded (kernel, and the bytes of the
arrays passed to it, which it reads or writes at least once) and returns at once. The simulated
arrays count every other device operation CuPy would run (element-wise kernels, reductions,
gathers, copies, memsets) with the bytes each writes. One step after a warm-up is counted at
--width and --batch. The host time per step is the median of --steps steps of the same network
at --host-width and --host-batch (4 and 2: the same launches, give or take a split), where the
stand-in's own work on the arrays (NumPy copies and fills that a GPU would run asynchronously, and
its bookkeeping of device memory, a few microseconds an allocation) is small beside what it
measures: the launchers, the tape and the optimizer. It still bounds the Python side of a step
from above. Prints a table by kernel, with the totals, and the device memory the step holds,
eager and captured as a CUDA graph (device_memory).
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("KERNELS_SIMULATED_GPUS", "1")

import kernels  # noqa: E402  (after the environment that selects the simulated GPUs)
from bench import layers  # noqa: E402
import kernels.simulated  # noqa: E402
from kernels.simulated import arrays, cuda  # noqa: E402


class StubModule:
    """A RawModule whose kernels record their launch and do nothing: the count, and with
    `sizes` the bytes of the arrays passed (off while the host time is measured)."""
    launches, launch_bytes = collections.Counter(), collections.Counter()
    sizes = False

    def __init__(self, code=None, *, name_expressions=None, **kwargs):
        pass

    def get_function(self, name):
        return lambda grid, block, args, **kwargs: self.record(name, args)

    @classmethod
    def record(cls, name, args):
        cls.launches[name] += 1
        if cls.sizes:   # each piece of memory once, whatever views of it the launch was handed
            seen = {(a.data.ptr, a.nbytes): a for a in args if isinstance(a, arrays.ndarray)}
            cls.launch_bytes[name] += sum(a.nbytes for a in seen.values())


def measure(width, batch, host_width, host_batch, steps):
    """{'kernels': {name: (launches, bytes)}, 'operations': {...}} of one step at `width` and
    `batch`, and the host milliseconds of `steps` steps at `host_width` and `host_batch`, with the
    launches those steps made."""
    from bench.train_times import ours_step, random_data
    kernels.simulated.RawModule = StubModule   # what the cuda backend compiles with, before it is made

    def counted(width, batch, steps):
        config = {"device": "cuda", "batch": batch, "width": width, "batches": 2}
        step = ours_step(config, *random_data(config))
        step()   # warm-up: first allocations, first lookups
        for counter in (StubModule.launches, StubModule.launch_bytes, *(cuda.ledger[k] for k in OPERATIONS)):
            counter.clear()
        host_ms = []
        for _ in range(steps):
            began = time.perf_counter()
            step()
            host_ms.append(1e3 * (time.perf_counter() - began))
        return host_ms, sum(StubModule.launches.values()) / steps + sum(cuda.ledger["operations"].values()) / steps

    host_ms, host_launches = counted(host_width, host_batch, steps)
    StubModule.sizes = True
    counted(width, batch, 1)
    return {"width": width, "batch": batch, "precision": kernels.precision(),
            "kernels": {k: (n, StubModule.launch_bytes[k]) for k, n in StubModule.launches.items()},
            "operations": {k: (n, cuda.ledger["operation_bytes"][k]) for k, n in cuda.ledger["operations"].items()},
            "host_width": host_width, "host_batch": host_batch, "host_ms": host_ms, "host_launches": host_launches,
            "device_bytes": device_memory(width, batch)}


def device_memory(width, batch):
    """Device memory of a training step of a fresh model (training/step.py's GraphedStep), as CuPy's pools
    hold it: {'eager': (in use, cached) bytes of the default pool after the first, eager step (the cached
    blocks are what the next step reuses); 'graphed': (the default pool's bytes, the graph's pool's) once
    the second step is captured, the default pool having given its cached blocks back first}. The stand-in's
    capture pool keeps every block it hands out, where CuPy's reuses a block freed within the capture: the
    graph's figure is an upper bound."""
    import gc
    from bench.train_times import ours_graph_step, random_data
    pool = kernels.simulated.get_default_memory_pool()
    gc.collect()
    pool.free_all_blocks()
    config = {"device": "cuda", "batch": batch, "width": width, "batches": 2}
    step = ours_graph_step(config, *random_data(config))
    step()
    eager = (pool.used_bytes(), pool.free_bytes())
    step()
    return {"eager": eager, "graphed": (pool.total_bytes(), step.graphed.graph.pool.used_bytes())}


OPERATIONS = ("operations", "operation_bytes")


def table(result):
    rows = [("kernel", name, n, b) for name, (n, b) in result["kernels"].items()]
    rows += [("operation", name, n, b) for name, (n, b) in result["operations"].items()]
    rows.sort(key=lambda r: -r[2])
    lines = [f"one training step of ResNet-18 width {result['width']}, batch {result['batch']}, precision "
             f"{result['precision']}: launches per step", f"{'':9s} {'name':44s} {'count':>6s} {'MB':>9s}"]
    lines += [f"{kind:9s} {name[:44]:44s} {n:6.0f} {b / 1e6:9.1f}" for kind, name, n, b in rows]
    kernels_n = sum(n for n, _ in result["kernels"].values())
    operations_n = sum(n for n, _ in result["operations"].values())
    moved = sum(b for _, b in result["kernels"].values()) + sum(b for _, b in result["operations"].values())
    lines += [f"total: {kernels_n + operations_n:.0f} launches per step ({kernels_n:.0f} of the project's kernels, "
              f"{operations_n:.0f} array operations), {moved / 1e9:.2f} GB at least",
              f"host time per step at width {result['host_width']}, batch {result['host_batch']} (kernels stubbed): "
              f"median "
              f"{statistics.median(result['host_ms']):.1f} ms of {len(result['host_ms'])} steps, "
              f"{result['host_launches']:.0f} launches, "
              f"{1e3 * statistics.median(result['host_ms']) / result['host_launches']:.1f} us per launch",
              "device memory of the step: eager {:.2f} GB in use between steps and {:.2f} GB cached; captured as a "
              "CUDA graph {:.2f} GB in the default pool (its cached blocks given back first) and at most {:.2f} GB "
              "in the graph's".format(*(b / 1e9 for b in (*result["device_bytes"]["eager"],
                                                         *result["device_bytes"]["graphed"])))]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=layers.BATCH)
    p.add_argument("--host-width", type=int, default=4, help="the width of the timed steps (default 4)")
    p.add_argument("--host-batch", type=int, default=2, help="the batch of the timed steps (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--precision", choices=kernels.PRECISIONS, default=kernels.precision())
    p.add_argument("--json", help="also write the result to this JSON file")
    args = p.parse_args(argv)
    with kernels.use_precision(args.precision):
        result = measure(args.width, args.batch, args.host_width, args.host_batch, args.steps)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
