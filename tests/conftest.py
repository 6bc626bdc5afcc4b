"""Puts the repository root on sys.path (for the project's packages under plain `pytest`), prints
the session's random seed in the header and at the end (also under -q), adds the command that
replays it to every failure's report, starts NVRTC on the families that the session's `nvrtc` tests read (on a
thread, while the others run), and offers the `poisoned_empty` fixture, `halo_everywhere`, `order`, the
emulator's thread orders, and `slurm`, a one-node Slurm cluster for the tests marked `slurm`."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import helpers  # noqa: E402  (pytest puts tests/ on sys.path before importing this file)
from kernels import emu, nvrtc  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (-n, as the README's command runs the suite): the workers, started after this, take
    the session's seed from the environment (one seed for the whole run, as printed) and one BLAS thread
    each (two workers whose OpenBLAS threads spin on the same cores slow each other several times)."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("TEST_SEED", str(helpers.SESSION_SEED))
        for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(variable, "1")


def pytest_report_header(config):
    return f"random inputs: TEST_SEED={helpers.SESSION_SEED}"


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"random inputs: TEST_SEED={helpers.SESSION_SEED} (set it to draw them again)")


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """pytest-xdist's groups (the README's --dist loadgroup): the tests marked `nvrtc` on one worker (each
    process compiles a family for itself), and the tests of a module that share a fixture of the module's
    scope on one worker (where it is made once); every other test goes wherever a worker is free."""
    if not config.pluginmanager.hasplugin("xdist"):   # the GPU machine's pytest, without it
        return
    for item in items:
        if item.get_closest_marker("nvrtc"):
            item.add_marker(pytest.mark.xdist_group("nvrtc"))
        elif item.get_closest_marker("slurm"):   # one worker starts the session's cluster
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif any(d.scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_collection_finish(session):
    """The families the tests marked `nvrtc` compile (the marker's argument, else the test's `family`
    parameter), compiled in the order they are needed on a thread of their own: half a minute each, which
    the tests would otherwise wait for in turn. Not in a pytest-xdist worker: every worker collects every test,
    and the other workers keep the cores busy."""
    families = {}
    for item in session.items:
        marker = item.get_closest_marker("nvrtc")
        if marker:
            families[marker.args[0] if marker.args else item.callspec.params["family"]] = None
    if families and not os.environ.get("PYTEST_XDIST_WORKER") and nvrtc.unavailable_reason() is None:
        from kernels.cuda import ptxas_report
        ptxas_report.prefetch(families)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed:
        report.sections.append(("random inputs", f"reproduce with: TEST_SEED={helpers.SESSION_SEED} "
                                                 f"python -m pytest '{item.nodeid}'"))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """np.empty and np.empty_like return NaN (integers: their minimum) instead of whatever the
    memory held, so an output element that code forgets to write cannot pass by luck."""
    def poison(array):
        if np.issubdtype(array.dtype, np.floating) or array.dtype.name == "bfloat16":   # NumPy's floating lacks it
            array.fill(np.nan)
        elif np.issubdtype(array.dtype, np.integer):
            array.fill(np.iinfo(array.dtype).min)
        return array

    empty, empty_like = np.empty, np.empty_like
    monkeypatch.setattr(np, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(np, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture
def halo_everywhere(monkeypatch):
    """The tensor-core convolutions' halo kernels (TF32's and BF16's) wherever the convolution allows them,
    whatever the grid (kernels/cuda/conv_tc.py's halo: the split targets at one block); the name expressions
    of the kernels launched."""
    from kernels.cuda import conv_tc
    for target in ("SPLIT_TARGET", "BF16_SPLIT_TARGET"):
        monkeypatch.setattr(conv_tc, target, 1)
    conv_tc.plan.cache_clear()
    names, launch = [], conv_tc.launch
    monkeypatch.setattr(conv_tc, "launch", lambda be, family, kernel, *a, **k: names.append(kernel) or
                        launch(be, family, kernel, *a, **k))
    yield names
    conv_tc.plan.cache_clear()


@pytest.fixture(params=emu.ORDERS)
def order(request):
    """The test once per order in which the emulator runs a block's threads (kernels.emu.ORDERS)."""
    with emu.thread_order(request.param):
        yield request.param


SLURM_PROGRAMS = ("srun", "sinfo", "slurmctld", "slurmd", "munged", "munge")


def _running(pid):
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The environment for ``srun`` on a one-node Slurm cluster: the one running here (sinfo answers), or
    one that this session starts (munged, slurmctld and slurmd, with a configuration, a munge socket and
    ports of its own, so that another session's cluster on the machine is not disturbed) and stops at
    its end. Skipped, saying why, where Slurm is not installed (Debian:
    apt-get install slurmd slurmctld slurm-client munge) or cannot be started."""
    import shutil
    import socket
    import subprocess
    import time
    missing = [name for name in SLURM_PROGRAMS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found): apt-get install slurmd slurmctld "
                    f"slurm-client munge")
    environment = dict(os.environ)
    if subprocess.run(["sinfo", "-h"], capture_output=True, timeout=60, env=environment).returncode == 0:
        yield environment
        return
    if os.geteuid() != 0:
        pytest.skip("no Slurm cluster runs here, and starting slurmd takes root")
    folder = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    (folder / "state").mkdir()
    (folder / "spool").mkdir()
    (folder / "slurm.conf").write_text(
        f"ClusterName=tests\nSlurmctldHost={host}\nAuthType=auth/munge\nCredType=cred/munge\nSlurmUser=root\n"
        f"SlurmdUser=root\nStateSaveLocation={folder}/state\nSlurmdSpoolDir={folder}/spool\n"
        f"SlurmctldPidFile={folder}/slurmctld.pid\nSlurmdPidFile={folder}/slurmd.pid\n"
        f"SlurmctldLogFile={folder}/slurmctld.log\nSlurmdLogFile={folder}/slurmd.log\n"
        f"ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
        f"SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nMpiDefault=none\nReturnToService=2\n"
        f"MessageTimeout=30\n"   # the default 10 s is short for two busy cores
        # ports of its own, not 6817 and 6818: another session's cluster on this machine (or one
        # installed as a service) would take its jobs, or refuse its daemons' start
        f"SlurmctldPort={helpers.free_port()}\nSlurmdPort={helpers.free_port()}\n"
        f"AuthInfo=socket={folder}/munge.socket\n"   # and a munged of its own, which it stops at its end
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN\n"
        f"PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n")
    environment["SLURM_CONF"] = str(folder / "slurm.conf")
    started = []
    try:
        subprocess.run(["munged", "--force", f"--socket={folder}/munge.socket", f"--pid-file={folder}/munged.pid",
                        f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed"], check=True,
                       capture_output=True, timeout=30)
        started.append(folder / "munged.pid")
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon], check=True, capture_output=True, timeout=60, env=environment)
            started.append(folder / f"{daemon}.pid")
        state = helpers.slurm_idle(environment, 30)
        if state != "idle":
            pytest.skip(f"the one-node Slurm cluster started here did not come up (its node is {state!r}; logs in "
                        f"{folder})")
        yield environment
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"a one-node Slurm cluster could not be started here ({e}; logs in {folder})")
    finally:   # stopped, and waited for: a daemon still shutting down would answer the next session's srun
        pids = []
        for pid_file in reversed(started):
            try:
                pids.append(int(pid_file.read_text()))
                os.kill(pids[-1], 15)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 15
        while pids and time.monotonic() < deadline:
            pids = [pid for pid in pids if _running(pid)]
            time.sleep(0.1)
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
