"""The Fashion-MNIST reader on tiny generated IDX files, and its errors; the batches of an epoch."""
import gzip
from pathlib import Path

import numpy as np
import pytest

from helpers import rng, write_fashion_mnist, write_idx
from nn import data
from training import fashion_mnist

# a port on this machine where nothing listens: a download fails at once, offline
NOWHERE = "http://127.0.0.1:9/"


def test_reads_what_was_written(tmp_path):
    images = rng().integers(0, 256, size=(5, 28, 28)).astype(np.uint8)
    write_idx(tmp_path / "x.gz", images)
    np.testing.assert_array_equal(fashion_mnist.read_idx(tmp_path / "x.gz", 3), images)


def test_load_split_pairs_images_and_labels(tmp_path):
    write_fashion_mnist(tmp_path, 12, 7)
    splits = fashion_mnist.load_fashion_mnist(tmp_path)
    assert splits["train"][0].shape == (12, 28, 28) and splits["train"][1].shape == (12,)
    assert splits["test"][0].shape == (7, 28, 28) and splits["test"][0].dtype == np.uint8


def test_truncated_file(tmp_path):
    write_idx(tmp_path / "x.gz", np.ones((4, 28, 28)))
    raw = gzip.decompress((tmp_path / "x.gz").read_bytes())
    (tmp_path / "x.gz").write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(fashion_mnist.DataError, match=r"x\.gz.*truncated"):
        fashion_mnist.read_idx(tmp_path / "x.gz", 3)


def test_truncated_gzip_stream(tmp_path):
    write_idx(tmp_path / "x.gz", rng().integers(0, 256, size=(40, 28, 28)))
    (tmp_path / "x.gz").write_bytes((tmp_path / "x.gz").read_bytes()[:500])
    with pytest.raises(fashion_mnist.DataError, match=r"x\.gz.*gzip"):
        fashion_mnist.read_idx(tmp_path / "x.gz", 3)


def test_not_gzip_at_all(tmp_path):
    (tmp_path / "x.gz").write_bytes(b"this is not a gzip file")
    with pytest.raises(fashion_mnist.DataError, match=r"x\.gz"):
        fashion_mnist.read_idx(tmp_path / "x.gz", 3)


def test_wrong_magic(tmp_path):
    write_idx(tmp_path / "labels.gz", np.ones(10))  # a 1-d file where images are expected
    with pytest.raises(fashion_mnist.DataError, match=r"labels\.gz.*magic"):
        fashion_mnist.read_idx(tmp_path / "labels.gz", 3)


def test_label_count_mismatch(tmp_path):
    write_fashion_mnist(tmp_path, 10, 5)
    write_idx(tmp_path / fashion_mnist.FILES["train"][1], np.ones(9))
    with pytest.raises(fashion_mnist.DataError, match="10 images but .*9 labels"):
        fashion_mnist.load_split(tmp_path, "train")


def test_label_out_of_range(tmp_path):
    write_fashion_mnist(tmp_path, 10, 5)
    write_idx(tmp_path / fashion_mnist.FILES["test"][1], np.full(5, 12))
    with pytest.raises(fashion_mnist.DataError, match="label 12"):
        fashion_mnist.load_split(tmp_path, "test")


def test_missing_folder_offline_names_the_folder_and_files(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion_mnist, "MIRROR", NOWHERE)
    folder = tmp_path / "nowhere"
    with pytest.raises(fashion_mnist.DataError) as e:
        fashion_mnist.load_fashion_mnist(folder, log=lambda *a: None)
    message = str(e.value)
    assert str(folder) in message
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        assert name in message
    assert not list(folder.glob("*.part")), "a failed download leaves no partial file"


def test_folder_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FASHION_MNIST_DIR", str(tmp_path))
    assert fashion_mnist.resolve_dir() == tmp_path
    assert fashion_mnist.resolve_dir("elsewhere") == Path("elsewhere")
    monkeypatch.delenv("FASHION_MNIST_DIR")
    assert fashion_mnist.resolve_dir() == fashion_mnist.DEFAULT_DIR


def test_epoch_order_is_a_seeded_permutation():
    a = data.epoch_order(50, seed=3, epoch=1)
    assert sorted(a) == list(range(50))
    np.testing.assert_array_equal(a, data.epoch_order(50, seed=3, epoch=1))
    assert not np.array_equal(a, data.epoch_order(50, seed=3, epoch=2))
    assert not np.array_equal(a, data.epoch_order(50, seed=4, epoch=1))
    batches = data.batch_indices(a, 16)
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    np.testing.assert_array_equal(np.concatenate(batches), a)
