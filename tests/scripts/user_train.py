"""A user's own training script, as a user writes one (not one of our examples): its own
dataset class yielding dicts and a collate_fn, its own model and loss, SGD with two param groups, a StepLR
schedule, gradient clipping, its own CSV history of the epochs that it never closes. Run by
tests/test_script.py through `invoke train --script`.

    invoke train --script tests/scripts/user_train.py -- --epochs 8 [--history PATH]
"""

import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import hvdhetero as hh


class Digits(torch.utils.data.Dataset):
    """scikit-learn's 8x8 digits as dicts; the first 1,500 train, the rest test."""

    def __init__(self, train: bool):
        x, y = load_digits(return_X_y=True)
        part = slice(0, 1500) if train else slice(1500, None)
        self.x = torch.tensor(x[part] / 16.0, dtype=torch.float32)
        self.y = torch.tensor(y[part])

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixels": self.x[i], "label": self.y[i]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)
        self.only_rank_0 = nn.Parameter(torch.zeros(3))  # gets a gradient on rank 0, none elsewhere

    def forward(self, pixels, rank=0):
        out = self.head(self.body(pixels))
        return out + 0.0 * self.only_rank_0.sum() if rank == 0 else out


def collate(items):
    """The user's own collate_fn: a list of dicts into one dict of stacked tensors."""
    return {"pixels": torch.stack([i["pixels"] for i in items]), "label": torch.stack([i["label"] for i in items])}


def smoothed_cross_entropy(logits, target, smoothing=0.05):
    """The user's own loss: cross-entropy against label-smoothed targets (mean over the batch)."""
    logp = F.log_softmax(logits, dim=1)
    return -((1 - smoothing) * logp.gather(1, target[:, None]).squeeze(1) + smoothing * logp.mean(1)).mean()


class History:
    """The user's CSV of the epochs, as such loggers are written: open for the whole run, never
    closed, an object in a reference cycle (it keeps its own bound method). Python flushes the
    file when it collects the object, at the script's end."""

    def __init__(self, path: str):
        self.file = open(path, "w")  # noqa: SIM115 - left open on purpose, see above
        self.row = self.write

    def write(self, *values):
        self.file.write(",".join(str(v) for v in values) + "\n")


HISTORY = None


def main():
    global HISTORY
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--history", default="", help="write each epoch to PATH.RANK")
    parser.add_argument("--nesterov", action="store_true", help="a flag (argparse's store_true): Nesterov momentum")
    args = parser.parse_args()
    if args.history:
        HISTORY = History(f"{args.history}.{os.environ.get('HOROVOD_RANK', 0)}")

    job = hh.init()
    model = Net().to(job.device)
    optimizer = torch.optim.SGD([{"params": model.body.parameters()},
                                 {"params": [*model.head.parameters(), model.only_rank_0], "lr": args.lr / 2}],
                                lr=args.lr, momentum=0.9, nesterov=args.nesterov)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)  # stepped per epoch
    model, optimizer, loader = job.prepare(model, optimizer, Digits(train=True), global_batch=100, collate_fn=collate)
    for epoch in job.epochs(args.epochs):
        model.train()
        for batch in loader:
            loss = smoothed_cross_entropy(model(batch["pixels"], job.rank), batch["label"])
            job.backward(loss)
            job.clip_grad_norm_(2.0)
            optimizer.step()
            optimizer.zero_grad()
        scheduler.step()

        def score(batch):
            logits = model(batch["pixels"])
            return {"correct": (logits.argmax(1) == batch["label"]).sum(), "count": len(batch["label"])}

        test = job.evaluate(score, Digits(train=False), collate_fn=collate)
        job.log(epoch=epoch, test_accuracy=test["correct"] / test["count"], lr=scheduler.get_last_lr()[0])
        if HISTORY:
            HISTORY.row(epoch, float(test["correct"] / test["count"]))
    job.save(model.state_dict(), "model.pt")
    if job.is_main:
        print(f"user script: test accuracy {test['correct'] / test['count']:.4f}", flush=True)


if __name__ == "__main__":
    main()
