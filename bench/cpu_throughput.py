"""Training throughput of ResNet-18 on the CPU: this project's NumPy backend against PyTorch.

One training step is zero_grad, forward, softmax cross-entropy, backward and an SGD step
(lr 0.05, momentum 0.9, weight decay 5e-4), float32, on random 1x28x28 images and labels,
for the full-width model (nn.resnet18(), 11.2 M parameters; --width for another). PyTorch, when it is installed,
trains d2l's ResNet-18 (the builder in tests/test_torch_parity.py) in the same run with the
same batch sizes and thread count. The two take turns, a step each (a machine whose speed drifts,
as a shared one's does by tens of percent over minutes, slows both alike), each step timed with
time.perf_counter after the warm-up steps; the table gives the median (the machine may be shared,
and a median ignores the odd disturbed step), images/s from that median, and the ratio ours/PyTorch,
of the medians and of each turn's two steps (their median). Its "busy"
column is how many cores other processes kept busy meanwhile (from /proc/stat): a number
taken while it was above 0.1 is suspect, and the run says so.

    PYTHONPATH=. python -m bench.cpu_throughput                      # batch 32 and 128
    PYTHONPATH=. python -m bench.cpu_throughput --batch-sizes 32 --steps 20 --json out.json
    PYTHONPATH=. python -m bench.cpu_throughput --profile            # where our step's time goes
    PYTHONPATH=. python -m bench.cpu_throughput --width 16 --batch-sizes 256   # where the passes weigh the most

--profile times every kernel call of our step (kernels.cpu) and every helper function those
kernels call, and reports milliseconds per step for each, the rest being Python and the tape.
"""
import argparse
import functools
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # also as a script: bench/cpu_throughput.py

from bench import report, timing  # noqa: E402  (neither imports NumPy, see set_threads)


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="Each number is the median over --steps timed steps, after --warmup untimed ones.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="32,128",
                        help="comma-separated batch sizes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8,
                        help="timed training steps per batch size and framework (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps before timing (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64,
                        help="channels of the first stage, for both models (default: %(default)s, ResNet-18's; "
                             "at 16 the passes around the products weigh the most)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for OpenBLAS (ours) and PyTorch (default: their own "
                             "defaults, one per core)")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--profile", action="store_true",
                        help="also break our step down by kernel, in ms per step")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.steps < 1 or args.warmup < 0 or min(args.batch_sizes) < 1 or args.width < 1:
        parser.error("--steps, --width and the batch sizes must be positive, --warmup non-negative")
    return args


def set_threads(threads):
    """OpenBLAS reads its thread count when NumPy is first imported, so this runs before."""
    if threads is not None:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)


def timed_steps(step, warmup, steps):
    """Milliseconds of each of `steps` steps, after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    clock = timing.WallClock()
    return [timing.time_ms(step, clock) for _ in range(steps)]


def busy_cpu_seconds():
    """CPU seconds that all processes have spent busy since boot (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _, _, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(steps_of, warmup, steps):
    """Each step's times (ms), the steps taking turns (ours, PyTorch's, ours, ...: a machine whose speed
    drifts slows both alike), and how many cores other processes kept busy meanwhile: the machine may be
    shared, and a number taken while someone else ran their tests is suspect."""
    for step in steps_of:
        for _ in range(warmup):
            step()
    busy, own, start = busy_cpu_seconds(), os.times(), time.perf_counter()
    clock, times = timing.WallClock(), [[] for _ in steps_of]
    for _ in range(steps):
        for step, kept in zip(steps_of, times):
            kept.append(timing.time_ms(step, clock))
    wall, after = time.perf_counter() - start, os.times()
    others = None
    if busy is not None:
        ours = (after.user + after.system) - (own.user + own.system)
        others = max(0.0, busy_cpu_seconds() - busy - ours) / wall
    return times, others


def ours_step(batch_size, width=64):
    """A training step of this project's ResNet-18 on fixed random data, as a closure."""
    import numpy as np
    import nn
    nn.manual_seed(0)
    model = nn.resnet18(width=width)
    opt = nn.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    g = np.random.default_rng(0)
    x = nn.Tensor(g.random((batch_size, 1, 28, 28), dtype=np.float32))
    y = g.integers(0, 10, size=batch_size)

    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return step


def torch_step(batch_size, width=64):
    """The same step in PyTorch, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_torch_parity import torch_resnet18   # the one copy of d2l's model in the repo
    torch.manual_seed(0)
    model = torch_resnet18(10, 1, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    x = torch.rand(batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (batch_size,))

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return step


def summary(measured, batch_size):
    times, others = measured
    median = statistics.median(times)
    return {"step_ms": median, "min_ms": min(times), "max_ms": max(times),
            "images_per_s": 1e3 * batch_size / median, "step_times_ms": times,
            "other_processes_cores": others}


# ---- profile: wall time inside each kernel and helper ------------------------------------

class KernelProfiler:
    """Wall time in every kernel of kernels.cpu and in every helper function its modules call.

    ``total`` is inclusive; ``own`` leaves out the time in wrapped callees, so the helpers'
    own times and the kernels' own times add up to the kernels' total. Only the calls of the thread that
    installed it are timed: a pass that the kernels cut into parts on several threads
    (kernels/cpu/_parallel.py's each) is one row, "<the function whose parts they are> (parts)", its wall
    time, the calls inside its parts untimed.
    """

    def __init__(self):
        self.total, self.own = defaultdict(float), defaultdict(float)
        self._callee_time = []   # one entry per wrapped call in progress
        self._thread = threading.get_ident()

    def install(self):
        import inspect
        import kernels.cpu as K
        public = {n for n in dir(K) if inspect.isfunction(getattr(K, n))}
        for name in public:
            setattr(K, name, self._wrap(name, getattr(K, name)))
        for module in [m for m in vars(K).values() if inspect.ismodule(m)]:
            short = module.__name__.rsplit(".", 1)[-1]
            for name, fn in list(vars(module).items()):
                if (inspect.isfunction(fn) and name not in public
                        and fn.__module__.startswith(K.__name__)):
                    setattr(module, name, self._wrap(f"{short}.{name}", fn))

    def clear(self):
        self.total.clear()
        self.own.clear()

    def _wrap(self, name, fn):
        from kernels.cpu import _parallel
        parts = (fn.__module__, fn.__name__) == (_parallel.__name__, "each")

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != self._thread or getattr(_parallel._inside, "part", False):
                return fn(*args, **kwargs)
            label = f"{name.split('.')[0]}.{args[0].__qualname__.split('.<locals>')[0]} (parts)" if parts else name
            self._callee_time.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.total[label] += elapsed
                self.own[label] += elapsed - self._callee_time.pop()
                if self._callee_time:
                    self._callee_time[-1] += elapsed
        return timed


def profile(batch_sizes, warmup, steps, width):
    profiler = KernelProfiler()
    profiler.install()
    return [profile_one(b, warmup, steps, profiler, width) for b in batch_sizes]


def profile_one(batch_size, warmup, steps, profiler, width):
    step = ours_step(batch_size, width)
    for _ in range(warmup):
        step()
    profiler.clear()
    step_ms = sum(timed_steps(step, 0, steps)) / steps
    per_step = {name: 1e3 * seconds / steps for name, seconds in profiler.total.items()}
    own = {name: 1e3 * seconds / steps for name, seconds in profiler.own.items()}
    kernels = sorted((n for n in per_step if "." not in n), key=lambda n: -per_step[n])
    helpers = sorted((n for n in per_step if "." in n), key=lambda n: -own[n])
    other = step_ms - sum(per_step[n] for n in kernels)
    share = lambda ms: f"{100 * ms / step_ms:5.1f}%"   # noqa: E731
    print(f"\nProfile, batch {batch_size}: ms per step, mean of {steps} steps")
    print(f"  {'kernel':34s} {'total':>8} {'share':>6} {'own code':>9}")
    for name in kernels:
        print(f"  {name:34s} {per_step[name]:8.1f} {share(per_step[name])} {own[name]:9.1f}")
    print(f"  {'other (Python, tape, hooks)':34s} {other:8.1f} {share(other)}")
    print(f"  {'step':34s} {step_ms:8.1f}")
    print(f"  {'helper (own time, without callees)':34s} {'own':>8} {'share':>6}")
    for name in helpers:
        if own[name] >= 0.05:
            print(f"  {name:34s} {own[name]:8.1f} {share(own[name])}")
    return {"batch_size": batch_size, "steps": steps, "step_ms": step_ms,
            "total_ms": per_step, "own_ms": own, "other_ms": other}


# ---- main ----------------------------------------------------------------------------------

def environment(threads):
    """bench.report's environment, and what a CPU number depends on: the CPU, its memory,
    NumPy's BLAS and the thread counts."""
    import numpy as np
    info = report.environment()
    info.update(cpu=_proc_field("/proc/cpuinfo", "model name"), cpus=os.cpu_count(),
                memory=_proc_field("/proc/meminfo", "MemTotal"),
                blas_threads=os.environ.get("OPENBLAS_NUM_THREADS", "OpenBLAS default"))
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info["numpy_blas"] = f"{blas.get('name')} {blas.get('version')}"
    except Exception:   # show_config's dict form is NumPy >= 1.26; the BLAS name is a nicety
        info["numpy_blas"] = "unknown"
    info["blas_kernels"] = blas_kernels()
    try:
        import torch
        if threads is not None:
            torch.set_num_threads(threads)
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def blas_kernels():
    """The kernels NumPy's BLAS picked for this CPU (OpenBLAS's core type, as threadpoolctl reads it; a
    build with DYNAMIC_ARCH picks at run time, unless OPENBLAS_CORETYPE forces it), or why unknown."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (pip install threadpoolctl)"
    found = [f"{i.get('internal_api')} {i.get('architecture')}" for i in threadpool_info()
             if i.get("user_api") == "blas"]
    if not found:
        return "unknown"
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return ", ".join(found) + (f" (forced by OPENBLAS_CORETYPE={forced})" if forced else "")


def _proc_field(path, name):
    """The value of the first `name: value` line of a /proc file, or None."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
    except OSError:
        return None


def main():
    args = parse_args()
    set_threads(args.threads)
    env = environment(args.threads)
    print(f"ResNet-18 (width {args.width}) training step, float32, 1x28x28, median of {args.steps} steps "
          f"after {args.warmup} warm-up\n" + ", ".join(
              f"{k} {env.get(k)}" for k in ("date", "cpu", "cpus", "memory", "python", "numpy", "numpy_blas",
                                            "blas_kernels", "blas_threads", "torch", "torch_threads")))
    results = []
    for batch_size in args.batch_sizes:
        steps_of = [ours_step(batch_size, args.width)]
        theirs = None if args.no_torch else torch_step(batch_size, args.width)
        steps_of += [] if theirs is None else [theirs]
        times, others = measure(steps_of, args.warmup, args.steps)
        row = {"batch_size": batch_size, "ours": summary((times[0], others), batch_size)}
        if theirs is not None:
            row["pytorch"] = summary((times[1], others), batch_size)
            row["ratio"] = row["ours"]["images_per_s"] / row["pytorch"]["images_per_s"]
            row["ratio_of_turns"] = statistics.median(t / o for o, t in zip(*times))
        results.append(row)
        print_row(row, first=len(results) == 1)
    result = {"environment": env, "command": " ".join(sys.argv), "width": args.width, "steps": args.steps,
              "warmup": args.warmup, "results": results}
    if args.profile:
        result["profile"] = profile(args.batch_sizes, min(args.warmup, 1), min(args.steps, 3), args.width)
    if args.json:
        report.write_json(args.json, result)


def print_row(row, first):
    if first:
        print(f"\n{'batch':>5} | {'ours ms/step':>18} {'img/s':>7} {'busy':>5} | "
              f"{'PyTorch ms/step':>18} {'img/s':>7} {'busy':>5} | {'ours/PyTorch':>12}")
        print("(ms/step: median [min-max]; busy: cores other processes kept busy meanwhile; ours/PyTorch: of the\n"
              " medians, and in brackets the median of each turn's ratio, PyTorch's step over ours just before)")
    cells = [f"{row['batch_size']:>5}"]
    for name, width in (("ours", 18), ("pytorch", 18)):
        r = row.get(name)
        if r is None:
            cells.append(f"{'-':>{width}} {'-':>7} {'-':>5}")
            continue
        busy = "?" if r["other_processes_cores"] is None else f"{r['other_processes_cores']:.2f}"
        spread = f"{r['step_ms']:.0f} [{r['min_ms']:.0f}-{r['max_ms']:.0f}]"
        cells.append(f"{spread:>{width}} {r['images_per_s']:>7.1f} {busy:>5}")
    cells.append(f"{row['ratio']:>5.2f} ({row['ratio_of_turns']:.2f})" if "ratio" in row else f"{'-':>12}")
    print(" | ".join(cells), flush=True)
    disturbed = [n for n in ("ours", "pytorch")
                 if ((row.get(n) or {}).get("other_processes_cores") or 0) > 0.1]
    if disturbed:
        print(f"      note: other processes were busy during {' and '.join(disturbed)}; "
              f"consider a rerun")


if __name__ == "__main__":
    main()
