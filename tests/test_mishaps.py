"""What a new user runs into, each a clear error with no work lost: an output folder that holds an
earlier run, or another run's, or cannot be written; a model that diverged in an epoch's last
steps; a full disk; damaged checkpoints and odd data; SIGTERM and Ctrl-C; resuming with more
epochs; the test seed. (Flags out of range: tests/test_cli.py.)"""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nn
from helpers import run_cli, one_line_error, write_fashion_mnist, write_idx
from training import checkpoint, cli, fashion_mnist, loop, output, reports

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--width", "2", "--batch-size", "16", "--limit", "40", "--test-limit", "20"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 48, 24)


def run(data_dir, out, *flags):
    return run_cli(data_dir, out, SMALL, *flags)


# ---- the output folder -------------------------------------------------------------------

def test_a_new_run_refuses_a_folder_that_holds_a_run(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert run(data_dir, out, "--epochs", "1") == 0
    first = (out / checkpoint.FILENAME).read_bytes()
    capsys.readouterr()
    err = one_line_error(capsys, run, data_dir, out, "--epochs", "2")
    assert f"--out {out} holds an earlier run (checkpoint.npz, metrics.json, metrics.csv, training.png): continue " \
           f"it with --resume {out}, or replace it with --overwrite" in err
    assert (out / checkpoint.FILENAME).read_bytes() == first, "the earlier run is untouched"
    assert run(data_dir, out, "--epochs", "1", "--seed", "4", "--overwrite") == 0
    assert checkpoint.load(out)[1]["config"]["seed"] == 4
    capsys.readouterr()
    assert "--overwrite starts a new run and --resume continues one" in \
        one_line_error(capsys, run, data_dir, None, "--resume", out, "--overwrite", "--epochs", "3")


def test_default_folders_are_unique_within_a_second(tmp_path):
    made = [output.fresh_default(tmp_path) for _ in range(3)]
    assert len(set(made)) == 3 and all(p.is_dir() for p in made)
    assert made[1].name == made[0].name + "-2"


def test_a_folder_in_use_by_another_run_is_refused_naming_it(data_dir, tmp_path, capsys):
    with output.claim(tmp_path / "busy"):
        err = one_line_error(capsys, run, data_dir, tmp_path / "busy", "--epochs", "1")
    assert f"--out {tmp_path / 'busy'} is in use by another run (process {os.getpid()})" in err
    assert run(data_dir, tmp_path / "busy", "--epochs", "1") == 0, "free again once the first run ended"


def test_an_output_folder_that_cannot_be_one_is_refused_before_the_data_is_read(tmp_path, capsys):
    nowhere = tmp_path / "no-data"   # reading it would fail too: the folder is checked first
    (tmp_path / "a-file").write_text("x")
    assert f"--out {tmp_path / 'a-file'} is a file, not a folder" in one_line_error(capsys, run, nowhere, tmp_path / "a-file")
    assert "--out /proc/no/such: cannot write there" in one_line_error(capsys, run, nowhere, "/proc/no/such")


def test_temporary_files_are_per_process(tmp_path):
    with nn.serialization.atomic_write(tmp_path / "f") as f:
        assert Path(f.name).name == f".f.{os.getpid()}.tmp"
        f.write(b"x")
    assert (tmp_path / "f").read_bytes() == b"x" and not list(tmp_path.glob(".*.tmp"))


# ---- a diverged model, flags out of range, strict JSON --------------------------------------

def test_a_model_that_diverged_in_the_last_step_of_an_epoch_is_never_saved(data_dir, tmp_path, monkeypatch, capsys):
    real_step, steps = nn.SGD.step, []

    def diverging(opt):   # the loss before each step stays finite: only the update goes wrong
        real_step(opt)
        steps.append(1)
        if len(steps) == 6:   # epoch 2's last step (3 steps an epoch)
            opt.flat.data[7] = np.nan
    monkeypatch.setattr(nn.SGD, "step", diverging)
    assert run(data_dir, tmp_path / "run", "--epochs", "3") == 1
    err = capsys.readouterr().err
    assert "the model after epoch 2 is not finite: 1 of" in err and "elements of params" in err, err
    assert f"the last good checkpoint, of epoch 1, is intact: {tmp_path / 'run' / 'checkpoint.npz'}" in err
    arrays, record = checkpoint.load(tmp_path / "run")
    assert record["epoch"] == 1 and np.isfinite(arrays["params"]).all()


def test_metrics_stay_strict_json(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "evaluate", lambda *a, **k: (float("inf"), 0.1))   # a test loss that overflowed
    assert run(data_dir, tmp_path / "run", "--epochs", "1") == 0

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text(), parse_constant=refuse)
    assert metrics[0]["test_loss"] is None and metrics[0]["test_acc"] == 0.1
    assert checkpoint.load(tmp_path / "run")[1]["metrics"][0]["test_loss"] is None


# ---- a full disk ---------------------------------------------------------------------------

def full_disk_at(monkeypatch, module, name, call):
    """``module.name`` raises ENOSPC on its ``call``-th call (counting from 1)."""
    real, calls = getattr(module, name), []

    def fill(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, fill)


@pytest.mark.parametrize("while_writing, module, name, call, then", [
    ("checkpoint.npz", np, "savez", 2, "the last good checkpoint, of epoch 1, is intact"),   # epoch 2's checkpoint
    ("training.png", reports, "plot", 1, "the checkpoint of epoch 1 was written"),         # epoch 1's chart
])
def test_a_full_disk_says_which_file_and_keeps_the_last_checkpoint(data_dir, tmp_path, monkeypatch, capsys,
                                                                   while_writing, module, name, call, then):
    full_disk_at(monkeypatch, module, name, call)
    assert run(data_dir, tmp_path / "run", "--epochs", "3") == 1
    err = capsys.readouterr().err
    assert f"could not write {tmp_path / 'run' / while_writing} (No space left on device); {then}" in err, err
    assert checkpoint.load(tmp_path / "run")[1]["epoch"] == 1
    assert not list((tmp_path / "run").glob(".*.tmp"))


# ---- checkpoints and data that are not what they should be ----------------------------------

@pytest.mark.parametrize("content", ["another program's npz", "a .npy", "a damaged zip", "no record"])
def test_what_is_not_our_checkpoint_says_so(tmp_path, capsys, content):
    path = tmp_path / "checkpoint.npz"
    if content == "another program's npz":
        np.savez(path, weights=np.ones(3), record=np.array(json.dumps({"epoch": 1})))
    elif content == "a .npy":
        with open(path, "wb") as f:
            np.save(f, np.ones(3))
    elif content == "a damaged zip":
        np.savez(path, params=np.ones(1000), record=np.array("{}"))
        data = bytearray(path.read_bytes())
        data[200:210] = b"0123456789"
        path.write_bytes(bytes(data))
    else:
        np.savez(path, params=np.ones(3))
    with pytest.raises(SystemExit) as e:
        cli.main(["--resume", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"not a checkpoint of this program, or corrupt: {path}" in err, err
    assert "Traceback" not in err


def test_test_images_of_another_size_are_an_error(tmp_path, capsys):
    folder = write_fashion_mnist(tmp_path / "data", 32, 8)
    write_idx(folder / fashion_mnist.FILES["test"][0], np.zeros((8, 32, 32), np.uint8))
    err = one_line_error(capsys, run, folder, tmp_path / "run", "--epochs", "1")
    assert "t10k-images-idx3-ubyte.gz holds images of 32x32 pixels" in err and "of 28x28" in err


def test_a_data_folder_that_cannot_be_read_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in one_line_error(capsys, run, tmp_path / "a-file", tmp_path / "r1")
    real_kind = fashion_mnist.file_kind

    def denied(path):   # what a folder without read permission gives a user other than root
        if "locked" in Path(path).parts[:-1]:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_kind(path)
    monkeypatch.setattr(fashion_mnist, "file_kind", denied)
    assert f"{tmp_path / 'locked'}: cannot be read (Permission denied)" in \
        one_line_error(capsys, run, tmp_path / "locked", tmp_path / "r2")


# ---- signals --------------------------------------------------------------------------------

def start(data_dir, out, *flags):
    """train_resnet.py in a process of its own, with Ctrl-C's default handling whatever this
    process was started with."""
    return subprocess.Popen([sys.executable, "train_resnet.py", "--data-dir", str(data_dir), "--out", str(out),
                             *SMALL, *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for(condition, process, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended or took too long"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigterm_keeps_the_last_finished_epoch(data_dir, tmp_path):
    process = start(data_dir, tmp_path / "run", "--epochs", "500")
    try:
        wait_for(lambda: (tmp_path / "run" / "checkpoint.npz").exists(), process)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, err
    epoch = checkpoint.load(tmp_path / "run")[1]["epoch"]
    assert f"terminated (SIGTERM): the checkpoint of epoch {epoch} is kept; --resume {tmp_path / 'run'}" in err
    assert "Traceback" not in err


def test_a_sigterm_swallowed_where_it_landed_still_stops_training(data_dir, tmp_path, monkeypatch):
    """SIGTERM's Terminated raised where Python only prints an exception (here a __del__; in CI's run, an import's
    module-lock callback, after which training went on for its 500 epochs): the loop raises it again before its
    next batch. The twin: no SIGTERM, every batch trained."""
    batches = []
    real = loop.train_step

    def step(*args, swallowed=True):
        batches.append(len(batches))
        if swallowed and len(batches) == 2:
            class Lands:
                def __del__(self):
                    loop.terminate(signal.SIGTERM, None)
            Lands()   # collected here: Python prints the Terminated its __del__ raises, and goes on
        return real(*args)
    flags = {"data_dir": str(data_dir), "width": 2, "batch_size": 8, "limit": 40, "test_limit": 8, "epochs": 1}
    loop.TERMINATIONS.clear()
    monkeypatch.setattr(loop, "train_step", step)
    swallowed = []   # what Python would print as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    with pytest.raises(loop.Terminated):
        loop.run({**flags, "out": str(tmp_path / "terminated")})
    assert batches == [0, 1] and swallowed == [loop.Terminated]
    loop.TERMINATIONS.clear()
    batches.clear()
    monkeypatch.setattr(loop, "train_step", lambda *args: step(*args, swallowed=False))
    loop.run({**flags, "out": str(tmp_path / "whole")})
    assert batches == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_ctrl_c_before_the_first_epoch_says_nothing_was_saved(tmp_path):
    data_dir = write_fashion_mnist(tmp_path / "data", 2000, 8)   # an epoch of about 15 s, one image a step
    process = start(data_dir, tmp_path / "run", "--epochs", "1", "--limit", "2000", "--test-limit", "8",
                    "--batch-size", "1")
    try:
        wait_for(lambda: (tmp_path / "run" / output.LOCK).exists(), process)   # the run has begun
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "interrupted: no epoch had finished: nothing was saved" in err, err
    assert not (tmp_path / "run" / "checkpoint.npz").exists()


# ---- what the README promises about the tests -------------------------------------------------

def test_the_seed_is_printed_and_quoted_in_every_failure_under_q(tmp_path):
    """The README's own test command uses -q, which hides pytest's header: the seed is printed at
    the end too, and every failure, not only validate()'s, says how to replay it."""
    for name in ("conftest.py", "helpers.py"):
        (tmp_path / name).write_text((ROOT / "tests" / name).read_text())
    (tmp_path / "test_plain.py").write_text("def test_plain_assert():\n    assert 1 == 2\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_plain.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TEST_SEED": "1234"})
    assert done.returncode == 1
    assert "reproduce with: TEST_SEED=1234 python -m pytest 'test_plain.py::test_plain_assert'" in done.stdout
    assert "random inputs: TEST_SEED=1234 (set it to draw them again)" in done.stdout


# ---- resuming with more epochs ---------------------------------------------------------------

def test_more_epochs_on_resume_stretch_the_cosine_schedule_and_say_so(data_dir, tmp_path, capsys):
    import math
    assert run(data_dir, tmp_path / "run", "--epochs", "2", "--schedule", "cosine", "--lr", "0.2") == 0
    capsys.readouterr()
    assert cli.main(["--resume", str(tmp_path / "run"), "--epochs", "4"]) == 0
    out = capsys.readouterr().out
    steps = 3   # 40 images in batches of 16
    old, new = (0.2 * (1 + math.cos(math.pi * 2 * steps / (e * steps))) / 2 for e in (2, 4))
    assert f"the cosine schedule now spans 4 epochs, not 2: from here the learning rate is that of a run started " \
           f"with --epochs 4, {new:g} at the next step (the 2-epoch schedule was at {old:g})" in out, out
    metrics = checkpoint.load(tmp_path / "run")[1]["metrics"]
    for m in metrics[2:]:   # each epoch's last step, on the 4-epoch schedule
        last = m["epoch"] * steps - 1
        assert m["lr"] == pytest.approx(0.2 * (1 + math.cos(math.pi * last / (4 * steps))) / 2, rel=1e-12)


def test_a_checkpoint_of_another_flat_layout_is_refused_by_name(tmp_path):
    """An older checkpoint's flat buffer (unaligned, conv weights (out, in, kh, kw)) would load as
    scrambled weights: restore() names the two layouts instead."""
    model = nn.resnet18(width=2)
    opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint.save(tmp_path / "c.npz", model, opt, {"epoch": 1, "config": {}, "metrics": [], "rng_state": {}})
    arrays, _ = checkpoint.load(tmp_path / "c.npz")
    checkpoint.restore(arrays, model, opt)   # its own layout: fine
    del arrays["layout"]
    with pytest.raises(checkpoint.CheckpointError, match="laid out as 'unaligned, every parameter in its own "
                                                         "order'.*cannot be resumed"):
        checkpoint.restore(arrays, model, opt)
