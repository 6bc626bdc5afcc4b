"""Launchers of elementwise.cu: a + b, relu, relu's backward, relu(a + b) and uint8 images to float."""
import numpy as np

from .launch import blocks, float32, launch, typed

OPS = ("add", "relu_forward", "relu_backward", "add_relu_forward", "images_to_float")
KERNELS = OPS


def add(be, a, b, out=None):
    a, b = float32(be, "add", a, b)
    _same_shape("add", a, b)
    if out is None:
        out = be.xp.empty_like(a)
    else:
        (out,) = float32(be, "add", out)
        _same_shape("add", a, out)
    launch(be, "elementwise", "add", blocks(a.size), (a, b, a.size, out))
    return out


def relu_forward(be, x):
    (x,) = float32(be, "relu_forward", x)
    y = be.xp.empty_like(x)
    launch(be, "elementwise", "relu_forward", blocks(x.size), (x, x.size, y))
    return y


def relu_backward(be, dy, y):
    dy, y = float32(be, "relu_backward", dy, y)
    _same_shape("relu_backward", dy, y)
    dx = be.xp.empty_like(dy)
    launch(be, "elementwise", "relu_backward", blocks(dy.size), (dy, y, dy.size, dx))
    return dx


def add_relu_forward(be, a, b):
    a, b = float32(be, "add_relu_forward", a, b)
    _same_shape("add_relu", a, b)
    y = be.xp.empty_like(a)
    launch(be, "elementwise", "add_relu_forward", blocks(a.size), (a, b, a.size, y))
    return y


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
