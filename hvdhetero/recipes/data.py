"""The datasets a run can train on, as (train, test, info).

`digits` ships inside scikit-learn, so it needs no files and no network: it is the one the
tests and smoke runs use. Its split tensors are kept in ~/.cache/hvdhetero (XDG_CACHE_HOME),
named by the seed and the scikit-learn version that made them, so that a rank loads them in
milliseconds instead of importing scikit-learn and SciPy (about a second of CPU, on every rank
of every job). `mnist` and `cifar10` are read by torchvision from `data_dir`; on a host that
cannot reach the internet, copy the files there first (the error says which).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from hvdhetero.errors import ConfigError, DataError
from hvdhetero.recipes.options import DATASETS

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about its inputs and outputs."""

    name: str
    """One of DATASETS."""
    num_classes: int
    """Number of labels; labels are 0..num_classes-1."""
    in_channels: int
    """Channels of one image: 1 for greyscale, 3 for RGB."""
    image_size: int
    """Side length in pixels of the (square) images."""


INFO = {"digits": DatasetInfo("digits", num_classes=10, in_channels=1, image_size=8),
        "mnist": DatasetInfo("mnist", num_classes=10, in_channels=1, image_size=28),
        "cifar10": DatasetInfo("cifar10", num_classes=10, in_channels=3, image_size=32)}
"""Each dataset's shape, whether read from its files or made up (`synthetic`)."""


def synthetic(name: str, samples: int, seed: int = 0) -> tuple[TensorDataset, DatasetInfo]:
    """`samples` random images of `name`'s shape (normalised: mean 0, sd 1) and uniform labels,
    the same for every `seed` on every machine: what a benchmark times a step on without the
    files (a step's time does not depend on the pixels)."""
    if name not in INFO:
        raise ConfigError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")
    info = INFO[name]
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(samples, info.in_channels, info.image_size, info.image_size, generator=gen)
    return TensorDataset(images, torch.randint(info.num_classes, (samples,), generator=gen)), info


def load(
    name: str, data_dir: str | Path, *, download: bool = False, seed: int = 0
) -> tuple[Dataset, Dataset, DatasetInfo]:
    """The train and test sets of `name`, and its DatasetInfo; `seed` fixes the digits split."""
    if name == "digits":
        return _digits(seed)
    if name == "mnist":
        return _mnist(Path(data_dir), download)
    if name == "cifar10":
        return _cifar10(Path(data_dir), download)
    raise ConfigError(f"unknown dataset {name!r}; allowed: {', '.join(DATASETS)}")


DIGITS_FORMAT = "v1"
DIGITS_SHAPES = {"x_train": (1437, 1, 8, 8), "y_train": (1437,), "x_test": (360, 1, 8, 8), "y_test": (360,)}
"""What a kept split holds (anything else is made again)."""


def _digits(seed: int) -> tuple[Dataset, Dataset, DatasetInfo]:
    path = digits_cache(seed)
    try:
        split = torch.load(path, weights_only=True)
        shapes = {k: tuple(t.shape) if isinstance(t := split.get(k), torch.Tensor) else None for k in DIGITS_SHAPES}
        if shapes != DIGITS_SHAPES:
            raise ValueError(f"not a digits split: {shapes}")
    except Exception:  # none yet, or unreadable: made again, and kept if the folder is writable
        split = _digits_split(seed)
        if path is not None:
            _keep(split, path)
    return (TensorDataset(split["x_train"], split["y_train"]), TensorDataset(split["x_test"], split["y_test"]),
            INFO["digits"])


def digits_cache(seed: int) -> Path | None:
    """Where the split for `seed` is kept: named by the scikit-learn version that makes it and by
    DIGITS_FORMAT (a change to `_digits_split` must change it); None where there is no home."""
    try:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvdhetero"
    except RuntimeError:  # no HOME and no passwd entry (some containers)
        return None
    return root / f"digits-{DIGITS_FORMAT}-sklearn{metadata.version('scikit-learn')}-seed{seed}.pt"


def _digits_split(seed: int) -> dict[str, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x / 16.0, y, test_size=0.2, random_state=seed, stratify=y
    )
    # Statistics from the training split only, so nothing about the test set leaks into training.
    mean, std = x_train.mean(), x_train.std()
    images = lambda x: torch.as_tensor((x - mean) / std, dtype=torch.float32).reshape(-1, 1, 8, 8)  # noqa: E731
    return {"x_train": images(x_train), "y_train": torch.as_tensor(y_train, dtype=torch.int64),
            "x_test": images(x_test), "y_test": torch.as_tensor(y_test, dtype=torch.int64)}


def _keep(split: dict[str, torch.Tensor], path: Path) -> None:
    """Write `split` to `path` whole or not at all (ranks of one machine may race: each renames
    its own complete file into place); a folder that cannot be written only costs the speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(split, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


DOWNLOAD_TIMEOUT_S = 60.0
"""The longest a download waits on one read or connect: torchvision's urlopen has no timeout of
its own, and a mirror that accepts and never answers held every rank (no collective is pending
then, so neither Gloo's timeout nor the heartbeats end it)."""


@contextlib.contextmanager
def _bounded_network():
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        yield
    finally:
        socket.setdefaulttimeout(before)


def _mnist(root: Path, download: bool) -> tuple[Dataset, Dataset, DatasetInfo]:
    from torchvision import datasets, transforms  # here, not at the top: the digits default does without

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MNIST_MEAN, MNIST_STD)])
    try:
        with _bounded_network():
            train = datasets.MNIST(root, train=True, download=download, transform=transform)
            test = datasets.MNIST(root, train=False, download=download, transform=transform)
    except (RuntimeError, OSError) as e:
        raise DataError(_mnist_help(root, download, e)) from e
    return train, test, INFO["mnist"]


def _cifar10(root: Path, download: bool) -> tuple[Dataset, Dataset, DatasetInfo]:
    from torchvision import datasets, transforms

    normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    try:
        with _bounded_network():
            train = datasets.CIFAR10(
                root, train=True, download=download, transform=transforms.Compose(augment + normalize)
            )
            test = datasets.CIFAR10(
                root, train=False, download=download, transform=transforms.Compose(normalize)
            )
    except (RuntimeError, OSError) as e:  # URLError is an OSError
        raise DataError(_cifar10_help(root, download, e)) from e
    return train, test, INFO["cifar10"]


# The help texts take file names and URLs from the torchvision classes themselves, so they stay
# right if a torchvision release moves them.


def _mnist_help(root: Path, download: bool, cause: Exception) -> str:
    from torchvision import datasets

    raw = root / "MNIST" / "raw"
    gz_names = [filename for filename, _md5 in datasets.MNIST.resources]
    names = [name.removesuffix(".gz") for name in gz_names]
    return "\n".join([
        _failed("MNIST", download, cause),
        f"torchvision expects these un-gzipped files in {raw}/:",
        *(f"  {raw / name}" for name in names),
        f"Download {', '.join(gz_names)} from {' or '.join(datasets.MNIST.mirrors)}, "
        f"gunzip them into {raw}/, "
        "or run on a machine that is online with --download.",
    ])


def _cifar10_help(root: Path, download: bool, cause: Exception) -> str:
    from torchvision import datasets

    folder = root / datasets.CIFAR10.base_folder
    names = [f for f, _md5 in datasets.CIFAR10.train_list + datasets.CIFAR10.test_list]
    names.append(datasets.CIFAR10.meta["filename"])
    return "\n".join([
        _failed("CIFAR-10", download, cause),
        f"torchvision expects these files in {folder}/ (their MD5s are checked):",
        *(f"  {folder / name}" for name in names),
        f"Download {datasets.CIFAR10.url} and extract it in {root}/ "
        f"(tar xzf {datasets.CIFAR10.filename} -C {root}), "
        "or run on a machine that is online with --download.",
    ])


def _failed(dataset: str, download: bool, cause: Exception) -> str:
    what = "could not be downloaded" if download else "was not found or is corrupted"
    return f"dataset {dataset} {what} ({type(cause).__name__}: {str(cause).strip()})."
