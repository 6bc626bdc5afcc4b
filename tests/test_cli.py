"""train_resnet.py end to end on a few dozen generated images at width 2."""
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kernels
import nn
from helpers import one_line_error, run_cli, usage_then_error, write_fashion_mnist
from training import checkpoint, cli, config, loop
from training import step as training_step

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--width", "2", "--batch-size", "16", "--limit", "40", "--test-limit", "20"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 48, 24)


def run(data_dir, out, *flags):
    return run_cli(data_dir, out, SMALL, *flags)


def test_one_epoch_from_the_command_line(data_dir, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "train_resnet.py", "--data-dir", str(data_dir), "--out", str(out),
                             "--epochs", "1", *SMALL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("epoch 1/1: loss ") and "test acc" in line and "images/s" in line
               for line in lines), result.stdout
    assert lines[-1].startswith("test acc: 0.") and lines[-1].endswith("sec/epoch on cpu"), lines[-1]
    assert "epoch 1/1" in result.stderr, "progress goes to stderr"
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics) == 1 and metrics[0]["epoch"] == 1 and metrics[0]["precision"] == "fp32"
    assert 0 <= metrics[0]["test_acc"] <= 1 and np.isfinite(metrics[0]["train_loss"])
    csv_lines = (out / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].split(",")[:3] == ["epoch", "lr", "train_loss"] and len(csv_lines) == 2
    assert (out / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    arrays, record = checkpoint.load(out)
    assert record["epoch"] == 1 and record["config"]["width"] == 2
    assert arrays["params"].dtype == np.float32 and "buffer/1.running_mean" in arrays
    assert not list(out.glob(".*.tmp")), "no temporary files are left behind"


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(data_dir, tmp_path, monkeypatch):
    flags = ["--epochs", "3", "--momentum", "0.9", "--weight-decay", "1e-4", "--schedule", "cosine",
             "--seed", "5"]
    assert run(data_dir, tmp_path / "straight", *flags) == 0

    real_epoch = loop.train_epoch

    def interrupted_in_epoch_2(model, opt, schedule, images, labels, cfg, epoch, **kw):
        if epoch == 1:
            raise KeyboardInterrupt
        return real_epoch(model, opt, schedule, images, labels, cfg, epoch, **kw)
    monkeypatch.setattr(loop, "train_epoch", interrupted_in_epoch_2)
    assert run(data_dir, tmp_path / "resumed", *flags) == 130
    assert checkpoint.load(tmp_path / "resumed")[1]["epoch"] == 1, "the finished epoch's checkpoint is kept"
    monkeypatch.setattr(loop, "train_epoch", real_epoch)

    assert cli.main(["--resume", str(tmp_path / "resumed"), "--epochs", "3"]) == 0
    a, record_a = checkpoint.load(tmp_path / "straight")
    b, record_b = checkpoint.load(tmp_path / "resumed")
    assert record_b["epoch"] == 3 and [m["epoch"] for m in record_b["metrics"]] == [1, 2, 3]
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} differs after resuming")
    assert [m["train_loss"] for m in record_a["metrics"]] == [m["train_loss"] for m in record_b["metrics"]]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    real_loss, calls = loop.cross_entropy, []

    def poisoned_in_epoch_2(logits, labels):  # 3 training steps per epoch, then evaluation
        loss = real_loss(logits, labels)
        calls.append(1)
        return loss * float("nan") if len(calls) == 3 + 2 + 2 else loss
    monkeypatch.setattr(loop, "cross_entropy", poisoned_in_epoch_2)      # evaluation's
    monkeypatch.setattr(training_step, "cross_entropy", poisoned_in_epoch_2)   # the training step's
    assert run(data_dir, tmp_path / "run", "--epochs", "3") == 1
    err = capsys.readouterr().err
    assert "loss is nan at epoch 2, step 2" in err and "last good checkpoint, of epoch 1, is intact" in err, err
    assert checkpoint.load(tmp_path / "run")[1]["epoch"] == 1


@pytest.mark.parametrize("flags,message", [
    (["--lr", "0"], "learning rate must be positive"),
    (["--lr", "-0.1"], "learning rate must be positive"),
    (["--batch-size", "0"], "batch size must be at least 1"),
    (["--epochs", "0"], "epochs must be at least 1"),
    (["--limit", "1000"], "--limit 1000 is larger than the split, which has 48"),
    (["--test-limit", "25"], "--test-limit 25 is larger than the split, which has 24"),
    (["--resume", "/no/such/checkpoint.npz"], "no checkpoint at /no/such/checkpoint.npz"),
    (["--gpus", "1"], "--gpus 1: "),  # no GPU on a test machine
    (["--gpus", "2"], "--gpus 2: this machine has 0 GPU(s)"),
    (["--gpus", "-1"], "--gpus must be 0 or more"),
    (["--lr", "inf"], "learning rate must be positive and finite, got inf"),
    (["--lr", "nan"], "learning rate must be positive and finite, got nan"),
    (["--momentum", "nan"], "--momentum must be at least 0 and below 1, got nan"),
    (["--momentum", "1"], "--momentum must be at least 0 and below 1, got 1.0"),
    (["--weight-decay", "nan"], "--weight-decay must be 0 or more and finite, got nan"),
    (["--weight-decay", "inf"], "--weight-decay must be 0 or more and finite, got inf"),
    (["--bucket-mb", "inf"], "--bucket-mb must be positive and finite, got inf"),
    (["--seed", "-1"], "--seed must be 0 or more, got -1"),
    (["--precision", "tf32"], "--precision tf32 runs on GPU tensor cores: add --gpus N"),
    (["--precision", "bf16"], "--precision bf16 runs on GPU tensor cores: add --gpus N"),
])
def test_bad_flags_are_clear_errors(data_dir, tmp_path, capsys, flags, message):
    """Well-formed values that will not do: one line (helpers.one_line_error), not argparse's usage first."""
    assert message in one_line_error(capsys, run, data_dir, tmp_path / "run", *flags)
    assert not (tmp_path / "run" / "checkpoint.npz").exists(), "nothing ran"


@pytest.mark.parametrize("flags, message", [
    (["--lr", "0.1x"], "argument --lr: invalid float value: '0.1x'"),
    (["--epochs", "three"], "argument --epochs: invalid int value: 'three'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--epochs"], "argument --epochs: expected one argument"),
    (["--schedule", "linear"], "argument --schedule: invalid choice: 'linear'"),
])
def test_a_command_line_argparse_cannot_read_shows_the_usage(data_dir, tmp_path, capsys, flags, message):
    """The twin of the one-line errors: what argparse cannot read gets its usage, then the line."""
    assert usage_then_error(capsys, run, data_dir, tmp_path / "run", *flags).startswith(
        f"train_resnet.py: error: {message}")


def test_a_precision_the_gpu_lacks_is_one_line(data_dir, tmp_path, capsys, monkeypatch):
    """Wrong for this machine: --precision tf32 on a GPU of compute capability 7.5 (a simulated T4)."""
    from kernels.simulated import cuda as sim_cuda
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    monkeypatch.setenv(sim_cuda.CAPABILITY, "75")
    assert one_line_error(capsys, run, data_dir, tmp_path / "run", "--gpus", "1", "--precision", "tf32") == (
        "train_resnet.py: error: --gpus 1: --precision tf32 multiplies on the tensor cores of compute capability 8.0 "
        "and later (Ampere): GPU 0 (Simulated GPU 0 (CPU emulator)) is of compute capability 7.5; use --precision "
        "fp32 there\n")


def test_resuming_with_another_width_is_an_error(data_dir, tmp_path, capsys):
    assert run(data_dir, tmp_path / "run", "--epochs", "1") == 0
    capsys.readouterr()
    assert "--width 4 does not match the checkpoint's 2" in \
        one_line_error(capsys, cli.main, ["--resume", str(tmp_path / "run"), "--epochs", "2", "--width", "4"])
    assert "finished 1 epochs already" in \
        one_line_error(capsys, cli.main, ["--resume", str(tmp_path / "run"), "--epochs", "1"])


def as_if_trained_on_a_gpu(out, precision):
    """Rewrite the record of the checkpoint in `out` (a CPU run's) as a run of --gpus 1 --graph --precision
    `precision` would have written it: what resuming it on the CPU meets."""
    arrays, record = checkpoint.load(out)
    record["config"].update(gpus=1, graph=True, precision=precision)
    for row in record["metrics"]:
        row["precision"] = precision
    np.savez(out / checkpoint.FILENAME, **arrays, record=np.array(json.dumps(record)))


def test_a_resumed_run_keeps_its_precision_unless_told_and_says_so(data_dir, tmp_path, capsys):
    """--precision, like --gpus, says how a run computes, not what it trains (the float32 weights are the
    whole state under every precision): a resumed run may change it, and says so; a run moved to the
    CPU from a tensor-core precision must say --precision fp32 rather than have it changed unasked. Its
    --graph, for the GPUs, does not follow it there."""
    out = tmp_path / "run"
    assert run(data_dir, out, "--epochs", "1") == 0
    as_if_trained_on_a_gpu(out, "bf16")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(out), "--epochs", "2", "--gpus", "0"])
    assert e.value.code == 2
    assert "the checkpoint's run trained with --precision bf16, which runs on GPUs: add --precision fp32 to " \
           "continue it on the CPU" in capsys.readouterr().err
    assert cli.main(["--resume", str(out), "--epochs", "2", "--gpus", "0", "--precision", "fp32"]) == 0
    printed = capsys.readouterr().out
    assert "the checkpoint's run trained with --gpus 1; it continues with --gpus 0 (on the CPU)" in printed
    assert "the checkpoint's run trained in precision bf16; it continues in fp32" in printed
    record = checkpoint.load(out)[1]
    assert [m["precision"] for m in record["metrics"]] == ["bf16", "fp32"]
    assert record["config"]["precision"] == "fp32" and record["config"]["graph"] is None
    assert cli.main(["--resume", str(out), "--epochs", "3"]) == 0   # kept from now on, silently
    assert "continues" not in capsys.readouterr().out


def test_export_writes_the_trained_weights_and_init_from_starts_from_them(data_dir, tmp_path, monkeypatch, capsys):
    weights = tmp_path / "w.safetensors"
    assert run(data_dir, tmp_path / "first", "--epochs", "1", "--export", weights) == 0
    assert f"exported to {weights}" in capsys.readouterr().out
    arrays, _ = checkpoint.load(tmp_path / "first")
    model = nn.resnet18(width=2)
    nn.load_safetensors(model, weights)
    np.testing.assert_array_equal(model.flat_parameters().data, arrays["params"])
    np.testing.assert_array_equal(model.state_dict()["1.running_var"], arrays["buffer/1.running_var"])

    started_from = []
    real_epoch = loop.train_epoch

    def first_epoch(model, opt, *args, **kwargs):
        started_from.append(opt.flat.data.copy())
        return real_epoch(model, opt, *args, **kwargs)
    monkeypatch.setattr(loop, "train_epoch", first_epoch)
    assert run(data_dir, tmp_path / "second", "--epochs", "1", "--seed", "9", "--init-from", weights) == 0
    np.testing.assert_array_equal(started_from[0], arrays["params"])

    # a finished run, resumed with --export only: the same weights again, no epoch more
    assert cli.main(["--resume", str(tmp_path / "first"), "--export", str(tmp_path / "again.safetensors")]) == 0
    assert (tmp_path / "again.safetensors").read_bytes() == weights.read_bytes()
    assert checkpoint.load(tmp_path / "first")[1]["epoch"] == 1


def test_weights_that_do_not_fit_are_a_clear_error(data_dir, tmp_path, capsys):
    weights = tmp_path / "wide.safetensors"
    nn.save_safetensors(nn.resnet18(width=4), weights)
    for flags, message in (
            (["--init-from", weights], "--init-from: " + str(weights) + ": 0.weight is float32 of shape (4, 1, 3, 3), "
                                       "the model's is float32 of shape (2, 1, 3, 3)"),
            (["--init-from", tmp_path / "none.safetensors"], "none.safetensors: no such file"),
            (["--init-from", weights, "--resume", tmp_path], "--init-from starts a new run"),
            (["--export", tmp_path / "no" / "such" / "w.safetensors"], "--export " + str(tmp_path) + "/no/such/"
                                                                          "w.safetensors: the folder")):
        with pytest.raises(SystemExit) as e:
            run(data_dir, tmp_path / "run", *map(str, flags))
        assert e.value.code == 2 and message in capsys.readouterr().err, flags
        assert not (tmp_path / "run" / "checkpoint.npz").exists(), "nothing ran"


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "checkpoint.npz").write_bytes(b"PK\x03\x04 not really a zip")
    assert f"not a checkpoint of this program, or corrupt: {tmp_path / 'checkpoint.npz'}" in \
        one_line_error(capsys, cli.main, ["--resume", str(tmp_path)])


def test_every_flag_is_of_one_class_of_what_a_resume_does_with_it():
    """config.py's RUN_DEFINING, KEPT and ONCE sort the parser's flags, each into one class; a checkpoint keeps
    the first two (a flag added without a class would be kept or dropped by chance)."""
    parser, _ = cli.parse_args([])
    flags = {action.dest for action in parser._actions} - {"help"}
    classes = (config.RUN_DEFINING, config.KEPT, config.ONCE)
    assert sorted(name for names in classes for name in names) == sorted(flags)
    assert sorted(config.Config().kept()) == sorted(config.RUN_DEFINING + config.KEPT)


@pytest.mark.parametrize("flag", ["sync_bn", "scale_lr"])
def test_a_resumed_run_keeps_its_data_parallel_switches_unless_told_either_way(flag):
    """--sync-bn and --scale-lr are kept in the checkpoint and taken from it unless given; their --no- forms turn
    off what the checkpoint's run turned on (without them a resumed run could not)."""
    option = "--" + flag.replace("_", "-")
    saved = {**config.Config(sync_bn=True, scale_lr=True).kept()}
    for argv, want in (([], True), ([option], True), (["--no-" + option[2:]], False)):
        _, args = cli.parse_args(["--resume", "run"] + argv)
        assert getattr(config.merge_resumed(cli.given_flags(args), saved, "run"), flag) is want, argv
    _, args = cli.parse_args([])
    assert getattr(args, flag) is None and getattr(config.Config(), flag) is False


def test_help_explains_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--gpus", "--epochs", "--batch-size", "--lr", "--momentum", "--weight-decay", "--schedule",
                 "--data-dir", "--limit", "--test-limit", "--width", "--seed", "--out", "--resume", "--precision"):
        assert flag in text


def test_running_out_of_memory_names_the_batch_size(data_dir, tmp_path, monkeypatch, capsys):
    def exhausted(*args, **kwargs):
        raise MemoryError("out of memory allocating 1,073,741,824 bytes")
    monkeypatch.setattr(loop, "train_epoch", exhausted)
    assert run(data_dir, tmp_path / "run", "--epochs", "1") == 1
    err = capsys.readouterr().err
    assert "out of cpu memory at batch size 16: try a smaller --batch-size" in err, err


@pytest.mark.slow
def test_training_through_the_cuda_kernels_on_the_emulator(data_dir, tmp_path):
    """The trainer's device path (uint8 upload, gathers, accuracy on the device, no per-step
    reads) driven through the CUDA launchers, against the NumPy backend."""
    import kernels
    flags = ["--width", "2", "--batch-size", "8", "--limit", "16", "--test-limit", "8", "--epochs", "1"]
    with kernels.emulate():
        emulated = cli.main(["--data-dir", str(data_dir), "--out", str(tmp_path / "emu"), *flags])
    assert emulated == 0
    assert cli.main(["--data-dir", str(data_dir), "--out", str(tmp_path / "cpu"), *flags]) == 0
    (emu,), (cpu,) = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("emu", "cpu"))
    assert abs(emu["train_loss"] - cpu["train_loss"]) <= 1e-4 * cpu["train_loss"]
    assert emu["train_acc"] == cpu["train_acc"] and emu["test_acc"] == cpu["test_acc"]


def test_profile_times_the_configured_model_instead_of_training(data_dir, tmp_path, capsys):
    out = tmp_path / "profile"
    assert run(data_dir, out, "--profile", "--profile-steps", "2") == 0
    printed = capsys.readouterr().out
    assert "profile written" in printed and "resnet_block" in printed   # the table: its rows by measured time
    document = json.loads((out / "profile.json").read_text())
    assert document["config"]["batch_size"] == 16 and document["config"]["steps"] == 2
    assert {row["name"] for row in document["rows"]} >= {"0", "resnet_block1.0.conv1", "resnet_block4.1.conv2", "fc.1"}
    assert (out / "profile.csv").exists() and (out / "profile.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "checkpoint.npz").exists(), "profiling does not train"


def test_profile_steps_must_be_positive(data_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run(data_dir, tmp_path / "profile", "--profile", "--profile-steps", "0")
    assert "--profile-steps must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--lr", "0"], "learning rate must be positive"),
    ([], "--gpus 2: NCCL is unavailable (RuntimeError: CuPy cannot load NCCL"),
])
def test_several_gpus_check_the_flags_and_nccl_before_any_worker_starts(data_dir, tmp_path, capsys, monkeypatch,
                                                                        flags, message):
    """On two simulated GPUs whose NCCL does not load: the parent's own checks, before it starts workers."""
    import types
    from parallel import comm, launch
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "2")
    monkeypatch.setattr(comm, "nccl_module", lambda: types.SimpleNamespace(available=False))
    monkeypatch.setattr(launch, "run_workers", lambda *a, **k: pytest.fail("a worker was started"))
    assert message in one_line_error(capsys, run, data_dir, tmp_path / "run", "--gpus", "2", *flags)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_shows_images_per_second_and_time_left():
    from training.reports import Progress
    terminal, pipe = Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        progress = Progress(640, "epoch 2/5", stream)
        for done in (64, 320):
            time.sleep(0.05)
            progress.update(done, 2.25)
        progress.close()
    bar = terminal.getvalue()
    assert "epoch 2/5" in bar and "320/640" in bar and "img/s" in bar and "loss=2.2500" in bar, bar
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", bar), "elapsed<remaining"
    lines = pipe.getvalue().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"epoch 2/5: 320/640 images in [\d.]+ s, [\d.]+ images/s, loss 2\.2500",
                                            lines[0]), lines
