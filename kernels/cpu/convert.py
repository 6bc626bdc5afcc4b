"""uint8 images to float32 in [0, 1], with a channel axis: (N, H, W) -> (N, 1, H, W), those of a
batch's indices; the gather of a batch's labels; and the conversion of an array to another float
dtype (float32 to bfloat16 and back, for the bf16 precision's copies), and float32 rounded to TF32 (the
tf32 precision's copy of the weights)."""
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


def round_tf32(a, out=None):
    """float32 `a` rounded to TF32 as cvt.rna.tf32.f32 rounds (10 mantissa bits, to nearest, ties away from
    zero: half a TF32 unit added to the magnitude's bits, the low 13 cleared), infinity and NaN as they
    are; into `out` when given."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise TypeError(f"round_tf32: rounds float32, not {a.dtype}")
    bits = a.view(np.uint32)
    rounded = np.where(np.isfinite(a), (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits).view(np.float32)
    if out is None:
        return rounded
    if out.shape != a.shape or out.dtype != np.float32:
        raise ValueError(f"round_tf32: out is {out.dtype} {out.shape}, where float32 {a.shape} is due")
    out[...] = rounded
    return out
