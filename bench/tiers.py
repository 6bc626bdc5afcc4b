"""The GPU check of this project in one command: within about 6 minutes on one H200, in tiers, each tier's
results written to --out as soon as it ends, so that a run cut off early still leaves results.

  a  first every kernel family compiled for the GPU at once (python -m kernels.cuda.compile_all), then
     the tensor-core wrappers on the GPU against their emulation, fragment by fragment
     (pytest -m gpu tests/test_tensor_core.py: it proves the PTX strings mean what the emulator runs),
     then the tensor-core convolutions against float64 of their TF32-rounded inputs and beside
     cuDNN (tests/test_conv_tc.py), and the BF16 ones against float64 of their bfloat16 inputs and
     beside cuDNN on the same inputs (tests/test_conv_bf16.py), then a CUDA graph of a training step replayed against eager steps
     (tests/test_graph.py), then the GPU tests on small shapes of the fp32 kernels and all
     the others (pytest -m gpu tests/test_kernels_cuda.py), then
     compute-sanitizer memcheck and racecheck over one small training step (bench/sanitizer_step.py),
     where compute-sanitizer is on PATH or in $CUDA_HOME/bin
  b  the full-shape GPU tests: every op at every ResNet-18 layer shape at batch 256, and odd shapes,
     against PyTorch float64 (tests/test_gpu_full.py)
  c  each op forward and backward at every ResNet-18 layer shape at batch 256, beside PyTorch with
     TF32 off and with its defaults, and in bf16 beside PyTorch under autocast to bfloat16 with
     channels_last: ms, TFLOP/s, GB/s (bench/op_times.py)
  d  100 training steps at batch 256, ours eagerly and as a CUDA graph (the trainer's default), in
     tf32 and in bf16, beside PyTorch eager with TF32 off, with its defaults and under autocast to
     bfloat16 with channels_last: sec/epoch (bench/train_times.py)
  e  one epoch on the full data: train_resnet.py --gpus 1 --epochs 1, and its test accuracy; then the
     same in bf16 (--precision bf16)
  f  the per-layer profile: the profiler's GPU test (pytest -m gpu tests/test_profiler.py), then
     python -m profiler at batch 256 (20 steps): profile.json, profile.csv, profile.png and the
     timeline profile.trace.json
  g  NCCL data parallelism: the communicator, the trainer through NCCL in a world of one against the
     trainer without it, and two GPUs against one where there are two (tests/test_gpu_nccl.py)

Budget: before each tier the time left is checked; a tier starts only when its usual time on one
H200 fits in what is left (the usual times of all tiers add up to the default budget or less), and
it runs as subprocesses in their own sessions, killed at the tier's own limit or at the end of the
budget, whichever comes first, so one hang cannot eat the budget. Tiers that do not fit are
recorded as skipped, with the reason.

Output in --out: summary.json and summary.txt (rewritten after every tier; the text is printed
last), tier_<t>.json per tier, and each command's log (tier_<t>_<step>.log), pytest's junit XML,
ops.json, training.json, the epoch's output folder and the profile's.
Exit status: 0 when every selected tier passed (a dry run: every tier it covers); 1 when one
failed, timed out or was skipped; 2 when there is no GPU (nothing ran; the summary says so).
"""
import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench import report
from bench.summary import summary_lines
from kernels import SIMULATED_GPUS

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
the NumPy backend, and tiers e, f and g on simulated GPUs (KERNELS_SIMULATED_GPUS, kernels/simulated,
the emulator's sanitizer off): the epoch through --gpus 2, the profile on one, and the NCCL tests on two."""


@dataclasses.dataclass(frozen=True)
class Tier:
    key: str
    title: str
    estimate_s: float    # about what it takes on one H200: it starts only if this much is left
    limit_s: float       # its own timeout
    run: object          # run(Run) -> a dict of results
    dry_run: bool        # whether --dry-run runs it (on the CPU, or on simulated GPUs)


class Run:
    """One tier under way: its deadline, where its files go, and the commands it has run."""

    def __init__(self, args, tier, timeout):
        self.args, self.tier = args, tier
        self.deadline = time.monotonic() + timeout
        self.commands = []

    def left(self):
        return self.deadline - time.monotonic()

    def path(self, name):
        return self.args.out / f"tier_{self.tier.key}_{name}"

    def command(self, name, argv, limit=None, simulated_gpus=0):
        """Run argv from the repository root, its output in tier_<t>_<name>.log, within `limit`
        seconds and the tier's deadline; on that many simulated GPUs when a dry run asks for them."""
        timeout = min(limit or float("inf"), self.left())
        if timeout < MIN_COMMAND_S:
            result = {"name": name, "argv": [str(a) for a in argv], "status": "skipped",
                      "reason": "no time left in the tier"}
        else:
            # a dry run rehearses this check's plumbing, not the kernels (their tests run them under the
            # emulator's sanitizer): the simulated GPUs run them without it, at the emulator's full speed
            env = {SIMULATED_GPUS: str(simulated_gpus), "CUDA_EMU_SANITIZE": "off"} \
                if simulated_gpus and self.args.dry_run else {}
            result = {"name": name, **run_command(argv, self.path(f"{name}.log"), timeout, env)}
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
    """pytest -m gpu on one file, with its junit XML; the counts read back from it."""
    xml = run.path(f"{name}.xml")
    result = run.command(name, [PYTHON, "-m", "pytest", path, "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
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
               "graph": pytest_gpu(run, "graph", "tests/test_graph.py", limit=30),
               "pytest": pytest_gpu(run, "pytest", "tests/test_kernels_cuda.py", limit=90)}
    sanitizer = report.compute_sanitizer()
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


def layer_profile(run):
    results = {} if run.args.dry_run else {"pytest": pytest_gpu(run, "pytest", "tests/test_profiler.py", limit=40)}
    out = run.path("profile")
    # the dry run: the same command on a simulated GPU, on a narrow model and a small batch
    shape = ["--width", "2", "--batch-size", "4", "--steps", "1", "--warmup", "1"] \
        if run.args.dry_run else ["--batch-size", "256", "--steps", "20", "--warmup", "3"]
    run.command("profile", [PYTHON, "-m", "profiler", "--device", "cuda", *shape, "--out", out], simulated_gpus=1)
    results["profile"] = report.read_json(out / "profile.json")
    return results


TIERS = (
    Tier("a", "GPU tests on small shapes; compute-sanitizer memcheck and racecheck", 100, 190, small_tests, False),
    Tier("b", "full-shape GPU tests against PyTorch float64", 45, 100, full_tests, False),
    Tier("c", "each op at every ResNet-18 layer shape, batch 256, beside PyTorch", 45, 100, op_times, True),
    Tier("d", "100 training steps at batch 256, eager and as a CUDA graph, tf32 and bf16, beside PyTorch eager",
         55, 120, train_times, True),
    Tier("e", "one epoch on the full data in tf32 and one in bf16, train_resnet.py --gpus 1", 75, 200, epoch, True),
    Tier("f", "per-layer profile of a training step at batch 256, python -m profiler", 25, 75, layer_profile, True),
    Tier("g", "NCCL data parallelism: world of one through the trainer; two GPUs where present", 15, 90,
         nccl_tests, True),
)


# ---- running the tiers within the budget ----------------------------------------------------

def run_tier(tier, args, left):
    """The tier's result: its own (or why it was skipped), with its status, time and commands."""
    head = {"tier": tier.key, "title": tier.title}
    if args.dry_run and not tier.dry_run:
        return {**head, "status": "not run", "reason": "needs a GPU: a dry run covers tiers c, d, e, f and g"}
    if left < tier.estimate_s:
        return {**head, "status": "skipped",
                "reason": f"{max(left, 0):.0f} s of the {args.budget_seconds:.0f} s budget left; this tier takes "
                          f"about {tier.estimate_s:.0f} s"}
    timeout = min(tier.limit_s, left)
    print(f"tier {tier.key}: {tier.title} (at most {timeout:.0f} s)", flush=True)
    began, run = time.monotonic(), Run(args, tier, timeout)
    try:
        details = tier.run(run)
    except Exception as e:  # a fault of the check itself: recorded, and the next tier still runs
        details = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    result = {**head, "status": status(run.commands, details), "seconds": round(time.monotonic() - began, 1),
              "timeout_s": round(timeout), **details, "commands": run.commands}
    print(f"tier {tier.key}: {result['status']} in {result['seconds']:.0f} s", flush=True)
    return result


def status(commands, details):
    """passed, failed, timeout, skipped (a command or all its tests were), or what the tier said."""
    if "status" in details:
        return details["status"]
    if any(c.get("timed_out") for c in commands):
        return "timeout"
    if any(c.get("rc") not in (0, None) for c in commands):
        return "failed"
    tests = [c["tests"] for c in commands if "tests" in c]
    if any(c.get("status") == "skipped" for c in commands) or any(t is None or t["passed"] == 0 for t in tests):
        return "skipped"
    if any(v is None for k, v in details.items() if k in ("ops", "training", "epoch", "epoch_bf16", "profile")):
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


def parse_args(argv):
    from training.fashion_mnist import resolve_dir
    p = argparse.ArgumentParser(prog="bench/gpu_check", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(resolve_dir()), metavar="DIR",
                   help="the Fashion-MNIST folder, with its four .gz files (default: $FASHION_MNIST_DIR, else "
                        "./data/fashion-mnist)")
    p.add_argument("--out", metavar="DIR", default=time.strftime("runs/gpu-check-%Y%m%d-%H%M%S"),
                   help="results folder (default: runs/gpu-check-<date>-<time>)")
    every = ",".join(t.key for t in TIERS)
    p.add_argument("--tiers", default=every, metavar=every,
                   help="the tiers to run, comma-separated (default: %(default)s)")
    p.add_argument("--budget-seconds", type=float, default=365, metavar="S",
                   help="total time for all tiers; a tier that would not fit is skipped (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiers c, d (NumPy backend), e, f and g (simulated GPUs), tiny, through the same code: "
                        "checks the check")
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.tiers.split(",") if k.strip()]
    unknown = sorted(set(keys) - {t.key for t in TIERS})
    if unknown or not keys:
        p.error(f"--tiers takes letters among {','.join(t.key for t in TIERS)}, got {args.tiers!r}")
    args.tiers = [t for t in TIERS if t.key in keys]
    args.out = Path(args.out).resolve()
    args.data_dir = str(Path(args.data_dir).resolve())
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": ["bench/gpu_check", *(sys.argv[1:] if argv is None else argv)], "started": report.now(),
               "out": str(args.out), "data_dir": args.data_dir, "budget_s": args.budget_seconds,
               "dry_run": args.dry_run, "environment": probe(), "tiers": {}}
    reason = None if args.dry_run else no_gpu_reason(summary["environment"])
    if reason:
        summary["nothing_ran"] = reason
        for tier in args.tiers:
            summary["tiers"][tier.key] = {"tier": tier.key, "title": tier.title, "status": "not run", "reason": reason}
        finish(summary, args.out, start)
        print(f"bench/gpu_check: {reason}; nothing ran (summary in {args.out})", file=sys.stderr)
        return 2
    for tier in args.tiers:
        result = run_tier(tier, args, args.budget_seconds - (time.monotonic() - start))
        summary["tiers"][tier.key] = result
        report.write_json(args.out / f"tier_{tier.key}.json", result)
        report.write_json(args.out / "summary.json", summary)
    finish(summary, args.out, start)
    return 0 if all(t["status"] in ("passed", "not run") for t in summary["tiers"].values()) else 1


def finish(summary, out, start):
    """summary.json and summary.txt, final; the text printed last."""
    summary["finished"], summary["seconds"] = report.now(), round(time.monotonic() - start, 1)
    report.write_json(out / "summary.json", summary)
    text = "\n".join(summary_lines(summary)) + "\n"
    (out / "summary.txt").write_text(text)
    print(text, end="", flush=True)
