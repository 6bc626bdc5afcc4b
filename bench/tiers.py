"""The GPU check of this project in one command: within 6 minutes on one H200, NVRTC's compile of every
kernel family included, in tiers run in this order, most valuable first, each tier's results written to
--out as soon as it ends, so that a run cut off early still leaves results.

  a  first every kernel family compiled for the GPU at once (python -m kernels.cuda.compile_all), then
     the tensor-core wrappers on the GPU against their emulation, fragment by fragment
     (pytest -m gpu tests/test_tensor_core.py: it proves the PTX strings mean what the emulator runs),
     then the tensor-core convolutions against float64 of their TF32-rounded inputs and beside
     cuDNN (tests/test_conv_tc.py), and the BF16 ones against float64 of their bfloat16 inputs and
     beside cuDNN on the same inputs (tests/test_conv_bf16.py), then, where the GPU is a Hopper, sm90.cuh's
     instructions against the NumPy models the emulator is held to (tests/test_sm90_emu.py) and Hopper's
     convolutions against float64 (tests/test_conv_sm90.py), then a CUDA graph of a training step
     replayed against eager steps (tests/test_graph.py), then the GPU tests on small shapes of the fp32
     kernels and all the others (pytest -m gpu tests/test_kernels_cuda.py), then compute-sanitizer
     memcheck and racecheck over one small training step (bench/sanitizer_step.py), where
     compute-sanitizer is on PATH or in $CUDA_HOME/bin
  b  the full-shape GPU tests: every op at every ResNet-18 layer shape at batch 256, and odd shapes,
     against PyTorch float64 (tests/test_gpu_full.py)
  d  100 training steps at batch 256, ours eagerly and as a CUDA graph (the trainer's default), in
     tf32 and in bf16, beside PyTorch with cudnn.benchmark on: eager with TF32 off, with its defaults
     and under autocast to bfloat16 with channels_last, and that last one captured as one CUDA graph:
     sec/epoch (bench/train_times.py)
  k  where a step's GPU time goes, kernel by kernel (CUPTI through torch.profiler): ours eagerly in tf32
     and bf16, beside PyTorch with cudnn.benchmark on (TF32; bf16 autocast channels_last; that as one
     CUDA graph): per run the step, per kernel its calls, microseconds and kind, totals by kind
     (bench/kernel_times.py); then, with the time the later tiers leave it, where ncu is on PATH or in
     $CUDA_HOME/bin, its SpeedOfLight section (clocks left alone) over the launches of the ten slowest
     kernels of one bf16 step of ours (tier_k_ncu_bf16.csv), PyTorch's bf16 step under torch.compile
     (in a process of its own with a time limit), and ncu over a tf32 step of ours where the time left
     is as long as the bf16 one took
  f  the per-layer profile: the profiler's GPU test (pytest -m gpu tests/test_profiler.py), then
     python -m profiler at batch 256 (20 steps) in tf32 and in bf16, each into its own folder
     (profile.json, profile.csv, profile.png, profile.trace.json); each profile's layers' GPU times
     added up must be within 10 % of tier k's kernel time of the same step (tier_k_kernels.json),
     or the tier fails; without tier k that comparison is not made, and said so
  g  NCCL data parallelism: the communicator, the trainer through NCCL in a world of one against the
     trainer without it, and two GPUs against one where there are two (tests/test_gpu_nccl.py)
  c  each op forward and backward at every ResNet-18 layer shape at batch 256, beside PyTorch with
     TF32 off and with its defaults, and in bf16 beside PyTorch under autocast to bfloat16 with
     channels_last: ms, TFLOP/s, GB/s (bench/op_times.py). Not in the default: it does not fit the 6
     minutes after the others (give --tiers c, about 30 s; tier k times the same work kernel by kernel)
  e  one epoch on the full data: train_resnet.py --gpus 1 --epochs 1, and its test accuracy; then the
     same in bf16 (--precision bf16). Not in the default: it does not fit the 6 minutes after the
     others (give --tiers e, about 75 s), and needs --data-dir

Budget: before each tier the time left is checked; a tier starts only when its usual time on one
H200 fits in what is left (the usual times of the default tiers add up to the default budget or less),
and it runs as subprocesses in their own sessions, killed at the tier's own limit or at the end of the
budget, whichever comes first, so one hang cannot eat the budget; within a tier a command that fails
or hangs costs that command alone. Tiers that do not fit are recorded as skipped, with the reason.
Tiers d, k and f load the kernels tier a compiled: on a fresh machine run a with them.

Output in --out: summary.json and summary.txt (rewritten after every tier; the text is printed
last), tier_<t>.json per tier, and each command's log (tier_<t>_<step>.log), pytest's junit XML,
ops.json, training.json, kernels.json with each run's trace, the ncu CSVs, the epochs' output folders
and the profiles'. --archive FILE.tar.gz: all of that in one archive, rewritten after every tier and
at the end (also when the check is stopped by Ctrl-C or SIGTERM), replaced whole each time.
Exit status: 0 when every selected tier passed (a dry run: every tier it covers); 1 when one
failed, timed out or was skipped; 2 when there is no GPU (nothing ran; the summary says so) or
--archive names a file that cannot be written (nothing ran).
"""
import argparse
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench import kernel_times, report
from bench.summary import summary_lines
from kernels import SIMULATED_GPUS
from nn.serialization import file_kind

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
MIN_COMMAND_S = 5        # a command that would get less time than this is not started
STARTUP_S = 15           # what a tier's process spends importing and building before it times runs
EPOCH_S = 100            # the most one epoch of tier e may take, so that the other still gets its turn
TEN_EPOCHS = ("PYTHONPATH=. python3 train_resnet.py --gpus 1 --epochs 10 --batch-size 256 --lr 0.1 \\\n"
              "      --data-dir DIR --out runs/resnet18-1gpu-10-epochs")
EPILOG = f"""The 10-epoch run on one GPU is a separate command (not part of this check):
  {TEN_EPOCHS}

--dry-run checks the check without a GPU, through the same code with tiny shapes: tiers c and d on
the NumPy backend, and tiers k, e, f and g on simulated GPUs (KERNELS_SIMULATED_GPUS, kernels/simulated,
the emulator's sanitizer off): tier k's ours on one, its PyTorch on the CPU (CUPTI sees no kernels
there: tier_k_kernels.json's "recorded" says what stands in for them, and ncu is not run), the epoch
through --gpus 2, the profiles on one, and the NCCL tests on two; --archive as on a GPU."""


@dataclasses.dataclass(frozen=True)
class Tier:
    key: str
    title: str
    estimate_s: float    # about what it takes on one H200: it starts only if this much is left
    limit_s: float       # its own timeout
    run: object          # run(Run) -> a dict of results
    dry_run: bool        # whether --dry-run runs it (on the CPU, or on simulated GPUs)


class Run:
    """One tier under way: its deadline, where its files go, and the commands it has run; `spare`:
    the seconds of the budget that the tiers after it do not need (by their estimates)."""

    def __init__(self, args, tier, timeout, spare=float("inf")):
        self.args, self.tier = args, tier
        now = time.monotonic()
        self.deadline, self.spare_until = now + timeout, now + spare
        self.commands = []

    def left(self):
        return self.deadline - time.monotonic()

    def spare(self):
        """What the tier may still spend on extras without taking the later tiers' time."""
        return min(self.left(), self.spare_until - time.monotonic())

    def path(self, name):
        return self.args.out / f"tier_{self.tier.key}_{name}"

    def command(self, name, argv, limit=None, simulated_gpus=0, optional=False, spare_only=False):
        """Run argv from the repository root, its output in tier_<t>_<name>.log, within `limit`
        seconds and the tier's deadline (`spare_only`: and the time the later tiers leave, spare());
        on that many simulated GPUs when a dry run asks for them. An `optional` command's failure,
        time-out or skip is reported but does not fail the tier; a `spare_only` one is optional."""
        optional = optional or spare_only
        timeout = min(limit or float("inf"), self.spare() if spare_only else self.left())
        if timeout < MIN_COMMAND_S:
            result = {"name": name, "argv": [str(a) for a in argv], "status": "skipped",
                      "reason": "no time to spare in the budget" if spare_only else "no time left in the tier"}
        else:
            # a dry run rehearses this check's plumbing, not the kernels (their tests run them under the
            # emulator's sanitizer): the simulated GPUs run them without it, at the emulator's full speed
            env = {SIMULATED_GPUS: str(simulated_gpus), "CUDA_EMU_SANITIZE": "off"} \
                if simulated_gpus and self.args.dry_run else {}
            result = {"name": name, **run_command(argv, self.path(f"{name}.log"), timeout, env)}
        if optional:
            result["optional"] = True
        self.commands.append(result)
        return result


def run_command(argv, log, timeout, env=None):
    """{argv, log, rc, seconds, timed_out}: argv run in its own session (so that its children go
    with it), killed when `timeout` seconds have passed; ``env``: more environment variables."""
    extra = env or {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", **extra}
    began = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + "".join(f"{k}={v} " for k, v in extra.items()) + " ".join(map(str, argv)) + "\n")
        out.flush()
        process = subprocess.Popen([str(a) for a in argv], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = process.wait(timeout), False
        except subprocess.TimeoutExpired:
            rc, timed_out = _stop(process), True
            out.write(f"\n[bench/gpu_check: killed after {timeout:.0f} s]\n")
        except BaseException:   # Ctrl-C: a child in its own session does not get it from the terminal
            _stop(process)
            raise
    return {"argv": [str(a) for a in argv], **({"env": extra} if extra else {}), "log": log.name, "rc": rc, "seconds": round(time.monotonic() - began, 1),
            "timed_out": timed_out}


def _stop(process):
    """End the process's whole session: SIGTERM, then SIGKILL after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            return process.wait(grace)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


# ---- the tiers ---------------------------------------------------------------------------------

def pytest_gpu(run, name, path, limit=None, simulated_gpus=0):
    """pytest -m gpu on one file (or a tuple of them), with its junit XML; the counts read back from it."""
    xml = run.path(f"{name}.xml")
    paths = list(path) if isinstance(path, tuple) else [path]
    result = run.command(name, [PYTHON, "-m", "pytest", *paths, "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                                f"--junitxml={xml}"], limit, simulated_gpus)
    result["tests"] = junit_counts(xml)
    return result


def junit_counts(xml):
    """{tests, passed, failed, errors, skipped} from pytest's junit XML; None without one."""
    try:
        root = ElementTree.parse(xml).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = counts.pop("failures")
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def small_tests(run):
    # every kernel family compiled first, one process each, into CuPy's disk cache: the commands below load
    # them, where each compiled its own in turn within its limit (conv_tc alone takes NVRTC a minute or more)
    results = {"compile": run.command("compile", [PYTHON, "-m", "kernels.cuda.compile_all"], limit=150),
               "wrappers": pytest_gpu(run, "wrappers", "tests/test_tensor_core.py", limit=30),
               "tensor_cores": pytest_gpu(run, "tensor_cores", "tests/test_conv_tc.py", limit=40),
               "tensor_cores_bf16": pytest_gpu(run, "tensor_cores_bf16", "tests/test_conv_bf16.py", limit=50),
               "hopper": pytest_gpu(run, "hopper", ("tests/test_sm90_emu.py", "tests/test_conv_sm90.py"), limit=30),
               "graph": pytest_gpu(run, "graph", "tests/test_graph.py", limit=30),
               "pytest": pytest_gpu(run, "pytest", "tests/test_kernels_cuda.py", limit=90)}
    sanitizer = report.cuda_tool("compute-sanitizer")
    if sanitizer is None:
        results["sanitizer"] = ("compute-sanitizer is not on PATH nor in $CUDA_HOME/bin: memcheck and racecheck "
                                "did not run")
        return results
    for tool in ("memcheck", "racecheck"):
        # API errors are left out: Python libraries probe the driver with calls that fail by design
        result = run.command(tool, [sanitizer, "--tool", tool, "--error-exitcode", "1", "--report-api-errors", "no",
                                    PYTHON, "-m", "bench.sanitizer_step"], limit=60)
        if "log" in result:
            result["summary"] = last_line_with(run.args.out / result["log"], "SUMMARY")
        results[tool] = result
    return results


def last_line_with(path, text):
    """The last line of a log that contains `text` ('ERROR SUMMARY: 0 errors'), or None."""
    try:
        lines = [line.strip("= \n") for line in path.read_text(errors="replace").splitlines() if text in line]
    except OSError:
        return None
    return lines[-1] if lines else None


def full_tests(run):
    return {"pytest": pytest_gpu(run, "pytest", "tests/test_gpu_full.py")}


def dry(run):
    return ["--dry-run"] if run.args.dry_run else []


def op_times(run):
    out = run.path("ops.json")
    run.command("ops", [PYTHON, "-m", "bench.op_times", "--out", out, *dry(run)])
    return {"ops": report.read_json(out)}


def train_times(run):
    out = run.path("training.json")
    per_run = max(MIN_COMMAND_S, min(25, (run.left() - STARTUP_S) / 5))
    run.command("training", [PYTHON, "-m", "bench.train_times", "--out", out, "--seconds-per-run",
                             f"{per_run:.0f}", *dry(run)])
    return {"training": report.read_json(out)}


def epoch(run):
    from training import fashion_mnist
    folder = Path(run.args.data_dir)
    missing = [name for pair in fashion_mnist.FILES.values() for name in pair if not (folder / name).exists()]
    if missing:
        return {"status": "skipped", "reason": f"Fashion-MNIST is not in {folder} (missing {', '.join(missing)}): "
                                               f"give its folder with --data-dir"}
    # the dry run: on two simulated GPUs, through the launcher and NCCL, a few images of a narrow model
    device = ["--gpus", "2", "--limit", "16", "--test-limit", "16", "--width", "2", "--batch-size", "8"] \
        if run.args.dry_run else ["--gpus", "1"]
    results = {}
    for key, precision in (("epoch", "tf32"), ("epoch_bf16", "bf16")):
        out = run.path(key)
        run.command(key.replace("epoch", "train"), [PYTHON, "train_resnet.py", *device, "--precision", precision,
                                                    "--epochs", "1", "--data-dir", folder, "--out", out],
                    limit=EPOCH_S, simulated_gpus=2)
        metrics = report.read_json(out / "metrics.json")
        results[key] = metrics[-1] if metrics else None
    return results


def nccl_tests(run):
    # the limit is for a hang: the dry run's emulated trainers took 33 s on one 2-core machine and 50 s on a
    # slower one, where 55 s killed them; on a GPU the tier takes about 15 s
    return {"pytest": pytest_gpu(run, "pytest", "tests/test_gpu_nccl.py", limit=85, simulated_gpus=2)}


# Tier k: bench/kernel_times.py's runs of ours, then PyTorch's eager and graphed runs, each process on its own so
# that a crash costs its runs alone (limits that allow for a dry run's emulated steps); then, with the time the
# later tiers leave (Run.spare), ncu over a bf16 step of ours, torch.compile's run (its compilation may take long or
# fail), and ncu over a tf32 step where the time spared is as long as the bf16 one took. Those are optional: they
# are reported, but do not fail the tier.
NCU_S, COMPILED_S = 60, 60    # their limits
NCU_KERNELS = 10              # the slowest kernels of a step whose launches ncu reads
NCU_SECTION = ["--profile-from-start", "off", "--clock-control", "none", "--section", "SpeedOfLight", "--csv",
               "--page", "raw"]


def kernel_breakdown(run):
    out = run.path("kernels.json")

    def runs(name, names, limit, **options):
        run.command(name, [PYTHON, "-m", "bench.kernel_times", "--out", out, "--runs", names,
                           *(["--add"] if run.commands else []), *dry(run)], limit=limit, simulated_gpus=1, **options)
    runs("ours", "ours_tf32,ours_bf16,ours_bf16_mma,ours_tf32_mma", 100)
    runs("torch", "torch_tf32,torch_bf16,torch_bf16_graph", 60)
    ncu = speed_of_light(run, report.read_json(out), "bf16")
    runs("compiled", "torch_bf16_compiled", COMPILED_S, spare_only=True)
    measured = report.read_json(out)
    if "not_run" not in ncu:
        took = ncu["bf16"].get("seconds", 0)
        ncu.update(speed_of_light(run, measured, "tf32") if run.spare() >= took else {"tf32": {
            "not_run": f"{max(run.spare(), 0):.0f} s to spare in the budget, and bf16's took {took:.0f} s"}})
    return {"kernels": measured, "ncu": ncu}


def speed_of_light(run, measured, chosen):
    """ncu's SpeedOfLight section over the launches of the NCU_KERNELS slowest kernels of one step of ours in
    precision `chosen`, with the time the budget spares: {chosen: the functions filtered, the CSV and the
    launches by kernel (kernel_times.ncu_by_kernel), or {"not_run": why}}, or {"not_run": why} without ncu."""
    if run.args.dry_run:
        return {"not_run": "a dry run: no GPU for ncu to read"}
    ncu = report.cuda_tool("ncu")
    if ncu is None:
        return {"not_run": "ncu is not on PATH nor in $CUDA_HOME/bin: the SpeedOfLight sections were not read"}
    rows = (((measured or {}).get("runs") or {}).get(f"ours_{chosen}") or {}).get("kernels")
    functions = kernel_times.slowest_functions(rows, NCU_KERNELS)
    name = f"ncu_{chosen}"
    only = ["--kernel-name", kernel_times.ncu_filter(functions)] if functions else []
    command = run.command(name, [ncu, *NCU_SECTION, *only, PYTHON, "-m", "bench.kernel_times", "--ncu-step", chosen],
                          limit=NCU_S, spare_only=True)
    if command.get("status") == "skipped":
        return {chosen: {"not_run": command["reason"]}}
    try:
        lines, launches = kernel_times.ncu_launches(run.path(f"{name}.log").read_text(errors="replace"))
    except OSError:
        lines, launches = [], []
    if lines:
        run.path(f"{name}.csv").write_text("\n".join(lines) + "\n")
    return {chosen: {"functions": functions or f"every kernel of the step: tier k timed no ours_{chosen} run",
                     "csv": run.path(f"{name}.csv").name if lines else None, "launches": len(launches),
                     "seconds": command["seconds"], "by_kernel": kernel_times.ncu_by_kernel(launches)}}


PROFILE_TOLERANCE = 0.10   # the profiler's layers added up against tier k's kernel time of the same step
PROFILE_S = 50             # one profile's limit, so that a hang of the first leaves the second its time


def layer_profile(run):
    results = {} if run.args.dry_run else {"pytest": pytest_gpu(run, "pytest", "tests/test_profiler.py", limit=40)}
    # the dry run: the same commands on a simulated GPU, on a narrow model and a small batch
    shape = ["--width", "2", "--batch-size", "4", "--steps", "1", "--warmup", "1"] \
        if run.args.dry_run else ["--batch-size", "256", "--steps", "20", "--warmup", "3"]
    measured, why_not = kernel_tier_result(run)
    results["against_kernels"] = {}
    for chosen in ("tf32", "bf16"):
        out = run.path(f"profile_{chosen}")
        run.command(f"profile_{chosen}", [PYTHON, "-m", "profiler", "--device", "cuda", "--precision", chosen, *shape,
                                          "--out", out], limit=PROFILE_S, simulated_gpus=1)
        profile = results[f"profile_{chosen}"] = report.read_json(out / "profile.json")
        results["against_kernels"][chosen] = against_kernels(profile, measured, chosen) if measured else \
            {"status": "not made", "reason": why_not}
    return results


def kernel_tier_result(run):
    """(tier k's tier_k_kernels.json, None), or (None, why there is none to compare with)."""
    if "k" not in [t.key for t in run.args.tiers]:
        return None, "tier k was not among this check's tiers"
    measured = report.read_json(run.args.out / "tier_k_kernels.json")
    return (measured, None) if measured else (None, "tier k wrote no tier_k_kernels.json (skipped, or failed first)")


def against_kernels(profile, measured, chosen, tolerance=PROFILE_TOLERANCE):
    """Whether the profiler's numbers hold: its layers' GPU times added up (profile.json's
    step.rows_median_sum_ms) within `tolerance` of tier k's kernel time of the same step
    (runs.ours_<chosen>.kernel_ms_per_step): {status: passed, failed or "not made", profile_ms, kernel_ms,
    ratio, tolerance, reason}."""
    name = f"ours_{chosen}"
    profile_ms = ((profile or {}).get("step") or {}).get("rows_median_sum_ms")
    run = ((measured or {}).get("runs") or {}).get(name) or {}
    kernel_ms = run.get("kernel_ms_per_step")
    if profile_ms is None:
        return {"status": "not made", "reason": f"no {chosen} profile.json with step.rows_median_sum_ms"}
    if not kernel_ms:
        why = run.get("error") or run.get("unfinished") or run.get("not_run") or \
            (f"its kernels carry no times: {measured['recorded']['ours']}" if run else "no such run")
        return {"status": "not made", "profile_ms": profile_ms, "reason": f"tier k's {name} has no kernel time ({why})"}
    ratio = profile_ms / kernel_ms
    return {"status": "passed" if abs(ratio - 1) <= tolerance else "failed", "profile_ms": profile_ms,
            "kernel_ms": kernel_ms, "ratio": round(ratio, 4), "tolerance": tolerance}


# Tiers in the order they run, the most valuable first (a, b, d, k, f; k before f, which reads its kernel
# times), each with its usual time on one H200 (it starts only with that much of the budget left) and its own
# limit. The first H200 run (driver 580, 16 cores, bench/RESULTS.md) took: a 124 s, NVRTC's compile of every
# family 60 s of it from an empty cache; b 32; c 27; d 25, with 7 runs of 100 steps, to which the graph of
# PyTorch's bf16 step and cuDNN's benchmarking of each convolution's algorithms (in its first steps) add some
# 10 s; g 4 in a world of one. Tier f crashed at 5 s and e never ran; k is new. Their figures are what the
# parts would take by that run's: k, ours' process 20 s (imports, 3 x 36 steps of at most 19 ms, CUPTI's
# start; the third and fourth, bf16 and tf32 under KERNELS_HOPPER=0, new: a guess of 7 s more, tier a's compile
# having cached the kernels, taken from the time that ncu's and torch.compile's optional runs may spare), PyTorch's 25 (cuDNN's benchmarking twice, 3 x 36 steps), torch.compile's run 28 there (its compilation
# from an empty cache) and its process's imports, ncu over one bf16 step (some 90 launches of the functions of its
# ten slowest kernels) 25, a guess: that run did not record ncu's time; f, the profiler's GPU test and two
# profiles of 43 steps at batch 256, each process with its imports and chart; e, two processes that train an
# epoch of 4.3 s (2.7 in bf16) and evaluate it; tier a's Hopper tests (new, a guess: 9 small shapes' three GEMMs) 5 s.
# The default leaves out c and e: a, b, d, k, f and g add up to 360 s, the budget.
TIERS = (
    Tier("a", "GPU tests on small shapes; compute-sanitizer memcheck and racecheck", 130, 220, small_tests, False),
    Tier("b", "full-shape GPU tests against PyTorch float64", 35, 90, full_tests, False),
    Tier("d", "100 training steps at batch 256, eager and as a CUDA graph, tf32 and bf16, beside PyTorch tuned",
         35, 90, train_times, True),
    Tier("k", "a step's GPU time kernel by kernel, ours beside PyTorch's; ncu's speed of light", 105, 200,
         kernel_breakdown, True),
    Tier("f", "per-layer profiles of a training step at batch 256 in tf32 and bf16, against tier k", 45, 120,
         layer_profile, True),
    Tier("g", "NCCL data parallelism: world of one through the trainer; two GPUs where present", 10, 90,
         nccl_tests, True),
    Tier("c", "each op at every ResNet-18 layer shape, batch 256, beside PyTorch", 30, 100, op_times, True),
    Tier("e", "one epoch on the full data in tf32 and one in bf16, train_resnet.py --gpus 1", 75, 200, epoch, True),
)
DEFAULT_TIERS = "a,b,d,k,f,g"   # c and e left out: see above and the module's docstring


# ---- running the tiers within the budget ----------------------------------------------------

def run_tier(tier, args, left, reserve=0.0):
    """The tier's result: its own (or why it was skipped), with its status, time and commands; `reserve`:
    what the tiers after it need of the `left` seconds (by their estimates)."""
    head = {"tier": tier.key, "title": tier.title}
    if args.dry_run and not tier.dry_run:
        return {**head, "status": "not run",
                "reason": f"needs a GPU: a dry run covers tiers {', '.join(t.key for t in TIERS if t.dry_run)}"}
    if left < tier.estimate_s:
        return {**head, "status": "skipped",
                "reason": f"{max(left, 0):.0f} s of the {args.budget_seconds:.0f} s budget left; this tier takes "
                          f"about {tier.estimate_s:.0f} s"}
    timeout = min(tier.limit_s, left)
    print(f"tier {tier.key}: {tier.title} (at most {timeout:.0f} s)", flush=True)
    began, run = time.monotonic(), Run(args, tier, timeout, spare=left - reserve)
    try:
        details = tier.run(run)
    except Exception as e:  # a fault of the check itself: recorded, and the next tier still runs
        details = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    result = {**head, "status": status(run.commands, details), "seconds": round(time.monotonic() - began, 1),
              "timeout_s": round(timeout), **details, "commands": run.commands}
    print(f"tier {tier.key}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    return result


RESULTS = ("ops", "training", "kernels", "epoch", "epoch_bf16", "profile_tf32", "profile_bf16")   # None: missing


def status(commands, details):
    """passed, failed, timeout, skipped (a command or all its tests were), or what the tier said; an
    optional command's outcome does not count."""
    if "status" in details:
        return details["status"]
    commands = [c for c in commands if not c.get("optional")]
    if any(c.get("timed_out") for c in commands):
        return "timeout"
    if any(c.get("rc") not in (0, None) for c in commands):
        return "failed"
    tests = [c["tests"] for c in commands if "tests" in c]
    if any(c.get("status") == "skipped" for c in commands) or any(t is None or t["passed"] == 0 for t in tests):
        return "skipped"
    if any(v is None for k, v in details.items() if k in RESULTS):
        return "failed"
    if any(check["status"] == "failed" for check in details.get("against_kernels", {}).values()):
        return "failed"
    return "passed"


def probe():
    """The environment, as bench/report.py describes it, from a child process with a timeout (a
    broken driver may hang)."""
    try:
        done = subprocess.run([PYTHON, "-m", "bench.report"], cwd=ROOT, capture_output=True, text=True, timeout=90,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        return json.loads(done.stdout)
    except (subprocess.TimeoutExpired, ValueError) as e:
        return {"probe_error": f"{type(e).__name__}: {e}"}


def no_gpu_reason(env):
    if env.get("gpu_count", 0) >= 1:
        return None
    why = env.get("gpu_error") or env.get("cupy_error") or env.get("probe_error") or "CuPy sees no CUDA device"
    return f"no GPU: {why}"


# ---- the archive ---------------------------------------------------------------------------------

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")


def archive_problem(path):
    """Why --archive cannot be written at `path`, in one line (asked before anything runs: its folder is
    made and a file written and removed there); None when it can."""
    if not path.name.endswith(ARCHIVE_SUFFIXES):
        return f"--archive {path}: give a file name ending in .tar.gz or .tgz"
    kind = file_kind(path)
    if kind not in (None, "a regular file"):
        return f"--archive {path} is {kind}, not a file the archive can replace"
    return folder_problem(f"--archive {path}", path.parent)


def folder_problem(flag, folder):
    """Why `folder` cannot be made or written, in one line that begins with `flag` (the option and its path),
    asked before anything runs: it is made, and a file written and removed there; None when it can."""
    nearest = next(f for f in (folder, *folder.parents) if file_kind(f) is not None)   # the nearest that is
    if file_kind(nearest) != "a folder":
        return f"{flag}: {nearest} is {file_kind(nearest)}, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".written").write_bytes(b"")
        (folder / ".written").unlink()
    except OSError as e:
        return f"{flag}: cannot write there ({e.strerror or e})"
    return None


def write_archive(path, out):
    """Every file in the folder `out` (but files being written, *.part, and the archive itself) into the
    gzipped tar `path`, under the folder's name; written beside it and renamed over it, so that a check
    stopped mid-write leaves the previous archive whole."""
    partial = path.with_name(path.name + ".part")
    with tarfile.open(partial, "w:gz", compresslevel=6) as tar:
        for file in sorted(out.rglob("*")):
            if file.is_file() and not file.name.endswith(".part") and file.resolve() != path.resolve():
                tar.add(file, arcname=str(Path(out.name) / file.relative_to(out)), recursive=False)
    os.replace(partial, path)


def parse_args(argv):
    from training.fashion_mnist import resolve_dir
    p = argparse.ArgumentParser(prog="bench/gpu_check", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(resolve_dir()), metavar="DIR",
                   help="the Fashion-MNIST folder, with its four .gz files (default: $FASHION_MNIST_DIR, else "
                        "./data/fashion-mnist)")
    p.add_argument("--out", metavar="DIR", default=time.strftime("runs/gpu-check-%Y%m%d-%H%M%S"),
                   help="results folder (default: runs/gpu-check-<date>-<time>)")
    p.add_argument("--archive", metavar="FILE.tar.gz",
                   help="also one gzipped tar of every file in --out, rewritten after every tier and at the end")
    every = ",".join(t.key for t in TIERS)
    p.add_argument("--tiers", metavar=every,
                   help=f"the tiers to run, comma-separated; they run in the order above (default: {DEFAULT_TIERS}; "
                        f"with --dry-run every tier it covers)")
    p.add_argument("--budget-seconds", type=float, default=360, metavar="S",
                   help="total time for all tiers; a tier that would not fit is skipped (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiers c, d (NumPy backend), k, e, f and g (simulated GPUs), tiny, through the same code: "
                        "checks the check")
    args = p.parse_args(argv)
    args.tiers = args.tiers or (every if args.dry_run else DEFAULT_TIERS)
    keys = [k.strip() for k in args.tiers.split(",") if k.strip()]
    unknown = sorted(set(keys) - {t.key for t in TIERS})
    if unknown or not keys:
        p.error(f"--tiers takes letters among {every}, got {args.tiers!r}")
    args.tiers = [t for t in TIERS if t.key in keys]
    args.out = Path(args.out).resolve()
    args.data_dir = str(Path(args.data_dir).resolve())
    args.archive = Path(args.archive).resolve() if args.archive else None
    # argparse's usage is for a flag it cannot parse (above); a well-formed value that cannot serve is one line
    problem = budget_problem(args.budget_seconds) or (archive_problem(args.archive) if args.archive else None) or \
        folder_problem(f"--out {args.out}", args.out)   # the folder made last, when nothing else is wrong
    if problem:
        p.exit(2, f"{p.prog}: error: {problem}\n")
    return args


def budget_problem(seconds):
    """Why --budget-seconds cannot serve, in one line; None when it can."""
    return None if 0 < seconds < math.inf else f"--budget-seconds must be positive and finite, got {seconds}"


def _terminated(signum, frame):
    """SIGTERM as an exception, so that the running command's processes are stopped (run_command) and the
    summary and the archive are written before the check exits."""
    raise SystemExit(128 + signum)


def main(argv=None):
    args = parse_args(argv)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": ["bench/gpu_check", *(sys.argv[1:] if argv is None else argv)], "started": report.now(),
               "out": str(args.out), "archive": str(args.archive) if args.archive else None, "data_dir": args.data_dir,
               "budget_s": args.budget_seconds, "dry_run": args.dry_run, "environment": probe(), "tiers": {}}
    reason = None if args.dry_run else no_gpu_reason(summary["environment"])
    if reason:
        summary["nothing_ran"] = reason
        for tier in args.tiers:
            summary["tiers"][tier.key] = {"tier": tier.key, "title": tier.title, "status": "not run", "reason": reason}
        finish(summary, args, start)
        print(f"bench/gpu_check: {reason}; nothing ran (summary in {args.out})", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        for i, tier in enumerate(args.tiers):
            summary["tiers"][tier.key] = {"tier": tier.key, "title": tier.title, "status": "interrupted",
                                          "reason": "the check was stopped while this tier ran"}
            left = args.budget_seconds - (time.monotonic() - start)
            result = run_tier(tier, args, left, reserve=sum(t.estimate_s for t in args.tiers[i + 1:]))
            summary["tiers"][tier.key] = result
            report.write_json(args.out / f"tier_{tier.key}.json", result)
            save(summary, args)
    finally:
        signal.signal(signal.SIGTERM, previous)
        finish(summary, args, start)
    return 0 if all(t["status"] in ("passed", "not run") for t in summary["tiers"].values()) else 1


def save(summary, args):
    """summary.json and summary.txt as they stand, then the archive (where one was asked for): a failure to
    write the archive is recorded in the summary and said on stderr, and the check goes on."""
    report.write_json(args.out / "summary.json", summary)
    (args.out / "summary.txt").write_text("\n".join(summary_lines(summary)) + "\n")
    if args.archive:
        try:
            write_archive(args.archive, args.out)
        except OSError as e:
            summary["archive_error"] = f"{type(e).__name__}: {e}"
            report.write_json(args.out / "summary.json", summary)
            print(f"bench/gpu_check: cannot write the archive {args.archive}: {e}", file=sys.stderr)


def finish(summary, args, start):
    """summary.json, summary.txt and the archive, final; the text printed last."""
    summary["finished"], summary["seconds"] = report.now(), round(time.monotonic() - start, 1)
    save(summary, args)
    print((args.out / "summary.txt").read_text(), end="", flush=True)
