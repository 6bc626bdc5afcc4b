"""Tier (d) of bench/gpu_check: training steps of ResNet-18 at batch 256 on the GPU, ours (nn on the
cuda kernels) eagerly ("ours", --no-graph) and as a CUDA graph ("ours_graph", --graph, the trainer's
default on GPUs), in the default tf32 precision and in bf16 ("ours_bf16", "ours_bf16_graph"), beside
d2l's model in PyTorch eager (cuDNN) with TF32 off, with its defaults, and under
torch.autocast(device, torch.bfloat16) with the model and its input channels_last ("torch_bf16"), and
that last one also captured as one CUDA graph ("torch_bf16_graph"), in one process; sec/epoch is the
time of 60000 images at the median step time. PyTorch runs with cudnn.benchmark on (tuned: cuDNN times
each convolution's algorithms once and keeps the fastest), as a user tuning for speed sets it; each
row's "precision" says so, and whether it was a graph.

  PYTHONPATH=. python -m bench.train_times --out training.json              # 100 steps each
  PYTHONPATH=. python -m bench.train_times --dry-run --out training.json    # tiny, on the CPU

A step is what training/loop.py's epoch loop does, with the trainer's default hyperparameters: gather
the batch from uint8 images on the device, convert it to float, forward, cross-entropy, backward,
SGD. The images are random: the time does not depend on them. Steps run in chunks of 10 between
two clock marks (CUDA events), with no host synchronisation inside a chunk; the median chunk
gives the step time. A run that has spent --seconds-per-run stops early and says how many steps
it timed. Each run's result is written to the JSON file as soon as it ends.
"""
import argparse
import contextlib
import itertools
import os
import statistics
import sys
import time

import numpy as np

import kernels
from bench import layers, report, timing
from bench.op_times import SETTINGS, autocast, load_torch, precision

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = {"device": "cuda", "batch": layers.BATCH, "width": 64, "steps": 100, "warmup": 3, "chunk": 10,
        "batches": 16}
DRY = {"device": "cpu", "batch": 4, "width": 4, "steps": 4, "warmup": 1, "chunk": 2, "batches": 2}


def random_data(config):
    """`batches` batches of random uint8 images and int32 labels, as host arrays."""
    g = np.random.default_rng(0)
    n = config["batch"] * config["batches"]
    return (g.integers(0, 256, (n, layers.IMAGE, layers.IMAGE)).astype(np.uint8),
            g.integers(0, layers.CLASSES, n).astype(np.int32))


def hyperparameters():
    from training.config import Config
    d = Config()
    return {"lr": d.lr, "momentum": d.momentum, "weight_decay": d.weight_decay}


def _ours(config, images, labels):
    """(model, optimizer, images, labels, batches): our ResNet-18 and its data on the device."""
    import nn
    from nn import data
    xp = kernels.array_module_for(config["device"])
    images, labels = xp.asarray(images), xp.asarray(labels)
    nn.manual_seed(0)
    model = nn.resnet18(width=config["width"]).to(config["device"])
    opt = nn.SGD(model.parameters(), **hyperparameters())
    batches = itertools.cycle(data.batch_indices(xp.asarray(data.epoch_order(len(images), 0, 0)), config["batch"]))
    return model, opt, images, labels, batches


def ours_step(config, images, labels):
    """A closure that runs one training step of our ResNet-18, as training/loop.py's loop does
    with --no-graph."""
    import nn
    model, opt, images, labels, batches = _ours(config, images, labels)
    K = kernels.backend_of(images)

    def step():
        idx = next(batches)
        x = nn.Tensor(K.images_to_float(images, idx))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), K.take(labels, idx))
        loss.backward()
        opt.step()
        return loss.data
    return step


def ours_graph_step(config, images, labels):
    """The same step as the trainer runs it with --graph (the default on GPUs): training/step.py's
    GraphedStep, captured as a CUDA graph on the second call and replayed from the third."""
    from parallel.comm import SingleProcess
    from parallel.ddp import DataParallel
    from training.step import GraphedStep
    model, opt, images, labels, batches = _ours(config, images, labels)
    ddp = DataParallel(model, SingleProcess())
    step = GraphedStep(model, opt, ddp, images, labels, config["batch"],
                       warn=lambda line: print(f"warning: {line}", flush=True))
    run = lambda: step(ddp.scatter(next(batches)))[0]   # noqa: E731
    run.graphed = step   # its graph, once captured (bench/launches.py's device memory)
    return run


def torch_step(torch, config, images, labels, mixed, graph=False, compiled=None):
    """The same step of d2l's ResNet-18 in PyTorch eager; `mixed`: as PyTorch's mixed-precision recipe
    has it, the model and its input channels_last, forward and loss under autocast to bfloat16;
    `graph`: the whole step captured as one CUDA graph (captured); `compiled`: the model under
    torch.compile with this backend ("inductor" is its default), the optimizer eager."""
    from nn import data
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_torch_parity import torch_resnet18   # the one copy of d2l's model in the repository
    device = config["device"]
    images, labels = torch.from_numpy(images).to(device), torch.from_numpy(labels).long().to(device)
    torch.manual_seed(0)
    model = torch_resnet18(layers.CLASSES, 1, config["width"]).to(device)
    layout = torch.channels_last if mixed else torch.contiguous_format
    model = model.to(memory_format=layout)
    opt = torch.optim.SGD(model.parameters(), **hyperparameters())
    order = torch.from_numpy(data.epoch_order(len(images), 0, 0)).to(device)
    batches = itertools.cycle(order.split(config["batch"]))
    forward = torch.compile(model, backend=compiled) if compiled else model

    def step(idx):
        x = images[idx].unsqueeze(1).to(torch.float32).div_(255).contiguous(memory_format=layout)
        opt.zero_grad()
        with autocast(torch, device, mixed):
            loss = torch.nn.functional.cross_entropy(forward(x), labels[idx])
        loss.backward()
        opt.step()
        return loss.detach()
    return captured(torch, step, batches) if graph else lambda: step(next(batches))


def captured(torch, step, batches):
    """step(idx) as PyTorch's whole-network capture runs it: three warm-up steps on a side stream, one
    captured as a CUDA graph (torch.cuda.graph); then each step copies its batch's indices into the
    graph's input and replays the graph, whose loss is the captured step's output."""
    idx = next(batches).clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(idx)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(idx)

    def replay():
        idx.copy_(next(batches))
        graph.replay()
        return loss
    return replay


@contextlib.contextmanager
def tuned(torch):
    """cudnn.benchmark on inside the block (cuDNN times the algorithms of each new convolution once and
    keeps the fastest), as a user tuning for speed sets it; yields the setting for a run's record."""
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        yield {"cudnn.benchmark": True}
    finally:
        torch.backends.cudnn.benchmark = saved


def time_steps(step, clock, config, seconds):
    """Warm-up, then chunks of steps until config['steps'] are timed or `seconds` are spent."""
    for _ in range(config["warmup"]):
        step()
    chunk, chunks, last = config["chunk"], [], None
    began = time.perf_counter()
    while len(chunks) * chunk < config["steps"] and (not chunks or time.perf_counter() - began < seconds):
        start = clock.mark()
        for _ in range(chunk):
            last = step()
        chunks.append(clock.elapsed_ms(start, clock.mark()) / chunk)
    step_ms = statistics.median(chunks)
    return {"steps": len(chunks) * chunk, "step_ms": step_ms, "chunk_step_ms": chunks,
            "sec_per_epoch": step_ms / 1e3 * layers.EPOCH_IMAGES / config["batch"], "final_loss": float(last)}


OURS = (("ours", "tf32"), ("ours_bf16", "bf16"))   # our runs' names and precisions (kernels.precision())


TORCH_GRAPHS = ("torch_bf16",)   # PyTorch's settings also run as one CUDA graph ("<setting>_graph")


def runs(config, torch):
    """(name, make_step, clock framework, setting) for every run to time: ours in a precision of OURS,
    PyTorch in a setting of bench.op_times.SETTINGS, and as a graph for those of TORCH_GRAPHS."""
    images, labels = random_data(config)
    graphs = config["device"] == "cuda"   # graphs are the GPU's
    for name, chosen in OURS:
        yield name, lambda: ours_step(config, images, labels), "ours", chosen
        if graphs:
            yield f"{name}_graph", lambda: ours_graph_step(config, images, labels), "ours", chosen
    if torch is not None:
        for setting, tf32, mixed in SETTINGS:
            for graph in (False, True) if graphs and setting in TORCH_GRAPHS else (False,):
                yield setting + "_graph" * graph, lambda mixed=mixed, graph=graph: torch_step(
                    torch, config, images, labels, mixed, graph), "torch", (tf32, mixed, graph)


def run(out, seconds_per_run, dry_run=False):
    config = DRY if dry_run else FULL
    torch, why_not = load_torch(config["device"])
    result = {"environment": report.environment(), "config": config, "hyperparameters": hyperparameters(),
              "torch": why_not or "compared", "runs": {}}
    for name, make_step, side, setting in runs(config, torch):
        clock = timing.clock(side, config["device"], torch)
        if side == "torch":
            tf32, mixed, graph = setting
            with precision(torch, tf32) as flags, tuned(torch) as tuning:
                measured = {**time_steps(make_step(), clock, config, seconds_per_run),
                            "precision": {**flags, **tuning, "autocast": "bfloat16" if mixed else None,
                                          "cuda_graph": graph}}
        else:
            with kernels.use_precision(setting):
                measured = {**time_steps(make_step(), clock, config, seconds_per_run),
                            "precision": {"kernels": setting}}
        result["runs"][name] = measured
        print(f"{name:15s} {measured['steps']:4d} steps, {measured['step_ms']:8.2f} ms/step, "
              f"{measured['sec_per_epoch']:7.2f} sec/epoch, last loss {measured['final_loss']:.4f}", flush=True)
        report.write_json(out, result)
    for mine in [name for name in result["runs"] if name.startswith("ours")]:   # each of ours over every other run
        t = result["runs"][mine]["sec_per_epoch"]
        result[f"{mine}_over"] = {name: t / r["sec_per_epoch"] for name, r in result["runs"].items() if name != mine}
    report.write_json(out, result)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--seconds-per-run", type=float, default=25.0,
                   help="stop timing a run after this many seconds, even short of its steps (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the NumPy backend, on the CPU")
    args = p.parse_args(argv)
    run(args.out, args.seconds_per_run, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
