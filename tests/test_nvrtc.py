"""ptxas' resource report, as kernels/nvrtc.py reads it; the options it compiles with, as CuPy's."""
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
