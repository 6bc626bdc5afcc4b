"""The short report bench/gpu_check prints last, from summary.json alone: each tier's status; the ops at
batch 256, ours beside PyTorch; training sec/epoch; a step's kernels by kind, ours beside PyTorch's, our
slowest kernels and ncu's speed of light for them; the profiler's layers against those kernels; the
epochs' test accuracy in tf32 and in bf16."""
from bench.kernel_times import CONVOLUTION, ELEMENTWISE, KINDS, OTHER, short_name
from bench.op_times import PEERS

PHASES = ("forward", "backward")
CONV_TARGET = 1.25   # every convolution within this factor of cuDNN's time in the same precision
# our side and PyTorch's whose convolutions are held to CONV_TARGET, and what PyTorch runs there
CONV_PEERS = (("ours", "torch_default", "cuDNN TF32"), ("ours_bf16", "torch_bf16", "cuDNN BF16 under autocast"))
EPOCHS = (("epoch", "tf32"), ("epoch_bf16", "bf16"))   # tier e's results and their precisions
# tier k: each of our runs beside the PyTorch run whose convolutions round as ours do
KERNEL_PEERS = (("ours_tf32", "torch_tf32"), ("ours_bf16", "torch_bf16"), ("ours_bf16_mma", "torch_bf16"),
                ("ours_tf32_mma", "torch_tf32"))
SLOWEST = 8   # our kernels listed per run
KIND_HEADS = {CONVOLUTION: "convolution", ELEMENTWISE: "bn+elementwise", OTHER: "other"}


def summary_lines(summary):
    tiers = summary["tiers"]
    lines = header(summary) + [""] + tier_lines(tiers)
    ops, training, measured = (tiers.get(k, {}).get(name) for k, name in (("c", "ops"), ("d", "training"),
                                                                           ("k", "kernels")))
    if ops and ops.get("rows"):
        lines += [""] + ops_lines(ops)
    if training and training.get("runs"):
        lines += [""] + training_lines(training)
    if measured and measured.get("runs"):
        lines += [""] + kernel_lines(measured, tiers["k"].get("ncu") or {})
    if tiers.get("f", {}).get("against_kernels"):
        lines += [""] + against_kernels_lines(tiers["f"]["against_kernels"])
    epochs = [epoch_line(tiers["e"][key], precision) for key, precision in EPOCHS if tiers.get("e", {}).get(key)]
    if epochs:
        lines += [""] + epochs
    return lines


def header(summary):
    env = summary.get("environment", {})
    gpus = ", ".join(env.get("gpus") or []) or "no GPU"
    parts = [f"{gpus} (driver {env.get('driver')})", f"CUDA runtime {env.get('cuda_runtime')}",
             f"CuPy {env.get('cupy')}", f"PyTorch {env.get('torch')}", f"cuDNN {env.get('cudnn')}"]
    kind = " (dry run: CPU and simulated GPUs)" if summary.get("dry_run") else ""
    lines = [f"bench/gpu_check{kind}: " + ", ".join(parts),
             f"{summary.get('seconds', 0):.0f} s of the {summary['budget_s']:.0f} s budget; "
             f"results in {summary['out']}"]
    if summary.get("nothing_ran"):
        lines.append(f"NOTHING RAN: {summary['nothing_ran']}")
    return lines


def tier_lines(tiers):
    lines = [f"{'tier':4s}  {'status':8s} {'seconds':>7s}  result"]
    for key, t in tiers.items():
        seconds = f"{t['seconds']:.0f}" if "seconds" in t else "-"
        lines.append(f"{key:4s}  {t['status']:8s} {seconds:>7s}  {outcome(t)}")
    return lines


def outcome(t):
    """One line of what a tier found."""
    if "reason" in t:
        return t["reason"]
    parts = [f"compile: {command_state(t['compile'])}"] if "compile" in t else []
    for run in ("wrappers", "tensor_cores", "tensor_cores_bf16", "graph", "pytest"):
        if run in t:
            counts = t[run].get("tests")
            parts.append(f"{run}: " + (", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "errors", "skipped"))
                                       if counts else f"no junit XML, see {t[run].get('log')}"))
    if "sanitizer" in t:
        parts.append(t["sanitizer"])
    for tool in ("memcheck", "racecheck"):
        if tool in t:
            parts.append(f"{tool}: {t[tool].get('summary') or command_state(t[tool])}")
    if "ops" in t:
        parts.append(f"{len((t['ops'] or {}).get('rows', []))} layer shapes timed")
    if "training" in t:
        runs = (t["training"] or {}).get("runs", {})
        parts.append(", ".join(f"{name} {r['steps']} steps" for name, r in runs.items()) or "no run finished")
    if "kernels" in t:
        runs = (t["kernels"] or {}).get("runs", {})
        done = [name for name, r in runs.items() if "kernels" in r]
        parts.append(f"kernels of {len(done)} runs recorded" + "".join(
            f"; {name}: {why_not(r)}" for name, r in runs.items() if "kernels" not in r))
    if "ncu" in t:
        ncu = t["ncu"] or {}
        parts.append("ncu: " + (ncu["not_run"] if "not_run" in ncu else ", ".join(
            f"{precision} {r['not_run']}" if "not_run" in r else f"{precision} {r['launches']} launches read"
            for precision, r in ncu.items())))
    for precision, check in t.get("against_kernels", {}).items():
        parts.append(f"{precision} profile against tier k: " + (
            f"{check['ratio']:.2f}x, {check['status']}" if "ratio" in check else f"{check['status']}"))
    for key, precision in EPOCHS:
        if key in t:
            parts.append(f"{precision} test acc {t[key]['test_acc']:.4f}" if t[key] else
                         f"no {precision} epoch finished")
    failed = [c for c in t.get("commands", []) if c.get("rc") not in (0, None) or c.get("timed_out")]
    parts += [f"{c['name']}: {command_state(c)}, see {c['log']}" for c in failed]
    return "; ".join(parts)


def command_state(c):
    if c.get("status") == "skipped":
        return f"not run ({c['reason']})"
    return f"killed after {c['seconds']:.0f} s" if c.get("timed_out") else f"exit status {c['rc']}"


def ms(row, side):
    """'forward/backward' milliseconds of one side, or '-'."""
    times = [row[p][side]["ms"] for p in PHASES if p in row and side in row[p]]
    return "/".join(f"{t:.3f}" for t in times) if times else "-"


def ratio(row, ours, side):
    """ours / side over forward + backward, or None where a side is missing."""
    phases = [p for p in PHASES if p in row]
    if not all(side in row[p] and ours in row[p] for p in phases):
        return None
    total = sum(row[p][side]["ms"] for p in phases)
    return sum(row[p][ours]["ms"] for p in phases) / total if total > 0 else None


def _times(value):
    return f"{value:.2f}x" if value is not None else "-"


def ops_lines(ops):
    names = {"ours": "ours tf32", "ours_fp32": "ours fp32", "ours_bf16": "ours bf16", "torch_fp32": "torch TF32 off",
             "torch_default": "torch default", "torch_bf16": "torch autocast"}
    lines = [f"ops at batch {ops['config']['batch']}: ms per call forward/backward (median); "
             f"ratio = ours / PyTorch rounding as we do, forward + backward",
             f"{'layer':30s} {'n':>2s}  " + "  ".join(f"{names[o]:>15s} {names[t]:>15s} {'ratio':>6s}"
                                                      for o, t in PEERS.items())]
    for row in ops["rows"]:
        cells = [f"{ms(row, o):>15s} {ms(row, t):>15s} {_times(ratio(row, o, t)):>6s}" for o, t in PEERS.items()]
        lines.append(f"{row['layer'][:30]:30s} {row['count']:>2d}  " + "  ".join(cells))
    step = ops.get("per_step_ms") or {}
    if step.get("ours"):
        cells = [f"{_number(step.get(o))} {_number(step.get(t))} "
                 + (f"{step[o] / step[t]:>5.2f}x" if step.get(o) and step.get(t) else f"{'-':>6s}")
                 for o, t in PEERS.items()]
        lines.append(f"{'one step: sum of n x (fwd+bwd)':30s} {'':>2s}  " + "  ".join(cells))
    for ours, peer, what in CONV_PEERS:
        convs = [row for row in ops["rows"] if row["op"] == "conv2d" and ratio(row, ours, peer)]
        if convs:
            slow = [row["layer"] for row in convs if ratio(row, ours, peer) > CONV_TARGET]
            lines.append(f"{names[ours]} convolutions within {CONV_TARGET}x of {what}: {len(convs) - len(slow)} of "
                         f"{len(convs)}" + (f"; not: {', '.join(slow)}" if slow else ""))
    if ops.get("torch") != "compared":
        lines.append(f"PyTorch not compared: {ops.get('torch')}")
    return lines


def _number(value):
    return f"{value:>15.2f}" if value else f"{'-':>15s}"


def training_lines(training):
    config, hyper = training["config"], training["hyperparameters"]
    lines = [f"training ResNet-18 at batch {config['batch']} (lr {hyper['lr']}, momentum {hyper['momentum']}, "
             f"weight decay {hyper['weight_decay']}): sec/epoch of 60000 images"]
    overs = {mine: training[f"{mine}_over"] for mine in training["runs"] if f"{mine}_over" in training}
    for name, r in training["runs"].items():
        versus = "".join(f", {mine} / this {over[name]:.2f}x" for mine, over in overs.items() if name in over)
        lines.append(f"  {name:15s} {r['sec_per_epoch']:8.2f} s  ({r['step_ms']:.1f} ms/step, median of "
                     f"{r['steps']} steps{versus})")
    if training.get("torch") != "compared":
        lines.append(f"  PyTorch not compared: {training.get('torch')}")
    return lines


def why_not(run):
    """Why a run of tier k has no kernels: its error, that it did not finish, or that it was not run."""
    return run.get("error") or run.get("not_run") or f"unfinished ({run.get('unfinished')})"


def _ms(value, width=9):
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}s}"


def kernel_lines(measured, ncu):
    """Tier k: per run the step, its kernels and their kinds; our slowest kernels beside PyTorch's
    convolutions in the same precision; ncu's speed of light for ours."""
    runs = measured["runs"]
    lines = [f"a training step's kernels at batch {measured['config']['batch']}, ms per step: the step by CUDA events, "
             f"the kernels added up, by kind"] + [f"  {side}: {how}" for side, how in measured["recorded"].items()]
    lines.append(f"  {'run':20s} {'step':>9s} {'kernels':>9s} {'launches':>9s}  " +
                 " ".join(f"{KIND_HEADS[kind]:>14s}" for kind in KINDS))
    for name, r in runs.items():
        if "kernels" not in r:
            lines.append(f"  {name:20s} {why_not(r)}")
            continue
        lines.append(f"  {name:20s} {_ms(r['step_ms'])} {_ms(r['kernel_ms_per_step'])} {r['kernels_per_step']:>9g}  " +
                     " ".join(_ms(r["by_kind"][kind]["ms_per_step"], 14) for kind in KINDS))
    for ours, peer in KERNEL_PEERS:
        if "kernels" not in runs.get(ours, {}):
            continue
        convolutions = (runs.get(peer) or {}).get("by_kind", {}).get(CONVOLUTION)
        beside = f"; {peer}'s convolutions: {_ms(convolutions['ms_per_step'], 0)} ms in " \
                 f"{convolutions['calls_per_step']:g} launches" if convolutions else ""
        lines.append(f"the slowest kernels of {ours}: us per step, launches per step, kind{beside}")
        for k in runs[ours]["kernels"][:SLOWEST]:
            us = f"{k['us_per_step']:9.1f}" if k["us_per_step"] is not None else f"{'-':>9s}"
            lines.append(f"  {us} x{k['calls_per_step']:<4g} {short_name(k['name'])[:60]:60s} {k['kind']}")
    for precision, r in ncu.items() if "not_run" not in ncu else ():
        if r.get("by_kernel"):
            lines.append(f"ncu's speed of light for ours_{precision} ({r['csv']}): launches, us, SM % and memory % of "
                         f"peak throughput (weighted by duration; the lowest and highest launch's)")
            lines += [f"  {k['kernel'][:50]:50s} {k['launches']:>3d} {k['us']:9.1f}  SM {k['sm_pct']:5.1f} "
                      f"({k['sm_pct_range'][0]:.1f}-{k['sm_pct_range'][1]:.1f})  memory {k['memory_pct']:5.1f} "
                      f"({k['memory_pct_range'][0]:.1f}-{k['memory_pct_range'][1]:.1f})" for k in r["by_kernel"]]
    return lines


def against_kernels_lines(checks):
    """Tier f: each profile's layers added up beside tier k's kernel time of the same step."""
    lines = ["the profiler's layers added up against tier k's kernels of the same step (ms per step)"]
    for precision, c in checks.items():
        if "ratio" in c:
            lines.append(f"  {precision}: layers {c['profile_ms']:.2f}, kernels {c['kernel_ms']:.2f}, ratio "
                         f"{c['ratio']:.3f}: {c['status']} (within {c['tolerance']:.0%} passes)")
        else:
            lines.append(f"  {precision}: {c['status']}: {c['reason']}")
    return lines


def epoch_line(e, precision):
    return (f"one epoch in {precision}, train_resnet.py: test acc {e['test_acc']:.4f}, train loss "
            f"{e['train_loss']:.4f}, {e['seconds']:.1f} s, {e['images_per_sec']:.0f} images/s")
