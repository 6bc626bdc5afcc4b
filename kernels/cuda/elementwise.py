"""Launchers of elementwise.cu: a + b, relu, relu's backward, relu(a + b) on float32 or bfloat16
activations, the conversion between the two, float32 rounded to TF32, uint8 images (of a batch's indices)
to float, and the gather of labels; and the kernel hold (Backend.hold), which is no op of the contract."""
import numpy as np

import kernels

from .launch import C_TYPES, STORAGE_TYPES, blocks, dense, in_place, integers, launch, like, storage, \
    storage_argument, typed, vector_width

OPS = ("add", "relu_forward", "relu_backward", "add_relu_forward", "cast", "round_tf32", "images_to_float", "take")
KERNELS = tuple(f"{kernel}<{vec}{storage_argument(t)}>"
                for kernel in ("add", "relu_forward", "relu_backward", "add_relu_forward")
                for vec in (1, 4) for t in STORAGE_TYPES.values()) + \
    tuple(f"cast<{vec}, {source}, {target}>" for vec in (1, 4) for source in STORAGE_TYPES.values()
          for target in STORAGE_TYPES.values()) + ("round_tf32<1>", "round_tf32<4>") + \
    tuple(f"images_to_float<{t}{storage_argument(storage)}>" for t in C_TYPES.values()
          for storage in STORAGE_TYPES.values()) + tuple(f"take<{t}>" for t in C_TYPES.values()) + ("hold",)


def add(be, a, b, out=None):
    return _elementwise(be, "add", a, b, out=out)


def relu_forward(be, x):
    return _elementwise(be, "relu_forward", x)


def relu_backward(be, dy, y):
    return _elementwise(be, "relu_backward", dy, y)


def add_relu_forward(be, a, b):
    return _elementwise(be, "add_relu_forward", a, b)


def cast(be, a, dtype, out=None):
    """`a` (float32 or bfloat16) converted to `dtype` (one of those), into `out` when given (dense,
    of that dtype), else into a new array in a's layout."""
    dtype = np.dtype(dtype)
    if dtype not in STORAGE_TYPES:
        raise TypeError(f"cast: converts to float32 or bfloat16, not {dtype}")
    a = dense(be, "cast", a)
    if out is None:
        out = be.xp.empty_like(a, dtype=dtype)
    else:
        in_place(be, "cast", out, dtype=dtype)
    (a,) = like(be, "cast", out, a)
    _same_shape("cast", a, out)
    vec = vector_width(out.size, a, out)
    launch(be, "elementwise", f"cast<{vec}, {STORAGE_TYPES[a.dtype]}, {STORAGE_TYPES[dtype]}>",
           blocks(out.size // vec), (a, out.size, out))
    return out


def round_tf32(be, a, out=None):
    """`a` (float32) rounded to TF32 (tf32.cuh's tf32_value), into `out` when given (dense, float32), else into
    a new array in a's layout."""
    if getattr(a, "dtype", None) != np.float32:
        raise TypeError(f"round_tf32: rounds float32, not {getattr(a, 'dtype', type(a).__name__)}")
    return _elementwise(be, "round_tf32", a, out=out)


def _elementwise(be, kernel, *operands, out=None):
    """One launch of kernel(operands..., total, out) over operands of one shape and one storage dtype
    (float32 or bfloat16), element by element of their memory: every operand in the layout (NCHW or
    channels-last) of the first one, or of `out` when given (which must then be dense, of their
    dtype); the result in that layout."""
    first = dense(be, kernel, operands[0])
    if out is None:
        out = be.xp.empty_like(first)
    else:
        in_place(be, kernel, out, dtype=first.dtype)
    operands = like(be, kernel, out, first, *operands[1:])
    for other in (*operands[1:], out):
        _same_shape(kernel, operands[0], other)
    t = storage(kernel, *operands)
    vec = vector_width(out.size, *operands, out)
    launch(be, "elementwise", f"{kernel}<{vec}{storage_argument(t)}>", blocks(out.size // vec),
           (*operands, out.size, out))
    return out


def images_to_float(be, images, idx=None):
    """The images (of idx) as the network's first activation: float32, or bfloat16 under the bf16
    precision (kernels.storage_dtype()), as autocast rounds a convolution's input."""
    images = typed(be, "images_to_float", images, np.uint8)
    if images.ndim != 3:
        raise ValueError(f"images_to_float expects uint8 (N, H, W), got shape {images.shape}")
    _, h, w = images.shape
    idx = None if idx is None else _indices(be, "images_to_float", idx)
    n = len(images) if idx is None else len(idx)
    x = be.xp.empty((n, 1, h, w), kernels.storage_dtype())
    index_type = C_TYPES[np.dtype(np.int32) if idx is None else idx.dtype]
    launch(be, "elementwise", f"images_to_float<{index_type}{storage_argument(STORAGE_TYPES[x.dtype])}>",
           blocks(x.size), (images, idx, h * w, x.size, x))
    return x


def take(be, a, idx):
    a = typed(be, "take", a, np.int32)
    idx = _indices(be, "take", idx)
    if a.ndim != 1:
        raise ValueError(f"take expects a 1-D int32 array, got shape {a.shape}")
    out = be.xp.empty(idx.shape, np.int32)
    launch(be, "elementwise", f"take<{C_TYPES[idx.dtype]}>", blocks(out.size), (a, idx, out.size, out))
    return out


def _indices(be, op, idx):
    """A 1-D integer array of indices (their range is the caller's to keep: the kernels index
    without checking)."""
    idx = integers(be, op, idx)
    if idx.ndim != 1:
        raise ValueError(f"{op} expects 1-D indices, got shape {idx.shape}")
    return idx


def _same_shape(op, a, b):
    if a.shape != b.shape:
        raise ValueError(f"{op} operands differ in shape: {a.shape} and {b.shape}")
