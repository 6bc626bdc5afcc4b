"""Fashion-MNIST from its four standard IDX .gz files (or the files gunzip makes of them): found,
downloaded when missing, checked. (Shuffled batches: nn/data.py.)

The folder is ``data_dir``, else ``$FASHION_MNIST_DIR``, else ``./data/fashion-mnist``.
Every problem with a file (missing, truncated, corrupt, wrong magic, sizes that do not
agree) is a ``DataError`` that names the file.
"""
import gzip
import hashlib
import os
import struct
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from nn.serialization import file_kind

DEFAULT_DIR = Path("data") / "fashion-mnist"
MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# split -> (images file, labels file); md5 of the .gz files as published with the dataset
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
NUM_CLASSES = 10
_UBYTE = 0x08


class DataError(Exception):
    """The dataset cannot be found or read; the message says which file and why."""


def resolve_dir(data_dir=None):
    return Path(data_dir or os.environ.get("FASHION_MNIST_DIR") or DEFAULT_DIR)


def found(folder, name):
    """Where one of the four files is in ``folder``: ``name`` (the .gz), or ``name`` without .gz where only
    that is there (gunzip left it so)."""
    path = Path(folder) / name
    plain = path.with_suffix("")
    return plain if file_kind(path) is None and file_kind(plain) is not None else path


def read_idx(path, ndim):
    """The uint8 array of an IDX file with ``ndim`` dimensions, gzip-compressed or not."""
    kind = file_kind(path)
    if kind not in (None, "a regular file"):
        raise DataError(f"{path} is {kind}, not a regular file")
    try:
        with open(path, "rb") as f:
            compressed = f.read(2) == b"\x1f\x8b"
        with (gzip.open if compressed else open)(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: {len(raw)} bytes, too short for an IDX header")
    zero, dtype, dims = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != _UBYTE or dims != ndim:
        raise DataError(f"{path}: magic number {raw[:4].hex()} is not that of a {ndim}-d uint8 IDX "
                        f"file (expected 0000080{ndim})")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise DataError(f"{path}: header promises {shape} = {expected} bytes of data, file has "
                        f"{len(raw) - header} (truncated or corrupt)")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


def load_split(folder, split):
    """(images (N, 28, 28) uint8, labels (N,) uint8) of 'train' or 'test'."""
    images_file, labels_file = (found(folder, name) for name in FILES[split])
    images, labels = read_idx(images_file, 3), read_idx(labels_file, 1)
    if len(images) != len(labels):
        raise DataError(f"{images_file} holds {len(images)} images but {labels_file} "
                        f"{len(labels)} labels")
    if labels.size and labels.max() >= NUM_CLASSES:
        raise DataError(f"{labels_file}: label {labels.max()} outside 0..{NUM_CLASSES - 1}")
    return images, labels


def _md5(path):
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(name, folder, mirror):
    """Fetch one file to a temporary name, check its md5, then move it in place."""
    target, partial = folder / name, folder / (name + ".part")
    with urllib.request.urlopen(mirror + name, timeout=30) as response, open(partial, "wb") as f:
        while block := response.read(1 << 20):
            f.write(block)
    if _md5(partial) != MD5[name]:
        partial.unlink()
        raise DataError(f"{mirror + name}: md5 does not match the published {MD5[name]}")
    partial.replace(target)


def ensure_files(folder, mirror=None, log=print):
    """Download whichever of the four files are missing from ``folder``."""
    folder, mirror = Path(folder), mirror or MIRROR
    try:
        kind = file_kind(folder)
        if kind not in (None, "a folder"):
            raise DataError(f"{folder} is {'a file' if kind == 'a regular file' else kind}, not a folder: point "
                            f"--data-dir (or FASHION_MNIST_DIR) at the folder of the four .gz files")
        missing = [name for pair in FILES.values() for name in pair if file_kind(found(folder, name)) is None]
    except OSError as e:   # a folder that may not be read
        raise DataError(f"{folder}: cannot be read ({e.strerror})") from None
    if not missing:
        return
    log(f"Fashion-MNIST: downloading {len(missing)} missing file(s) to {folder}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name in missing:
            _download(name, folder, mirror)
    except (OSError, DataError) as e:
        raise DataError(
            f"Fashion-MNIST is not in {folder} and could not be downloaded ({e}). Put these files "
            f"there: {', '.join(missing)} (or point --data-dir or FASHION_MNIST_DIR at a folder "
            f"that has them)") from None


def load_fashion_mnist(data_dir=None, download=True, log=print):
    """{'train': (images, labels), 'test': (images, labels)}, uint8, images (N, 28, 28)."""
    folder = resolve_dir(data_dir)
    if download:
        ensure_files(folder, log=log)
    splits = {split: load_split(folder, split) for split in FILES}
    for split, (images, _) in splits.items():
        if len(images) == 0:
            raise DataError(f"{found(folder, FILES[split][0])} holds no images: the {split} split is empty")
    sizes = {split: images.shape[1:] for split, (images, _) in splits.items()}
    if sizes["train"] != sizes["test"]:
        raise DataError(f"{found(folder, FILES['test'][0])} holds images of {sizes['test'][0]}x{sizes['test'][1]} pixels, "
                        f"{found(folder, FILES['train'][0])} of {sizes['train'][0]}x{sizes['train'][1]}: a model trained on "
                        f"the one cannot be tested on the other")
    return splits
