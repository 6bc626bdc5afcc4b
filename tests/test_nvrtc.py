"""ptxas' resource report, as kernels/nvrtc.py reads it; the options it compiles with, as CuPy's."""
import os

import pytest

from kernels.nvrtc import parse_ptxas_log

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'gemm_128' for 'sm_90'
ptxas info    : Function properties for gemm_128
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 8 bytes cumulative stack size, 16896 bytes smem
ptxas info    : Compiling entry function 'relu' for 'sm_90'
ptxas info    : Function properties for relu
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers
"""


def test_spilling_and_plain_kernels():
    report = parse_ptxas_log(LOG)
    gemm, relu = report["gemm_128"], report["relu"]
    assert (gemm.registers, gemm.barriers, gemm.shared_bytes) == (128, 1, 16896)
    assert (gemm.stack_bytes, gemm.spill_stores, gemm.spill_loads) == (8, 4, 4)
    assert (relu.registers, relu.shared_bytes, relu.spill_stores) == (12, 0, 0)


def test_kernels_compile_with_the_options_cupy_gives_nvrtc(tmp_path, monkeypatch):
    """What CuPy 14.2 hands NVRTC for a RawModule of a family, caught on its way in (no GPU needed
    up to there), against kernels/nvrtc.py's options for the same module."""
    from kernels import nvrtc
    from kernels.cuda import OPTIONS, launcher, source
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)
    from cupy._core import core
    from cupy.cuda import compiler

    class Caught(Exception):
        pass

    code, seen = source("elementwise"), []
    compile_program = compiler._NVRTCProgram.compile

    def catch(program, options=(), log_stream=None):
        if program.src != code:  # CuPy's probe of the compiler's version on an empty source
            return compile_program(program, options, log_stream)
        seen.append(tuple(options))
        raise Caught
    monkeypatch.setattr(compiler._NVRTCProgram, "compile", catch)
    monkeypatch.setattr(compiler, "_kernel_cache_backend", compiler._DiskKernelCacheBackend(str(tmp_path)))
    # memoized per device, so it asks the driver; for sm_90, which NVRTC 12.8 and later support,
    # it gives CuPy's choice of a real architecture (cubin), unless CUPY_COMPILE_WITH_PTX is set
    assert not compiler._use_ptx
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc", lambda arch=None: (f"-arch=sm_{arch}", "cubin"))
    with pytest.raises(Caught):
        core.compile_with_cache(code, OPTIONS, arch="90", prepend_cupy_headers=False,
                                name_expressions=launcher("elementwise").KERNELS)
    assert seen == [nvrtc.cupy_options(OPTIONS, "sm_90")]
    assert "-ftz=true" in seen[0]


def cuda12_or_skip():
    from kernels import nvrtc
    reason = nvrtc.unavailable_reason()
    if reason or nvrtc.cuda12() is None:
        pytest.skip(reason or "CUDA 12's NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12)")
    return nvrtc


KERNEL = 'extern "C" __global__ void scale(float* x, float a) { x[threadIdx.x] *= a; }\n'


def test_sm_70_compiles_with_cuda_12s_nvrtc_beside_cupys():
    """CUDA 13 dropped sm_70: its programs go to CUDA 12's library, everything else stays with CuPy's."""
    nvrtc = cuda12_or_skip()
    assert nvrtc.nvrtc_for("sm_70") is nvrtc.cuda12() and nvrtc.cuda12().getVersion()[0] == 12
    assert nvrtc.nvrtc_for("sm_90") is nvrtc._nvrtc() and nvrtc.version()[0] == 13
    old = nvrtc.compile(KERNEL, arch="sm_70", verbose=True)
    assert ".target sm_70" in old.ptx and old.cubin[:4] == b"\x7fELF" and old.resources()["scale"].registers > 0
    new = nvrtc.compile(KERNEL, arch="sm_90")
    assert ".target sm_90" in new.ptx and ".version 8." not in new.ptx   # CUDA 12.9's PTX is 8.8
    assert nvrtc.compile("template <int N> __global__ void k(int* x) { x[0] = N; }", arch="sm_70",
                         name_expressions=("k<3>",)).lowered_names == {"k<3>": "_Z1kILi3EEvPi"}
    with pytest.raises(nvrtc.NvrtcError, match=r"(?s)failed to compile bad.cu for sm_70.*bad.cu\(1\).*undefined"):
        nvrtc.compile("__global__ void f() { undefined_name = 1; }", arch="sm_70", filename="bad.cu")


def test_loading_cuda_12s_nvrtc_first_leaves_cupy_on_its_own():
    """CuPy binds whichever libnvrtc the process already holds (cuda.pathfinder): cuda12() loads CuPy's
    first, so that CuPy, asked after it, still compiles with CUDA 13's."""
    import subprocess
    import sys
    cuda12_or_skip()
    done = subprocess.run([sys.executable, "-c", "from kernels import nvrtc; nvrtc.cuda12(); "
                                                 "from cupy.cuda import nvrtc as c; print(c.getVersion()[0])"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "13", done.stderr


def test_an_architecture_no_nvrtc_here_compiles_says_what_to_install(monkeypatch):
    from kernels import nvrtc
    if nvrtc.unavailable_reason():
        pytest.skip(nvrtc.unavailable_reason())
    monkeypatch.setattr(nvrtc, "cuda12", lambda: None)
    assert nvrtc.unsupported_reason("sm_90") is None
    assert "pip install nvidia-cuda-nvrtc-cu12" in nvrtc.unsupported_reason("sm_70")


def test_one_ptx_for_sm_80_to_sm_90_assembled_by_ptxas_is_what_nvrtc_makes_for_each():
    """kernels/cuda/ptxas_report.py compiles a family's PTX once for sm_80 to sm_90 and has ptxas make each
    one's SASS. That holds where NVRTC writes the same PTX for each (but its .target line), and where ptxas, of
    NVRTC's release, makes from it what NVRTC makes: both checked on a family, elementwise, whose bfloat16
    conversions branch below compute_80 (so that the comparison of PTX is seen to tell them apart)."""
    import re
    from kernels import nvrtc
    from kernels.cuda import OPTIONS, launcher, source
    from kernels.cuda.ptxas_report import PTX_SHARED, SHARED_PTX
    reason = nvrtc.unavailable_reason()
    if reason:
        pytest.skip(reason)

    def compiled(arch, verbose=False):
        return nvrtc.compile(source("elementwise"), arch, OPTIONS, launcher("elementwise").KERNELS,
                             "elementwise.cu", verbose)

    def body(c):
        return re.sub(r"^\.target .*$", "", c.ptx, flags=re.MULTILINE)
    shared = compiled(SHARED_PTX)
    assert body(compiled("compute_90")) == body(shared) != body(compiled("compute_75"))
    if nvrtc.ptxas(nvrtc.release(shared.ptx)) is None:
        pytest.skip(f"no ptxas of NVRTC's release {nvrtc.release(shared.ptx)} (pip install nvidia-cuda-nvcc)")
    for arch in (PTX_SHARED[0], PTX_SHARED[-1]):
        ours, theirs = nvrtc.assemble(shared, arch, verbose=True), compiled(arch, verbose=True)
        assert ours.resources() == theirs.resources() and ours.resources()
        assert ours.sass() == theirs.sass()


def test_a_ptxas_of_another_release_is_not_taken(monkeypatch, tmp_path):
    from kernels import nvrtc
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    nvrtc.ptxas.cache_clear()
    try:
        assert nvrtc.ptxas("V13.0.88") == fake
        assert nvrtc.ptxas("V99.1.2") is None
    finally:
        nvrtc.ptxas.cache_clear()
