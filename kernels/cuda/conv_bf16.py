"""The kernels of conv_bf16.cu, the BF16 tensor-core convolutions, which conv_tc.py plans and
launches beside the TF32 ones (one plan for both precisions)."""
from .conv_tc import BF16_KERNELS

OPS = ()  # the contract's ops are conv.py's
KERNELS = BF16_KERNELS
