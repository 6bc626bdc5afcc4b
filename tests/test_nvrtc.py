"""ptxas' resource report, as kernels/nvrtc.py reads it."""
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
