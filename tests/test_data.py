"""The dataset loaders, run through the real torchvision readers on tiny files written here."""

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import datasets

from conftest import VENV_BIN, run_cmd
from hvdhetero.recipes import data
from hvdhetero.errors import ConfigError, DataError


def write_idx(path: Path, array: np.ndarray) -> None:
    # IDX: two zero bytes, type code 0x08 (ubyte), number of dims, then big-endian int32 dims.
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def write_tiny_mnist(root: Path, rng: np.random.Generator) -> dict:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    written = {}
    for split, n in (("train", 20), ("t10k", 10)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(raw / f"{split}-images-idx3-ubyte", images)
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels)
        written[split] = (images, labels)
    return written


def write_tiny_cifar10(root: Path, rng: np.random.Generator) -> dict:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = rng.integers(0, 256, size=(4, 3072), dtype=np.uint8)  # rows are CHW, flattened
        labels = rng.integers(0, 10, size=4).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": images, "labels": labels}, f)
        written[name] = (images, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return written


@pytest.fixture
def no_cifar_md5(monkeypatch):
    # torchvision checks each CIFAR file's MD5 against the official archive's (check_integrity in
    # CIFAR10._check_integrity and _load_meta), which files written here can never match. With
    # md5=None check_integrity only checks that the file exists; everything else is the real loader.
    cls = datasets.CIFAR10
    monkeypatch.setattr(cls, "train_list", [[name, None] for name, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[name, None] for name, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": None})


def test_unknown_dataset_lists_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown dataset 'imagenet'; allowed: digits, mnist, cifar10"):
        data.load("imagenet", tmp_path)


def test_mnist_reads_idx_files(tmp_path):
    written = write_tiny_mnist(tmp_path, np.random.default_rng(0))
    train, test, info = data.load("mnist", tmp_path)
    assert info == data.DatasetInfo("mnist", num_classes=10, in_channels=1, image_size=28)
    assert (len(train), len(test)) == (20, 10)
    for dataset, (images, labels) in ((train, written["train"]), (test, written["t10k"])):
        for i in (0, len(dataset) - 1):
            image, label = dataset[i]
            assert image.shape == (1, 28, 28) and image.dtype == torch.float32
            assert label == labels[i]
            expected = (torch.from_numpy(images[i]).float() / 255 - 0.1307) / 0.3081
            torch.testing.assert_close(image[0], expected)


def test_mnist_missing_files_say_where_and_how(tmp_path):
    with pytest.raises(DataError) as err:
        data.load("mnist", tmp_path / "nowhere")
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "MNIST" / "raw" / "train-images-idx3-ubyte") in message
    assert "t10k-labels-idx1-ubyte" in message
    assert "https://" in message
    assert "--download" in message


def test_mnist_failed_download_is_a_data_error(tmp_path, monkeypatch):
    # Nothing listens on the discard port, so the download fails at once, as it does offline.
    monkeypatch.setattr(datasets.MNIST, "mirrors", ["http://127.0.0.1:9/"])
    with pytest.raises(DataError, match="could not be downloaded") as err:
        data.load("mnist", tmp_path, download=True)
    assert str(tmp_path / "MNIST" / "raw") in str(err.value)


def test_cifar10_reads_pickled_batches(tmp_path, no_cifar_md5):
    written = write_tiny_cifar10(tmp_path, np.random.default_rng(0))
    train, test, info = data.load("cifar10", tmp_path)
    assert info == data.DatasetInfo("cifar10", num_classes=10, in_channels=3, image_size=32)
    assert (len(train), len(test)) == (20, 4)
    train_labels = [label for i in range(1, 6) for label in written[f"data_batch_{i}"][1]]
    assert [train[i][1] for i in range(len(train))] == train_labels
    test_images, test_labels = written["test_batch"]
    for i in range(len(test)):
        image, label = test[i]
        assert image.shape == (3, 32, 32) and label == test_labels[i]
        # The test transform is deterministic: undo Normalize and compare with the bytes written.
        mean = torch.tensor(data.CIFAR10_MEAN).view(3, 1, 1)
        std = torch.tensor(data.CIFAR10_STD).view(3, 1, 1)
        pixels = torch.from_numpy(test_images[i].reshape(3, 32, 32)).float() / 255
        torch.testing.assert_close(image * std + mean, pixels)
    assert train[0][0].shape == (3, 32, 32)  # augmented, so only the shape is fixed


def test_cifar10_missing_files_say_where_and_how(tmp_path):
    with pytest.raises(DataError) as err:
        data.load("cifar10", tmp_path)
    message = str(err.value)
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_5") in message
    assert "test_batch" in message and "batches.meta" in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message
    assert "--download" in message


def test_digits_split_sizes_and_dtypes(tmp_path):
    train, test, info = data.load("digits", tmp_path)
    assert info == data.DatasetInfo("digits", num_classes=10, in_channels=1, image_size=8)
    assert (len(train), len(test)) == (1437, 360)
    x, y = train.tensors
    assert x.shape == (1437, 1, 8, 8) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    assert set(test.tensors[1].tolist()) == set(range(10))


def test_digits_standardized_on_train_split(tmp_path):
    train, _, _ = data.load("digits", tmp_path)
    x = train.tensors[0].double()
    assert abs(x.mean().item()) < 1e-5
    assert abs(x.std(unbiased=False).item() - 1) < 1e-5


def test_digits_split_is_deterministic_and_disjoint(tmp_path):
    train_a, test_a, _ = data.load("digits", tmp_path, seed=3)
    train_b, test_b, _ = data.load("digits", tmp_path, seed=3)
    _, test_c, _ = data.load("digits", tmp_path, seed=4)
    assert torch.equal(test_a.tensors[0], test_b.tensors[0])
    assert torch.equal(train_a.tensors[1], train_b.tensors[1])
    assert not torch.equal(test_a.tensors[0], test_c.tensors[0])
    # load_digits has no duplicate images, so a shared row would mean a sample in both splits.
    train_rows = {row.numpy().tobytes() for row in train_a.tensors[0].flatten(1)}
    assert not any(row.numpy().tobytes() in train_rows for row in test_a.tensors[0].flatten(1))


def test_the_digits_split_is_kept_and_read_back_without_importing_scikit_learn(tmp_path, monkeypatch):
    """Every rank of every digits job split the set with scikit-learn (about a second of CPU to
    import it and SciPy); the split is kept in the user's cache, named by seed and version."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    load = "from hvdhetero.recipes import data; import sys; t = data.load('digits', 'unused', seed=5); " \
           "print(len(t[0]), 'sklearn' in sys.modules)"
    first = run_cmd([VENV_BIN / "python", "-c", load], env={"XDG_CACHE_HOME": str(tmp_path)})
    kept = data.digits_cache(5)
    assert kept.parent == tmp_path / "hvdhetero" and kept.is_file() and first.stdout.split() == ["1437", "True"]
    again = run_cmd([VENV_BIN / "python", "-c", load], env={"XDG_CACHE_HOME": str(tmp_path)})
    assert again.stdout.split() == ["1437", "False"], "read back, scikit-learn not imported"
    fresh = data._digits_split(5)
    train, test, _ = data.load("digits", "unused", seed=5)
    assert torch.equal(train.tensors[0], fresh["x_train"]) and torch.equal(test.tensors[1], fresh["y_test"])
    kept.write_bytes(b"torn")  # half-written by something else, or another format: made again
    train, _, _ = data.load("digits", "unused", seed=5)
    assert torch.equal(train.tensors[0], fresh["x_train"]) and torch.load(kept, weights_only=True).keys() == fresh.keys()
    assert not list(kept.parent.glob("*.part")), "no temporary file left behind"


def test_a_mirror_that_accepts_and_never_answers_ends_the_download(tmp_path, monkeypatch):
    """torchvision's urlopen waits for ever on a server that accepts and says nothing, and no
    collective is pending while a rank downloads: the download is bounded (DOWNLOAD_TIMEOUT_S
    on each connect and read; 0.5 s here) and ends in the same DataError as a failed one."""
    import socket
    import threading
    import time

    silent = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.extend(silent.accept() for _ in range(4)), daemon=True).start()
    monkeypatch.setattr(datasets.MNIST, "mirrors", [f"http://127.0.0.1:{silent.getsockname()[1]}/"])
    monkeypatch.setattr(data, "DOWNLOAD_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(DataError):
        data.load("mnist", tmp_path, download=True)
    assert time.monotonic() - started < 30 and socket.getdefaulttimeout() is None
    silent.close()
