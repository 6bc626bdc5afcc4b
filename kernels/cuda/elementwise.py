"""Launchers of elementwise.cu: a + b, relu, relu's backward, relu(a + b) and uint8 images to float."""
import numpy as np

from .launch import blocks, dense, in_place, launch, like, typed

OPS = ("add", "relu_forward", "relu_backward", "add_relu_forward", "images_to_float")
KERNELS = OPS


def add(be, a, b, out=None):
    return _elementwise(be, "add", a, b, out=out)


def relu_forward(be, x):
    return _elementwise(be, "relu_forward", x)


def relu_backward(be, dy, y):
    return _elementwise(be, "relu_backward", dy, y)


def add_relu_forward(be, a, b):
    return _elementwise(be, "add_relu_forward", a, b)


def _elementwise(be, kernel, *operands, out=None):
    """One launch of a float32 kernel(operands..., total, out) over operands of one shape, element
    by element of their memory: every operand in the layout (NCHW or channels-last) of the first
    one, or of `out` when given (which must then be dense); the result in that layout."""
    first = dense(be, kernel, operands[0])
    if out is None:
        out = be.xp.empty_like(first)
    else:
        in_place(be, kernel, out)
    operands = like(be, kernel, out, first, *operands[1:])
    for other in (*operands[1:], out):
        _same_shape(kernel, operands[0], other)
    launch(be, "elementwise", kernel, blocks(out.size), (*operands, out.size, out))
    return out


def images_to_float(be, images):
    images = typed(be, "images_to_float", images, np.uint8)
    if images.ndim != 3:
        raise ValueError(f"images_to_float expects uint8 (N, H, W), got shape {images.shape}")
    n, h, w = images.shape
    x = be.xp.empty((n, 1, h, w), np.float32)
    launch(be, "elementwise", "images_to_float", blocks(images.size), (images, images.size, x))
    return x


def _same_shape(op, a, b):
    if a.shape != b.shape:
        raise ValueError(f"{op} operands differ in shape: {a.shape} and {b.shape}")
