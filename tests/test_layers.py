"""Imports run one way: kernels, then nn, then parallel, then the profiler and the training
application (train_resnet.py is the application's), then the benchmarks. No module imports from
a layer above its own, at the top of a file or inside a function."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"kernels": 0, "nn": 1, "parallel": 2, "profiler": 3, "training": 4, "train_resnet": 4, "bench": 5}


def project_files():
    for name in LAYERS:
        path = ROOT / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    yield ROOT / "bench" / "gpu_check"


def imported_packages(path):
    """(line, top-level name) of every import in the file, relative ones resolved."""
    package = path.relative_to(ROOT).parts[0].removesuffix(".py")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, package if node.level else node.module.split(".")[0]


def test_every_layer_has_files():
    files = list(project_files())
    assert {f.relative_to(ROOT).parts[0].removesuffix(".py") for f in files} == set(LAYERS)
    assert len(files) > 50


@pytest.mark.parametrize("path", list(project_files()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_upward(path):
    own = path.relative_to(ROOT).parts[0].removesuffix(".py")
    upward = [f"line {line}: {name} (layer {LAYERS[name]})" for line, name in imported_packages(path)
              if name in LAYERS and LAYERS[name] > LAYERS[own]]
    # the profiler and the application share a level, and only the application may use the other
    sideways = [f"line {line}: training" for line, name in imported_packages(path)
                if own == "profiler" and name in ("training", "train_resnet")]
    assert not upward + sideways, f"{path.relative_to(ROOT)} (layer {LAYERS[own]}) imports from above: " \
                                  f"{upward + sideways}"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The test can fail: a function-level import of the application from nn is caught."""
    fake = tmp_path / "nn" / "bad.py"
    fake.parent.mkdir()
    fake.write_text("def f():\n    from training import loop\n    return loop\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert list(imported_packages(fake)) == [(2, "training")]
    with pytest.raises(AssertionError, match=r"nn/bad.py \(layer 1\) imports from above: \['line 2: training"):
        test_no_import_runs_upward(fake)
