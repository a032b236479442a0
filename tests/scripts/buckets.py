"""A seq2seq-style loader as people write one: sequences of 2 to 30 tokens, a bucket sampler of
the script's own (bucketing.py's: indices shuffled with Python's random, sorted by length within
chunks of 4 batches, cut into batches of 16, the batches shuffled) and a collate_fn that pads each batch to its
longest. The DataLoader goes to job.prepare as it is. Each rank writes the samples it trained on
at each step to RUN_DIR/seen-RANK.json; rank 0 prints the mean padding a batch.

With --look the loop is the script's own (`for epoch in range(n)`, not job.epochs), and rank 0
takes `next(iter(loader))` after each step (a sample to log).

    invoke train --script tests/scripts/buckets.py -- [--epochs 2] [--by-rank] [--look]
"""

import argparse
import json
import random

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import hvdhetero as hh
from bucketing import Buckets  # the script's own sampler, beside it

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--by-rank", action="store_true", help="the sampler shuffles with a generator seeded by the rank")
parser.add_argument("--look", action="store_true", help="a loop of the script's own; rank 0 looks at a batch each step")
args = parser.parse_args()
job = hh.init()
rng = random.Random(1)
LENGTHS = [rng.randint(2, 30) for _ in range(320)]
SEQUENCES = [torch.randint(1, 20, (n,), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(LENGTHS)]


def pad_collate(items):
    index = torch.tensor([i for i, _ in items])
    return index, pad_sequence([s for _, s in items], batch_first=True), torch.tensor([len(s) for _, s in items])


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(20, 16, padding_idx=0), nn.GRU(16, 32, batch_first=True)
        self.out = nn.Linear(32, 2)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        return self.out(self.rnn(packed)[1][-1])


dataset = [(i, s) for i, s in enumerate(SEQUENCES)]


class ByRank(Buckets):  # a sampler that keeps a generator of its own, seeded by the rank (a DDP habit)
    def __iter__(self):
        batches = list(range(len(self.lengths)))
        random.Random(job.rank).shuffle(batches)
        return iter([batches[i:i + self.batch_size] for i in range(0, len(batches), self.batch_size)])


sampler = (ByRank if args.by_rank else Buckets)(LENGTHS, batch_size=16)
loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=pad_collate)
model = Model()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model, optimizer, loader = job.prepare(model, optimizer, loader, loss_fn=lambda m, b: m(b[1], b[2]).sum())
seen, padding = [], []
for epoch in (range(args.epochs) if args.look else job.epochs(args.epochs)):
    for index, tokens, lengths in loader:
        labels = (tokens[:, 0] > 10).long()  # a sequence's first token says its class
        job.backward(F.cross_entropy(model(tokens, lengths), labels))
        optimizer.step()
        optimizer.zero_grad()
        seen.append([epoch, job.step, index.tolist()])
        padding.append(1 - lengths.sum().item() / tokens.numel())
        if args.look and job.is_main:
            sample = next(iter(loader))
(job.run_dir / f"seen-{job.rank}.json").write_text(json.dumps(seen))
if job.is_main:
    print(f"mean padding {sum(padding) / len(padding):.3f}", flush=True)
