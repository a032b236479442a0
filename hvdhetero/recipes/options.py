"""The built-in recipe's own options, defined once: the recipe parses its command line into
them on every rank, and the launcher (`invoke train`, `plan`, `bench --to-accuracy`) builds
and checks the same ones before it starts anything, so a bad value ends there, exit 2:

    options = RecipeOptions(dataset="mnist", epochs=5)   # ConfigError on a bad value
    options.argv()                                       # ["--dataset", "mnist", "--epochs", "5", ...]
    RecipeOptions.parse(["--epochs", "0"])               # ConfigError: --epochs must be ... >= 1

Torch-free (data.py and models.py, which import torch, take their names from here).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from typing import Sequence

from hvdhetero import checks
from hvdhetero.errors import ConfigError

DATASETS = ("digits", "mnist", "cifar10")
MODELS = ("cnn", "resnet18")
DEFAULT_MODEL = {"digits": "cnn", "mnist": "cnn", "cifar10": "resnet18"}
TRAIN_SAMPLES = {"digits": 1437, "mnist": 60_000, "cifar10": 50_000}
"""Samples in each training set (digits: scikit-learn's 1,797 less the 20% test split): a
global batch cannot be larger (job.prepare refuses it on the ranks; here it is caught first)."""
PROG = "python -m hvdhetero.recipes.train"


@dataclass(frozen=True)
class RecipeOptions:
    """What the built-in recipe trains, and how; the job's own settings (seed, precision, sync,
    ...) are JobConfig's and reach it through hh.init()."""

    dataset: str = "digits"
    """digits (in scikit-learn, offline), mnist or cifar10 (read from data_dir)."""
    model: str = ""
    """cnn or resnet18; empty: the dataset's own (cnn for digits and mnist, resnet18 for cifar10)."""
    epochs: int = 10
    """Passes over the training set."""
    batch_size: int = 64
    """The global batch: the sum of every rank's batch."""
    lr: float = 1e-3
    """The optimizer's learning rate."""
    optimizer: str = "adam"
    """adam, or sgd (momentum 0.9)."""
    data_dir: str = "data"
    """Where the mnist/cifar10 files are (downloaded there with download)."""
    download: bool = False
    """Let each host's first rank download the dataset."""
    repeat: int = 1
    """Passes over the training set in one epoch (one evaluation an epoch): a small set such as
    digits, 3 steps an epoch at batch 512, repeated so that --sync diloco:H rounds fit in an epoch."""
    target_accuracy: float = 0.0
    """Stop after the first epoch whose test accuracy reaches this (0: off); the training
    seconds to it, evaluation excluded, are logged."""
    eval_global: bool = False
    """With --sync local/diloco, evaluate each epoch the global model as of the last exchange
    (job.evaluate(..., exchange=False): nothing exchanged first, 1-2 rounds old when overlapped);
    the last epoch's evaluation exchanges first and scores the model saved, and so does one more
    when the global model reaches --target-accuracy (logged as final_test_accuracy)."""

    def __post_init__(self):
        checks.types(self)
        checks.one_of("dataset", self.dataset, DATASETS)
        if self.model:
            checks.one_of("model", self.model, MODELS, "or none: the dataset's own")
        checks.at_least("epochs", self.epochs, 1, "passes over the training set")
        checks.at_least("repeat", self.repeat, 1, "passes over the training set per epoch")
        checks.above("lr", self.lr, 0, "the learning rate")
        checks.one_of("optimizer", self.optimizer, ("adam", "sgd"))
        checks.within("target_accuracy", self.target_accuracy, 0, 1, "0: off")
        if not self.data_dir:
            raise ConfigError("--data-dir must name a folder, got ''")
        samples = TRAIN_SAMPLES[self.dataset] * self.repeat
        if not 1 <= self.batch_size <= samples:
            raise ConfigError(f"--batch-size must be an integer from 1 to {samples} (the {self.dataset} training "
                              f"set{f' x {self.repeat} repeats' if self.repeat > 1 else ''}: the global batch "
                              f"cannot be larger), got {self.batch_size!r}")

    def fits(self, hosts) -> None:
        """The global batch can be dealt to the ranks of `hosts` (checks.batch_fits)."""
        checks.batch_fits(self.batch_size, hosts)

    def argv(self) -> list[str]:
        """These options as the recipe's command line (what `parse` reads back)."""
        out = []
        for name, value in asdict(self).items():
            if name not in _ALWAYS and value == getattr(RecipeOptions, name):
                continue
            out += [checks.flag(name)] if isinstance(value, bool) else [checks.flag(name), str(value)]
        return out

    @classmethod
    def parse(cls, argv: Sequence[str]) -> "RecipeOptions":
        """The options on a recipe command line; ConfigError names a bad or unknown one."""
        return cls(**vars(_parser().parse_args(list(argv))))


_ALWAYS = ("dataset", "epochs", "batch_size", "lr", "optimizer", "data_dir")
"""Written out by argv() even at their defaults: the command a user sees says what trains."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # the launcher shows it as bad input (exit 2), the recipe as usage
        raise ConfigError(f"the built-in recipe ({PROG}): {message}")


def _parser() -> argparse.ArgumentParser:
    """argparse for RecipeOptions, one option per field (its docstring is the help)."""
    parser = _Parser(prog=PROG, description="the built-in recipe's options (hvdhetero/recipes/options.py)")
    docs = checks.field_docs(RecipeOptions)
    for f in fields(RecipeOptions):
        if f.type == "bool":
            parser.add_argument(checks.flag(f.name), action="store_true", help=docs[f.name])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            parser.add_argument(checks.flag(f.name), type=kind, default=f.default, help=docs[f.name])
    return parser


def check_argv(argv: Sequence[str], hosts) -> None:
    """The recipe's options as the launcher has them (those after `--` too), parsed and checked
    for `hosts`: ConfigError (exit 2) before anything starts, rather than on every rank."""
    RecipeOptions.parse(argv).fits(hosts)


def recipe_argv(given: dict, script: str = "", **fixed) -> list[str]:
    """The recipe's command line from the options a task was `given` (by field name) and the
    ones the task itself sets (`fixed`), checked. With a `script` the recipe does not run, so
    a recipe option given there is a mistake: it is named rather than silently dropped."""
    if script:
        ignored = [checks.flag(k) for k, v in given.items() if v != getattr(RecipeOptions, k)]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} {'is an option' if len(ignored) == 1 else 'are options'} of "
                              f"the built-in recipe, which --script {script} replaces: give your script its own "
                              f"options after --, e.g. --script {script} -- --epochs 5")
    return RecipeOptions(**given, **fixed).argv()
