"""SGD with momentum and weight decay, PyTorch's rule (dampening 0, no Nesterov).

Updates the flat parameter and velocity buffers in place, and the bfloat16 or TF32 copy of the
parameters when one is given. The update is five elementwise
passes; over the whole 45 MB buffers of ResNet-18 each pass would go to memory, so the
buffers are updated in blocks small enough that the passes over a block stay in cache, the blocks
on every core (kernels/cpu/_parallel.py).
"""
import numpy as np

from ._parallel import each
from ._util import workspace
from .convert import round_tf32

_BLOCK = 1 << 18   # elements: 1 MB blocks of param, grad, velocity and scratch stay in cache


def sgd_update(param, grad, velocity, lr, momentum, weight_decay, copy=None):
    if not np.isscalar(lr):   # a 1-element array, as a device keeps it
        lr = lr.reshape(-1)[0]
    if param.shape != grad.shape:
        raise ValueError(f"sgd param {param.shape} and grad {grad.shape} differ in shape")
    if momentum != 0 and (velocity is None or velocity.shape != param.shape):
        raise ValueError("sgd with momentum needs a velocity buffer shaped like the param")
    if copy is not None and copy.shape != param.shape:
        raise ValueError(f"sgd param {param.shape} and copy {copy.shape} differ in shape")
    velocity = velocity if momentum != 0 else None
    arrays = [a for a in (param, grad, velocity, copy) if a is not None]
    if not all(a.flags.c_contiguous for a in arrays):
        # blocks are slices of the flat views, which only contiguous arrays have
        _sgd_block(param, grad, velocity, lr, momentum, weight_decay, np.empty_like(param), copy)
        return
    flat = [None if a is None else a.reshape(-1) for a in (param, grad, velocity, copy)]

    def part(i):
        block = slice(i * _BLOCK, min((i + 1) * _BLOCK, param.size))
        p, g, v, c = (None if a is None else a[block] for a in flat)
        _sgd_block(p, g, v, lr, momentum, weight_decay, workspace("sgd", (block.stop - block.start,), param.dtype), c)
    each(part, -(-param.size // _BLOCK))


def _sgd_block(param, grad, velocity, lr, momentum, weight_decay, scratch, copy):
    step = grad
    if weight_decay != 0:
        step = np.multiply(param, weight_decay, out=scratch)
        step += grad
    if velocity is not None:
        velocity *= momentum
        velocity += step
        step = velocity
    param -= np.multiply(step, lr, out=scratch)
    if copy is not None and copy.dtype == np.float32:
        round_tf32(param, out=copy)
    elif copy is not None:
        copy[...] = param   # rounded to nearest even
