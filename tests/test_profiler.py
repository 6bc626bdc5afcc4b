"""The profiler package on the CPU backend: an entry for every layer, rows that add up to the step, FLOP
counts against hand arithmetic, the files, the timeline (profile.trace.json), the spans other code
records, the CUDA kernel names (through the emulator), the command line; on simulated GPUs, every way a
step launches its kernels (the tensor cores' projection, stride-2 phase, halo and split-K kernels, each
precision's families) named by the recorder, whose wrapper takes every call launch() makes, the hold
before each step and the steps where the GPU waited for the host, and the two commands that profile
(python -m profiler --device cuda in each precision, train_resnet.py --profile with --graph and without);
and, marked ``gpu``, ResNet-18 at batch 256 on CUDA in tf32 and bf16."""
import collections
import contextlib
import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kernels
import nn
from helpers import one_line_error, rng, usage_then_error
from test_kernels_cuda import poisoned_device_empty, simulated_gpu  # noqa: F401  (fixtures)
import profiler
from kernels.cuda import conv_tc
from profiler import cli as command

ROOT = Path(__file__).resolve().parent.parent


def batch(n, size=28):
    """n random uint8 images and int32 labels, as the trainer holds them."""
    g = rng()
    return g.integers(0, 256, (n, size, size), dtype=np.uint8), g.integers(0, 10, n).astype(np.int32)


def tiny_net():
    """One layer of each kind the hand-computed FLOPs check: conv, max pool, average pool, linear."""
    nn.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.MaxPool2d(2), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 10))


def run_profile(model, images, labels, batch_size, steps=5, warmup=1):
    optimizer = nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    return profiler.profile(model, optimizer, images, labels, batch_size, steps, warmup, log=lambda *a: None)


@pytest.fixture(scope="module")
def resnet():
    """ResNet-18 at width 4 on 8 images, and its profile."""
    nn.manual_seed(0)
    model = nn.resnet18(width=4)
    images, labels = batch(8)
    return model, run_profile(model, images, labels, batch_size=8)


@pytest.fixture(scope="module")
def written(resnet, tmp_path_factory):
    """The files of the ResNet-18 profile: {'json': path, 'csv': path, 'png': path, 'trace': path}."""
    return resnet[1].write(tmp_path_factory.mktemp("profile") / "out")


def rows_by_name(report):
    return {(r.name, r.category): r for r in report.rows}


# ---- the timeline's checks, for every test that reads a profile.trace.json ----------------------

NANOSECOND = 1e-3   # in the trace's microseconds: the rounding of its times


def trace_problems(events):
    """What keeps `events` from being a trace that Perfetto and chrome://tracing show as recorded:
    [] when every event has a name, ph, ts, pid and tid, every complete event ("X") a dur >= 0, and
    the complete events of each track (pid, tid) nest: one that begins inside another ends inside it."""
    problems, tracks = [], collections.defaultdict(list)
    for i, event in enumerate(events):
        missing = [field for field in ("name", "ph", "ts", "pid", "tid") if field not in event]
        if missing:
            problems.append(f"event {i} has no {', '.join(missing)}: {event}")
        elif event["ph"] == "X" and not event.get("dur", -1) >= 0:
            problems.append(f"event {i} ({event['name']}) has dur {event.get('dur')}")
        elif event["ph"] == "X":
            tracks[event["pid"], event["tid"]].append(event)
    for track, spans in tracks.items():
        enclosing = []      # the spans open at the current one's begin, innermost last
        for span in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while enclosing and enclosing[-1]["ts"] + enclosing[-1]["dur"] <= span["ts"] + NANOSECOND:
                enclosing.pop()
            if enclosing and span["ts"] + span["dur"] > enclosing[-1]["ts"] + enclosing[-1]["dur"] + NANOSECOND:
                problems.append(f"on track {track}, {span['name']} begins inside {enclosing[-1]['name']} "
                                f"and ends after it")
            enclosing.append(span)
    return problems


def check_timeline(events, modules, steps, ranks=(0,)):
    """`events` (profile.trace.json's) are a sound trace (trace_problems) of `steps` profiled steps on
    each of `ranks`: on a rank's first track the steps, 'step 0', 'step 1', ..., one after the other,
    each holding one forward and one backward span of every module named in `modules` (as
    model.named_modules() names them) and one span of each part of the training step."""
    assert trace_problems(events) == []
    assert {e["pid"] for e in events} == set(ranks)
    parts = ["batch gather", "zero_grad", "loss forward", "loss backward", "optimizer step"]
    expected = [f"{name or '(model)'} {phase}" for name in modules for phase in ("forward", "backward")] + parts
    for rank in ranks:
        ours = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        roots = sorted((e for e in ours if e["cat"] == "step"), key=lambda e: e["ts"])
        assert [e["name"] for e in roots] == [f"step {i}" for i in range(steps)], f"rank {rank}"
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(roots, roots[1:])), f"rank {rank}: steps overlap"
        for i, root in enumerate(roots):
            inside = [e for e in ours if e["args"]["step"] == i and e["tid"] == root["tid"]]
            assert all(root["ts"] <= e["ts"] and e["ts"] + e["dur"] <= root["ts"] + root["dur"] + NANOSECOND
                       for e in inside), f"rank {rank}: a span of step {i} lies outside it"
            count = collections.Counter(e["name"] for e in inside)
            assert {name: count[name] for name in expected} == dict.fromkeys(expected, 1), f"rank {rank}, step {i}"


def test_every_layer_has_an_entry_with_its_shape_and_kernels(resnet):
    model, report = resnet
    rows = rows_by_name(report)
    for name, module in model.named_modules():
        if not module.children():
            assert (name, "layer") in rows, name
    conv = rows["resnet_block2.0.conv1", "layer"]
    assert conv.output == (8, 8, 14, 14) and conv.stage == "resnet_block2" and conv.block == "resnet_block2.0"
    assert {"conv2d_forward"} == set(conv.kernels["forward"])
    # the block input's gradient so far (from conv3) takes this conv's dx in place: no add
    assert set(conv.kernels["backward"]) == {"conv2d_backward"}
    # the relu after bn1 and the join relu(bn2 + shortcut) run inside the batch norms, whose statistics
    # the convolutions before them computed (on the training step's path): Residual.forward launches
    # nothing of its own
    assert set(rows["resnet_block2.0.bn2", "layer"].kernels["forward"]) == {"batch_norm_apply"}
    assert set(rows["0", "layer"].kernels["forward"]) == {"conv2d_forward"}   # the stem's, and its norm's
    assert set(rows["1", "layer"].kernels["forward"]) == {"batch_norm_apply"}
    own = rows.get(("resnet_block2.0", "block"))
    assert own is None or not own.kernels["forward"]
    for span in ("batch gather", "data"), ("zero_grad", "optimizer"), ("loss", "loss"), ("optimizer step", "optimizer"):
        assert span in rows, span
    assert set(rows["batch gather", "data"].kernels["other"]) == {"images_to_float", "take"}
    assert set(rows["loss", "loss"].kernels["backward"]) == {"softmax_cross_entropy_backward"}
    # after the model's backward, backward() returns and drops the tape: a row of its own
    release = rows["release of the tape", "autograd"]
    assert release.ms["backward"] > 0 and not any(release.kernels.values())
    assert set(rows["optimizer step", "optimizer"].kernels["other"]) == {"sgd_update"}
    assert all(r.total_ms >= 0 for r in report.rows) and rows["0", "layer"].ms["backward"] > 0


def test_layer_and_span_times_add_up_to_the_step(resnet):
    """In a profiled step, the layers and spans add up to the step's time as the marks around the
    whole step measure it, but for the Python between the spans: a few statements, well under
    1 % of a ~20 ms step. Tolerance: 5 % or 1 ms, in most steps. On a loaded 2-core machine
    another process takes the CPU for whole time slices (tens of ms) at random places of a step;
    inside a layer, that time is the layer's and still adds up, and the rare step whose slice
    fell between two spans is outvoted. The rows' medians themselves add up to less than the
    median step under such load (each row's median leaves the interruptions out, each step keeps
    its own): they are held only to not exceed it, which double counting would."""
    _, report = resnet
    within = [s["profiled_ms"] - s["covered_ms"] <= max(0.05 * s["profiled_ms"], 1.0) for s in report.steps]
    assert sum(within) > len(within) / 2, report.steps
    assert report.covered_fraction() <= 1
    assert report.rows_ms() <= 1.15 * report.step_ms + 2.0, (report.rows_ms(), report.step_ms)
    assert report.step_ms > 0 and report.plain_step_ms > 0
    assert report.overhead_ms == pytest.approx(report.step_ms - report.plain_step_ms)


class ScriptedClock(profiler.WallClock):
    """Marks at given times (ms), so that what each row owns can be worked out by hand (nothing to hold, as
    on the CPU)."""
    name = "scripted"

    def __init__(self, times):
        self.times = iter(times)

    def mark(self, stream=None):
        return next(self.times)

    def resolve(self, marks, origin=None):
        return [m - (marks[0] if origin is None else origin) for m in marks]


def test_each_interval_belongs_to_the_innermost_row_open_during_it():
    """Marks: the timeline's origin at -5; step begins at 0, A at 1, B (inside A) at 3, B ends at 6,
    A at 10, the step at 12; a concurrent span C runs from 4 to 11, beside them."""
    p = profiler.Profiler(tiny_net(), ScriptedClock([-5, 0, 1, 3, 4, 6, 10, 11, 12]), profiler.Nvtx(enabled=False))
    p.start_timeline()

    def step():
        with contextlib.ExitStack() as beside:      # C begins inside B and ends after A
            with p.span("A", "x", "forward"):
                with p.span("B", "x", "forward"):
                    beside.enter_context(p.span("C", "allreduce", concurrent=True))
    times = p.step(step)
    assert times.exclusive == {(profiler.UNTRACKED, "other"): 1 + 2, (("A", "x"), "forward"): 2 + 4,
                               (("B", "x"), "forward"): 3}
    assert times.total_ms == 12 and times.covered_ms == 9
    assert times.concurrent == [(("C", "allreduce"), 7, 0.0)]     # no model backward ran
    # on the timeline, from the origin
    assert {(s.key[0], s.concurrent): (s.begin_ms, s.end_ms) for s in times.spans} == {
        ("A", False): (6, 15), ("B", False): (8, 11), (profiler.UNTRACKED[0], False): (5, 17), ("C", True): (9, 16)}


def test_flop_counts_equal_the_hand_computed_ones():
    images, labels = batch(4)
    rows = rows_by_name(run_profile(tiny_net(), images, labels, batch_size=4, steps=2))
    flops = {name: {p: c.flops for p, c in rows[name, "layer"].cost.items()} for name in ("0", "1", "4", "6")}
    # conv 1 -> 3 channels, 3x3, padding 1: 4 x 3 x 28 x 28 = 9408 outputs, each a dot product of
    # 1 x 3 x 3 = 9 multiply-adds (2 FLOPs each) plus its bias
    assert flops["0"]["forward"] == 2 * 9408 * 9 + 9408 == 178_752
    # backward: the weight gradient is as many multiply-adds as the forward, the bias gradient one
    # add per output; no data gradient (the images need none), and the gradients are written
    # straight into the parameters' zeroed gradient buffers, with no addition
    assert flops["0"]["backward"] == 2 * 9408 * 9 + 9408 == 178_752
    # max pool 2x2, stride 2: 4 x 3 x 14 x 14 = 2352 outputs, 4 comparisons each
    assert flops["1"]["forward"] == 2352 * 4 == 9408
    # global average pool of 4 x 3 x 14 x 14: one add per input
    assert flops["4"]["forward"] == 4 * 3 * 14 * 14 == 2352
    # linear 3 -> 10 on 4 rows: 4 x 10 dot products of 3 multiply-adds, plus the bias
    assert flops["6"]["forward"] == 2 * 4 * 10 * 3 + 4 * 10 == 280
    # its bytes: x (4 x 3), w (10 x 3), b (10) read and y (4 x 10) written, in float32
    assert rows["6", "layer"].cost["forward"].bytes == 4 * (12 + 30 + 10 + 40)


def test_profiling_leaves_the_model_and_optimizer_as_it_found_them():
    model = tiny_net()
    optimizer = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.velocity[:] = 0.5
    model.eval()
    before = {k: v.copy() for k, v in model.state_dict().items()}
    images, labels = batch(4)
    profiler.profile(model, optimizer, images, labels, 4, steps=1, warmup=1, log=lambda *a: None)
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)
    assert not model.training and np.all(optimizer.velocity == 0.5)


def test_the_json_csv_and_chart_are_written_and_read_back(resnet, written):
    _, report = resnet
    document = json.loads(written["json"].read_text())
    assert len(document["rows"]) == len(report.rows)
    assert document["step"]["overhead_ms"] == pytest.approx(report.overhead_ms)
    conv = next(r for r in document["rows"] if r["name"] == "resnet_block1.0.conv1")
    assert conv["flops"] > 0 and conv["bound"] in ("compute", "memory") and 0 < conv["peak_fraction"]
    assert conv["roofline_ms"] == pytest.approx(conv["peak_fraction"] * conv["total_ms"])
    assert {g["group"] for g in document["groups"]} >= {"resnet_block1", "resnet_block1.0", "resnet_block4.1"}
    with open(written["csv"], newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["name"] for r in table] == [r["name"] for r in document["rows"]]
    assert float(next(r for r in table if r["name"] == "fc.1")["forward_ms"]) > 0
    import matplotlib.pyplot as plt
    assert plt.imread(written["png"]).ndim == 3
    text = report.table(top=5)
    assert "total of all" in text and "profiler overhead" in text and "resnet_block1.0" in text


def test_the_timeline_has_every_module_and_part_of_the_step_once_per_step(resnet, written):
    model, report = resnet
    document = json.loads(written["trace"].read_text())
    assert written["trace"].name == "profile.trace.json" and document["displayTimeUnit"] == "ms"
    events = document["traceEvents"]
    check_timeline(events, [name for name, _ in model.named_modules()], report.config["steps"])
    labels = {(e["name"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert labels == {("process_name", 0): "rank 0 (cpu)", ("thread_name", 0): "training step"}
    # each step as long as the profile measured it, on one timeline: later steps begin later
    roots = [e for e in events if e.get("cat") == "step"]
    assert [r["dur"] / 1e3 for r in roots] == pytest.approx([s["profiled_ms"] for s in report.steps], abs=1e-5)
    conv = [e for e in events if e["name"] == "resnet_block2.0.conv1 backward"]
    assert [e["args"] for e in conv] == [{"step": i, "phase": "backward", "type": "Conv2d"}
                                         for i in range(report.config["steps"])]
    assert conv[0]["cat"] == "layer" and 0 < conv[0]["ts"] < conv[1]["ts"] < roots[-1]["ts"]


@pytest.mark.parametrize("events, problem", [
    ([{"name": "a", "ph": "X", "ts": 0, "dur": 1, "tid": 0}], "event 0 has no pid"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": -1, "pid": 0, "tid": 0}], r"event 0 \(a\) has dur -1"),
    ([{"name": "a", "ph": "X", "ts": 0, "pid": 0, "tid": 0}], r"event 0 \(a\) has dur None"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 0},
      {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 0}], r"on track \(0, 0\), b begins inside a"),
    ([{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 0},
      {"name": "b", "ph": "X", "ts": 2, "dur": 3, "pid": 0, "tid": 0},
      {"name": "c", "ph": "X", "ts": 4, "dur": 2, "pid": 0, "tid": 0}], "c begins inside b and ends after it"),
])
def test_the_timeline_check_rejects_a_broken_trace(events, problem):
    problems = trace_problems(events)
    assert len(problems) == 1 and re.search(problem, problems[0]), problems
    # the same spans on a track each, or one inside the other, are sound
    apart = [{**e, "dur": abs(e.get("dur", 1)), "pid": 0, "tid": i} for i, e in enumerate(events)]
    assert trace_problems(apart) == []
    assert trace_problems([{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 0},
                           {"name": "b", "ph": "X", "ts": 2, "dur": 8, "pid": 0, "tid": 0},
                           {"name": "c", "ph": "X", "ts": 10, "dur": 0, "pid": 0, "tid": 0}]) == []


def test_spans_from_other_code_nested_and_concurrent():
    """What data-parallel code records: a bucket's all-reduce beside the backward (concurrent) and
    the wait for it (nested); outside a profile the span does nothing."""
    import time
    model = tiny_net()
    calls = []

    def bucket_ready(parameter):
        calls.append(profiler.current())
        with profiler.span("bucket 0", "allreduce", concurrent=True):
            time.sleep(0.002)
        with profiler.span("bucket 0 wait", "allreduce"):
            pass
    model[6].weight.register_post_accumulate_grad_hook(bucket_ready)
    images, labels = batch(4)
    report = run_profile(model, images, labels, batch_size=4, steps=2)
    assert None in calls and any(isinstance(c, profiler.Profiler) for c in calls)   # plain and profiled steps
    assert ("bucket 0 wait", "allreduce") in rows_by_name(report)
    ms, overlap = report.concurrent["bucket 0", "allreduce"]
    assert ms >= 2 and overlap == pytest.approx(ms)      # it ran within the model's backward
    assert "bucket 0 (allreduce)" in report.table()
    assert report.to_json()["concurrent"][0]["overlap_fraction"] == pytest.approx(1.0)
    assert profiler.current() is None


@pytest.mark.parametrize("precision, forward, backward", [   # 1 -> 3 channels: conv.cu's kernels under tf32 too
    ("tf32", "conv2d_forward<Tile64, 3, 3>", {"conv2d_wgrad<Tile64, 3, 3>"}),
    ("fp32", "conv2d_forward<Tile64, 3, 3>", {"conv2d_wgrad<Tile64, 3, 3>"})])
def test_the_cuda_kernels_are_named_through_the_emulator(precision, forward, backward):
    images, labels = batch(4)
    with kernels.emulate(), kernels.use_precision(precision):
        report = run_profile(tiny_net(), images, labels, batch_size=4, steps=1)
    conv = rows_by_name(report)["0", "layer"]
    # the first layer's input needs no gradient: no backward-data GEMM
    assert forward in conv.kernels["forward"] and set(conv.kernels["backward"]) == backward
    assert conv.cost["forward"].flops == 178_752
    assert report.config["precision"] == precision and f"emu backend, {precision}" in report.table()


def test_rows_whose_kernels_multiply_on_the_tensor_cores_sit_under_their_roof():
    h200 = profiler.gpu_peak("NVIDIA H200")
    assert h200.of(["conv_tc_forward<Tc128x64, 16>", "bn_stats_rows"]).tflops == h200.tensor_tflops == 494.7
    assert h200.of(["conv_tc_wgrad<Tc128x64, 4>"]).tflops == 494.7
    assert h200.of(["conv_tc_dgrad<Tc128x64, 16>"]).compute == "TF32 tensor cores" and h200.compute == "FP32"
    for gemm in ("conv_bf16_forward", "conv_bf16_dgrad", "conv_bf16_wgrad", "conv_sm90_forward",
                 "conv_sm90_wgrad"):   # the bf16 precision's, Hopper's too
        bf16 = h200.of([f"{gemm}<Tc128x64, 16>", "bn_stats_rows"])
        assert bf16.tflops == h200.bf16_tflops == 989.4 and bf16.compute == "BF16 tensor cores", gemm
        assert bf16.gbs == h200.gbs and bf16.ridge == 2 * h200.of(["conv_tc_forward<Tc64x64, 4>"]).ridge
    for gemm in ("conv_sm90_forward<Sm90Tf32x64, false>", "conv_sm90_forward<Sm90Tf32x128, true>"):   # Hopper's TF32
        assert h200.of([gemm, "bn_stats_rows"]).tflops == 494.7, gemm
    assert h200.of(["conv_sm90_forward<Sm90x64, false>"]).tflops == h200.bf16_tflops
    assert h200.of(["conv2d_forward<Tile64, 3, 3>", "conv2d_wgrad<Tile64, 3, 3>"]) is h200   # the stem: FP32
    assert h200.of(["linear_forward"]) is h200 and h200.of([]) is h200
    assert profiler.measured_cpu_peak().of(["conv_tc_forward<Tc64x64, 4>"]) is profiler.measured_cpu_peak()


def test_the_stem_sits_under_the_fp32_roof_and_the_tensor_core_convolutions_under_theirs():
    """Under tf32 a 1-channel convolution runs conv.cu's FP32 kernels and a 4-channel one conv_tc.cu's:
    the report places each by the kernels it launched, not by its module's class."""
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    images, labels = batch(2, size=8)
    with kernels.emulate(), kernels.use_precision("tf32"):
        report = run_profile(model, images, labels, batch_size=2, steps=1, warmup=0)
    h200 = profiler.gpu_peak("NVIDIA H200")
    report = dataclasses.replace(report, peak=h200)
    rows = rows_by_name(report)
    stem, conv, linear = rows["0", "layer"], rows["2", "layer"], rows["5", "layer"]
    assert any(k.startswith("conv_tc_forward") for k in conv.kernels["forward"])
    assert not any(k.startswith("conv_tc") for p in stem.kernels.values() for k in p)
    assert report.roofs(stem) is h200 and report.roofs(linear) is h200
    assert report.roofs(conv).tflops == h200.tensor_tflops
    metrics = {m["name"]: m for m in report.to_json()["rows"]}
    assert metrics[conv.label]["flops_fraction"] == pytest.approx(
        metrics[conv.label]["tflops"] / h200.tensor_tflops)
    assert metrics[stem.label]["flops_fraction"] == pytest.approx(metrics[stem.label]["tflops"] / h200.tflops)
    assert "the rows on the TF32 tensor cores: 494.7 TFLOP/s" in report.table().splitlines()[1]


def test_under_bf16_the_tensor_core_convolutions_sit_under_the_bf16_roof():
    """Under bf16 an 8-channel convolution runs conv_bf16.cu's GEMMs (the BF16 tensor cores take channel
    counts that are multiples of 8) and the stem conv.cu's FP32 kernels, on bfloat16 storage; the report
    places each by the kernels it launched, and records the precision."""
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    images, labels = batch(2, size=8)
    with kernels.emulate(), kernels.use_precision("bf16"):
        report = run_profile(model, images, labels, batch_size=2, steps=1, warmup=0)
    h200 = profiler.gpu_peak("NVIDIA H200")
    report = dataclasses.replace(report, peak=h200)
    rows = rows_by_name(report)
    stem, conv, linear = rows["0", "layer"], rows["2", "layer"], rows["5", "layer"]
    assert any(k.startswith("conv_bf16_forward<") for k in conv.kernels["forward"]), conv.kernels
    assert report.roofs(conv).tflops == h200.bf16_tflops and report.roofs(conv).compute == "BF16 tensor cores"
    assert report.roofs(stem) is h200 and report.roofs(linear) is h200
    assert report.config["precision"] == "bf16" and "emu backend, bf16" in report.table()
    assert "the rows on the BF16 tensor cores: 989.4 TFLOP/s" in report.table().splitlines()[1]


def test_the_peak_table():
    assert profiler.gpu_peak("NVIDIA H200").tflops == 67 and profiler.gpu_peak("NVIDIA H200").gbs == 4800
    assert profiler.gpu_peak("NVIDIA H200 NVL").bf16_tflops == 835.5
    assert profiler.gpu_peak("NVIDIA H100 PCIe").bf16_tflops == 2 * profiler.gpu_peak("NVIDIA H100 PCIe").tensor_tflops \
        + 0.5   # the datasheet's 1,513 with sparsity
    assert profiler.gpu_peak("NVIDIA A100-SXM4-40GB").bf16_tflops == 312
    assert profiler.gpu_peak("NVIDIA H100 80GB HBM3").gbs == 3350
    assert profiler.gpu_peak("NVIDIA H100 PCIe").tflops == 51
    assert profiler.gpu_peak("NVIDIA A100-SXM4-80GB").gbs == 2039
    assert profiler.gpu_peak("NVIDIA A100-SXM4-40GB").gbs == 1555
    assert profiler.gpu_peak("NVIDIA GeForce GTX 1080") is None
    cpu = profiler.measured_cpu_peak()
    assert cpu.tflops > 0 and cpu.gbs > 0 and cpu.source.startswith("measured")


def test_bad_inputs_are_refused_with_the_reason():
    images, labels = batch(4)
    model = tiny_net()
    optimizer = nn.SGD(model.parameters(), lr=0.1)
    for args, message in (((images, labels, 8, 1, 0), "at least as many images"),
                          ((images, labels, 4, 0, 0), "steps must be at least 1"),
                          ((images.astype(np.float32), labels, 4, 1, 0), "uint8"),
                          ((images, labels[:3], 4, 1, 0), "labels must be")):
        with pytest.raises(ValueError, match=message):
            profiler.profile(model, optimizer, *args, log=lambda *a: None)


# ---- the command -------------------------------------------------------------------------------

def cli(*flags):
    return subprocess.run([sys.executable, "-m", "profiler", *map(str, flags)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_help_explains_the_command():
    done = cli("--help")
    assert done.returncode == 0, done.stderr
    for text in ("--batch-size", "--steps", "--warmup", "--width", "--device", "--out", "--json", "--csv", "--png",
                 "overhead", "profile(model, optimizer, images, labels"):
        assert text in done.stdout, text


def test_a_tiny_run_writes_its_files(tmp_path):
    done = cli("--device", "cpu", "--width", "2", "--batch-size", "4", "--steps", "2", "--warmup", "1",
               "--out", tmp_path, "--png", tmp_path / "chart.png")
    assert done.returncode == 0, done.stderr
    assert "profiler overhead" in done.stdout and "resnet_block4" in done.stdout
    assert f"{tmp_path / 'profile.trace.json'}" in done.stdout
    check_timeline(json.loads((tmp_path / "profile.trace.json").read_text())["traceEvents"],
                   [name for name, _ in nn.resnet18(width=2).named_modules()], steps=2)
    assert json.loads((tmp_path / "profile.json").read_text())["config"]["batch_size"] == 4
    assert (tmp_path / "profile.csv").exists() and (tmp_path / "chart.png").stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "many"], "argument --batch-size: invalid int value: 'many'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--stpes", "3"], "unrecognized arguments: --stpes 3"),
    (["--steps"], "argument --steps: expected one argument"),
])
def test_malformed_flags_are_refused_with_the_usage(flags, message, capsys):
    """An unknown flag, a missing value, a malformed number or choice: argparse's usage, then the error."""
    assert message in usage_then_error(capsys, command.parse_args, flags, prog="python -m profiler")


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be 0 or more, got -1"),
    (["--seed", "-3"], "--seed must be 0 or more, got -3"),
    (["--top", "0"], "--top must be at least 1, got 0"),
    (["--device", "cpu", "--precision", "bf16"], "--precision bf16 is the GPU's: the CPU computes in float32"),
])
def test_well_formed_but_wrong_flags_are_one_line_errors(flags, message, capsys):
    """A value argparse takes but this command cannot use is `python -m profiler: error: ...` alone, exit code 2,
    as train_resnet.py's."""
    assert one_line_error(capsys, command.parse_args, flags, prog="python -m profiler") == \
        f"python -m profiler: error: {message}\n"


def test_a_batch_too_large_for_the_kernels_indices_is_refused_before_profiling(simulated_gpu, capsys):
    """On a GPU the first stage's activations of a batch must fit the int indices of the CUDA kernels."""
    err = one_line_error(capsys, command.parse_args, ["--device", "cuda", "--width", "64", "--batch-size", "50000"],
                         prog="python -m profiler")
    assert err.startswith("python -m profiler: error: --batch-size 50000: at --width 64") and \
        "at most 42,778 images fit a batch" in err, err
    command.parse_args(["--device", "cuda", "--width", "64", "--batch-size", "42778"])   # the largest that fits


def test_an_emulator_cache_that_cannot_be_written_is_a_one_line_error(tmp_path):
    """On a simulated GPU the kernels are compiled into the emulator's cache: a folder that cannot be written is
    one line naming it, exit code 2, not a traceback."""
    (tmp_path / "a-file").write_text("")
    done = simulated_command(["-m", "profiler", "--device", "cuda", "--width", "2", "--batch-size", "2", "--steps",
                              "1", "--warmup", "0", "--out", tmp_path / "p"], tmp_path,
                             CUDA_EMU_CACHE_DIR=str(tmp_path / "a-file" / "cache"))
    assert done.returncode == 2 and done.stderr.startswith("python -m profiler: error: the CUDA emulator's cache "
                                                           f"folder {tmp_path / 'a-file' / 'cache'} cannot be written") \
        and done.stderr.count("\n") == 1, done.stderr[-2000:]


def test_running_out_of_memory_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    def exhausted(*args, **kwargs):
        raise MemoryError("planted")
    monkeypatch.setattr(command, "profile", exhausted)
    assert command.main(["--device", "cpu", "--width", "2", "--batch-size", "4", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("python -m profiler: error: out of cpu memory at batch size 4: try a smaller "
                                       "--batch-size\n")


@pytest.mark.parametrize("flags, message", [
    (["--out", "{tmp}/a-file"], "--out {tmp}/a-file: {tmp}/a-file is a regular file, not a folder"),
    (["--json", "{tmp}/p.json", "--trace", "{tmp}/p.json"], "--json and --trace name the same file, {tmp}/p.json"),
    (["--csv", "{tmp}/a-file/p.csv"], "--csv: {tmp}/a-file is a regular file, not a folder"),
    (["--out", "{tmp}/loop"], "{tmp}/loop/profile.json is a loop of symbolic links"),
    (["--width", "100000"], "--width 100000: the model has 27,240,028,600,010 parameters"),
])
def test_outputs_and_memory_are_checked_before_profiling(flags, message, tmp_path, capsys):
    """Refused at the start in one line, not after the profile has run (or with a traceback)."""
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    err = one_line_error(capsys, command.parse_args, ["--device", "cpu", "--out", str(tmp_path / "out"),
                                                      *(f.format(tmp=tmp_path) for f in flags)], prog="python -m profiler")
    assert message.format(tmp=tmp_path) in err, err


@pytest.mark.skipif(kernels.gpu_count() > 0, reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so(capsys):
    assert one_line_error(capsys, command.parse_args, ["--device", "cuda"], prog="python -m profiler").startswith(
        "python -m profiler: error: --device cuda: ")


# ---- every way a step launches its kernels, on simulated GPUs --------------------------------------

@contextlib.contextmanager
def narrow(backend, on_launch):
    """Backend.observing_launches as the profiler's recorder was: a wrapper of the backend's function() that takes
    the kernel's family and name, nothing more (a launch that asked for dynamic shared memory crashed every GPU
    profile with a TypeError)."""
    function = backend.function

    def launched(family, name):
        on_launch(family, name)
        return function(family, name)
    backend.function = launched
    try:
        yield
    finally:
        del backend.function


@pytest.mark.parametrize("planted", [False, True], ids=["recorder", "planted narrow recorder"])
def test_the_recorder_takes_every_call_that_launch_makes(monkeypatch, planted):
    """launch() looks every kernel up through be.function, with the dynamic shared memory where it asks for
    some and without where not: under the profiler's recording both run, and both are named."""
    from kernels.cuda import Backend
    from kernels.cuda.launch import launch
    from profiler import measure
    if planted:
        monkeypatch.setattr(Backend, "observing_launches", narrow)
    backend, names = kernels._device_backend("emu"), []
    with measure._recording_ops(backend, lambda op, args, kwargs: None, names.append):
        launch(backend, "elementwise", "hold", (1,), (0,), block=(1,))
        try:
            launch(backend, "elementwise", "hold", (1,), (0,), block=(1,), shared_mem=64)
        except TypeError as e:
            assert planted, f"the recorder refused a launch with shared memory: {e}"
            return
    assert not planted, "the narrow recorder took a launch with shared memory"
    assert names == ["hold", "hold"]
    assert not backend._observers, "the recorder left itself on the backend"


def launch_paths_net():
    """A network whose step takes every kind of launch of a ResNet-18 step, on 28 x 28 images: the stem (1 -> 16,
    conv.cu's FP32 kernels, under every precision), a stride-2 block of 16 channels (the tensor cores' stride-2
    backward-data from windows of dy, conv_tc.phase_windows), a block of 16 (the 3x3 kernels from windows of the
    image, conv_tc.halo and wgrad_halo), 16 -> 64 at stride 2, and ResNet-18's first projection, 64 -> 128 (its
    backward in one kernel, conv_tc.projection); split-K where the grids are small."""
    from nn.resnet import Residual
    nn.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         Residual(16, 16, use_1x1conv=True, stride=2), Residual(16, 16),
                         Residual(16, 64, use_1x1conv=True, stride=2), Residual(64, 128, use_1x1conv=True, stride=2),
                         nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(128, 10))


# (precision, windows wherever the convolution allows them (conftest's halo_everywhere: the phase and halo
# kernels' grid conditions dropped, as at batch 256), kernels the step must launch (the beginnings of their
# name expressions: a folded twin's ends ", true>"), GEMMs that must split k, the simulated GPU's compute
# capability: 8.0 for the mma.sync kernels, which a Hopper's (9.0) conv_sm90.cu replaces at 64 channels; 8.6, whose
# 100 KB an SM take TF32's 128 x 128 tile with a ring of 2 stages, conv_tc.RING2)
LAUNCH_PATHS = [
    ("tf32", True, {conv_tc.PHASE_KERNEL, conv_tc.PROJECTION_KERNELS[0], f"conv_tc_forward_halo<{conv_tc.TF32.halo}",
                    f"conv_tc_dgrad_halo<{conv_tc.TF32.halo}", conv_tc.WGRAD_HALO["conv_tc"].kernel[:-1],
                    "conv2d_forward<Tile64, 3, 3>", "conv_tc_wgrad<Tc128x128, "}, {"wgrad"}, "80"),
    ("tf32", False, {f"conv_tc_wgrad<{conv_tc.RING2}, "}, set(), "86"),
    ("tf32", False, {"conv_sm90_forward<Sm90Tf32x64, ", "conv_sm90_forward<Sm90Tf32x128, ",
                     "conv_sm90_wgrad_tf32<Sm90Tf32Wgrad64>", "conv_sm90_wgrad_tf32<Sm90Tf32Wgrad128>",
                     "mirrored_weights<float>"}, set(), "90"),
    ("bf16", True, {f"conv_bf16_forward_halo<{conv_tc.BF16.halo}", f"conv_bf16_dgrad_halo<{conv_tc.BF16.halo}",
                    conv_tc.WGRAD_HALO["conv_bf16"].kernel[:-1], "conv2d_forward<Tile64, 3, 3, bf16>"}, {"wgrad"}, "80"),
    ("bf16", False, {"conv2d_wgrad_one_channel<3, 3, bf16>"}, {"forward", "dgrad", "wgrad"}, "80"),
    ("bf16", False, {"conv_sm90_forward<Sm90x64, ", "conv_sm90_forward<Sm90x128, ", "conv_sm90_wgrad<Sm90Wgrad64>",
                     "conv_sm90_wgrad<Sm90Wgrad128>", "mirrored_weights<bf16>"}, set(), "90"),
    ("fp32", False, {"conv2d_forward<Tile64, 3, 3>", "conv2d_dgrad_strided<Tile64>", "conv2d_forward<Tile64, 1, 1>",
                     "conv2d_wgrad<Tile64, 1, 1>"}, set(), "90"),
]


@pytest.mark.parametrize("precision, windows, launched, split, capability", LAUNCH_PATHS,
                         ids=["tf32 windows", "tf32 ada", "tf32 hopper", "bf16 windows", "bf16", "bf16 hopper", "fp32"])
def test_every_kernel_a_step_launches_is_named_on_a_simulated_gpu(simulated_gpu, request, monkeypatch, precision,
                                                                    windows, launched, split, capability):
    """profile() on a simulated GPU through every kind of launch (LAUNCH_PATHS): the kernels the report names are
    all those the step looked up (a backend.function of the class's, counted beneath the recorder), none lost
    to a launch the recorder mishandles, each in a row of the layer that ran it."""
    from kernels.cuda import Backend
    monkeypatch.setenv("KERNELS_SIMULATED_COMPUTE_CAPABILITY", capability)
    if windows:
        request.getfixturevalue("halo_everywhere")
    looked_up, split_gemms = set(), set()
    function = Backend.function
    monkeypatch.setattr(Backend, "function", lambda self, family, name, *a, **k: (looked_up.add(name),
                                                                                   function(self, family, name, *a, **k))[1])
    plan = conv_tc.plan

    def planned(gemm, *args, **kwargs):
        p = plan(gemm, *args, **kwargs)
        if p.splits > 1:
            split_gemms.add(gemm)
        return p
    planned.cache_clear = plan.cache_clear
    monkeypatch.setattr(conv_tc, "plan", planned)
    with kernels.use_precision(precision):
        model = launch_paths_net().to("cuda")
        images, labels = (kernels.cupy_module().asarray(a) for a in batch(4))
        report = run_profile(model, images, labels, batch_size=2, steps=1, warmup=0)
    named = {name for r in report.rows for phase in r.kernels.values() for name in phase}
    assert named == looked_up - {"hold"}, f"looked up, not named: {looked_up - named - {'hold'}}; named, not looked " \
                                          f"up: {named - looked_up}"
    missing = [kernel for kernel in launched if not any(name.startswith(kernel) for name in named)]
    assert not missing, f"not launched: {missing}"
    assert split <= split_gemms, f"no split of k in {split - split_gemms}"
    if precision == "tf32":   # each kernel in the row of the layer that launched it
        assert conv_tc.PROJECTION_KERNELS[0] in rows_by_name(report)["6.conv3", "layer"].kernels["backward"]
    assert report.config["precision"] == precision and report.starved() == 0


def test_a_step_that_waits_for_the_gpu_is_reported(simulated_gpu):
    """A step during which the host waits for the GPU (a synchronize, a copy to the host) has let the GPU's hold
    run out before it was queued whole: the report counts it and warns; the same step without the wait is fed."""
    def waits(step):
        def run(*args, **kwargs):
            step(*args, **kwargs)
            kernels.cupy_module().cuda.Device().synchronize()
        return run
    images, labels = (kernels.cupy_module().asarray(a) for a in batch(4))
    reports = {}
    for planted in (False, True):
        nn.manual_seed(0)
        model = tiny_net().to("cuda")
        optimizer = nn.SGD(model.parameters(), lr=0.1)
        training_step = profiler.steps.training_step
        with pytest.MonkeyPatch.context() as patch:
            if planted:
                patch.setattr(profiler.steps, "training_step", waits(training_step))
            reports[planted] = profiler.profile(model, optimizer, images, labels, 2, steps=2, warmup=0,
                                                log=lambda *a: None)
    assert reports[False].starved() == 0 and "waited for the host" not in reports[False].table()
    assert reports[True].starved() == 2 and "in 2 of 2 profiled steps the GPU waited for the host" in \
        reports[True].table()
    assert reports[True].to_json()["step"]["gpu_waited_for_the_host"] == 2


def test_the_hold_keeps_the_stream_busy_for_the_time_asked():
    """Backend.hold on the emulator: the time asked, from the clock the kernel reads, and not much more."""
    import time
    backend = kernels._device_backend("emu")
    backend.hold(0)   # compiled
    for microseconds in (0, 30_000):
        began = time.perf_counter()
        backend.hold(microseconds)
        took = time.perf_counter() - began
        assert microseconds * 1e-6 <= took < microseconds * 1e-6 + 0.5, (microseconds, took)
    with pytest.raises(ValueError, match="hold: takes 0 to"):
        backend.hold(-1)


def simulated_command(argv, tmp_path, **environment):
    """A command of the project on one simulated GPU, its kernels on the emulator without the sanitizer; with
    more `environment`."""
    env = {**os.environ, kernels.SIMULATED_GPUS: "1", "CUDA_EMU_SANITIZE": "off", "TMPDIR": str(tmp_path),
           **environment}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp32"])
def test_python_m_profiler_on_a_simulated_gpu(tmp_path, precision):
    """python -m profiler --device cuda, as bench/gpu_check's tier f runs it, in each precision."""
    done = simulated_command(["-m", "profiler", "--device", "cuda", "--precision", precision, "--width", "4",
                              "--batch-size", "2", "--steps", "1", "--warmup", "0", "--out", tmp_path / "p"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert written["config"]["precision"] == precision and written["config"]["backend"] == "cuda"
    family = {"tf32": "conv_tc_", "bf16": "conv_bf16_", "fp32": "conv2d_"}[precision]
    row = next(r for r in written["rows"] if r["name"] == "resnet_block2.1.conv2")
    assert any(k.startswith(family) for k in row["kernels"]["backward"]), row["kernels"]
    assert written["step"]["gpu_waited_for_the_host"] == 0


@pytest.mark.parametrize("graph", ["--graph", "--no-graph"])
def test_train_resnet_profile_on_a_simulated_gpu(tmp_path, graph):
    """train_resnet.py --gpus 1 --profile, with the step as a graph or not: the profile times eager steps either
    way (a graph replays the step as one launch, with no layer to mark), and says so."""
    from helpers import write_fashion_mnist
    data = write_fashion_mnist(tmp_path / "data", 8, 4)
    done = simulated_command(["train_resnet.py", "--gpus", "1", "--width", "4", "--batch-size", "2", "--limit", "8",
                              "--test-limit", "4", "--profile", "--profile-steps", "1", graph, "--data-dir", data,
                              "--out", tmp_path / "run"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert written["config"]["backend"] == "cuda" and written["config"]["precision"] == "tf32"
    assert ("eager steps" in done.stdout) == (graph == "--graph"), done.stdout[-2000:]


# ---- on the GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("precision, family", [("tf32", "conv_tc_forward"), ("bf16", "conv_bf16_forward")])
def test_resnet18_at_batch_256_on_the_gpu(tmp_path, precision, family):
    """Every layer has its row, with the kernels of its precision; the GPU never waited for the host (the
    hold before each step outlasted its queueing), so the rows add up to the step."""
    from test_kernels_cuda import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cupy = kernels.cupy_module()
    with kernels.use_precision(precision):
        nn.manual_seed(0)
        model = nn.resnet18().to("cuda")
        images, labels = (cupy.asarray(a) for a in batch(512))
        report = run_profile(model, images, labels, batch_size=256, steps=3, warmup=2)
    rows = rows_by_name(report)
    for name, module in model.named_modules():
        if not module.children():
            assert (name, "layer") in rows, name
    assert any(k.startswith(family) for k in rows["resnet_block1.0.conv1", "layer"].kernels["forward"])
    assert report.config["clock"] == "CUDA events" and report.step_ms > 0 and report.starved() == 0
    assert abs(report.rows_ms() - report.step_ms) <= max(0.15 * report.step_ms, 2.0)
    paths = report.write(tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][0]["total_ms"] >= 0
    check_timeline(json.loads(paths["trace"].read_text())["traceEvents"],
                   [name for name, _ in model.named_modules()], steps=3)
