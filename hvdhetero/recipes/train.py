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

import argparse
import time

import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.recipes import data, models


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.recipes.train", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits", choices=data.DATASETS)
    parser.add_argument("--model", default="", help="cnn or resnet18 (default: the dataset's own)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch: the sum of every rank's")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--download", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    job = hh.init()
    train_set, test_set, info = load_data(job, args)
    model = models.build(args.model or models.default_for(args.dataset), info).to(job.device)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size,
                                           loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    started = time.perf_counter()
    for epoch in job.epochs(args.epochs):
        model.train()
        for x, y in loader:
            with job.autocast():
                loss = F.cross_entropy(model(x), y)
            job.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        test = job.evaluate(lambda b: score(model, b), test_set)
        job.log(test_loss=test["loss"] / test["count"], test_accuracy=test["correct"] / test["count"],
                test_samples=int(test["count"]))
    path = job.save(model.state_dict(), "model.pt")
    if job.is_main:
        print(f"hvdhetero: {args.dataset} on {job.size} ranks, {args.epochs} epochs in "
              f"{time.perf_counter() - started:.1f} s: test accuracy {test['correct'] / test['count']:.2%}, "
              f"loss {test['loss'] / test['count']:.4f}; model {path}", flush=True)


def score(model, batch) -> dict:
    """Summed test loss, correct predictions and samples of one batch."""
    x, y = batch
    out = model(x)
    return {"loss": F.cross_entropy(out.float(), y, reduction="sum"), "correct": (out.argmax(1) == y).sum(),
            "count": len(y)}


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
