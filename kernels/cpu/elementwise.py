"""ReLU and the residual join relu(a + b), elementwise in the input dtype."""
import numpy as np


def relu_forward(x):
    return np.maximum(x, 0)


def relu_backward(dy, y):
    # The mask comes from the output: y > 0 exactly where the input was, and the
    # output is what add_relu_forward keeps, so one backward serves both ops.
    # Written as 1.0/0.0 in dy's dtype, the mask multiplies without a cast from bool.
    mask = np.greater(y, 0, out=np.empty_like(dy))
    return np.multiply(dy, mask, out=mask)


def add_relu_forward(a, b):
    if a.shape != b.shape:
        raise ValueError(f"add_relu operands differ in shape: {a.shape} and {b.shape}")
    y = a + b
    return np.maximum(y, 0, out=y)


def add(a, b, out=None):
    if a.shape != b.shape:
        raise ValueError(f"add operands differ in shape: {a.shape} and {b.shape}")
    return np.add(a, b, out=out)
