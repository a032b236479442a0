"""nanoGPT's train.py habits, ported: a loop over iterations (no epochs), the batches drawn by
renewing the loader's iterator when it runs out, a learning rate set by hand each iteration,
the loss printed and logged every few iterations, a checkpoint dict saved by rank 0.

    invoke train --script tests/scripts/step_loop.py -- --max-iters 30
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hvdhetero as hh  # hh:

parser = argparse.ArgumentParser()
parser.add_argument("--max-iters", type=int, default=30)
parser.add_argument("--log-interval", type=int, default=5)
args = parser.parse_args()
block, vocab = 16, 32
torch.manual_seed(1337)
data = torch.arange(4000) % vocab  # a cycle the model can learn: the next token is this one + 1


class Blocks(Dataset):
    def __len__(self):
        return len(data) - block - 1

    def __getitem__(self, i):
        return data[i:i + block], data[i + 1:i + 1 + block]


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(vocab, 32)
        self.head = nn.Linear(32, vocab)

    def forward(self, idx, targets=None):
        logits = self.head(torch.tanh(self.emb(idx)))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, vocab), targets.view(-1))
        return logits, loss


def get_lr(it, warmup=5, max_lr=3e-2, min_lr=3e-3):
    if it < warmup:
        return max_lr * (it + 1) / (warmup + 1)
    ratio = min(1.0, (it - warmup) / (args.max_iters - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


job = hh.init()  # hh:
model = Bigram().to(job.device)  # hh: job.device
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)
loader = DataLoader(Blocks(), batch_size=64, shuffle=True)
model, optimizer, loader = job.prepare(model, optimizer, loader)  # hh:
batches, iter_num = iter(loader), 0
while iter_num < args.max_iters:
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    try:
        x, y = next(batches)
    except StopIteration:
        batches = iter(loader)
        x, y = next(batches)
    _, loss = model(x.to(job.device), y.to(job.device))
    job.backward(loss)  # hh:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num % args.log_interval == 0:
        job.log(loss=loss.item(), lr=get_lr(iter_num))  # hh: metrics.jsonl, the live table, invoke report
        if job.is_main:
            print(f"iter {iter_num}: loss {loss.item():.4f}")
if job.is_main:
    job.save({"model": model.state_dict(), "iter_num": iter_num}, "ckpt.pt")
