"""bench/gpu_check without a GPU: its command line, its exit without a GPU, its budget and timeouts, its
archive, the cost formulas of profiler/costs.py, the layer list of bench/layers.py against the model, the
checks of tests/test_gpu_full.py run small on the CPU, tier k's kernel kinds on names read on an H200, its
trace tables and ncu's CSV, tier f's check of the profiler against tier k, and a dry run of tiers c and d
on the NumPy backend and k, e, f and g on simulated GPUs, through the same code as on the GPU."""
import argparse
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

import kernels
import kernels.cpu as K
from bench import kernel_times, tiers
from bench.layers import distinct, parameter_count, resnet18_layers
from profiler import costs
from helpers import (again_where_permissions_bind, one_line_error, permissions_bind, usage_then_error,
                     write_fashion_mnist)

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


@pytest.mark.parametrize("flags, message", [
    (["--tiers", "a,x"], "--tiers takes letters among"),
    (["--budget-seconds", "soon"], "argument --budget-seconds: invalid float value: 'soon'"),
    (["--dry-runn"], "unrecognized arguments: --dry-runn"),
])
def test_malformed_flags_are_refused_with_the_usage(flags, message, capsys, tmp_path):
    assert message in usage_then_error(capsys, tiers.parse_args, ["--out", str(tmp_path / "out"), *flags],
                                       prog="bench/gpu_check")


@pytest.mark.parametrize("flags, message", [
    (["--budget-seconds", "0"], "--budget-seconds must be positive and finite, got 0.0"),
    (["--budget-seconds", "-60"], "--budget-seconds must be positive and finite, got -60.0"),
    (["--budget-seconds", "inf"], "--budget-seconds must be positive and finite, got inf"),
    (["--out", "{tmp}/a-file/out"], "--out {tmp}/a-file/out: {tmp}/a-file is a regular file, not a folder"),
    (["--out", "{tmp}/a-file"], "--out {tmp}/a-file: {tmp}/a-file is a regular file, not a folder"),
])
def test_well_formed_but_wrong_flags_are_one_line_errors(flags, message, capsys, tmp_path):
    """A value argparse takes but the check cannot use: `bench/gpu_check: error: ...` alone, exit code 2, before
    anything runs (as train_resnet.py's and python -m profiler's)."""
    (tmp_path / "a-file").write_text("not a folder")
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert one_line_error(capsys, tiers.parse_args, ["--out", str(tmp_path / "out"), *flags],
                          prog="bench/gpu_check") == f"bench/gpu_check: error: {message.format(tmp=tmp_path)}\n"


@pytest.mark.skipif(kernels.gpu_count() > 0, reason="this machine has a GPU")
def test_without_a_gpu_nothing_runs_and_the_summary_says_so(tmp_path):
    began = time.monotonic()
    done = gpu_check("--out", tmp_path)
    assert done.returncode == 2 and time.monotonic() - began < 30
    assert "no GPU" in done.stderr and "nothing ran" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nothing_ran"].startswith("no GPU")
    assert [t["status"] for t in summary["tiers"].values()] == ["not run"] * len(tiers.parse_args([]).tiers)
    assert "NOTHING RAN" in (tmp_path / "summary.txt").read_text() and "NOTHING RAN" in done.stdout


def test_a_dry_run_runs_tiers_c_to_k_through_the_same_code_and_archives_them(tmp_path):
    data = write_fashion_mnist(tmp_path / "data", n_train=64, n_test=64)
    archive = tmp_path / "results" / "check.tar.gz"
    done = gpu_check("--dry-run", "--out", tmp_path / "out", "--data-dir", data, "--archive", archive,
                     timeout=480)   # two epochs, two profiles and two steps of tier k on the emulator
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {k: t["status"] for k, t in summary["tiers"].items()} == {
        "a": "not run", "b": "not run", "c": "passed", "d": "passed", "k": "passed", "e": "passed", "f": "passed",
        "g": "passed"}
    assert list(summary["tiers"]) == [t.key for t in tiers.TIERS]   # in the order they run
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
        assert all(r["precision"]["cudnn.benchmark"] is True and r["precision"]["cuda_graph"] is False
                   for name, r in training["runs"].items() if name.startswith("torch"))
        assert all(setting in row["forward"] for row in ops["rows"] for setting in ("torch_fp32", "torch_bf16"))
    # tier k: ours on a simulated GPU, its launches named through the launchers with no durations; PyTorch's CPU ops
    measured = json.loads((tmp_path / "out" / "tier_k_kernels.json").read_text())
    assert measured == summary["tiers"]["k"]["kernels"] and measured["config"]["recorded"]["ours"] == "launches"
    assert "no durations" in measured["recorded"]["ours"] and "CUPTI" in measured["recorded"]["ours"]
    assert measured["runs"]["ours_bf16_mma"]["precision"] == {"kernels": "bf16", "KERNELS_HOPPER": "0"}
    assert measured["runs"]["ours_tf32_mma"]["precision"] == {"kernels": "tf32", "KERNELS_HOPPER": "0"}
    for name in ("ours_tf32", "ours_bf16", "ours_bf16_mma", "ours_tf32_mma"):
        run = measured["runs"][name]
        assert run["step_ms"] > 0 and run["kernel_ms_per_step"] is None and run["kernels_per_step"] > 50, name
        conv = "conv_tc_" if name.startswith("ours_tf32") else "conv_bf16_"
        assert any(k["name"].startswith(conv) and k["kind"] == "convolution" for k in run["kernels"]), name
        assert all(k["us_per_step"] is None for k in run["kernels"])
        assert sum(k["calls_per_step"] for k in run["kernels"]) == run["kernels_per_step"] == \
            sum(kind["calls_per_step"] for kind in run["by_kind"].values())
    if measured["torch"] == "compared":
        assert measured["runs"]["torch_bf16_graph"]["not_run"] == "a CUDA graph needs a GPU"
        for name in ("torch_tf32", "torch_bf16", "torch_bf16_compiled"):
            run = measured["runs"][name]
            assert run["kernel_ms_per_step"] > 0 and run["precision"]["cudnn.benchmark"] is True, name
            assert any(k["name"] == "aten::convolution_backward" and k["kind"] == "convolution" for k in run["kernels"])
            assert (tmp_path / "out" / f"tier_k_kernels.{name}.trace.json").exists()
        assert measured["runs"]["torch_bf16_compiled"]["precision"]["compile_backend"] == "eager"
    assert [c["name"] for c in summary["tiers"]["k"]["commands"]] == ["ours", "torch", "compiled"]
    # tiers e, f and g on simulated GPUs: two through the launcher and NCCL, one for the profiles
    for key, precision in (("epoch", "tf32"), ("epoch_bf16", "bf16")):
        epoch = summary["tiers"]["e"][key]
        assert 0 <= epoch["test_acc"] <= 1 and epoch["world_size"] == 2 and epoch["precision"] == precision, key
    for precision in ("tf32", "bf16"):
        profile = summary["tiers"]["f"][f"profile_{precision}"]
        assert profile["config"]["batch_size"] == 4 and any(r["name"] == "fc.1" for r in profile["rows"])
        assert profile["config"]["backend"] == "cuda" and profile["config"]["precision"] == precision
        assert (tmp_path / "out" / f"tier_f_profile_{precision}" / "profile.png").exists()
        check = summary["tiers"]["f"]["against_kernels"][precision]   # no kernel times in a dry run: not made
        assert check["status"] == "not made" and "no kernel time" in check["reason"], check
    nccl = summary["tiers"]["g"]["pytest"]["tests"]
    assert nccl["passed"] == nccl["tests"] == 3, nccl  # two GPUs: not one of them skipped
    assert done.stdout.endswith((tmp_path / "out" / "summary.txt").read_text())
    assert "sec/epoch" in done.stdout and "one epoch in tf32" in done.stdout and "one epoch in bf16" in done.stdout
    assert "a training step's kernels at batch 4" in done.stdout and "the slowest kernels of ours_bf16" in done.stdout
    assert "tf32: not made: tier k's ours_tf32 has no kernel time" in done.stdout
    # the archive: every file of the out folder, as it is at the end
    with tarfile.open(archive) as tar:
        held = {m.name: m.size for m in tar.getmembers() if m.isfile()}
    files = {str(Path("out") / f.relative_to(tmp_path / "out")): f.stat().st_size
             for f in (tmp_path / "out").rglob("*") if f.is_file()}
    assert held == files and "out/summary.txt" in held and "out/tier_k_kernels.json" in held
    assert not list(archive.parent.glob("*.part"))


# ---- the budget ----------------------------------------------------------------------------------

def budget_args(tmp_path, budget=280):
    return argparse.Namespace(out=tmp_path, dry_run=False, budget_seconds=budget)


def test_the_default_tiers_usual_times_fit_the_default_budget_and_the_help_names_those_left_out():
    """The default check (NVRTC's compile included, in tier a's estimate) fits 6 minutes on one H200; a tier
    that the default leaves out says so in its paragraph of the docstring (--help), and a dry run covers
    every tier it can."""
    default = tiers.parse_args([])
    assert default.budget_seconds <= 360
    assert sum(t.estimate_s for t in default.tiers) <= default.budget_seconds
    paragraphs = dict(re.findall(r"^  ([a-z])  (.*?)(?=^  [a-z]  |^\n)", tiers.__doc__, re.MULTILINE | re.DOTALL))
    assert set(paragraphs) == {t.key for t in tiers.TIERS}
    for t in tiers.TIERS:
        assert ("Not in the default" in paragraphs[t.key]) == (t not in default.tiers), t.key
    assert [t.key for t in default.tiers][:5] == ["a", "b", "d", "k", "f"]   # the most valuable first
    assert tiers.parse_args(["--dry-run"]).tiers == list(tiers.TIERS)
    assert all(t.estimate_s < t.limit_s for t in tiers.TIERS)


def test_a_tier_gets_what_the_later_tiers_do_not_need_as_spare_time(tmp_path):
    seen = {}

    def note(run):
        seen["spare"], seen["left"] = run.spare(), run.left()
        return {}
    tier = tiers.Tier("x", "a tier", estimate_s=10, limit_s=50, run=note, dry_run=True)
    tiers.run_tier(tier, budget_args(tmp_path), left=100, reserve=80)
    assert 19 < seen["spare"] <= 20 and 49 < seen["left"] <= 50


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


def test_an_optional_commands_failure_is_reported_but_does_not_fail_the_tier(tmp_path):
    def fails(run):
        run.command("extra", [sys.executable, "-c", "raise SystemExit(3)"], optional=True)
        run.command("main", [sys.executable, "-c", "pass"])
        return {}
    tier = tiers.Tier("x", "a tier", estimate_s=0, limit_s=60, run=fails, dry_run=True)
    result = tiers.run_tier(tier, budget_args(tmp_path), left=100)
    assert result["status"] == "passed" and result["commands"][0]["rc"] == 3
    from bench.summary import outcome
    assert "extra: exit status 3, see tier_x_extra.log" in outcome(result)
    assert tiers.status([{**result["commands"][0], "optional": False}], {}) == "failed"


# ---- the archive ---------------------------------------------------------------------------------

def test_an_archive_that_cannot_be_written_stops_the_check_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("")
    began = time.monotonic()
    done = gpu_check("--out", tmp_path / "out", "--archive", tmp_path / "file" / "check.tar.gz")
    assert done.returncode == 2 and time.monotonic() - began < 30
    assert done.stderr == f"bench/gpu_check: error: --archive {tmp_path / 'file' / 'check.tar.gz'}: " \
                          f"{tmp_path / 'file'} is a regular file, not a folder\n"
    assert not (tmp_path / "out").exists() and done.stdout == ""
    (tmp_path / "folder.tar.gz").mkdir()
    assert "is a folder" in tiers.archive_problem(tmp_path / "folder.tar.gz")
    assert "ending in .tar.gz or .tgz" in tiers.archive_problem(tmp_path / "check.zip")
    assert tiers.archive_problem(tmp_path / "new" / "check.tgz") is None and not list((tmp_path / "new").iterdir())


def test_an_archive_or_results_folder_without_write_permission_is_refused(tmp_path, request):
    if not permissions_bind(tmp_path):   # root, as CI runs the suite: again without the override
        return again_where_permissions_bind(request)
    (tmp_path / "locked").mkdir(mode=0o500)
    assert tiers.archive_problem(tmp_path / "locked" / "check.tar.gz") == \
        f"--archive {tmp_path / 'locked' / 'check.tar.gz'}: cannot write there (Permission denied)"
    assert tiers.folder_problem("--out X", tmp_path / "locked" / "out") == "--out X: cannot write there (Permission denied)"
    assert tiers.folder_problem("--out X", tmp_path / "open") is None


def test_the_archive_holds_every_file_of_the_out_folder_and_is_replaced_whole(tmp_path):
    out = tmp_path / "out"
    (out / "tier_f_profile_tf32").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "tier_f_profile_tf32" / "profile.json").write_text("[1]")
    (out / "training.json.part").write_text("half")   # being written: left out
    archive = out / "check.tar.gz"                     # the archive in the folder it archives: left out
    tiers.write_archive(archive, out)
    tiers.write_archive(archive, out)
    with tarfile.open(archive) as tar:
        assert sorted(m.name for m in tar.getmembers()) == ["out/summary.json", "out/tier_f_profile_tf32/profile.json"]
        assert tar.extractfile("out/tier_f_profile_tf32/profile.json").read() == b"[1]"
    assert not (out / "check.tar.gz.part").exists()


def test_the_archive_is_rewritten_after_every_tier_and_when_the_check_is_stopped(tmp_path, monkeypatch):
    """A check stopped by SIGTERM in its second tier leaves an archive of the first tier's results, and then one
    with the summary saying which tier was stopped."""
    out, archive, seen = tmp_path / "out", tmp_path / "check.tgz", {}

    def first(run):
        run.path("result.txt").write_text("first")
        return {}

    def second(run):
        with tarfile.open(archive) as tar:
            seen["names"] = sorted(m.name for m in tar.getmembers())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the check")
    monkeypatch.setattr(tiers, "TIERS", (tiers.Tier("x", "first", 0, 60, first, True),
                                         tiers.Tier("y", "second", 0, 60, second, True)))
    monkeypatch.setattr(tiers, "probe", lambda: {})
    with pytest.raises(SystemExit) as stopped:
        tiers.main(["--dry-run", "--out", str(out), "--archive", str(archive)])
    assert stopped.value.code == 128 + signal.SIGTERM
    assert seen["names"] == ["out/summary.json", "out/summary.txt", "out/tier_x.json", "out/tier_x_result.txt"]
    with tarfile.open(archive) as tar:
        summary = json.loads(tar.extractfile("out/summary.json").read())
        assert "the check was stopped" in tar.extractfile("out/summary.txt").read().decode()
    assert summary["tiers"]["x"]["status"] == "passed" and summary["tiers"]["y"]["status"] == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is not tiers._terminated


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
    a process of its own and named as it is done; a family the GPU does not run named as such; a family that does
    not compile named, and the exit non-zero; an unknown one refused."""
    env = {**os.environ, kernels.SIMULATED_GPUS: "1", "CUDA_EMU_SANITIZE": "off", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "kernels.cuda.compile_all", "loss", "optim"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(":")[0] for line in done.stdout.splitlines()) == ["loss", "optim"], done.stdout
    # Hopper's family on an Ampere: named, not compiled (NVRTC would refuse sm_80a)
    done = subprocess.run([sys.executable, "-m", "kernels.cuda.compile_all", "conv_sm90"], cwd=ROOT, timeout=300,
                          env={**env, "KERNELS_SIMULATED_COMPUTE_CAPABILITY": "80"}, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "conv_sm90: not for this GPU\n"), done.stderr
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


# ---- tier k: the kernels of a step; tier f against them ------------------------------------

# names as CUPTI gave them on one H200 (driver 580, PyTorch 2.11 with cuDNN 9.19), cut at 160 characters, with
# the kind each gets: our families by the .cu file that defines them; cuDNN's layout transposes (NCHW to NHWC and
# back, run to feed its tensor-core convolutions) are convolution work; Inductor's fused kernels are element-wise
# work whatever they fused, a convolution's cast included; the linear layer's GEMMs, the loss and SGD are other
H200_NAMES = (
    ("void conv_bf16_wgrad<Bf128x128, 32>(bf16 const*, bf16 const*, float*, int, float*, float*, float*, unsigned "
     "int*, int, int, int, int, int, int, int, i", "convolution"),
    ("void conv_tc_dgrad_halo<TcHalo128x64>(float const*, float const*, float*, int, float*, unsigned int*, int, "
     "int, int, int, int, int, int, int, int, int", "convolution"),
    ("void conv2d_wgrad<Tile64, 3, 3, bf16>(bf16 const*, bf16 const*, float*, float*, unsigned int*, float*, "
     "float*, int, int, int, int, int, int, int, int,", "convolution"),
    ("mirrored_weights", "convolution"),
    ("void bn_backward_dx<4, bf16>(bf16 const*, bf16 const*, bf16 const*, float const*, float const*, float "
     "const*, float const*, float const*, float const*", "batch norm and elementwise"),
    ("void images_to_float<long long, bf16>(unsigned char const*, long long const*, int, int, bf16*)",
     "batch norm and elementwise"),
    ("void global_avg_pool_forward<bf16>(bf16 const*, int, int, int, int, float*)", "batch norm and elementwise"),
    ("cupy_fill", "batch norm and elementwise"),
    ("void matmul<Tile64, true, true>(float const*, float const*, float const*, float*, int, int, int, int, int, "
     "int, int)", "other"),
    ("sgd_update", "other"),
    ("sum_partials", "other"),
    ("void softmax_xent_forward<int>(float const*, int const*, int, int, float*, float*)", "other"),
    ("sm90_xmma_wgrad_indexed_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x64x64_warpgroupsize1x1x1_"
     "g1_execute_segment_k_off_kernel__5x_cudn", "convolution"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)0>"
     "(cudnn::engines_precompiled::nchw2nhwc_pa", "convolution"),
    ("void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float, true, false, "
     "(cudnnKernelDataType_t)0>(cudnn::engines_precompil", "convolution"),
    ("void cask_plugin__5x_cudnn::xmma__5x_cudnn::init_device_workspace_kernel<xmma__5x_cudnn::implicit_gemm::"
     "wgrad_indexed::Warp_specialized_params<xmma__5", "convolution"),
    ("_ZN17cutlass__5x_cudnn6KernelINS_4conv6kernel23ImplicitGemmConvolutionINS1_11threadblock22ImplicitGemm"
     "MultistageINS_4gemm9GemmShapeILi64ELi128ELi64EEE", "convolution"),
    ("void convolve_common_engine_float_NHWC<__nv_bfloat16, __nv_bfloat16, 128, 6, 7, 3, 3, 5, true, false, false, "
     "false, false>(int, int, int, __nv_bfloat1", "convolution"),
    ("void wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, int, int, float const*, int, float*, float "
     "const*, kernel_grad_params, unsigned lon", "convolution"),
    ("void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 32, true, 1>(float, float, float, float, "
     "cudnnTensorStruct, float const*, cudnnTensorStruct, f", "batch norm and elementwise"),
    ("void at::native::batch_norm_collect_statistics_channels_last_kernel<at::native::Var, c10::BFloat16, float, "
     "4>(c10::BFloat16 const*, float*, float*, fl", "batch norm and elementwise"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, at::native::func_wrapper_t<"
     "c10::BFloat16, at::native::sum_functor<c10::BFlo", "batch norm and elementwise"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<"
     "char*, 3ul> >(int, at::native::CUDAFunctor_ad", "batch norm and elementwise"),
    ("triton_red_fused__native_batch_norm_legit_functional_3", "batch norm and elementwise"),
    ("triton_poi_fused__to_copy_convolution_2", "batch norm and elementwise"),
    ("Memset (Device)", "batch norm and elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous nam", "other"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nn_align1>(cutlass_80_simt_sgemm_128x64_8x5_nn_align1"
     "::Params)", "other"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, float, float, float, true, "
     "false, false, false>(cublasLt::cublasSpl", "other"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, "
     "float*, float const*, long const*, float co", "other"),
)


@pytest.mark.parametrize("name, kind", H200_NAMES, ids=[kernel_times.function_name(n)[-40:] for n, _ in H200_NAMES])
def test_a_kernel_read_on_an_h200_gets_its_kind(name, kind):
    assert kernel_times.kind_of(name) == kind


def test_every_kernel_of_every_family_has_the_familys_kind():
    """The __global__ functions found in each family's source are all its kernels (KERNELS names those with
    templates), each of the kind its family has."""
    from kernels.cuda import FAMILIES, launcher
    assert set(kernel_times.FAMILY_KINDS) == set(FAMILIES)
    ours = kernel_times.our_kernels()
    for family in FAMILIES:
        for expression in launcher(family).KERNELS:
            function = kernel_times.function_name(expression)
            expected = kernel_times.FAMILY_KINDS[family] if function != "sum_partials" else "other"
            assert ours.get(function) == expected, (family, expression)


def test_kernel_names_are_cut_to_their_function_and_template():
    short, function = kernel_times.short_name, kernel_times.function_name
    cupti = "void conv_bf16_wgrad<Bf128x128, 32>(bf16 const*, bf16 const*, float*, int)"
    ncu = "void conv_bf16_wgrad<Bf128x128, 32>(const bf16 *, const bf16 *, float *, int)"
    assert short(cupti) == short(ncu) == "conv_bf16_wgrad<Bf128x128, 32>" and function(cupti) == "conv_bf16_wgrad"
    assert short("void (anonymous namespace)::softmax_warp_forward<float, 4>(float*, int)") == \
        "softmax_warp_forward<float, 4>"
    assert short("void f<g(int)>(int)") == "f<g(int)>" and short("Memset (Device)") == "Memset"
    assert function("sm90_xmma_fprop_implicit_gemm_bf16") == "sm90_xmma_fprop_implicit_gemm_bf16"


def test_a_trace_table_counts_each_event_by_its_own_time_per_step():
    """Kernels on two streams, two of them overlapping, a memset, a CPU event that is not asked for; CPU ops
    nested in one another, each by its own time."""
    def event(name, ts, dur, cat="kernel", tid=7):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}
    gpu = [event("a", 0, 10), event("b", 10, 4), event("a", 20, 6), event("a", 5, 2, tid=8),
           event("Memset (Device)", 30, 1, cat="gpu_memset"), event("aten::add", 0, 50, cat="cpu_op"),
           {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3}]
    gpu.append(event("b", 21, 2))    # a launch that overlaps the one before it on the stream: both count whole
    table = kernel_times.event_table(gpu, 2, kernel_times.GPU_EVENTS)
    assert [(r["name"], r["calls_per_step"], r["us_per_step"]) for r in table] == [
        ("a", 1.5, 9.0), ("b", 1.0, 3.0), ("Memset (Device)", 0.5, 0.5)]
    cpu = [event("aten::conv2d", 0, 100, "cpu_op", 1), event("aten::convolution", 10, 80, "cpu_op", 1),
           event("aten::mkldnn_convolution", 20, 60, "cpu_op", 1), event("aten::relu", 100, 5, "cpu_op", 1),
           event("aten::empty", 30, 10, "cpu_op", 2)]
    own = {r["name"]: r["us_per_step"] for r in kernel_times.event_table(cpu, 1, kernel_times.CPU_EVENTS, nested=True)}
    assert own == {"aten::conv2d": 20, "aten::convolution": 20, "aten::mkldnn_convolution": 60, "aten::relu": 5,
                   "aten::empty": 10}


def test_a_runs_totals_by_kind():
    rows = [{"name": "a", "calls_per_step": 2, "us_per_step": 1500.0, "kind": "convolution"},
            {"name": "b", "calls_per_step": 3, "us_per_step": 500.0, "kind": "other"}]
    assert kernel_times.totals(rows) == {"kernel_ms_per_step": 2.0, "kernels_per_step": 5, "by_kind": {
        "convolution": {"ms_per_step": 1.5, "calls_per_step": 2},
        "batch norm and elementwise": {"ms_per_step": 0, "calls_per_step": 0},
        "other": {"ms_per_step": 0.5, "calls_per_step": 3}}}
    untimed = kernel_times.totals([{**rows[0], "us_per_step": None}])
    assert untimed["kernel_ms_per_step"] is None and untimed["by_kind"]["convolution"] == {
        "ms_per_step": None, "calls_per_step": 2}


NCU_LOG = """$ ncu --csv --page raw python -m bench.kernel_times --ncu-step bf16
==PROF== Connected to process 4242 (/usr/bin/python3)
one bf16 step of ours at batch 256 ran between cudaProfilerStart and Stop
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device",\
"CC","gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum",\
"sm__throughput.avg.pct_of_peak_sustained_elapsed"
"","","","","","","","","","","","%","nsecond","%"
"0","4242","python3","h","void conv_bf16_wgrad<Bf128x128, 32>(const bf16 *, float *, int)","1","7","(128, 1, 1)",\
"(1, 2, 196)","0","9.0","12.5","300,000","2.00"
"1","4242","python3","h","void conv_bf16_wgrad<Bf128x128, 32>(const bf16 *, float *, int)","1","7","(128, 1, 1)",\
"(1, 1, 314)","0","9.0","20.5","100,000","6.00"
"2","4242","python3","h","void bn_backward_dx<4, bf16>(const bf16 *)","1","7","(256, 1, 1)","(784, 1, 1)","0",\
"9.0","80.0","3,200","30.0"
""".replace("\\\n", "")


def test_ncus_csv_is_read_from_its_log_and_summed_by_kernel():
    lines, launches = kernel_times.ncu_launches(NCU_LOG)
    assert len(lines) == 5 and all(line.startswith('"') for line in lines)
    assert launches[0] == {"kernel": "conv_bf16_wgrad<Bf128x128, 32>", "duration_us": 300.0, "sm_pct": 2.0,
                           "memory_pct": 12.5}
    assert kernel_times.ncu_by_kernel(launches) == [
        {"kernel": "conv_bf16_wgrad<Bf128x128, 32>", "launches": 2, "us": 400.0, "sm_pct": 3.0,
         "sm_pct_range": [2.0, 6.0], "memory_pct": 14.5, "memory_pct_range": [12.5, 20.5]},
        {"kernel": "bn_backward_dx<4, bf16>", "launches": 1, "us": 3.2, "sm_pct": 30.0, "sm_pct_range": [30.0, 30.0],
         "memory_pct": 80.0, "memory_pct_range": [80.0, 80.0]}]
    assert kernel_times.ncu_launches("==ERROR== no kernels were profiled\n") == ([], [])


def test_ncus_filter_takes_the_slowest_kernels_functions_and_no_others():
    rows = [{"name": f"void k{i}<{i}>(float*)", "us_per_step": 100.0 - i, "calls_per_step": 1} for i in range(12)]
    rows.insert(1, {"name": "void k0<99>(float*)", "us_per_step": 99.5, "calls_per_step": 1})
    functions = kernel_times.slowest_functions(rows, 10)
    assert functions == [f"k{i}" for i in range(9)]      # k0's two templates are one function
    pattern = re.compile(kernel_times.ncu_filter(["conv_bf16_wgrad", "bn_apply"]).removeprefix("regex:"))
    for name in ("conv_bf16_wgrad", "bn_apply", "void conv_bf16_wgrad<Bf128x128, 32>(const bf16 *)",
                 "void bn_apply<1, 4, bf16>(const bf16 *, float *)"):
        assert pattern.fullmatch(name) and pattern.search(name), name
    for name in ("conv_bf16_wgrad_halo", "void conv_bf16_wgrad_halo<Halo288x64>(const bf16 *)", "xbn_apply"):
        assert not pattern.search(name), name
    assert kernel_times.slowest_functions([{**rows[0], "us_per_step": None}]) == []


def fake_ncu(folder, seconds):
    """An ncu on PATH that takes `seconds` and prints NCU_LOG's CSV, whatever it is asked."""
    (folder / "bin").mkdir(exist_ok=True)
    ncu = folder / "bin" / "ncu"
    ncu.write_text(f"#!/bin/sh\nsleep {seconds}\ncat <<'EOF'\n{NCU_LOG}EOF\n")
    ncu.chmod(0o755)
    return f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}"


def test_tier_k_runs_ncu_where_there_is_one_and_reads_its_csv(tmp_path, monkeypatch):
    """The command asks for the SpeedOfLight section with the clocks left alone over one step of ours, filtered
    to the slowest kernels' functions, only with time to spare in the budget; its CSV lands in the out folder."""
    monkeypatch.setenv("PATH", fake_ncu(tmp_path, 0))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    measured = {"runs": {"ours_bf16": {"kernels": [{"name": "void conv_bf16_wgrad<Bf128x128, 32>(bf16 const*)",
                                                    "us_per_step": 3000.0, "calls_per_step": 15}]}}}
    args = argparse.Namespace(out=tmp_path, dry_run=False, budget_seconds=100)
    tier = tiers.Tier("k", "kernels", estimate_s=0, limit_s=60, run=None, dry_run=True)
    results = tiers.speed_of_light(tiers.Run(args, tier, 60), measured, "bf16")["bf16"]
    command = (tmp_path / "tier_k_ncu_bf16.log").read_text().splitlines()[0]
    assert "--profile-from-start off --clock-control none --section SpeedOfLight" in command
    assert "regex:^(void )?(conv_bf16_wgrad)" in command and command.endswith("--ncu-step bf16")
    assert results["launches"] == 3 and results["csv"] == "tier_k_ncu_bf16.csv"
    assert (tmp_path / "tier_k_ncu_bf16.csv").read_text().count("\n") == 5
    results = tiers.speed_of_light(tiers.Run(args, tier, 60), {}, "tf32")["tf32"]
    assert results["functions"].startswith("every kernel of the step") and "--kernel-name" not in \
        (tmp_path / "tier_k_ncu_tf32.log").read_text().splitlines()[0]
    assert tiers.speed_of_light(tiers.Run(args, tier, 60, spare=2), measured, "bf16") == {
        "bf16": {"not_run": "no time to spare in the budget"}}
    monkeypatch.setenv("PATH", "")
    assert "not on PATH" in tiers.speed_of_light(tiers.Run(args, tier, 60), measured, "bf16")["not_run"]


@pytest.mark.parametrize("spare, ncu_seconds, tf32_runs", [(60, 0.2, True), (2.5, 1.5, False)])
def test_tier_ks_extras_take_only_the_time_the_budget_spares(tmp_path, monkeypatch, spare, ncu_seconds, tf32_runs):
    """ncu over bf16, torch.compile's run, then ncu over tf32 only where the time spared is as long as bf16's
    took; the extras are optional. (bench.kernel_times's commands stand in as `true`.)"""
    monkeypatch.setenv("PATH", fake_ncu(tmp_path, ncu_seconds))
    monkeypatch.setattr(tiers, "PYTHON", "true")
    monkeypatch.setattr(tiers, "MIN_COMMAND_S", 0.1)
    args = argparse.Namespace(out=tmp_path, dry_run=False, budget_seconds=100)
    tier = tiers.Tier("k", "kernels", estimate_s=0, limit_s=60, run=None, dry_run=True)
    run = tiers.Run(args, tier, 60, spare=spare)
    result = tiers.kernel_breakdown(run)
    assert [c["name"] for c in run.commands] == ["ours", "torch", "ncu_bf16", "compiled"] + ["ncu_tf32"] * tf32_runs
    assert [c.get("optional", False) for c in run.commands][:4] == [False, False, True, True]
    assert result["ncu"]["bf16"]["launches"] == 3
    if tf32_runs:
        assert result["ncu"]["tf32"]["launches"] == 3
    else:
        assert "bf16's took 2 s" in result["ncu"]["tf32"]["not_run"], result["ncu"]


def profile_of(ms):
    return {"step": {"rows_median_sum_ms": ms}}


def kernels_of(**runs):
    return {"recorded": {"ours": "CUPTI"}, "runs": {name: {"kernel_ms_per_step": ms} for name, ms in runs.items()}}


def test_the_profilers_layers_must_add_up_to_tier_ks_kernels_within_ten_percent():
    check = tiers.against_kernels
    assert check(profile_of(10.9), kernels_of(ours_tf32=10.0), "tf32")["status"] == "passed"
    assert check(profile_of(9.1), kernels_of(ours_bf16=10.0), "bf16")["status"] == "passed"
    off = check(profile_of(11.2), kernels_of(ours_tf32=10.0), "tf32")
    assert off == {"status": "failed", "profile_ms": 11.2, "kernel_ms": 10.0, "ratio": 1.12, "tolerance": 0.1}
    assert check(profile_of(8.8), kernels_of(ours_bf16=10.0), "bf16")["status"] == "failed"
    assert check(profile_of(10.0), kernels_of(ours_tf32=10.0), "bf16")["status"] == "not made"   # no bf16 run
    errored = {"recorded": {}, "runs": {"ours_bf16": {"error": "CUDARuntimeError: out of memory"}}}
    assert "out of memory" in check(profile_of(10.0), errored, "bf16")["reason"]
    assert check(None, kernels_of(ours_tf32=10.0), "tf32")["status"] == "not made"
    assert tiers.status([], {"against_kernels": {"tf32": off}}) == "failed"
    assert tiers.status([], {"against_kernels": {"tf32": {"status": "not made", "reason": "-"}}}) == "passed"


def test_tier_f_makes_no_comparison_without_tier_k(tmp_path):
    args = argparse.Namespace(out=tmp_path, dry_run=False, budget_seconds=100, tiers=[tiers.TIERS[0]])
    run = tiers.Run(args, tiers.TIERS[0], 10)
    assert tiers.kernel_tier_result(run) == (None, "tier k was not among this check's tiers")
    args.tiers = list(tiers.TIERS)
    assert "wrote no tier_k_kernels.json" in tiers.kernel_tier_result(run)[1]
    (tmp_path / "tier_k_kernels.json").write_text(json.dumps(kernels_of(ours_tf32=1.0)))
    assert tiers.kernel_tier_result(run) == (kernels_of(ours_tf32=1.0), None)


def test_the_summary_of_tiers_k_and_f():
    from bench.summary import summary_lines

    def run(step, kinds, *kernels):
        rows = [{"name": name, "calls_per_step": calls, "us_per_step": us, "kind": kind}
                for name, calls, us, kind in kernels]
        return {"step_ms": step, "kernel_ms_per_step": sum(kinds),
                "kernels_per_step": sum(r["calls_per_step"] for r in rows), "kernels": rows,
                "by_kind": {kind: {"ms_per_step": ms, "calls_per_step": 1}
                            for kind, ms in zip(kernel_times.KINDS, kinds)}}
    measured = {"config": {"batch": 256}, "recorded": {"ours": "CUPTI (ours)", "torch": "CUPTI (torch)"}, "runs": {
        "ours_bf16": run(11.3, (10.26, 0.89, 0.11),
                         ("void conv_bf16_wgrad<Bf128x128, 32>(bf16 const*)", 15, 3200.4, "convolution"),
                         ("void bn_backward_dx<4, bf16>(bf16 const*)", 17, 554.4, "batch norm and elementwise")),
        "torch_bf16": run(12.76, (1.76, 2.84, 0.24), ("sm90_xmma_dgrad", 9, 265.3, "convolution")),
        "torch_bf16_graph": {"not_run": "a CUDA graph needs a GPU"},
        "torch_bf16_compiled": {"unfinished": "started at noon"}}}
    ncu = {"bf16": {"csv": "tier_k_ncu_bf16.csv", "launches": 2, "by_kernel": [
        {"kernel": "conv_bf16_wgrad<Bf128x128, 32>", "launches": 15, "us": 3300.0, "sm_pct": 2.9,
         "sm_pct_range": [1.7, 18.0], "memory_pct": 12.0, "memory_pct_range": [9.0, 21.0]}]},
           "tf32": {"not_run": "3 s to spare in the budget, and bf16's took 40 s"}}
    checks = {"tf32": {"status": "failed", "profile_ms": 21.0, "kernel_ms": 18.0, "ratio": 1.1667, "tolerance": 0.1},
              "bf16": {"status": "not made", "reason": "tier k's ours_bf16 has no kernel time (no such run)"}}
    summary = {"environment": {}, "budget_s": 360, "seconds": 300, "out": "/results", "tiers": {
        "k": {"status": "passed", "seconds": 80, "kernels": measured, "ncu": ncu, "commands": []},
        "f": {"status": "failed", "seconds": 40, "against_kernels": checks, "commands": []}}}
    text = "\n".join(summary_lines(summary))
    assert "k     passed        80  kernels of 2 runs recorded; torch_bf16_graph: a CUDA graph needs a GPU; " \
           "torch_bf16_compiled: unfinished (started at noon); ncu: bf16 2 launches read, tf32 3 s to spare" in text
    assert "  ours_bf16                11.30     11.26        32           10.26           0.89           0.11" in text
    assert "  torch_bf16_compiled  unfinished (started at noon)" in text
    assert "the slowest kernels of ours_bf16: us per step, launches per step, kind; torch_bf16's convolutions: " \
           "1.76 ms in 1 launches" in text
    assert re.search(r"\n +3200\.4 x15 +conv_bf16_wgrad<Bf128x128, 32> +convolution\n", text)
    assert re.search(r"conv_bf16_wgrad<Bf128x128, 32> +15 +3300\.0  SM +2\.9 \(1\.7-18\.0\)  memory +12\.0 "
                     r"\(9\.0-21\.0\)", text)
    assert "f     failed        40  tf32 profile against tier k: 1.17x, failed; bf16 profile against tier k: not made" \
           in text
    assert "  tf32: layers 21.00, kernels 18.00, ratio 1.167: failed (within 10% passes)" in text
    assert "  bf16: not made: tier k's ours_bf16 has no kernel time (no such run)" in text


def test_tier_d_on_a_gpu_times_pytorchs_bf16_step_as_a_graph_too():
    """The runs tier d builds on a GPU (their steps are made only when timed): ours and PyTorch's bf16 each
    eager and as a CUDA graph."""
    torch = pytest.importorskip("torch")
    from bench import train_times
    runs = {name: setting for name, _, _, setting in train_times.runs(train_times.FULL, torch)}
    assert list(runs) == ["ours", "ours_graph", "ours_bf16", "ours_bf16_graph", "torch_fp32", "torch_default",
                          "torch_bf16", "torch_bf16_graph"]
    assert runs["torch_bf16_graph"] == (None, True, True) and runs["torch_bf16"] == (None, True, False)


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
