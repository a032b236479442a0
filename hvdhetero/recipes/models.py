"""The models a run can train: a small CNN for digits and MNIST, ResNet-18 for CIFAR-10."""

from __future__ import annotations

from torch import nn

from hvdhetero.recipes.data import DatasetInfo
from hvdhetero.errors import ConfigError
from hvdhetero.recipes.options import DEFAULT_MODEL as _DEFAULTS, MODELS


class SmallCNN(nn.Sequential):
    """Two 3x3 convolutions and a two-layer head, for 8x8 to 28x28 greyscale digits.

    No BatchNorm: its running statistics would be per rank and drift apart, whereas with
    only parameters every rank holds exactly the same model after each averaged step.
    """

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            # 8x8 inputs arrive here as 4x4 and 28x28 as 14x14; pooling to 4x4 lets one head serve both.
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, num_classes),
        )


def resnet18_cifar(in_channels: int, num_classes: int) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem: a 3x3 stride-1 first convolution, no max-pool.

    The ImageNet stem shrinks 32x32 inputs to 8x8 before the first block, which costs accuracy.
    Its BatchNorm running statistics are per rank: only the parameters are averaged.
    """
    import torchvision  # here, not at the top: 0.2-0.5 s of CPU a rank the small CNN does without

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def default_for(dataset: str) -> str:
    """The model to use for `dataset` when the config names none."""
    try:
        return _DEFAULTS[dataset]
    except KeyError:
        known = ", ".join(_DEFAULTS)
        raise ConfigError(f"no default model for dataset {dataset!r}; known: {known}") from None


def build(name: str, info: DatasetInfo) -> nn.Module:
    """A freshly initialised model `name` sized for the dataset described by `info`."""
    if name == "cnn":
        return SmallCNN(info.in_channels, info.num_classes)
    if name == "resnet18":
        return resnet18_cifar(info.in_channels, info.num_classes)
    raise ConfigError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
