"""Tier (k) of bench/gpu_check: where a training step's GPU time goes, kernel by kernel, ours beside
PyTorch's, at batch 256 (bench/train_times.py's steps, on random images).

  PYTHONPATH=. python -m bench.kernel_times --out kernels.json                         # every run
  PYTHONPATH=. python -m bench.kernel_times --out kernels.json --runs torch_bf16_compiled --add
  PYTHONPATH=. python -m bench.kernel_times --ncu-step bf16      # one step, for ncu --profile-from-start off
  KERNELS_SIMULATED_GPUS=1 PYTHONPATH=. python -m bench.kernel_times --dry-run --out kernels.json

The runs (RUNS): ours eagerly in the tf32 and the bf16 precision ("ours_tf32", "ours_bf16"; on a GPU of compute
capability 9.0 also "ours_bf16_mma" and "ours_tf32_mma", under KERNELS_HOPPER=0: conv_bf16.cu's and conv_tc.cu's
mma.sync kernels, those an A100 runs, where conv_sm90.cu's run in "ours_bf16" and "ours_tf32"); d2l's
model in PyTorch with cudnn.benchmark on (cuDNN times every algorithm of a convolution once and keeps
the fastest, as a user tuning for speed sets it): with its defaults (cuDNN's convolutions in TF32,
"torch_tf32"), under autocast to bfloat16 with the model and its input channels_last ("torch_bf16"),
the same captured as one CUDA graph ("torch_bf16_graph"), and the same with the model under
torch.compile ("torch_bf16_compiled"; bench/gpu_check runs it in a process of its own with a time
limit, since its compilation may take long or fail).

Per run: the step time from CUDA events (train_times.time_steps: the median of chunks of steps),
then a few steps recorded by CUPTI through torch.profiler with CUDA activity only, which sees every
kernel, memset and copy on the GPU, CuPy's included; their trace is written beside the JSON file
(<out>.<run>.trace.json, for Perfetto). From it, per kernel name: calls and microseconds per step,
and its kind (KINDS, kind_of): our kernels by the family of kernels/cuda that defines them, PyTorch's
by their names. Then totals by kind and the step's kernel total, "kernel_ms_per_step", which tier f
holds the profiler's layer times to.

The dry run (tiny shapes, no GPU): ours on a simulated GPU (kernels/simulated: the CUDA launchers on
the CPU emulator), PyTorch on the CPU. CUPTI sees nothing there, so the JSON's "recorded" says what
stands in for it: for ours the kernels the launchers looked up, one a launch (Backend.function), by
name, with no durations (a kernel time of None); for PyTorch its CPU ops (aten::...) with their own
time as torch.profiler's CPU activity records it. The graph needs a GPU and is not run; torch.compile
runs with the "eager" backend (TorchDynamo's capture, no code generation).

--ncu-step PRECISION runs warm-up steps of ours and then one step between cudaProfilerStart and
cudaProfilerStop, for `ncu --profile-from-start off`; ncu_filter and ncu_launches build ncu's kernel
filter and read its CSV (bench/gpu_check runs ncu's SpeedOfLight section this way over the launches of
the slowest kernels). It needs a GPU: the simulated ones have no profiler to start.
"""
import argparse
import collections
import csv
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from unittest import mock

import kernels
from bench import layers, report, timing, train_times
from bench.op_times import load_torch, precision
from kernels.cuda import conv_sm90

CONVOLUTION, ELEMENTWISE, OTHER = "convolution", "batch norm and elementwise", "other"
KINDS = (CONVOLUTION, ELEMENTWISE, OTHER)
# our families (kernels.cuda.FAMILIES) by kind: the convolutions; the batch norm, the element-wise kernels
# (casts, relu, the batch's gather) and the pooling; the linear layer, the loss and SGD
FAMILY_KINDS = {"conv": CONVOLUTION, "conv_tc": CONVOLUTION, "conv_bf16": CONVOLUTION, "conv_sm90": CONVOLUTION,
                "batchnorm": ELEMENTWISE,
                "elementwise": ELEMENTWISE, "pool": ELEMENTWISE, "linear": OTHER, "loss": OTHER, "optim": OTHER}
# PyTorch's kernels by name, the first that matches (lower case): Inductor's generated kernels (triton_poi_, _red_,
# _per_: fused element-wise work and reductions, whatever op they were fused from) and the batch norm first; then
# the convolutions: cuDNN's and the kernels cuDNN ships (xmma implicit GEMMs, its cutlass__5x_cudnn, the workspace
# and split-K kernels of its engines, and its layout transposes nchwToNhwc/nhwcToNchw, run only to feed a
# convolution NHWC); then the linear layer's GEMMs (cuBLAS's, and the cutlass ones it runs) as other, as ours
# are; then ATen's element-wise kernels, reductions, copies and fills, CuPy's (cupy_fill), and the device's
# memsets and copies. What is left is other too: the loss, the optimizer's multi_tensor_apply.
NAME_KINDS = ((ELEMENTWISE, ("triton_", "batch_norm", "cudnn::bn_", "bn_fw_", "bn_bw_")),
              (CONVOLUTION, ("cudnn", "xmma", "implicit_gemm", "conv", "wgrad", "dgrad", "fprop", "nchwtonhwc",
                             "nhwctonchw")),
              (OTHER, ("gemm", "cublas")),
              (ELEMENTWISE, ("elementwise", "reduce_kernel", "gather", "copy", "fill", "memset", "memcpy",
                             "cupy_")))
GPU_EVENTS = ("kernel", "gpu_memset", "gpu_memcpy")   # the chrome trace's categories of work on the GPU
CPU_EVENTS = ("cpu_op",)
# ours: the precision, and the environment it runs in ("ours_bf16_mma", "ours_tf32_mma": KERNELS_HOPPER=0, the
# mma.sync kernels on a Hopper, beside conv_sm90's; elsewhere the same kernels, so they are not run)
OURS = {"ours_tf32": ("tf32", {}), "ours_bf16": ("bf16", {}), "ours_bf16_mma": ("bf16", {"KERNELS_HOPPER": "0"}),
        "ours_tf32_mma": ("tf32", {"KERNELS_HOPPER": "0"})}
TORCH = {"torch_tf32": {"mixed": False}, "torch_bf16": {"mixed": True},
         "torch_bf16_graph": {"mixed": True, "graph": True}, "torch_bf16_compiled": {"mixed": True, "compiled": True}}
RUNS = tuple(OURS) + tuple(TORCH)
FULL = {"device": "cuda", "torch_device": "cuda", "batch": layers.BATCH, "width": 64, "steps": 30, "warmup": 3,
        "chunk": 10, "batches": 16, "recorded_steps": 3, "compile_backend": "inductor",
        "recorded": {"ours": "cuda", "torch": "cuda"}}
DRY = {"device": "cuda", "torch_device": "cpu", "batch": 4, "width": 2, "steps": 1, "warmup": 1, "chunk": 1,
       "batches": 2, "recorded_steps": 1, "compile_backend": "eager", "recorded": {"ours": "launches", "torch": "cpu"}}
RECORDED = {   # what stands for the GPU's kernels (config["recorded"]), in the JSON's words
    "cuda": "CUPTI (torch.profiler, CUDA activity): every kernel, memset and copy on the GPU, with its time",
    "launches": "a simulated GPU: the kernels our launchers looked up, one a launch, by name; no durations (None): "
                "CUPTI sees no kernels without a GPU",
    "cpu": "PyTorch on the CPU: its ops (aten::...) with their own time from torch.profiler's CPU activity, in "
           "place of kernels: CUPTI sees no kernels without a GPU"}


# ---- kernel names and kinds ----------------------------------------------------------------

def short_name(name):
    """A kernel's name without its return type and parameter list: 'conv_bf16_wgrad<Bf128x128, 32>' for
    CUPTI's 'void conv_bf16_wgrad<Bf128x128, 32>(bf16 const*, ...)' and for ncu's way of writing it."""
    name = name.replace("(anonymous namespace)::", "").strip()
    name = name[5:] if name.startswith("void ") else name
    depth = 0
    for i, c in enumerate(name):
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0 and i > 0:
            return name[:i].strip()
    return name


def function_name(name):
    """The function a kernel is an instance of: 'conv_bf16_wgrad' for any of its templates."""
    return short_name(name).split("<")[0].strip()


@functools.cache
def our_kernels():
    """{function name: kind} of every __global__ function in the sources of kernels/cuda's families; a
    function that several families compile (common.cuh's, included by each) has their kind if they agree,
    else OTHER."""
    from kernels.cuda import FAMILIES, source
    kinds = collections.defaultdict(set)
    for family in FAMILIES:
        for name in re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", source(family)):
            kinds[name].add(FAMILY_KINDS[family])
    return {name: next(iter(k)) if len(k) == 1 else OTHER for name, k in kinds.items()}


def kind_of(name):
    """CONVOLUTION, ELEMENTWISE or OTHER for a kernel's name (or, in a dry run, a PyTorch op's)."""
    ours = our_kernels().get(function_name(name))
    if ours:
        return ours
    lower = name.lower()
    return next((kind for kind, parts in NAME_KINDS if any(p in lower for p in parts)), OTHER)


# ---- recording a step's kernels ------------------------------------------------------------

def event_table(events, steps, categories, nested=False):
    """[{name, calls_per_step, us_per_step, kind}] from chrome-trace events of `steps` steps, slowest first:
    the events of `categories`, each by its duration; `nested` (CPU ops, which hold the ops they call): by
    its own time, what the events nested in it on its thread did not take. Kernels are never nested, even
    where two overlap on one stream (a launch that starts before the one before it ends)."""
    chosen = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "dur" in e),
                    key=lambda e: (str(e.get("pid")), str(e.get("tid")), e["ts"], -e["dur"]))
    own, open_, where = [], [], None
    for e in chosen:
        if (e.get("pid"), e.get("tid")) != where:
            open_, where = [], (e.get("pid"), e.get("tid"))
        while open_ and open_[-1][1] <= e["ts"]:
            open_.pop()
        own.append([e["name"], float(e["dur"])])
        if nested and open_ and e["ts"] + e["dur"] <= open_[-1][1]:
            own[open_[-1][0]][1] -= float(e["dur"])
        open_.append((len(own) - 1, e["ts"] + e["dur"]))
    calls, micros = collections.Counter(), collections.Counter()
    for name, us in own:
        calls[name] += 1
        micros[name] += us
    return sorted(({"name": n, "calls_per_step": calls[n] / steps, "us_per_step": round(micros[n] / steps, 3),
                    "kind": kind_of(n)} for n in calls), key=lambda r: (-r["us_per_step"], r["name"]))


def profiled(torch, step, steps, sync, activity, trace):
    """Run `steps` steps under torch.profiler with one activity (CUDA or CPU), its trace written to `trace`:
    the kernel table (event_table)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        for _ in range(steps):
            step()
        sync()
    prof.export_chrome_trace(str(trace))
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return event_table(events, steps, *((GPU_EVENTS, False) if activity == "CUDA" else (CPU_EVENTS, True)))


def launched(step, steps, sync):
    """The kernel table of `steps` steps of ours on a simulated GPU: calls per step, no durations."""
    calls = collections.Counter()
    with kernels.backend_of(kernels.cupy_module().zeros(1)).observing_launches(lambda family, name: calls.update((name,))):
        for _ in range(steps):
            step()
        sync()
    return sorted(({"name": n, "calls_per_step": c / steps, "us_per_step": None, "kind": kind_of(n)}
                   for n, c in calls.items()), key=lambda r: (-r["calls_per_step"], r["name"]))


def totals(rows):
    """The run's kernel figures: kernel_ms_per_step (None without durations), kernels_per_step, by_kind."""
    timed = bool(rows) and all(r["us_per_step"] is not None for r in rows)

    def ms(chosen):
        return round(sum(r["us_per_step"] for r in chosen) / 1e3, 4) if timed else None
    by_kind = {kind: {"ms_per_step": ms([r for r in rows if r["kind"] == kind]),
                      "calls_per_step": sum(r["calls_per_step"] for r in rows if r["kind"] == kind)} for kind in KINDS}
    return {"kernel_ms_per_step": ms(rows), "kernels_per_step": sum(r["calls_per_step"] for r in rows),
            "by_kind": by_kind}


# ---- the runs --------------------------------------------------------------------------------


def measure(name, config, torch, data, trace, seconds):
    """One run: its step time, precision and kernels (a dict for the JSON)."""
    steps, recorded = config["recorded_steps"], config["recorded"]
    if name in OURS:
        if recorded["ours"] == "cuda" and torch is None:
            raise RuntimeError("CUPTI is reached through torch.profiler, and PyTorch cannot use the GPU here")
        chosen, environment = OURS[name]
        if environment and not conv_sm90.available(kernels._device_backend("cuda")):
            return {"not_run": "KERNELS_HOPPER=0 changes nothing on a GPU whose compute capability is not 9.0"}
        sync = kernels.cupy_module().cuda.Device().synchronize
        with kernels.use_precision(chosen), mock.patch.dict(os.environ, environment):
            step = train_times.ours_step(config, *data)
            timed = train_times.time_steps(step, timing.clock("ours", config["device"]), config, seconds)
            rows = profiled(torch, step, steps, sync, "CUDA", trace) if recorded["ours"] == "cuda" else \
                launched(step, steps, sync)
        return {**timed, "precision": {"kernels": chosen, **environment}, **totals(rows), "kernels": rows}
    if torch is None:
        raise RuntimeError("no PyTorch to run")
    options, device = TORCH[name], config["torch_device"]
    if options.get("graph") and device != "cuda":
        return {"not_run": "a CUDA graph needs a GPU"}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    compiled = config["compile_backend"] if options.get("compiled") else None
    with precision(torch, None) as flags, train_times.tuned(torch) as tuning:
        step = train_times.torch_step(torch, {**config, "device": device}, *data, options["mixed"],
                                      graph=options.get("graph", False), compiled=compiled)
        timed = train_times.time_steps(step, timing.clock("torch", device, torch), config, seconds)
        rows = profiled(torch, step, steps, sync, "CUDA" if recorded["torch"] == "cuda" else "CPU", trace)
    setting = {**flags, **tuning, "autocast": "bfloat16" if options["mixed"] else None,
               "cuda_graph": options.get("graph", False), "compile_backend": compiled}
    return {**timed, "precision": setting, **totals(rows), "kernels": rows}


def run(out, names, add=False, seconds=10.0, dry_run=False):
    """Measure the runs `names` into the JSON file `out` (with `add`, beside the runs it holds), each written
    as soon as it ends, and marked unfinished while it runs; True when every one of them finished."""
    config = DRY if dry_run else FULL
    out = Path(out)
    torch, why_not = load_torch(config["torch_device"])
    earlier = (report.read_json(out) or {}).get("runs", {}) if add else {}
    result = {"environment": report.environment(), "config": config, "torch": why_not or "compared",
              "recorded": {side: RECORDED[how] for side, how in config["recorded"].items()},
              "runs": dict(earlier)}
    data = train_times.random_data(config)
    finished = True
    for name in names:
        began = time.perf_counter()
        result["runs"][name] = {"unfinished": f"started at {report.now()}; did not end (killed, or crashed)"}
        report.write_json(out, result)
        try:
            measured = measure(name, config, torch, data, out.with_name(f"{out.stem}.{name}.trace.json"), seconds)
        except Exception as e:  # one run's failure costs that run alone
            measured, finished = {"error": f"{type(e).__name__}: {e}"}, False
        result["runs"][name] = {**measured, "wall_s": round(time.perf_counter() - began, 1)}
        report.write_json(out, result)
        print(run_line(name, result["runs"][name]), flush=True)
    return finished


def run_line(name, r):
    """One line of the log: a run's step, its kernels and the slowest of them."""
    if "step_ms" not in r:
        return f"{name:20s} {r.get('error') or r.get('not_run')}"
    kernel_ms = "-" if r["kernel_ms_per_step"] is None else f"{r['kernel_ms_per_step']:.3f}"
    slowest = ", ".join(f"{short_name(k['name'])[:40]} x{k['calls_per_step']:g}" for k in r["kernels"][:3])
    return (f"{name:20s} step {r['step_ms']:8.3f} ms, kernels {kernel_ms} ms, {r['kernels_per_step']:g} a step "
            f"({r['wall_s']} s): {slowest}")


# ---- ncu ---------------------------------------------------------------------------------------

def slowest_functions(rows, count=10):
    """The functions of the `count` slowest kernels of a run's table (several templates of one function
    are one name to ncu's filter), slowest first; [] without times."""
    timed = [r for r in rows or [] if r["us_per_step"] is not None][:count]
    return list(dict.fromkeys(function_name(r["name"]) for r in timed))


def ncu_filter(functions):
    """ncu's --kernel-name for kernels of these functions, whether ncu matches the function's name alone or
    the demangled name with its templates and parameters."""
    return "regex:^(void )?(" + "|".join(map(re.escape, functions)) + r")(<.*|\(.*)?$"


SOL = {"duration": "gpu__time_duration.sum", "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
       "memory_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"}
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def ncu_launches(text):
    """(csv_lines, launches) from a log holding ncu's `--csv --page raw` output among other lines: its CSV
    lines (ncu quotes every field), and per launch {kernel, duration_us, sm_pct, memory_pct}."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.DictReader(lines))
    units = next((r for r in rows if not (r.get("Kernel Name") or "").strip()), {})   # the row under the header
    launches = []
    for r in rows:
        if not (r.get("Kernel Name") or "").strip():
            continue
        values = {key: _number(r.get(metric)) for key, metric in SOL.items()}
        scale = TO_US.get((units.get(SOL["duration"]) or "ns").strip(), 1e-3)
        launches.append({"kernel": short_name(r.get("Kernel Name", "?")),
                         "duration_us": None if values["duration"] is None else values["duration"] * scale,
                         "sm_pct": values["sm_pct"], "memory_pct": values["memory_pct"]})
    return lines, launches


def _number(text):
    try:
        return float((text or "").replace(",", ""))
    except ValueError:
        return None


def ncu_by_kernel(launches):
    """Per kernel, slowest first: its launches, their microseconds, and SM % and memory % of peak throughput
    weighted by each launch's duration, with the lowest and highest launch's (launches with every figure)."""
    kept = collections.defaultdict(list)
    for launch in launches:
        if None not in launch.values() and launch["duration_us"] > 0:
            kept[launch["kernel"]].append(launch)
    table = []
    for kernel, chosen in kept.items():
        us = sum(x["duration_us"] for x in chosen)
        row = {"kernel": kernel, "launches": len(chosen), "us": round(us, 1)}
        for key in ("sm_pct", "memory_pct"):
            row[key] = round(sum(x[key] * x["duration_us"] for x in chosen) / us, 1)
            row[f"{key}_range"] = [min(x[key] for x in chosen), max(x[key] for x in chosen)]
        table.append(row)
    return sorted(table, key=lambda r: -r["us"])


def ncu_step(chosen):
    """Warm-up steps of ours in precision `chosen` (FULL's shapes), then one step between cudaProfilerStart and
    cudaProfilerStop."""
    cuda = kernels.cupy_module().cuda
    with kernels.use_precision(chosen):
        step = train_times.ours_step(FULL, *train_times.random_data(FULL))
        for _ in range(FULL["warmup"]):
            step()
        cuda.Device().synchronize()
        cuda.runtime.profilerStart()
        step()
        cuda.Device().synchronize()
        cuda.runtime.profilerStop()
    print(f"one {chosen} step of ours at batch {FULL['batch']} ran between cudaProfilerStart and Stop", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the JSON file to write")
    p.add_argument("--runs", default=",".join(RUNS), help="the runs, comma-separated (default: %(default)s)")
    p.add_argument("--add", action="store_true", help="keep the runs already in --out, adding these")
    p.add_argument("--seconds-per-run", type=float, default=10.0,
                   help="stop timing a run's steps after this many seconds (default %(default)s)")
    p.add_argument("--ncu-step", choices=sorted({chosen for chosen, _ in OURS.values()}), metavar="PRECISION",
                   help="only one step of ours in this precision (tf32 or bf16) between cudaProfilerStart and Stop")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes: ours on a simulated GPU, PyTorch on the CPU")
    args = p.parse_args(argv)
    if args.ncu_step:
        ncu_step(args.ncu_step)
        return 0
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if not args.out or not names or set(names) - set(RUNS):
        p.error(f"give --out FILE and --runs among {','.join(RUNS)}")
    return 0 if run(args.out, names, args.add, args.seconds_per_run, args.dry_run) else 1


if __name__ == "__main__":
    sys.exit(main())
