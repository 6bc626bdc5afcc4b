"""uint8 images to float32 in [0, 1], with a channel axis: (N, H, W) -> (N, 1, H, W), those of a
batch's indices; and the gather of a batch's labels."""
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
