"""The report of a profile: a row per layer and span with its median times, costs, rates and
place under the roofs; the terminal table, profile.json, profile.csv and profile.png."""
import collections
import csv
import dataclasses
import io
import json
import os
import statistics
from pathlib import Path

import numpy as np

from nn.serialization import atomic_write, file_kind
from . import costs, trace
from .measure import PHASES, UNTRACKED, label
from .roofs import Peak


@dataclasses.dataclass
class Row:
    name: str               # dotted module name ('' for the model itself), or the span's name
    category: str           # layer, block (a container's own ops), data, loss, optimizer, ...
    kind: str               # the module's class, or the span's category
    output: tuple           # the module's output shape, or None
    ms: dict                # phase -> median ms per step
    cost: dict              # phase -> costs.Cost of the ops it ran
    kernels: dict           # phase -> {kernel name: launches per step}
    uncosted: list          # ops that profiler/costs.py has no formula for
    stage: str              # the model's top-level module it is in (resnet_block2), or a span's category
    block: str              # the second-level container it is in (resnet_block2.0), or its stage

    @property
    def total_ms(self):
        return sum(self.ms.values())

    @property
    def label(self):
        return label(self.name)

    def metrics(self, peak, step_ms):
        """The row's figures: times, share, FLOPs, bytes, rates, and its place under the roofs."""
        flops = sum(c.flops for c in self.cost.values())
        nbytes = sum(c.bytes for c in self.cost.values())
        ms = self.total_ms
        out = {"name": self.label, "category": self.category, "kind": self.kind, "stage": self.stage,
               "block": self.block, "output_shape": list(self.output) if self.output else None,
               **{f"{p}_ms": self.ms[p] for p in PHASES}, "total_ms": ms,
               "share": ms / step_ms if step_ms > 0 else None, "flops": flops, "bytes": nbytes,
               "tflops": flops / ms / 1e9 if ms > 0 else None, "gbs": nbytes / ms / 1e6 if ms > 0 else None,
               "intensity": flops / nbytes if nbytes else None, "bound": None, "peak_fraction": None,
               "flops_fraction": None, "bandwidth_fraction": None, "roofline_ms": None,
               "kernels": {p: dict(k) for p, k in self.kernels.items() if k}, "uncosted": self.uncosted}
        if peak is not None and nbytes and ms > 0:
            roof_ms = max(flops / (peak.tflops * 1e9), nbytes / (peak.gbs * 1e6))
            out.update(bound="compute" if flops / nbytes > peak.ridge else "memory", roofline_ms=roof_ms,
                       peak_fraction=roof_ms / ms, flops_fraction=out["tflops"] / peak.tflops,
                       bandwidth_fraction=out["gbs"] / peak.gbs)
        return out


def build_report(config, peak, kinds, inspection, profiled, plain, timeline):
    """The Report from the inspection step, the profiled steps' StepTimes, the plain steps' ms and
    the trace events of every rank (profiler/trace.py)."""
    ops, launches, shapes, order = inspection
    keys = order + [k for s in profiled for k, _ in s.exclusive if k not in order]
    rows = [_row(key, kinds, shapes, ops, launches, profiled) for key in dict.fromkeys(keys)]
    concurrent = collections.defaultdict(list)
    for s in profiled:
        for key, ms, overlap in s.concurrent:
            concurrent[key].append((ms, overlap))
    steps = [{"profiled_ms": s.total_ms, "covered_ms": s.covered_ms, "plain_ms": ms, "fed": s.fed}
             for s, ms in zip(profiled, plain)]
    return Report(config, peak, rows, steps,
                  {key: tuple(statistics.median(v) for v in zip(*times)) for key, times in concurrent.items()},
                  timeline)


def _row(key, kinds, shapes, ops, launches, profiled):
    name, category = key
    stage = block = category
    if key in kinds:     # a module: grouped by the containers its dotted name passes through
        stage = label(name.split(".")[0])
        second = ".".join(name.split(".")[:2])
        block = second if name and (second, "block") in kinds and second != stage else stage
    kind = kinds.get(key, category) + (" own ops" if category == "block" else "")
    ms = {p: statistics.median(s.exclusive.get((key, p), 0.0) for s in profiled) for p in PHASES}
    cost, uncosted = {}, []
    for p in PHASES:
        known = [(op, args, kwargs) for op, args, kwargs in ops.get((key, p), []) if hasattr(costs, op)]
        uncosted += [op for op, _, _ in ops.get((key, p), []) if not hasattr(costs, op)]
        cost[p] = sum((costs.cost_of(op, *args, **kwargs) for op, args, kwargs in known), costs.ZERO)
    output = tuple(shapes[key]) if shapes.get(key) is not None else None
    return Row(name, category, kind, output, ms, cost, {p: launches.get((key, p), {}) for p in PHASES},
               sorted(set(uncosted)), stage, block)


@dataclasses.dataclass
class Report:
    config: dict
    peak: Peak              # None for a GPU without figures in PEAKS
    rows: list              # in the order they first ran
    steps: list             # per profiled step: {profiled_ms, covered_ms, plain_ms (its plain neighbour), fed}
    concurrent: dict        # (name, category) -> (median ms, median ms overlapping backward)
    timeline: list          # the trace events of every rank's profiled steps (profiler/trace.py)

    @property
    def step_ms(self):
        """The median profiled step."""
        return statistics.median(s["profiled_ms"] for s in self.steps)

    @property
    def plain_step_ms(self):
        """The median step timed by one pair of marks."""
        return statistics.median(s["plain_ms"] for s in self.steps)

    @property
    def overhead_ms(self):
        return self.step_ms - self.plain_step_ms

    def starved(self):
        """The profiled steps in which the GPU waited for the host (measure.EventClock.ahead): their rows
        hold that wait too."""
        return sum(not s["fed"] for s in self.steps)

    def covered_fraction(self):
        """How much of a step its layers and spans account for (the median over the steps)."""
        return statistics.median(s["covered_ms"] / s["profiled_ms"] for s in self.steps)

    def rows_ms(self):
        """The layers' and spans' medians added up. Below the median step when other processes
        take the CPU at random places of each step: every step keeps its interruptions, while each
        row's median leaves them out."""
        return sum(r.total_ms for r in self.rows if r.category != UNTRACKED[1])

    def by_cost(self):
        return sorted(self.rows, key=lambda r: -r.total_ms)

    def to_json(self):
        metrics = [r.metrics(self.roofs(r), self.step_ms) for r in self.rows]
        return {"config": self.config,
                "device": {"peak": dataclasses.asdict(self.peak) if self.peak else None,
                           "ridge_flops_per_byte": self.peak.ridge if self.peak else None},
                "step": {"profiled_ms": self.step_ms, "plain_ms": self.plain_step_ms,
                         "overhead_ms": self.overhead_ms, "overhead_fraction": self.overhead_ms / self.plain_step_ms,
                         "covered_fraction": self.covered_fraction(), "rows_median_sum_ms": self.rows_ms(),
                         "gpu_waited_for_the_host": self.starved(), "each": self.steps},
                "rows": metrics, "groups": self.groups(),
                "concurrent": [{"name": n, "category": c, "ms": ms, "overlap_backward_ms": overlap,
                                "overlap_fraction": overlap / ms if ms > 0 else None}
                               for (n, c), (ms, overlap) in self.concurrent.items()]}

    def roofs(self, row):
        """The roofs of a row: the device's, with the compute roof of the tensor cores (TF32's or BF16's)
        for a row whose kernels multiply on them (roofs.Peak.of); None for a GPU without figures."""
        return self.peak.of([name for names in row.kernels.values() for name in names]) if self.peak else None

    def groups(self):
        """Medians added up by stage and by residual block: [{group, level, forward_ms, ...}]."""
        totals = {}
        for r in self.rows:
            for level, group in (("stage", r.stage), ("block", r.block)):
                if level == "block" and group == r.stage:
                    continue
                entry = totals.setdefault(group, {"group": group, "level": level, **{f"{p}_ms": 0.0 for p in PHASES}})
                for p, ms in r.ms.items():
                    entry[f"{p}_ms"] += ms
        return list(totals.values())

    def table(self, top=15):
        """The terminal report: the costliest rows, the totals, the overhead, the groups."""
        c, peak = self.config, self.peak
        roof = (f"{peak.device}: {peak.tflops:.3g} TFLOP/s, {peak.gbs:.4g} GB/s, ridge {peak.ridge:.1f} FLOP/B "
                f"({peak.source})") if peak else "roofs unknown for this GPU: add it to PEAKS in profiler/roofs.py"
        rows = self.by_cost()
        tensor_roofs = {(r.compute, r.tflops) for r in map(self.roofs, rows) if r is not None and r is not peak}
        roof += "".join(f"; the rows on the {compute}: {tflops:.4g} TFLOP/s" for compute, tflops in sorted(tensor_roofs))
        lines = [f"{c['model']}, batch {c['batch_size']}, {c['backend']} backend, {c['precision']} ({c['clock']}): "
                 f"medians of {c['steps']} steps after {c['warmup']} warm-up", roof, "", TABLE_HEADER]
        lines += [_table_line(r.metrics(self.roofs(r), self.step_ms), self.step_ms) for r in rows[:top]]
        if rows[top:]:
            lines.append(_times_line(f"... {len(rows[top:])} more rows", rows[top:], self.step_ms))
        lines += [_times_line(f"total of all {len(rows)} rows", rows, self.step_ms),
                  f"step: {self.step_ms:.2f} ms (median of the profiled steps), {100 * self.covered_fraction():.1f} % "
                  f"of it inside its layers and spans; the rows' medians add up to {self.rows_ms():.2f} ms",
                  f"profiler overhead: {self.step_ms:.2f} ms per step with per-layer marks against "
                  f"{self.plain_step_ms:.2f} ms with one pair of marks per step: {self.overhead_ms:+.2f} ms "
                  f"({100 * self.overhead_ms / self.plain_step_ms:+.1f} %)"]
        if self.starved():
            lines.append(f"warning: in {self.starved()} of {len(self.steps)} profiled steps the GPU waited for the host "
                         f"to queue work: those steps' rows include the wait")
        lines += ["",
                  f"{'by stage and residual block':{LABEL_WIDTH}s} " + " ".join(f"{h:>8s}" for h in PHASE_HEADS)
                  + f" {'share':>6s}"]
        for g in self.groups():
            indent = "  " if g["level"] == "block" else ""
            lines.append(f"{indent + g['group']:{LABEL_WIDTH}s} " + " ".join(_ms(g[f'{p}_ms']) for p in PHASES)
                         + f" {_share(sum(g[f'{p}_ms'] for p in PHASES), self.step_ms)}")
        if self.concurrent:
            lines += ["", "beside the step (concurrent spans): median ms, and how much of it overlapped the backward"]
            lines += [f"  {n} ({c}): {ms:.3f} ms, {overlap:.3f} ms overlapped ({100 * overlap / ms if ms else 0:.0f} %)"
                      for (n, c), (ms, overlap) in self.concurrent.items()]
        return "\n".join(lines)

    def write(self, out_dir=None, json_path=None, csv_path=None, png_path=None, trace_path=None):
        """profile.json, profile.csv, profile.png and the timeline profile.trace.json in `out_dir`
        (or at the paths given), each replaced atomically; {'json': path, 'csv': path, 'png': path,
        'trace': path}."""
        paths = output_paths(out_dir, json_path, csv_path, png_path, trace_path)
        for path in paths.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        document = self.to_json()
        with atomic_write(paths["json"], "w") as f:
            json.dump(document, f, indent=1)
        with atomic_write(paths["csv"], "w") as f:
            write_csv(f, document["rows"])
        with atomic_write(paths["png"]) as f:
            f.write(self.chart())
        with atomic_write(paths["trace"], "w") as f:
            json.dump(trace.document(self.timeline), f)
        return paths

    def chart(self):
        """PNG bytes: each row's median ms per step, forward, backward and other stacked, in the
        order the step runs them (containers without ops of their own left out)."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = [r for r in self.rows if r.category not in ("block", UNTRACKED[1]) or any(r.kernels.values())]
        fig, ax = plt.subplots(figsize=(9, 1.5 + 0.19 * len(rows)))
        y = np.arange(len(rows))
        left = np.zeros(len(rows))
        for phase, color in zip(PHASES, ("tab:blue", "tab:orange", "tab:gray")):
            widths = np.array([r.ms.get(phase, 0.0) for r in rows])
            ax.barh(y, widths, left=left, color=color, label=phase)
            left += widths
        ax.set_yticks(y, [r.label if r.kind == r.category else f"{r.label} ({r.kind})" for r in rows], fontsize=7)
        ax.set_ylim(len(rows) - 0.5, -0.5)     # the first row on top, no margins
        c = self.config
        ax.set_xlabel(f"ms per step, median of {c['steps']} steps")
        ax.set_title(f"{c['model']}, batch {c['batch_size']}, {c['backend']} {c['precision']}: "
                     f"step {self.step_ms:.1f} ms", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        return buf.getvalue()


FILES = {"json": "profile.json", "csv": "profile.csv", "png": "profile.png", "trace": "profile.trace.json"}
OPTIONS = {"json": "--json", "csv": "--csv", "png": "--png", "trace": "--trace"}


def output_paths(out_dir=None, json_path=None, csv_path=None, png_path=None, trace_path=None):
    """{'json': path, 'csv': path, 'png': path, 'trace': path}: the paths given, the others in ``out_dir``."""
    given = {"json": json_path, "csv": csv_path, "png": png_path, "trace": trace_path}
    if not all(given.values()) and out_dir is None:
        raise ValueError("write() needs an output folder for the files without a path")
    return {kind: Path(given[kind]) if given[kind] else Path(out_dir) / name for kind, name in FILES.items()}


def unwritable(paths, out_dir=None):
    """Why the profile's files cannot go to ``paths`` (output_paths), in words, asked before profiling
    (the trainer checks its outputs first too); None when they can: two of them the same file, one that
    is not a regular file, or in a folder that is a file or cannot be made or written."""
    seen = {}
    for kind, path in paths.items():
        named = OPTIONS[kind] if path.name != FILES[kind] or out_dir is None else f"--out {out_dir}"
        try:
            key = path.resolve()
        except (RuntimeError, OSError):   # a loop of symbolic links (RuntimeError before Python 3.13)
            key = path
        if key in seen:
            return f"{seen[key]} and {OPTIONS[kind]} name the same file, {path}: give each its own"
        seen[key] = OPTIONS[kind]
        what = file_kind(path)
        if what not in (None, "a regular file"):
            return f"{named}: {path} is {what}, not a file the profile can write"
        folder = path.parent
        while file_kind(folder) is None and folder != folder.parent:   # made when the files are written
            folder = folder.parent
        what = file_kind(folder)
        if what != "a folder":
            return f"{named}: {folder} is {what}, not a folder"
        if not os.access(folder, os.W_OK):
            return f"{named}: the folder {folder} cannot be written"
    return None
PHASE_HEADS = ("fwd ms", "bwd ms", "other ms")
LABEL_WIDTH = 34 + 1 + 14 + 1 + 10     # the layer, type and output columns
TABLE_HEADER = (f"{'layer':34s} {'type':14s} {'output':>10s} " + " ".join(f"{h:>8s}" for h in PHASE_HEADS)
                + f" {'share':>6s} {'GFLOP':>7s} {'MB':>7s} {'TFLOP/s':>8s} {'GB/s':>7s} {'bound':>7s} {'%peak':>6s}"
                + "  kernels")
CSV_FIELDS = ("name", "category", "kind", "stage", "block", "output_shape", "forward_ms", "backward_ms", "other_ms",
              "total_ms", "share", "flops", "bytes", "tflops", "gbs", "intensity", "bound", "peak_fraction",
              "flops_fraction", "bandwidth_fraction", "roofline_ms", "kernels")


def _ms(v):
    return f"{v:8.3f}" if v else f"{'-':>8s}"


def _share(ms, step_ms):
    return f"{100 * ms / step_ms:5.1f}%" if step_ms > 0 else f"{'-':>6s}"


def _number(v, fmt, width, scale=1):
    """v / scale in `width` columns; '-' where there is no figure (None, or no FLOPs or bytes)."""
    return f"{v / scale:{width}{fmt}}" if v else f"{'-':>{width}s}"


def _kernel_list(kernels_by_phase):
    """'conv2d_forward x1, add x2' over the phases, in the order they ran."""
    merged = collections.Counter()
    for counts in kernels_by_phase.values():
        merged.update(counts)
    return ", ".join(f"{name} x{n}" for name, n in merged.items())


def _table_line(m, step_ms):
    output = "x".join(map(str, m["output_shape"][1:])) if m["output_shape"] else "-"   # without the batch
    peak = 100 * m["peak_fraction"] if m["peak_fraction"] is not None else None
    return (f"{m['name'][:34]:34s} {m['kind'][:14]:14s} {output[:10]:>10s} "
            + " ".join(_ms(m[f"{p}_ms"]) for p in PHASES) + f" {_share(m['total_ms'], step_ms)}"
            f" {_number(m['flops'], '.3f', 7, 1e9)} {_number(m['bytes'], '.1f', 7, 1e6)}"
            f" {_number(m['tflops'], '.3f', 8)} {_number(m['gbs'], '.1f', 7)} {m['bound'] or '-':>7s}"
            f" {_number(peak, '.1f', 6)}  {_kernel_list(m['kernels'])}")


def _times_line(label, rows, step_ms):
    """A line of the table's time columns, added up over `rows`."""
    return (f"{label:{LABEL_WIDTH}s} " + " ".join(_ms(sum(r.ms[p] for r in rows)) for p in PHASES)
            + f" {_share(sum(r.total_ms for r in rows), step_ms)}")


def write_csv(f, metrics):
    writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
    writer.writeheader()
    for m in metrics:
        writer.writerow({**m, "output_shape": "x".join(map(str, m["output_shape"] or [])),
                         "kernels": "; ".join(f"{p}: {_kernel_list({p: k})}" for p, k in m["kernels"].items())})
