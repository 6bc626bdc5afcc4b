"""uint8 images to float32 in [0, 1], with a channel axis: (N, H, W) -> (N, 1, H, W), those of a
batch's indices; the gather of a batch's labels; and the conversion of an array to another float
dtype (float32 to bfloat16 and back, for the bf16 precision's copies)."""
import numpy as np


def images_to_float(images, idx=None):
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"images_to_float expects uint8 (N, H, W), got {images.dtype} {images.shape}")
    if idx is not None:
        images = images[_indices("images_to_float", idx)]
    out = images.astype(np.float32)[:, None]
    out *= np.float32(1 / 255)
    return out


def take(a, idx):
    if a.dtype != np.int32 or a.ndim != 1:
        raise ValueError(f"take expects a 1-D int32 array, got {a.dtype} {a.shape}")
    return a[_indices("take", idx)]


def _indices(op, idx):
    if idx.dtype.kind not in "iu" or idx.ndim != 1:
        raise ValueError(f"{op} expects 1-D integer indices, got {idx.dtype} {idx.shape}")
    return idx


def cast(a, dtype, out=None):
    """NumPy's astype, which keeps a's memory layout and rounds to nearest even (ml_dtypes' bfloat16
    too); into `out` when given."""
    if out is None:
        return a.astype(dtype)
    if out.shape != a.shape or out.dtype != np.dtype(dtype):
        raise ValueError(f"cast: out is {out.dtype} {out.shape}, where {np.dtype(dtype)} {a.shape} is due")
    out[...] = a
    return out
