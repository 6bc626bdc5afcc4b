"""Launcher of optim.cu: one SGD step over the flat parameter buffer, in place, and the bfloat16 or
TF32 copy of the updated parameters in the same pass when one is given."""
import numpy as np

from kernels import bfloat16

from .launch import blocks, float32, in_place, is_channels_last, launch

OPS = ("sgd_update",)
KERNELS = ("sgd_update",)


def sgd_update(be, param, grad, velocity, lr, momentum, weight_decay, copy=None):
    if momentum != 0 and velocity is None:
        raise ValueError("sgd with momentum needs a velocity buffer shaped like the param")
    # Without momentum the velocity plays no part (PyTorch keeps no buffer then).
    velocity = velocity if momentum != 0 else None
    in_place(be, "sgd_update", param, velocity)
    tf32 = copy is not None and copy.dtype == np.float32   # the copy's dtype says which rounding
    in_place(be, "sgd_update", copy, dtype=np.float32 if tf32 else bfloat16)
    (grad,) = float32(be, "sgd_update", grad)
    for name, a in (("grad", grad), ("velocity", velocity), ("copy", copy)):
        if a is not None and a.shape != param.shape:
            raise ValueError(f"sgd param {param.shape} and {name} {a.shape} differ in shape")
    if copy is not None and is_channels_last(copy) != is_channels_last(param):
        raise ValueError(f"sgd_update: the copy's memory (strides {copy.strides}) is not laid out as the param's "
                         f"(strides {param.strides})")
    lr_memory = None
    if isinstance(lr, be.xp.ndarray):   # a 1-element device array, read when the kernel runs
        (lr_memory,) = float32(be, "sgd_update", lr)
        if lr_memory.size != 1:
            raise ValueError(f"sgd_update: lr is a number or a 1-element array, got shape {lr_memory.shape}")
        lr = 0.0
    launch(be, "optim", "sgd_update", blocks(param.size),
           (param, grad, velocity, None if tf32 else copy, copy if tf32 else None, param.size, lr_memory, float(lr),
            float(momentum), float(weight_decay)))
