"""The built-in training script: digits, MNIST or CIFAR-10, written on the public API exactly as
a user's script is (compare examples/). `invoke train` runs it on every rank:

    invoke train                                   # 2 CPU ranks on this machine, digits
    invoke train --hosts mac,pc --dataset cifar10  # one rank per slot on each host
    invoke train --slowdown 3                      # the last rank acts 3x slower (experiments)
    invoke train --dry-run                         # print the horovodrun command instead

Its own options (below) come after the launcher's; the job's (seed, precision, compression,
micro-batches, straggler) reach it through `hh.init()`.
"""

from __future__ import annotations

import gc
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import ConcatDataset, TensorDataset

import hvdhetero as hh
from hvdhetero.errors import ConfigError
from hvdhetero.recipes import data, models
from hvdhetero.recipes.options import PROG, RecipeOptions


def parse_args(argv: list[str] | None = None) -> RecipeOptions:
    """The recipe's options (recipes/options.py: the launcher checked the same ones already)."""
    try:
        return RecipeOptions.parse(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    job = hh.init()
    # What exists now (torch, torchvision, Horovod) lives as long as the rank: out of the garbage
    # collector's sight, it is not searched for cycles again, above all when the rank exits, where
    # that search cost ~1 s a rank (torch, torchvision and a step: exit 1.0-1.4 s, frozen 0.2-0.3 s).
    # A script of one's own may do the same; hvdhetero never freezes a user's objects for them.
    gc.freeze()
    train_set, test_set, info = load_data(job, args)
    model = models.build(args.model or models.default_for(args.dataset), info).to(job.device)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.repeat > 1:
        train_set = repeated(train_set, args.repeat)
    clock = Clock()  # a resumed run's seconds count on from its checkpoint's
    job.track("clock", clock)
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size,
                                           loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    clock.start()
    test = None
    for epoch in job.epochs(args.epochs):
        model.train()
        clock.training(True)
        for x, y in loader:
            with job.autocast():
                loss = F.cross_entropy(model(x), y)
            job.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        clock.training(False)
        # --eval-global: under local/diloco the global model, no exchange first; the last epoch's is exact
        exact = not args.eval_global or job.sync == "step" or epoch + 1 == args.epochs
        test = job.evaluate(lambda b: score(model, b), test_set, exchange=exact)
        accuracy = test["correct"] / test["count"]
        reached = bool(args.target_accuracy) and accuracy >= args.target_accuracy  # the same sums on every rank
        # elapsed: evaluations included, and with them (--sync local/diloco, not --eval-global)
        # the exchange that makes the ranks' models one before each evaluation
        elapsed, trained = round(clock.elapsed(), 3), round(clock.trained(), 3)
        seen = (epoch + 1) * len(train_set)
        final = None
        if reached and not exact:  # the global model got there: the one saved (exchanged now) is scored too
            final = job.evaluate(lambda b: score(model, b), test_set)
        job.log(test_loss=test["loss"] / test["count"], test_accuracy=accuracy, test_samples=int(test["count"]),
                train_seconds=trained, elapsed_seconds=elapsed, samples_seen=seen,
                **({"reached_target": args.target_accuracy, "seconds_to_target": trained,
                    "elapsed_to_target": elapsed, "samples_to_target": seen} if reached else {}),
                **({} if exact else {"evaluated": "global"}),
                **({"final_test_accuracy": final["correct"] / final["count"]} if final is not None else {}))
        test = final or test  # what the last line below reports: the model saved
        if reached:
            job.stop()
    path = job.save(model.state_dict(), "model.pt")
    if job.is_main and test is not None:
        ranks, epochs = job.size, job.epoch + 1
        print(f"hvdhetero: {args.dataset} on {ranks} rank{'s' * (ranks != 1)}, {epochs} epoch{'s' * (epochs != 1)} in "
              f"{clock.elapsed():.1f} s: test accuracy {test['correct'] / test['count']:.2%}, "
              f"loss {test['loss'] / test['count']:.4f}; model {path}", flush=True)


def repeated(dataset, times: int):
    """`dataset` `times` over; tensors repeated when it holds tensors (indexing stays one gather)."""
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t.repeat(times, *[1] * (t.dim() - 1)) for t in dataset.tensors))
    return ConcatDataset([dataset] * times)


def score(model, batch) -> dict:
    """Summed test loss, correct predictions and samples of one batch."""
    x, y = batch
    out = model(x)
    return {"loss": F.cross_entropy(out.float(), y, reduction="sum"), "correct": (out.argmax(1) == y).sum(),
            "count": len(y)}


class Clock:
    """The recipe's seconds since it began training (evaluation included) and in its training
    loops (evaluation excluded), a resumed run's earlier stretches counted in: job.track puts
    them in every checkpoint (a checkpoint taken mid-epoch holds that epoch's loop so far)."""

    def __init__(self):
        self.began = self.loop_began = None
        self.elapsed_before = self.trained_before = self.looped = 0.0

    def start(self) -> None:
        self.began = time.perf_counter()

    def training(self, on: bool) -> None:
        now = time.perf_counter()
        if on:
            self.loop_began = now
        elif self.loop_began is not None:
            self.looped, self.loop_began = self.looped + now - self.loop_began, None

    def elapsed(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        return self.elapsed_before + (now - self.began if self.began is not None else 0.0)

    def trained(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        return self.trained_before + self.looped + (now - self.loop_began if self.loop_began is not None else 0.0)

    def state_dict(self) -> dict:
        now = time.perf_counter()
        return {"elapsed": self.elapsed(now), "trained": self.trained(now)}

    def load_state_dict(self, state: dict) -> None:
        self.elapsed_before, self.trained_before = float(state["elapsed"]), float(state["trained"])


def load_data(job, args):
    """Rank 0 of each host may download; the others wait for it, then read the same files."""
    if job.local_rank == 0:
        loaded = data.load(args.dataset, args.data_dir, download=args.download, seed=job.config.seed)
    job.barrier()  # nobody reads files rank 0 may still be writing
    if job.local_rank != 0:
        loaded = data.load(args.dataset, args.data_dir, download=False, seed=job.config.seed)
    return loaded


if __name__ == "__main__":
    main()
