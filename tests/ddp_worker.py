"""One rank of the data-parallel tests, started by tests/test_ddp.py under mpiexec.

  ddp_worker.py equivalence OUT    DataParallel runs beside single-process references;
                                   each rank writes OUT/rank<r>.npz
  ddp_worker.py cli FAULT ARGS...  train_resnet.py's main(ARGS) with a fault injected:
                                   raise:R:K  rank R raises at its step K
                                   diverge:R:K  rank R perturbs its weights after step K
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel import launch  # noqa: E402

launch.limit_threads()

import nn  # noqa: E402
from nn import init  # noqa: E402
from nn.functional import cross_entropy  # noqa: E402
from nn.tensor import Tensor  # noqa: E402
from parallel.comm import MPICommunicator  # noqa: E402
from parallel.ddp import DataParallel, shard_bounds  # noqa: E402
from training import cli as training_cli  # noqa: E402
from training import loop  # noqa: E402

WIDTH, SIZE, EPS = 8, 12, 1e-5
UNEVEN = (8, 7, 5)      # global batches; 7 and 5 do not divide by 2 ranks
EVEN = (8, 8, 6)
BUCKETS_MB = (8 / 2 ** 20, 0.02, 1000.0)   # one float64 per bucket (so one parameter), a few, one


def model_and_optimizer(seed=0):
    init.manual_seed(seed)
    model = nn.resnet18(num_classes=10, in_channels=1, width=WIDTH).to(np.float64)
    return model, nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def batches(sizes, seed=1):
    g = np.random.default_rng(seed)
    return [(g.standard_normal((n, 1, SIZE, SIZE)), g.integers(0, 10, n).astype(np.int32)) for n in sizes]


def step(model, opt, x, y, backward):
    opt.zero_grad()
    loss = cross_entropy(model(Tensor(x)), y)
    backward(loss)
    opt.step()


def train_replica(comm, sizes, sync_bn, bucket_mb=25.0):
    """DataParallel over ``comm``: (final parameters, the buckets' order of each step, ddp)."""
    model, opt = model_and_optimizer()
    ddp = DataParallel(model, comm, bucket_mb, sync_bn, state=(opt.velocity,))
    orders = []
    for x, y in batches(sizes):
        local = ddp.scatter(np.arange(len(x)))
        step(model, opt, x[local], y[local], ddp.backward)
        orders.append(list(ddp.reduced))
    return opt.flat.data.copy(), orders, ddp, model


def whole_batch_reference(sizes):
    """One process, each whole batch at once: what --sync-bn must equal."""
    model, opt = model_and_optimizer()
    for x, y in batches(sizes):
        step(model, opt, x, y, lambda loss: loss.backward())
    return opt.flat.data.copy()


def averaged_shards_reference(sizes, world_size):
    """One process that computes each shard's gradient with its own batch statistics and
    steps with their average: what per-replica batch norm must equal."""
    model, opt = model_and_optimizer()
    for x, y in batches(sizes):
        total = np.zeros_like(opt.flat.grad)
        for rank in range(world_size):
            lo, hi = shard_bounds(len(x), world_size, rank)
            opt.zero_grad()
            cross_entropy(model(Tensor(x[lo:hi])), y[lo:hi]).backward()
            total += opt.flat.grad
        opt.flat.grad[...] = total / world_size
        opt.step()
    return opt.flat.data.copy()


def equivalence(out):
    comm = MPICommunicator()
    results = {}
    results["sync_bn"], _, _, _ = train_replica(comm, UNEVEN, sync_bn=True)
    results["per_replica"], _, ddp, model = train_replica(comm, EVEN, sync_bn=False)
    for i, mb in enumerate(BUCKETS_MB):
        params, orders, _, _ = train_replica(comm, EVEN[:1], sync_bn=False, bucket_mb=mb)
        results[f"bucket{i}_params"] = params
        results[f"bucket{i}_order"] = np.array(orders[0])
    # running statistics, before and after the averaging, then a sharded evaluation
    results["buffers_before"] = np.concatenate([b.copy() for b in ddp.buffers])
    ddp.average_buffers()
    results["buffers_after"] = np.concatenate([b.copy() for b in ddp.buffers])
    model.to(np.float32)  # the trainer evaluates float32 images
    g = np.random.default_rng(7)
    images, labels = g.integers(0, 256, (41, SIZE, SIZE), dtype=np.uint8), g.integers(0, 10, 41).astype(np.int32)
    results["evaluation"] = np.array(loop.evaluate(model, images, labels, 2, comm))
    if comm.rank == 0:
        results["evaluation_one_process"] = np.array(loop.evaluate(model, images, labels, 2))
        results["reference_sync_bn"] = whole_batch_reference(UNEVEN)
        results["reference_per_replica"] = averaged_shards_reference(EVEN, comm.world_size)
    np.savez(Path(out) / f"rank{comm.rank}.npz", **results)


def cli(fault, argv):
    """train_resnet.py's main with rank R raising at (or diverging after) its step K."""
    kind, rank, at = fault.split(":")
    rank, at = int(rank), int(at)
    world = launch.mpi_world()
    if world.rank == rank:
        real_step, count = nn.SGD.step, [0]

        def faulty_step(opt):
            real_step(opt)
            count[0] += 1
            if count[0] == at and kind == "raise":
                raise RuntimeError(f"injected fault at step {at}")
            if count[0] == at and kind == "diverge":
                opt.flat.data[0] += 1e-3
        nn.SGD.step = faulty_step
    return training_cli.main(argv)


if __name__ == "__main__":
    if sys.argv[1] == "equivalence":
        equivalence(sys.argv[2])
    elif sys.argv[1] == "cli":
        sys.exit(cli(sys.argv[2], sys.argv[3:]))
    else:
        sys.exit(f"unknown scenario {sys.argv[1]!r}")
