"""bench/gpu_check without a GPU: its command line, its exit without a GPU, its budget and timeouts, the
cost formulas of profiler/costs.py, the layer list of bench/layers.py against the model, the checks of
tests/test_gpu_full.py run small on the CPU, and a dry run of tiers c and d on the NumPy backend and e,
f and g on simulated GPUs, through the same code as on the GPU."""
import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kernels
import kernels.cpu as K
from bench import tiers
from bench.layers import distinct, parameter_count, resnet18_layers
from profiler import costs
from helpers import write_fashion_mnist

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "bench" / "gpu_check"


def gpu_check(*flags, timeout=120):
    return subprocess.run([sys.executable, str(GPU_CHECK), *map(str, flags)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ---- the command ---------------------------------------------------------------------------------

def test_help_names_every_tier_and_the_ten_epoch_command():
    done = gpu_check("--help")
    assert done.returncode == 0, done.stderr
    for text in ("--data-dir", "--out", "--tiers", "--budget-seconds", "--dry-run", "compute-sanitizer",
                 "train_resnet.py --gpus 1 --epochs 10"):
        assert text in done.stdout, text


def test_unknown_tiers_are_refused(capsys):
    with pytest.raises(SystemExit):
        tiers.parse_args(["--tiers", "a,x"])
    assert "--tiers" in capsys.readouterr().err


@pytest.mark.skipif(kernels.gpu_count() > 0, reason="this machine has a GPU")
def test_without_a_gpu_nothing_runs_and_the_summary_says_so(tmp_path):
    began = time.monotonic()
    done = gpu_check("--out", tmp_path)
    assert done.returncode == 2 and time.monotonic() - began < 30
    assert "no GPU" in done.stderr and "nothing ran" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nothing_ran"].startswith("no GPU")
    assert [t["status"] for t in summary["tiers"].values()] == ["not run"] * len(tiers.TIERS)
    assert "NOTHING RAN" in (tmp_path / "summary.txt").read_text() and "NOTHING RAN" in done.stdout


def test_a_dry_run_runs_tiers_c_to_g_through_the_same_code(tmp_path):
    data = write_fashion_mnist(tmp_path / "data", n_train=64, n_test=64)
    done = gpu_check("--dry-run", "--out", tmp_path / "out", "--data-dir", data, timeout=240)   # two epochs on the emulator
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {k: t["status"] for k, t in summary["tiers"].items()} == {
        "a": "not run", "b": "not run", "c": "passed", "d": "passed", "e": "passed", "f": "passed", "g": "passed"}
    ops = json.loads((tmp_path / "out" / "tier_c_ops.json").read_text())
    assert [row["layer"] for row in ops["rows"]] == [layer.label for layer, _ in distinct(resnet18_layers(2, 4))]
    assert all(row["forward"][side]["ms"] > 0 for row in ops["rows"] for side in ("ours", "ours_bf16"))
    training = summary["tiers"]["d"]["training"]
    for name, precision in (("ours", "tf32"), ("ours_bf16", "bf16")):
        assert training["runs"][name]["steps"] > 0 and np.isfinite(training["runs"][name]["sec_per_epoch"])
        assert training["runs"][name]["precision"] == {"kernels": precision}
    if ops["torch"] == "compared":
        assert set(training["runs"]) == {"ours", "ours_bf16", "torch_fp32", "torch_default", "torch_bf16"}
        assert training["runs"]["torch_bf16"]["precision"]["autocast"] == "bfloat16"
        assert all(setting in row["forward"] for row in ops["rows"] for setting in ("torch_fp32", "torch_bf16"))
    # tiers e, f and g on simulated GPUs: two through the launcher and NCCL, one for the profile
    for key, precision in (("epoch", "tf32"), ("epoch_bf16", "bf16")):
        epoch = summary["tiers"]["e"][key]
        assert 0 <= epoch["test_acc"] <= 1 and epoch["world_size"] == 2 and epoch["precision"] == precision, key
    profile = summary["tiers"]["f"]["profile"]
    assert profile["config"]["batch_size"] == 4 and any(r["name"] == "fc.1" for r in profile["rows"])
    assert profile["config"]["backend"] == "cuda"
    nccl = summary["tiers"]["g"]["pytest"]["tests"]
    assert nccl["passed"] == nccl["tests"] == 3, nccl  # two GPUs: not one of them skipped
    assert (tmp_path / "out" / "tier_f_profile" / "profile.png").exists()
    assert done.stdout.endswith((tmp_path / "out" / "summary.txt").read_text())
    assert "sec/epoch" in done.stdout and "one epoch in tf32" in done.stdout and "one epoch in bf16" in done.stdout


# ---- the budget ----------------------------------------------------------------------------------

def budget_args(tmp_path, budget=280):
    return argparse.Namespace(out=tmp_path, dry_run=False, budget_seconds=budget)


def test_the_tiers_usual_times_fit_the_default_budget():
    assert sum(t.estimate_s for t in tiers.TIERS) <= tiers.parse_args([]).budget_seconds


def test_a_tier_that_does_not_fit_the_time_left_is_skipped(tmp_path):
    def must_not_run(run):
        raise AssertionError("ran a tier with no time for it")
    tier = tiers.Tier("x", "a long tier", estimate_s=60, limit_s=100, run=must_not_run, dry_run=True)
    result = tiers.run_tier(tier, budget_args(tmp_path), left=20)
    assert result["status"] == "skipped" and "20 s of the 280 s budget left" in result["reason"]


def test_a_hung_command_is_killed_at_the_tiers_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(tiers, "MIN_COMMAND_S", 0.1)

    def hang(run):
        run.command("hang", [sys.executable, "-c", "import time; print('hanging', flush=True); time.sleep(60)"])
        return {}
    tier = tiers.Tier("x", "a hanging tier", estimate_s=0, limit_s=1.5, run=hang, dry_run=True)
    began = time.monotonic()
    result = tiers.run_tier(tier, budget_args(tmp_path), left=100)
    assert time.monotonic() - began < 15
    assert result["status"] == "timeout" and result["commands"][0]["timed_out"]
    log = (tmp_path / "tier_x_hang.log").read_text()
    assert "hanging" in log and "killed after" in log


def test_junit_counts(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="7" failures="1" errors="1" skipped="2"/></testsuites>')
    assert tiers.junit_counts(xml) == {"tests": 7, "failed": 1, "errors": 1, "skipped": 2, "passed": 3}
    assert tiers.junit_counts(tmp_path / "missing.xml") is None


def test_the_summary_of_a_gpu_run():
    """The summary's paths that only a GPU run takes: pytest counts, the sanitizers, a failed and a
    timed-out command, a tier skipped for the budget, an epoch that did not finish."""
    from bench.summary import summary_lines
    command = {"name": "pytest", "log": "tier_b_pytest.log", "rc": 1, "seconds": 40.0, "timed_out": False,
               "tests": {"tests": 90, "passed": 88, "failed": 2, "errors": 0, "skipped": 0}}
    epoch = {"test_acc": 0.8812, "train_loss": 0.41, "seconds": 30.0, "images_per_sec": 2000.0}
    summary = {"environment": {"gpus": ["NVIDIA H200"], "driver": "580.1", "cupy": "14.0"}, "budget_s": 280,
               "seconds": 250, "out": "/results", "tiers": {
                   "a": {"status": "passed", "seconds": 60, "compile": {"rc": 0, "seconds": 70.0, "timed_out": False},
                         "pytest": {**command, "rc": 0, "tests": {**command["tests"], "passed": 90, "failed": 0}},
                         "memcheck": {"summary": "ERROR SUMMARY: 0 errors", "rc": 0},
                         "racecheck": {"rc": 0, "seconds": 60, "timed_out": True}},
                   "b": {"status": "failed", "seconds": 40, "pytest": command, "commands": [command]},
                   "d": {"status": "skipped", "reason": "10 s of the 280 s budget left"},
                   "e": {"status": "failed", "seconds": 90, "epoch": epoch, "epoch_bf16": None, "commands": []}}}
    text = "\n".join(summary_lines(summary))
    assert "NVIDIA H200 (driver 580.1)" in text
    assert "compile: exit status 0; pytest: 90 passed, 0 failed, 0 errors, 0 skipped; memcheck: ERROR SUMMARY: " \
           "0 errors; racecheck: killed after 60 s" in text
    assert "88 passed, 2 failed" in text and "pytest: exit status 1, see tier_b_pytest.log" in text
    assert "10 s of the 280 s budget left" in text
    assert "tf32 test acc 0.8812; no bf16 epoch finished" in text
    assert "one epoch in tf32, train_resnet.py: test acc 0.8812" in text and "one epoch in bf16" not in text


def test_compile_all_compiles_the_families_it_is_given(monkeypatch):
    """python -m kernels.cuda.compile_all, tier a's first command, on a simulated GPU: each family compiled in
    a process of its own and named as it is done; a family that does not compile named, and the exit non-zero;
    an unknown one refused."""
    env = {**os.environ, kernels.SIMULATED_GPUS: "1", "CUDA_EMU_SANITIZE": "off", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "kernels.cuda.compile_all", "loss", "optim"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(":")[0] for line in done.stdout.splitlines()) == ["loss", "optim"], done.stdout
    from kernels.cuda import compile_all
    monkeypatch.setattr(compile_all.concurrent.futures, "ProcessPoolExecutor",
                        compile_all.concurrent.futures.ThreadPoolExecutor)
    monkeypatch.setattr(compile_all, "compile_family", lambda family: 1 / (family != "pool"))
    assert compile_all.main(["pool", "loss"]) == 1
    with pytest.raises(SystemExit):
        compile_all.main(["nope"])


def test_the_summary_puts_each_of_our_precisions_beside_pytorchs():
    """Tiers c and d of a GPU run: ours in tf32, fp32 and bf16 each beside the PyTorch setting that rounds
    as it does (bf16 beside autocast), and every training run beside each of ours."""
    from bench.summary import summary_lines
    times = {"ours": 1.0, "ours_fp32": 3.0, "ours_bf16": 0.6, "torch_fp32": 2.0, "torch_default": 0.9,
             "torch_bf16": 0.4}
    row = {"layer": "conv 3x3/1 64->64 28->28", "op": "conv2d", "count": 4,
           **{phase: {side: {"ms": ms} for side, ms in times.items()} for phase in ("forward", "backward")}}
    ops = {"config": {"batch": 256}, "rows": [row], "torch": "compared",
           "per_step_ms": {side: 8 * ms for side, ms in times.items()}}
    runs = {name: {"sec_per_epoch": seconds, "step_ms": seconds, "steps": 100} for name, seconds in (
        ("ours", 10.0), ("ours_graph", 8.0), ("ours_bf16", 6.0), ("ours_bf16_graph", 5.0), ("torch_bf16", 4.0))}
    training = {"config": {"batch": 256}, "hyperparameters": {"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0},
                "torch": "compared", "runs": runs,
                **{f"{mine}_over": {name: runs[mine]["sec_per_epoch"] / r["sec_per_epoch"] for name, r in runs.items()
                                    if name != mine} for mine in runs if mine.startswith("ours")}}
    summary = {"environment": {}, "budget_s": 340, "seconds": 300, "out": "/results", "tiers": {
        "c": {"status": "passed", "ops": ops}, "d": {"status": "passed", "training": training}}}
    text = "\n".join(summary_lines(summary))
    assert "ours bf16  torch autocast" in text and "0.600/0.600     0.400/0.400  1.50x" in text
    assert "ours tf32 convolutions within 1.25x of cuDNN TF32: 1 of 1" in text
    assert "ours bf16 convolutions within 1.25x of cuDNN BF16 under autocast: 0 of 1; not: conv 3x3/1" in text
    assert "torch_bf16          4.00 s  (4.0 ms/step, median of 100 steps, ours / this 2.50x, ours_graph / this " \
           "2.00x, ours_bf16 / this 1.50x, ours_bf16_graph / this 1.25x)" in text


def test_the_sanitizer_step_runs_on_the_numpy_backend():
    from bench import sanitizer_step
    assert sanitizer_step.main(["--device", "cpu"]) == 0


# ---- costs -----------------------------------------------------------------------------------

def test_cost_of_a_convolution_by_hand():
    # 28x28 outputs x 64 channels, each a 64*3*3 = 576-term dot product, plus the bias
    c = costs.conv2d_forward((1, 64, 28, 28), (64, 64, 3, 3), (64,), 1, 1)
    assert c.flops == 2 * 28 * 28 * 64 * 576 + 28 * 28 * 64 == 57_852_928
    assert c.bytes == 4 * (64 * 28 * 28 + 64 * 64 * 9 + 64 + 64 * 28 * 28)
    # stride 2, 28 -> 14, 64 -> 128 channels, no bias
    assert costs.conv2d_forward((2, 64, 28, 28), (128, 64, 3, 3), None, 2, 1).flops == 2 * 2 * 14 * 14 * 128 * 576
    # backward: backward-data and backward-weight GEMMs as large as the forward's, and the bias sum
    assert costs.conv2d_backward((1, 64, 28, 28), (1, 64, 28, 28), (64, 64, 3, 3), 1, 1).flops == \
        4 * 28 * 28 * 64 * 576 + 28 * 28 * 64


def test_costs_count_each_array_at_its_own_elements_bytes():
    """The bf16 precision's bfloat16 activations and weights at 2 bytes, the float32 bias, statistics and
    parameter gradients at 4; the same FLOPs."""
    import kernels
    x, w = (np.zeros(shape, kernels.bfloat16) for shape in ((1, 64, 28, 28), (64, 64, 3, 3)))
    b = np.zeros(64, np.float32)
    c = costs.cost_of("conv2d_forward", x, w, b, 1, 1)
    assert c.flops == 57_852_928 and c.bytes == 2 * (64 * 28 * 28 + 64 * 64 * 9 + 64 * 28 * 28) + 4 * 64
    back = costs.cost_of("conv2d_backward", x, x, w, 1, 1)   # dy, x, w and dx at 2; dw and db at 4
    assert back.bytes == 2 * (3 * 64 * 28 * 28 + 64 * 64 * 9) + 4 * (64 * 64 * 9 + 64)
    y = costs.cost_of("batch_norm_forward", x, b, b, 1e-5, relu=True)
    assert y.bytes == 2 * 2 * 64 * 28 * 28 + 4 * 4 * 64
    assert costs.cost_of("relu_forward", x).bytes == 2 * 2 * 64 * 28 * 28 == costs.relu_forward(x.shape).bytes / 2


def test_cost_of_a_linear_layer_by_hand():
    c = costs.linear_forward((256, 512), (10, 512), (10,))
    assert c.flops == 2 * 256 * 512 * 10 + 256 * 10 == 2_624_000
    assert c.bytes == 4 * (256 * 512 + 10 * 512 + 10 + 256 * 10)
    assert costs.linear_backward((256, 10), (256, 512), (10, 512)).flops == 4 * 256 * 512 * 10 + 256 * 10


def test_cost_of_pooling_by_hand():
    c = costs.global_avg_pool_forward((256, 512, 4, 4))
    assert c.flops == 256 * 512 * 16 and c.bytes == 4 * (256 * 512 * 16 + 256 * 512)
    c = costs.max_pool2d_forward((1, 2, 4, 4), 2, 2, 0)   # 2 x 2 x 2 windows of 4 comparisons
    assert c.flops == 8 * 4 and c.bytes == 4 * (32 + 8) + 8 * 8


def test_the_forward_costs_add_up_to_the_models_gflop():
    """DESIGN.md: 0.912 GFLOP forward per 1x28x28 image (convolutions and the linear layer)."""
    total = 0
    for layer in resnet18_layers(batch=1):
        if layer.op == "conv2d":
            total += costs.conv2d_forward(layer.x, layer.w, None, layer.stride, layer.padding).flops
        elif layer.op == "linear":
            total += costs.linear_forward(layer.x, layer.w, None).flops
    assert abs(total / 1e9 - 0.912) < 0.001


def test_every_op_of_the_contract_has_a_cost_with_its_parameters():
    for name, fn in vars(K).items():
        if inspect.isfunction(fn) and not name.startswith("_"):
            assert inspect.signature(getattr(costs, name)).parameters.keys() == \
                inspect.signature(fn).parameters.keys(), name


def test_cost_of_takes_the_arrays_themselves():
    x, w, b = np.zeros((2, 3, 5, 5), np.float32), np.zeros((4, 3, 3, 3), np.float32), np.zeros(4, np.float32)
    assert costs.cost_of("conv2d_forward", x, w, b, 1, 1) == costs.conv2d_forward(x.shape, w.shape, b.shape, 1, 1)


# ---- the layer list ------------------------------------------------------------------------

FORWARD_OPS = ("images_to_float", "conv2d_forward", "batch_norm_forward", "batch_norm_apply", "relu_forward",
               "add_relu_forward", "global_avg_pool_forward", "linear_forward", "softmax_cross_entropy_forward")


def layer_key(op, x, *args, **kwargs):
    """The Layer.key of a call of one of FORWARD_OPS: a batch norm whose statistics the convolution before
    it computed (batch_norm_apply) is the list's batch norm all the same."""
    name = op.removesuffix("_forward").removesuffix("_apply")
    if kwargs.get("residual") is not None:
        name += "_add_relu"
    elif kwargs.get("relu"):
        name += "_relu"
    if name == "conv2d":
        w, _, stride, padding = args
        return name, x.shape, w.shape, stride[0], padding[0]    # nn.Conv2d passes (h, w) pairs
    return name, x.shape, args[0].shape if name == "linear" else None, 1, 0


def test_the_layer_list_is_what_the_model_runs(monkeypatch):
    """The ops that nn.resnet18's forward calls, with their shapes, are bench/layers.py's list."""
    import nn
    seen = []

    def recording(op, fn):
        def call(*args, **kwargs):
            seen.append(layer_key(op, *args, **kwargs))
            return fn(*args, **kwargs)
        return call
    for op in FORWARD_OPS:
        monkeypatch.setattr(K, op, recording(op, getattr(K, op)))
    nn.manual_seed(0)
    model = nn.resnet18(width=4)
    x = nn.Tensor(K.images_to_float(np.zeros((2, 28, 28), np.uint8)))
    nn.functional.cross_entropy(model(x), np.zeros(2, np.int32))
    listed = resnet18_layers(batch=2, width=4)
    assert seen == [layer.key for layer in listed if layer.op != "sgd_update"]
    assert listed[-1].x == (sum(p.size for p in model.parameters()),) == (parameter_count(listed),)
    assert parameter_count(resnet18_layers()) == 11_175_818


# ---- the full-shape GPU checks, small, on the CPU ----------------------------------------------

def small_layers():
    from test_gpu_full import ODD_SHAPES, Pool
    return ODD_SHAPES + [layer for layer, _ in distinct(resnet18_layers(batch=2, width=4))] + [
        Pool((2, 4, 9, 9), 3, 2, 1)]


def test_the_gpu_checks_pass_on_the_numpy_backend(poisoned_empty):
    """Every check of tests/test_gpu_full.py, with kernels.cpu as ours and PyTorch on the CPU as the
    peer: the checks themselves (shapes, argument orders, PyTorch's side, bounds) hold."""
    torch = pytest.importorskip("torch")
    from test_gpu_full import params
    for p in params(small_layers()):
        check, layer = p.values
        check(K, torch, "cpu", layer)


class Broken:
    """kernels.cpu with one op's result wrong: off by a relative 1e-3, or with an element unwritten."""

    def __init__(self, op, spoil):
        self.op, self.spoil = op, spoil

    def __getattr__(self, name):
        fn = getattr(K, name)
        if name != self.op:
            return fn
        return lambda *args: self.spoil(fn(*args))


def first_output(spoil):
    return lambda out: (spoil(out[0]), *out[1:]) if isinstance(out, tuple) else spoil(out)


@pytest.mark.parametrize("op, check_name, spoil", [
    ("conv2d_forward", "conv2d_fp32", lambda y: y * np.float32(1.001)),
    ("linear_backward", "linear_tf32", lambda dx: dx * np.float32(1.01)),
    ("relu_forward", "relu", lambda y: np.where(np.arange(y.size).reshape(y.shape) == 0, np.nan, y)),
    ("batch_norm_backward", "batch_norm", lambda dx: dx * np.float32(1.001)),
])
def test_a_check_fails_on_a_wrong_result(op, check_name, spoil):
    torch = pytest.importorskip("torch")
    from test_gpu_full import CHECKS
    layer = next(layer for layer in small_layers() if any(c.__name__ == check_name for c in CHECKS[layer.op]))
    check = next(c for c in CHECKS[layer.op] if c.__name__ == check_name)
    with pytest.raises(AssertionError):
        check(Broken(op, first_output(spoil)), torch, "cpu", layer)
