"""uint8 images to float32 in [0, 1], with a channel axis: (N, H, W) -> (N, 1, H, W)."""
import numpy as np


def images_to_float(images):
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"images_to_float expects uint8 (N, H, W), got {images.dtype} {images.shape}")
    out = images.astype(np.float32)[:, None]
    out *= np.float32(1 / 255)
    return out
