"""SGD with momentum and weight decay, PyTorch's rule (dampening 0, no Nesterov).

Updates the flat parameter and velocity buffers in place, through one scratch buffer.
"""
import numpy as np


def sgd_update(param, grad, velocity, lr, momentum, weight_decay):
    if param.shape != grad.shape:
        raise ValueError(f"sgd param {param.shape} and grad {grad.shape} differ in shape")
    if momentum != 0 and (velocity is None or velocity.shape != param.shape):
        raise ValueError("sgd with momentum needs a velocity buffer shaped like the param")
    scratch = np.empty_like(param)
    step = grad
    if weight_decay != 0:
        step = np.multiply(param, weight_decay, out=scratch)
        step += grad
    if momentum != 0:
        velocity *= momentum
        velocity += step
        step = velocity
    param -= np.multiply(step, lr, out=scratch)
