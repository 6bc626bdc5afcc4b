"""What the benchmarks write: JSON files replaced atomically (a run cut off mid-write leaves the
previous version, never half a file), and the environment the numbers were measured in.

  PYTHONPATH=. python -m bench.report      # the environment as JSON: GPUs, driver, versions
"""
import datetime
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path


def write_json(path, data):
    path = Path(path)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(partial, path)


def read_json(path):
    """The JSON in `path`, or None where there is no such file or it does not parse."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def now():
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def cuda_tool(name):
    """The path of one of CUDA's command-line tools (compute-sanitizer, ncu): on PATH, else in
    $CUDA_HOME/bin (or $CUDA_PATH/bin); None where there is none."""
    found = shutil.which(name)
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if found is None and home and os.access(Path(home) / "bin" / name, os.X_OK):
        found = str(Path(home) / "bin" / name)
    return found


def environment():
    """Python, NumPy, CuPy and CUDA, the GPUs and their driver, PyTorch and cuDNN, as far as each
    can be asked; a part that cannot says why under '<part>_error'."""
    import numpy
    info = {"date": now(), "host": platform.node(), "python": platform.python_version(),
            "numpy": numpy.__version__, "compute_sanitizer": cuda_tool("compute-sanitizer"),
            "ncu": cuda_tool("ncu")}
    for part, describe in (("cupy", _cupy), ("torch", _torch), ("nvidia_smi", _nvidia_smi)):
        try:
            info.update(describe())
        except Exception as e:  # a missing package or driver is a finding here, not a failure
            info[f"{part}_error"] = f"{type(e).__name__}: {e}"
    return info


def _cupy():
    """The installed CuPy and the GPUs it sees: the machine's, whatever KERNELS_SIMULATED_GPUS says."""
    import cupy
    runtime = cupy.cuda.runtime
    info = {"cupy": cupy.__version__, "gpu_count": 0}
    try:
        info["gpu_count"] = runtime.getDeviceCount()
    except Exception as e:  # no driver or no device: why there is no GPU
        info["gpu_error"] = f"{type(e).__name__}: {e}"
    info["cuda_runtime"] = runtime.runtimeGetVersion()
    info["cuda_driver_api"] = runtime.driverGetVersion()
    info["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    info["gpus"] = [_name(runtime.getDeviceProperties(i)) for i in range(info["gpu_count"])]
    return info


def _name(properties):
    name = properties["name"]
    return name.decode() if isinstance(name, bytes) else name


def _torch():
    import torch
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "torch_cuda_available": torch.cuda.is_available()}
    if info["torch_cuda_available"]:
        info["cudnn"] = torch.backends.cudnn.version()
        info["torch_gpu"] = torch.cuda.get_device_name(0)
    return info


def _nvidia_smi():
    if shutil.which("nvidia-smi") is None:
        return {"driver": None}
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20, check=True).stdout
    return {"driver": out.strip().splitlines()[0] if out.strip() else None}


if __name__ == "__main__":
    print(json.dumps(environment(), indent=1, default=str))
