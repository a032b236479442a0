"""Model shapes for each dataset, and a real check that the small CNN learns."""

import time

import pytest
import torch
from torch import nn

from hvdhetero.recipes import data
from hvdhetero.recipes import models
from hvdhetero.recipes.data import DatasetInfo
from hvdhetero.errors import ConfigError

DIGITS = DatasetInfo("digits", num_classes=10, in_channels=1, image_size=8)
MNIST = DatasetInfo("mnist", num_classes=10, in_channels=1, image_size=28)
CIFAR10 = DatasetInfo("cifar10", num_classes=10, in_channels=3, image_size=32)


@pytest.mark.parametrize("info", [DIGITS, MNIST, CIFAR10], ids=lambda info: info.name)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_output_shape(info, train):
    model = models.build(models.default_for(info.name), info).train(train)
    x = torch.randn(4, info.in_channels, info.image_size, info.image_size)
    with torch.no_grad():
        assert model(x).shape == (4, info.num_classes)


def test_cnn_handles_three_channels_and_other_class_counts():
    info = DatasetInfo("custom", num_classes=3, in_channels=3, image_size=32)
    assert models.build("cnn", info).eval()(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_defaults():
    assert [models.default_for(d) for d in data.DATASETS] == ["cnn", "cnn", "resnet18"]
    with pytest.raises(ConfigError, match="dataset 'svhn'; known: digits, mnist, cifar10"):
        models.default_for("svhn")


def test_unknown_model_lists_allowed():
    with pytest.raises(ConfigError, match=r"unknown model 'vgg'; allowed: cnn, resnet18"):
        models.build("vgg", DIGITS)


def test_small_cnn_has_no_batchnorm():
    model = models.build("cnn", MNIST)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_resnet18_has_cifar_stem():
    model = models.build("resnet18", CIFAR10)
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.bias) == ((3, 3), (1, 1), None)
    assert isinstance(model.maxpool, nn.Identity)
    assert model.fc.out_features == 10


@pytest.fixture
def one_thread():
    # Steps this small are slower with several intra-op threads, badly so on a busy CI machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.alone
def test_small_cnn_learns_digits(tmp_path, one_thread):
    torch.manual_seed(0)
    train, _, info = data.load("digits", tmp_path)
    x, y = train.tensors
    model = models.build("cnn", info)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    @torch.no_grad()
    def loss() -> float:
        model.eval()
        return nn.functional.cross_entropy(model(x), y).item()

    start, before = time.perf_counter(), loss()
    model.train()
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        batch = torch.randint(len(x), (64,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    after = loss()
    assert after < 0.5 * before, (before, after)
    assert time.perf_counter() - start < 2
