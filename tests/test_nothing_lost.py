"""Nothing lost whatever the flags, and one line for every mistake: each class of careless use that
used to lose a finished run, print a traceback, give wrong results or hang, handled.

- Data loss: --overwrite checks everything before the earlier run steps aside, and gives it back
  when the new run ends without a checkpoint (or is killed: the next start restores it); a
  resumed run never writes into a folder that holds another run; --export never names one of the
  run's own files, never replaces a device, a pipe or a symbolic link.
- What a resume may write: what its own command line says, and a fork nothing of the run it came
  from; the flags of one command (--export, --overwrite, --init-from, ...) are never kept, nor
  applied again from a checkpoint of an earlier version that kept them; the data folder is kept
  resolved, for a resume from another working folder.
- One-line errors (exit 2, no usage): what the --gpus N workers would find is found before they start, and
  a user's mistake a worker finds is one line too; a weights file in bfloat16 is read (widened
  exactly), one in a dtype the loader does not take names the key; an empty split; a model too
  large for memory; a failing MPI rank that SIGTERM reaches prints no traceback.
- Wrong results: a resumed run keeps its checkpoint's --gpus unless given one, and says when it
  changes; impossible values in --init-from (a negative running variance, NaN, infinity).
- Hangs: a named pipe where a file belongs.
- Smaller: --export checked at the start, its leftovers cleaned (by the next export, or the next run
  on the folder); no empty default folder after a failed start; a bad KERNELS_SIMULATED_GPUS named;
  --watchdog, --export '' and --profile --export refused; PyTorch's 'module.' prefix a one-line hint;
  a safetensors file given to --resume; an export of a finished run writes nothing in its folder; a
  finished run may be profiled; gunzipped data files; empty paths; an --export folder that is a file.
- Systems and streams: --resume after a killed --overwrite; MPI ranks that disagree on a flag; a loop
  of symbolic links, a name too long; a closed stdout or stderr; a path that is not UTF-8; an MPI
  environment that makes no sense; a SIGTERM while an error is handled.
"""
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kernels
import nn
from helpers import run_cli, one_line_error, write_fashion_mnist
from training import checkpoint, cli, config, fashion_mnist, loop, output

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--width", "2", "--batch-size", "16", "--limit", "32", "--test-limit", "16"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_fashion_mnist(tmp_path_factory.mktemp("fashion"), 40, 16)


def run(data_dir, out, *flags):
    return run_cli(data_dir, out, SMALL, *flags)


def refused(capsys, data_dir, out, *flags):
    """The one line of a run refused with exit code 2 before training."""
    return one_line_error(capsys, run, data_dir, out, *flags).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
    """A finished run of one epoch: (its folder, the bytes of each of its files)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert run(data_dir, out, "--epochs", "1") == 0
    return out, {name: (out / name).read_bytes() for name in output.RUN_FILES}


def copy_of(finished, tmp_path):
    out = tmp_path / "earlier"
    out.mkdir()
    for name, data in finished[1].items():
        (out / name).write_bytes(data)
    return out


def intact(out, finished):
    return all((out / name).read_bytes() == data for name, data in finished[1].items())


# ---- data loss -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--limit", "1000"], "--limit 1000 is larger than the split, which has 40 images"),
    (["--init-from", "no-such.safetensors"], "no-such.safetensors: no such file"),
    (["--data-dir", "/proc/no/such"], "/proc/no/such"),
    (["--width", "100000"], "--width 100000: the model has 27,240,028,600,010 parameters"),
])
def test_overwrite_deletes_nothing_before_the_new_run_has_passed_its_checks(data_dir, finished, tmp_path, capsys,
                                                                             flags, message):
    out = copy_of(finished, tmp_path)
    assert message in refused(capsys, data_dir, out, "--overwrite", "--epochs", "1", *flags)
    assert intact(out, finished), "the earlier run is untouched"


def test_overwrite_gives_the_earlier_run_back_when_the_new_one_writes_no_checkpoint(data_dir, finished, tmp_path,
                                                                                     monkeypatch, capsys):
    out = copy_of(finished, tmp_path)

    def diverge(*args, **kwargs):
        raise loop.NonFiniteLoss("loss is nan at epoch 1, step 1")
    monkeypatch.setattr(loop, "train_epoch", diverge)
    assert run(data_dir, out, "--overwrite", "--epochs", "1", "--seed", "3") == 1
    assert intact(out, finished) and not (out / output.REPLACED).exists()
    monkeypatch.undo()
    assert run(data_dir, out, "--overwrite", "--epochs", "1", "--seed", "3") == 0
    assert checkpoint.load(out)[1]["config"]["seed"] == 3 and not (out / output.REPLACED).exists()


def test_an_overwrite_killed_before_its_first_checkpoint_is_undone_by_the_next_start(data_dir, finished, tmp_path,
                                                                                       capsys):
    out = copy_of(finished, tmp_path)
    output.set_aside(out)   # where a run killed with SIGKILL after its checks leaves the folder
    assert not (out / checkpoint.FILENAME).exists()
    assert "holds an earlier run" in refused(capsys, data_dir, out, "--epochs", "1")
    assert intact(out, finished) and not (out / output.REPLACED).exists()


def test_resume_after_an_overwrite_killed_before_its_first_checkpoint_continues_the_earlier_run(
        data_dir, finished, tmp_path):
    """--resume is the next run on the folder too: it puts the set-aside files back before it looks
    for the checkpoint (it said "no checkpoint" while the run sat in .replaced)."""
    out = copy_of(finished, tmp_path)
    output.set_aside(out)   # an --overwrite run killed with SIGKILL in its first epoch
    assert run(data_dir, None, "--resume", out, "--epochs", "2") == 0
    assert checkpoint.load(out)[1]["epoch"] == 2 and not (out / output.REPLACED).exists()


def test_a_resumed_run_never_writes_into_a_folder_that_holds_another_run(data_dir, finished, tmp_path, capsys):
    other = copy_of(finished, tmp_path)
    line = refused(capsys, data_dir, other, "--resume", finished[0], "--epochs", "2")
    assert f"--out {other} holds another run (checkpoint.npz, metrics.json, metrics.csv, training.png): a resumed " \
           f"run continues in its own folder ({finished[0]}), or in an empty or new one" in line
    assert intact(other, finished)
    assert run(data_dir, tmp_path / "new", "--resume", finished[0], "--epochs", "2") == 0
    assert checkpoint.load(tmp_path / "new")[1]["epoch"] == 2 and intact(finished[0], finished)


# ---- what a resume may write ------------------------------------------------------------------------

def snapshot(*paths):
    """{path: (mtime, bytes)} of each of ``paths`` and, for a folder, of everything in it: the folder's own
    mtime changes when a file is made, removed or renamed in it."""
    found = [p for path in map(Path, paths) for p in (path, *(path.rglob("*") if path.is_dir() else ()))]
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in found}


@pytest.fixture
def started_once(data_dir, tmp_path, monkeypatch):
    """A finished run of one epoch, ``run`` in the working folder tmp_path, whose command gave every flag that
    acts once, with the paths as typed: --overwrite of an earlier run there, --init-from start.safetensors (no
    longer weights since) and --export run.safetensors. The paths the run and its first command wrote and read."""
    monkeypatch.chdir(tmp_path)
    nn.save_safetensors(nn.resnet18(width=2), "start.safetensors")
    assert run(data_dir, "run", "--epochs", "1") == 0
    assert run(data_dir, "run", "--epochs", "1", "--seed", "2", "--overwrite", "--init-from", "start.safetensors",
               "--export", "run.safetensors") == 0
    Path("start.safetensors").write_bytes(b"weights no more: a resume that read them again would stop")
    return [tmp_path / name for name in ("run", "run.safetensors", "start.safetensors")]


def once_flags_kept(out):
    return {name: value for name, value in checkpoint.load(out)[1]["config"].items() if name in config.ONCE}


def test_a_fork_writes_nothing_of_the_run_it_came_from(data_dir, started_once, tmp_path, capsys):
    """--resume run --out fork trains on in fork alone: its run's first command's --export (which the fork
    replaced with its own weights), --overwrite and --init-from are not done again, nor kept."""
    before = snapshot(*started_once)
    assert run(data_dir, "fork", "--resume", "run", "--epochs", "2") == 0
    assert snapshot(*started_once) == before, "the run, its export and its start are as they were"
    assert sorted(os.listdir(tmp_path)) == ["fork", "run", "run.safetensors", "start.safetensors"]
    assert "exported" not in capsys.readouterr().out
    assert checkpoint.load("fork")[1]["epoch"] == 2 and once_flags_kept("fork") == {}


def test_a_resume_in_place_does_nothing_its_runs_first_command_did_once(data_dir, started_once, tmp_path, capsys,
                                                                        monkeypatch):
    """--resume run (no --export): its first command's export stays that command's; --overwrite sets nothing
    aside (the run's files stay in place while it trains); --init-from is neither read nor kept."""
    run_folder, *others = started_once
    before, during, real_epoch = snapshot(*others), [], loop.train_epoch

    def epoch(*args, **kwargs):
        during.append(sorted(os.listdir(run_folder)))
        return real_epoch(*args, **kwargs)
    monkeypatch.setattr(loop, "train_epoch", epoch)
    assert run(data_dir, None, "--resume", "run", "--epochs", "2") == 0
    assert during == [sorted([*output.RUN_FILES, output.LOCK])], "nothing set aside"
    assert snapshot(*others) == before and sorted(os.listdir(tmp_path)) == ["run", "run.safetensors",
                                                                            "start.safetensors"]
    assert "exported" not in capsys.readouterr().out
    assert checkpoint.load("run")[1]["epoch"] == 2 and once_flags_kept("run") == {}


def test_export_of_a_finished_run_does_that_alone(data_dir, started_once, tmp_path, monkeypatch):
    """--resume run --export again.safetensors: the weights, no epoch, and nothing else written (its first
    command's --overwrite used to set the run's files aside and back)."""
    before = snapshot(*started_once)
    monkeypatch.setattr(loop, "train_epoch", lambda *args, **kwargs: pytest.fail("an epoch was trained"))
    assert run(data_dir, None, "--resume", "run", "--export", "again.safetensors") == 0
    assert snapshot(*started_once) == before
    assert Path("again.safetensors").read_bytes() == Path("run.safetensors").read_bytes()


def test_a_checkpoint_that_kept_every_flag_resumes_without_those_that_acted_once(data_dir, started_once, capsys):
    """Earlier versions kept every flag as typed: resumed now, such a checkpoint exports nothing unasked, and
    says so, and sets nothing aside."""
    run_folder, exported, _ = started_once
    arrays, record = checkpoint.load(run_folder)
    record["config"].update(out="run", resume=None, overwrite=True, init_from="start.safetensors",
                            export="run.safetensors", data_dir=str(data_dir))
    np.savez(run_folder / checkpoint.FILENAME, **arrays, record=np.array(json.dumps(record)))
    before = snapshot(exported)
    assert run(data_dir, None, "--resume", "run", "--epochs", "2") == 0
    assert snapshot(exported) == before
    assert ("the checkpoint keeps --export run.safetensors of its run's first command (an earlier version kept it): "
            "this run writes no weights file unless given --export FILE") in capsys.readouterr().out
    assert once_flags_kept(run_folder) == {}


@pytest.mark.parametrize("given", [["--data-dir", "fashion"], []], ids=["--data-dir", "the default"])
def test_a_resume_from_another_working_folder_reads_the_data_its_run_read(tmp_path, monkeypatch, given):
    """The data folder is kept resolved: resumed from elsewhere, the run reads the same files (it looked for a
    relative --data-dir, or ./data/fashion-mnist, in the new working folder, and downloaded the data there)."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    write_fashion_mnist(first / (given[-1] if given else fashion_mnist.DEFAULT_DIR), 40, 16)
    elsewhere.mkdir()
    monkeypatch.delenv("FASHION_MNIST_DIR", raising=False)
    monkeypatch.chdir(first)
    assert cli.main([*given, "--out", "run", *SMALL, "--epochs", "1"]) == 0
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(fashion_mnist, "_download", lambda *args: pytest.fail("downloaded"))
    assert cli.main(["--resume", str(first / "run"), "--epochs", "2"]) == 0
    assert checkpoint.load(first / "run")[1]["epoch"] == 2 and not list(elsewhere.iterdir())


@pytest.mark.parametrize("own", ["metrics.json", "training.png", ".lock"])
def test_a_fork_may_not_export_onto_a_file_of_the_run_it_came_from(data_dir, finished, tmp_path, capsys, own):
    out = copy_of(finished, tmp_path)
    (out / ".lock").touch()
    line = refused(capsys, data_dir, tmp_path / "fork", "--resume", out, "--epochs", "2", "--export", out / own)
    assert f"--export {out / own} is {own} of the run it resumes" in line, line
    assert intact(out, finished) and not (tmp_path / "fork" / checkpoint.FILENAME).exists()


@pytest.mark.parametrize("own", [checkpoint.FILENAME, "metrics.json", ".lock"])
def test_export_onto_a_file_of_the_run_itself_is_refused(data_dir, finished, tmp_path, capsys, own):
    out = copy_of(finished, tmp_path)
    line = refused(capsys, data_dir, None, "--resume", out, "--export", out / own)
    assert f"--export {out / own} is {own} of the run itself" in line
    assert intact(out, finished)
    link = tmp_path / "link.safetensors"
    link.symlink_to(out / checkpoint.FILENAME)
    assert "of the run itself" in refused(capsys, data_dir, tmp_path / "fresh", "--epochs", "1", "--export",
                                          tmp_path / "fresh" / checkpoint.FILENAME)
    assert "is checkpoint.npz of the run itself" in refused(capsys, data_dir, None, "--resume", out, "--export", link)


def test_export_writes_regular_files_only_and_follows_a_link(data_dir, finished, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [(fifo, "a named pipe (FIFO)"), (tmp_path, "a folder")]
    null = tmp_path / "null"   # a device node of the test's own, like /dev/null (which a failure would destroy)
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        targets.append((null, "a character device"))
    except PermissionError:   # not root: the device case needs a device node
        pass
    for target, kind in targets:
        assert f"--export {target} is {kind}: it writes regular files only" in \
            refused(capsys, data_dir, None, "--resume", finished[0], "--export", target)
    assert fifo.is_fifo() and (null.is_char_device() or not null.exists())
    weights, link = tmp_path / "weights.safetensors", tmp_path / "latest.safetensors"
    weights.write_bytes(b"older weights")
    link.symlink_to(weights)
    assert run(data_dir, None, "--resume", finished[0], "--export", link) == 0
    assert link.is_symlink() and os.readlink(link) == str(weights), "the link itself is kept"
    nn.load_safetensors(nn.resnet18(width=2), weights)   # it leads to the weights


# ---- one-line errors ------------------------------------------------------------------------------

@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "2")
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.mark.parametrize("flags, message", [
    (["--resume", "{tmp}/missing"], "no checkpoint at {tmp}/missing"),
    (["--init-from", "{tmp}/w.safetensors"], "--init-from: {tmp}/w.safetensors: no such file"),
    (["--limit", "1000"], "--limit 1000 is larger than the split"),
    (["--export", "{tmp}"], "--export {tmp} is a folder"),
    (["--out", "{busy}"], "is in use by another run (process"),
])
def test_gpu_workers_errors_are_one_line_found_before_any_worker_starts(data_dir, tmp_path, capsys, two_gpus,
                                                                          monkeypatch, flags, message):
    from parallel import launch
    monkeypatch.setattr(launch, "run_workers", lambda *args, **kwargs: pytest.fail("a worker was started"))
    busy = tmp_path / "busy"
    flags = [f.format(tmp=tmp_path, busy=busy) for f in flags]
    with output.claim(busy):
        assert message.format(tmp=tmp_path) in one_line_error(capsys, cli.main, ["--gpus", "2", "--data-dir", str(data_dir),
                                                                    "--out", str(tmp_path / "run"), *SMALL, *flags])


@pytest.mark.slow
def test_a_users_mistake_found_in_a_gpu_worker_is_one_line(data_dir, tmp_path, capsys, monkeypatch, two_gpus):
    """As if the parent's checks had missed it: the workers find --limit beyond the data."""
    monkeypatch.setattr(loop, "prepare", lambda *args, **kwargs: (output.Claim(None),))
    code = cli.main(["--gpus", "2", "--data-dir", str(data_dir), "--out", str(tmp_path / "run"), *SMALL,
                     "--limit", "1000"])
    printed = capsys.readouterr()
    assert "starting 2 worker processes" in printed.out
    assert code == 2 and "error: --limit 1000 is larger than the split" in printed.err, printed.err
    assert "Traceback" not in printed.err, printed.err


def bf16_file(path, state, odd=None):
    """``state`` (float32 values and one int64) written as a safetensors file whose floats are
    bfloat16 (their upper 16 bits, which the values were rounded to first); ``odd``: (key, dtype)
    to give one key a dtype NumPy lacks."""
    header, chunks, offset = {}, [], 0
    for key, value in state.items():
        if value.dtype == np.float32:
            data, dtype = (value.view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes(), "BF16"
        else:
            data, dtype = value.astype("<i8").tobytes(), "I64"
        if odd and key == odd[0]:   # a float8: one byte an element
            data, dtype = np.zeros(value.size, np.uint8).tobytes(), odd[1]
        header[key] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def test_bfloat16_weights_are_widened_exactly_and_other_dtypes_named(tmp_path):
    source = nn.resnet18(width=2)
    state = {}
    for key, value in source.state_dict().items():
        value = np.array(value)
        if value.dtype == np.float32:   # values bfloat16 holds exactly
            value = (value.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32) + np.float32(0.0)
        state[key] = value
    bf16_file(tmp_path / "bf16.safetensors", state)
    model = nn.resnet18(width=2)
    nn.load_safetensors(model, tmp_path / "bf16.safetensors")
    for key, value in model.state_dict().items():
        np.testing.assert_array_equal(np.array(value), state[key], err_msg=key)
    bf16_file(tmp_path / "f8.safetensors", state, odd=("0.weight", "F8_E4M3"))
    with pytest.raises(nn.SerializationError, match=r"0.weight is F8_E4M3, a dtype this loader does not take"):
        nn.load_safetensors(model, tmp_path / "f8.safetensors")


def test_an_empty_split_is_an_error_before_training(tmp_path, capsys):
    empty = write_fashion_mnist(tmp_path / "fashion", 20, 0)
    assert "holds no images: the test split is empty" in refused(capsys, empty, tmp_path / "run", "--limit", "20")


def test_a_model_too_large_for_memory_is_an_error_before_it_is_made(data_dir, tmp_path, capsys):
    line = refused(capsys, data_dir, tmp_path / "run", "--width", "100000")
    assert "--width 100000: the model has 27,240,028,600,010 parameters" in line and "GiB the host has" in line
    assert nn.resnet.parameter_count(64) == 11_175_818 == sum(p.size for p in nn.resnet18(width=64).parameters())


@pytest.mark.parametrize("failing", [
    # its abort, which makes the runtime signal every rank (planted: it signals itself)
    "class World:\n"
    "    rank, world_size = 1, 2\n"
    "    def abort(self, code):\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "        time.sleep(5)\n"
    "        os._exit(99)\n"
    "launch.fail(World(), 2, 'error: a fault')\n",
    # a usage error that rank 1 leaves to rank 0 to print, waiting while rank 0 exits
    "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()\n"
    "cli.one_line_error(cli.parse_args([])[0], 'a fault')\n"], ids=["abort", "usage error"])
def test_a_failing_mpi_rank_that_sigterm_reaches_exits_with_its_code_and_no_traceback(failing):
    """The MPI runtime's SIGTERM arriving while a rank fails (about 1 run in 10-20 under mpiexec)."""
    script = (f"import os, signal, sys, threading, time\nsys.path.insert(0, {str(ROOT)!r})\n"
              "from parallel import launch\nfrom training import cli\n"
              "signal.signal(signal.SIGTERM, cli._terminate)\n" + failing)
    environment = {**os.environ, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=environment)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr


def test_a_sigterm_in_the_handling_of_an_error_ends_quietly(data_dir, tmp_path, capsys, monkeypatch):
    """Under mpiexec -n 2 with a bad --init-from, the other rank's abort sent SIGTERM while this rank
    was still in the handler of its own error: once in twelve runs a traceback of cli.Terminated."""
    def terminated():
        raise cli.Terminated
    monkeypatch.setattr(output, "discard_unused", terminated)   # where the signal landed
    assert run(data_dir, tmp_path / "run", "--init-from", tmp_path / "no-such.safetensors") == 128 + 15
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--out", "{loop}"], "--out {loop} is a loop of symbolic links, not a folder"),
    (["--init-from", "{loop}"], "--init-from: {loop} is a loop of symbolic links, not a regular file"),
    (["--export", "{loop}"], "--export {loop} is a loop of symbolic links"),
    (["--export", "{long}.safetensors"], "is a name too long for the file system"),
    (["--resume", "{long}"], "is a name too long for the file system, not a checkpoint file"),
])
def test_a_path_the_system_refuses_is_one_line(data_dir, tmp_path, capsys, flags, message):
    loop_ = tmp_path / "loop"
    loop_.symlink_to(loop_)
    names = {"loop": loop_, "long": tmp_path / ("x" * 300)}
    line = refused(capsys, data_dir, tmp_path / "run", "--epochs", "1", *(f.format(**names) for f in flags))
    assert message.format(**names) in line, line


def test_the_mpi_environment_that_makes_no_sense_is_named(data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "x")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert "the MPI environment does not make sense (OMPI_COMM_WORLD_RANK='x', OMPI_COMM_WORLD_SIZE='2')" in refused(
        capsys, data_dir, tmp_path / "run", "--epochs", "1")


def command(data_dir, out, *flags):
    return [sys.executable, str(ROOT / "train_resnet.py"), "--data-dir", str(data_dir), "--out", out, *SMALL,
            "--epochs", "1", *flags]


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_stops_nothing(data_dir, tmp_path, closed):
    """| head -1, a log reader that went away, 2>&-: the run trains on and writes its files; a closed stdout
    is said once on stderr."""
    out = tmp_path / "run"
    if closed == "stdout":   # the reader goes away at once: the first line meets a broken pipe
        done = subprocess.Popen(command(data_dir, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done.stdout.close()
        err = done.communicate(timeout=120)[1]
        assert err.count("stdout was closed (what read it went away): the run goes on without it") == 1, err
    else:   # started with no file 2 at all
        done = subprocess.run(command(data_dir, out), stdout=subprocess.PIPE, preexec_fn=lambda: os.close(2),
                              timeout=120)
        err = ""
    assert done.returncode == 0 and "Traceback" not in err, err
    assert checkpoint.load(out)[1]["epoch"] == 1


def test_an_output_folder_whose_name_is_not_utf8_under_a_strict_utf8_stdout(data_dir, tmp_path):
    out = tmp_path / os.fsdecode(b"run-\xff")
    done = subprocess.run(command(data_dir, out), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8:strict"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "run-\\udcff" in done.stdout and checkpoint.load(out)[1]["epoch"] == 1


def test_an_emulator_cache_folder_that_cannot_be_written_is_one_line(data_dir, tmp_path):
    """On simulated GPUs the kernels are compiled into the CUDA emulator's cache folder: one that cannot be
    written (here under a file; a read-only home) is one line naming it, where it was a traceback."""
    (tmp_path / "a-file").write_text("x")
    cache = tmp_path / "a-file" / "cache"
    environment = {**os.environ, kernels.SIMULATED_GPUS: "1", "CUDA_EMU_CACHE_DIR": str(cache), "TMPDIR": str(tmp_path)}
    done = subprocess.run(command(data_dir, tmp_path / "run", "--gpus", "1"), capture_output=True, text=True,
                          timeout=120, env=environment)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"train_resnet.py: error: the CUDA emulator's cache folder {cache} cannot be "
                                  f"written"), done.stderr


def test_a_batch_whose_activations_pass_the_kernels_int_indices_is_refused(data_dir, tmp_path, capsys, monkeypatch):
    """On GPUs the kernels index with int: a batch of 50,000 at width 64 (the stem's output, 2.5e9 elements)
    is refused before training, naming the largest batch that fits, and every launch checks its arrays
    (outputs included) as a last line."""
    from kernels.cuda import launch
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    line = refused(capsys, data_dir, tmp_path / "run", "--gpus", "1", "--width", "64", "--batch-size", "50000")
    assert ("--batch-size 50000: a GPU's batch of 50,000 images at --width 64 makes the first stage's activations "
            "2,508,800,000 elements, more than the CUDA kernels index (2,146,435,072); at most 42,778 images fit a "
            "GPU's batch") in line, line
    output_ = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (42800, 64, 28, 28), (0, 0, 0, 0))
    with pytest.raises(ValueError, match=r"conv2d_forward: arrays of more than 2146435072 .* got shape "
                                         r"\(42800, 64, 28, 28\) .*; a batch of at most 42778 fits"):
        never = type("Backend", (), {"function": lambda self, family, kernel: pytest.fail("launched")})()
        launch.launch(never, "conv", "conv2d_forward", (1,), (np.zeros(4, np.float32), output_))


# ---- wrong results --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_resumed_gpu_run_stays_on_the_gpu_unless_told_and_says_so(data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "1")
    out = tmp_path / "run"
    flags = ["--width", "2", "--batch-size", "8", "--limit", "8", "--test-limit", "4", "--precision", "fp32"]
    assert cli.main(["--data-dir", str(data_dir), "--out", str(out), *flags, "--gpus", "1", "--epochs", "1"]) == 0
    assert cli.main(["--resume", str(out), "--epochs", "2"]) == 0
    record = checkpoint.load(out)[1]
    assert record["config"]["gpus"] == 1 and "on cuda" in capsys.readouterr().out
    assert cli.main(["--resume", str(out), "--epochs", "3", "--gpus", "0", "--precision", "fp32"]) == 0
    assert "the checkpoint's run trained with --gpus 1; it continues with --gpus 0 (on the CPU)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("spoil, message", [
    (lambda s: s["1.running_var"].__setitem__(0, -1.0), r"1.running_var holds a negative variance \(-1\)"),
    (lambda s: s["0.weight"].__setitem__((0, 0, 0, 0), np.nan), r"0.weight holds 1 values that are NaN or infinite"),
    (lambda s: s["fc.1.bias"].__setitem__(3, np.inf), r"fc.1.bias holds 1 values that are NaN or infinite"),
])
def test_init_from_refuses_impossible_values_naming_the_key(data_dir, tmp_path, capsys, spoil, message):
    import safetensors.numpy
    state = {k: np.array(v) for k, v in nn.resnet18(width=2).state_dict().items()}
    spoil(state)
    safetensors.numpy.save_file(state, str(tmp_path / "w.safetensors"))
    line = refused(capsys, data_dir, tmp_path / "run", "--init-from", tmp_path / "w.safetensors")
    assert re.search(message, line), line


# ---- hangs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["--init-from", "--resume", "data"])
def test_a_named_pipe_where_a_file_belongs_is_refused_not_waited_on(data_dir, tmp_path, where):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    flags = {"--init-from": ["--init-from", str(fifo)], "--resume": ["--resume", str(fifo)], "data": []}[where]
    data = data_dir
    if where == "data":
        data = tmp_path / "data"
        data.mkdir()
        for name in os.listdir(data_dir):
            (data / name).symlink_to(data_dir / name)
        (data / "t10k-labels-idx1-ubyte.gz").unlink()
        os.mkfifo(data / "t10k-labels-idx1-ubyte.gz")
    done = subprocess.run([sys.executable, "train_resnet.py", "--data-dir", str(data), "--out",
                           str(tmp_path / "run"), *SMALL, *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "is a named pipe (FIFO)" in done.stderr, done.stderr


# ---- smaller ----------------------------------------------------------------------------------------------

def test_an_export_killed_midway_leaves_nothing_behind_after_the_next_start(data_dir, finished, tmp_path):
    target = tmp_path / "w.safetensors"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".w.safetensors.{dead.stdout.strip()}.tmp"   # a process that is gone
    leftover.write_bytes(b"half a file")
    assert run(data_dir, None, "--resume", finished[0], "--export", target) == 0
    assert not leftover.exists() and target.is_file()


def test_a_run_on_the_folder_removes_what_an_export_killed_midway_left_in_it(data_dir, finished, tmp_path):
    out = copy_of(finished, tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = out / f".w.safetensors.{dead.stdout.strip()}.tmp"
    leftover.write_bytes(b"half a file")
    assert run(data_dir, None, "--resume", out, "--epochs", "2") == 0
    assert not leftover.exists()


def test_export_of_a_finished_run_writes_nothing_in_its_folder(data_dir, finished, tmp_path):
    """It only reads the run (which may sit on a read-only mount): no lock, no file of the folder touched."""
    out = copy_of(finished, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run(data_dir, None, "--resume", out, "--export", tmp_path / "w.safetensors") == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert (tmp_path / "w.safetensors").is_file()


def test_a_finished_run_may_be_profiled(data_dir, finished, tmp_path):
    out = copy_of(finished, tmp_path)
    assert run(data_dir, None, "--resume", out, "--profile", "--profile-steps", "1") == 0
    assert (out / "profile.json").is_file() and intact(out, finished)


def test_data_files_that_gunzip_left_uncompressed_are_read(data_dir, tmp_path):
    import gzip
    plain = tmp_path / "plain"
    plain.mkdir()
    for gz in Path(data_dir).glob("*.gz"):
        (plain / gz.stem).write_bytes(gzip.decompress(gz.read_bytes()))
    assert run(plain, tmp_path / "run", "--epochs", "1") == 0
    assert not list(plain.glob("*.gz")), "nothing downloaded"


@pytest.mark.parametrize("flag", ["--data-dir", "--out", "--init-from", "--resume"])
def test_an_empty_path_is_refused_not_taken_for_the_default(data_dir, tmp_path, capsys, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, data_dir, tmp_path / "run", "--epochs", "1", flag, "")
    assert f"{flag} needs a path, got an empty one" in line, line
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()


def test_export_into_a_folder_that_is_a_file_says_so(data_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    line = refused(capsys, data_dir, tmp_path / "run", "--export", tmp_path / "a-file" / "w.safetensors")
    assert f"the folder {tmp_path / 'a-file'} is a regular file, not a folder" in line, line


def test_a_failed_start_leaves_no_empty_default_folder(data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(capsys, data_dir, None, "--limit", "1000")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--watchdog", "-1"], "--watchdog must be a positive number of seconds, got -1.0"),
    (["--watchdog", "nan"], "--watchdog must be a positive number of seconds, got nan"),
    (["--export", ""], "--export needs the name of the file to write"),
    (["--profile", "--export", "w.safetensors"], "--export writes the weights a run trained, and --profile trains "
                                                 "none"),
])
def test_values_a_flag_cannot_use_are_refused(data_dir, tmp_path, capsys, argv, message):
    assert message in refused(capsys, data_dir, tmp_path / "run", *argv)


def test_a_bad_simulated_gpu_count_is_named(data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(kernels.SIMULATED_GPUS, "two")
    assert "KERNELS_SIMULATED_GPUS='two': give the number of GPUs to simulate" in \
        refused(capsys, data_dir, tmp_path / "run", "--gpus", "1")


def test_pytorchs_module_prefix_is_a_one_line_hint(data_dir, tmp_path, capsys):
    import safetensors.numpy
    state = {f"module.{k}": np.array(v) for k, v in nn.resnet18(width=2).state_dict().items()}
    safetensors.numpy.save_file(state, str(tmp_path / "ddp.safetensors"))
    line = refused(capsys, data_dir, tmp_path / "run", "--init-from", tmp_path / "ddp.safetensors")
    assert "every key starts with 'module.'" in line and "net.module.state_dict()" in line and len(line) < 400, line


def test_a_safetensors_file_given_to_resume_says_what_to_do(data_dir, tmp_path, capsys):
    nn.save_safetensors(nn.resnet18(width=2), tmp_path / "w.safetensors")
    line = refused(capsys, data_dir, None, "--resume", tmp_path / "w.safetensors")
    assert "is a safetensors file of weights, not a checkpoint of a run: start a new run from it with --init-from" \
        in line and "allow_pickle" not in line
