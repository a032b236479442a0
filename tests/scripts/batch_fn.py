"""A batch function in place of a dataset, as nanoGPT draws its batches: `get_batch(split)`
draws random windows with torch's generator (and a NumPy and a Python draw, so that all three
generators count), the next batch is fetched between the forward and the backward, rank 0
alone evaluates on `get_batch('val')` every few steps, and the loop counts job.step (a resumed
run goes on from its checkpoint's step). At the end each rank prints its parameters' digest.
With --hold-at, rank 0 waits at that step (writing GO.held) until killed, unless the file --go
exists: tests/test_batch_function.py kills a run there and resumes it.

    invoke train --script tests/scripts/batch_fn.py --checkpoint-every 10 -- --max-iters 60
"""

import argparse
import hashlib
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--max-iters", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=48)
parser.add_argument("--eval-interval", type=int, default=7)
parser.add_argument("--eval-batches", type=int, default=3)
parser.add_argument("--epochs", type=int, default=0, help="job.epochs(N), each of --steps-per-epoch steps")
parser.add_argument("--steps-per-epoch", type=int, default=100)
parser.add_argument("--hold-at", type=int, default=-1, help="rank 0 waits there (to be killed) unless --go exists")
parser.add_argument("--go", default="", help="the file whose absence holds rank 0 at --hold-at")
parser.add_argument("--accumulate", type=int, default=1, help="batches a step, as nanoGPT's gradient_accumulation_steps")
parser.add_argument("--in-order", action="store_true",
                    help="read the tokens in order, as build-nanogpt's DataLoaderLite (a position not job.track'ed)")
args = parser.parse_args()

job = hh.init()
torch.manual_seed(1337), np.random.seed(1337), random.seed(1337)  # every generator get_batch draws from
block, vocab = 16, 32
tokens = (torch.arange(20_000) * 7 + torch.arange(20_000) // 5) % vocab


def get_batch(split):
    data = tokens[:16_000] if split == "train" else tokens[16_000:]
    ix = torch.randint(len(data) - block - 1, (args.batch_size,))
    ix = (ix + int(np.random.randint(0, 3)) + random.randrange(3)) % (len(data) - block - 1)
    x = torch.stack([data[i:i + block] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block] for i in ix])
    return x.to(job.device), y.to(job.device)


class InOrder:
    """build-nanogpt's DataLoaderLite, small: windows read in order, the position its own."""

    def __init__(self):
        self.position = 0

    def next_batch(self):
        ix = [(self.position + i * block) % (16_000 - block - 1) for i in range(args.batch_size)]
        self.position = (self.position + args.batch_size * block) % (16_000 - block - 1)
        x = torch.stack([tokens[i:i + block] for i in ix])
        return x.to(job.device), torch.stack([tokens[i + 1:i + 1 + block] for i in ix]).to(job.device)


reader = InOrder()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(torch.tanh(self.mix(self.emb(idx))))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        return logits, loss


model = Net().to(job.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.99 ** step)  # stepped every step
model, optimizer, get_train_batch = job.prepare(model, optimizer, reader.next_batch if args.in_order else lambda: get_batch("train"),
                                               scheduler=scheduler)


def train_step(X, Y):
    """One step on (X, Y); returns the next batch, fetched before this one's backward (nanoGPT's way)."""
    if job.step == args.hold_at and job.is_main and not os.path.exists(args.go):
        open(args.go + ".held", "w").close()
        time.sleep(300)
    if job.step % args.eval_interval == 0 and job.is_main:
        model.eval()
        with torch.no_grad():
            val = sum(model(*get_batch("val"))[1].item() for _ in range(args.eval_batches)) / args.eval_batches
        model.train()
        print(f"step {job.step}: val loss {val:.4f}", flush=True)
    for micro_step in range(args.accumulate):  # nanoGPT's micro-steps (1 unless --accumulate)
        logits, loss = model(X, Y)
        X, Y = get_train_batch()
        job.backward(loss / args.accumulate)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return X, Y


X, Y = get_train_batch()
if args.epochs:  # job.epochs over a batch function: each epoch as many steps as the script says
    for epoch in job.epochs(args.epochs):
        for _ in range(args.steps_per_epoch):
            X, Y = train_step(X, Y)
else:
    while job.step < args.max_iters:
        X, Y = train_step(X, Y)
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"rank {job.rank} rows {len(X)} digest {digest[:16]}", flush=True)
print(f"rank {job.rank} counted {job.reduce(1)} ranks", flush=True)  # after the loop: every rank's 1
