"""Puts the repository root on sys.path (for the project's packages under plain `pytest`), prints
the session's random seed in the header and at the end (also under -q), adds the command that
replays it to every failure's report, starts NVRTC on the families that the session's `nvrtc` tests read (on a
thread, while the others run), and offers the `poisoned_empty` fixture and `order`, the emulator's thread orders."""
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


def pytest_collection_modifyitems(config, items):
    """pytest-xdist's groups (the README's --dist loadgroup): the tests marked `nvrtc` on one worker (each
    process compiles a family for itself), and the tests of a module that share a fixture of the module's
    scope on one worker (where it is made once); every other test goes wherever a worker is free."""
    if not config.pluginmanager.hasplugin("xdist"):   # the GPU machine's pytest, without it
        return
    for item in items:
        if item.get_closest_marker("nvrtc"):
            item.add_marker(pytest.mark.xdist_group("nvrtc"))
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


@pytest.fixture(params=emu.ORDERS)
def order(request):
    """The test once per order in which the emulator runs a block's threads (kernels.emu.ORDERS)."""
    with emu.thread_order(request.param):
        yield request.param
