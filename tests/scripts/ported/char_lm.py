"""char_lm_single.py ported to hvdhetero: the lines marked `# hh:` are all that changed.

    invoke train --script tests/scripts/ported/char_lm.py -- --epochs 4
"""

import argparse
import math
import random
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hvdhetero as hh  # hh:

Batch = namedtuple("Batch", ["inputs", "targets"])


def make_text(sentences, seed):
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my neighbour", "the old man", "her sister"]
    verbs = ["sees", "likes", "walks past", "waits for", "talks to"]
    objects = ["the river", "a red house", "the market", "his friend", "the garden"]
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(sentences))


class Chunks(Dataset):
    """Non-overlapping chunks of block_size + 1 token ids."""

    def __init__(self, ids, block_size):
        self.ids, self.block_size = ids, block_size

    def __len__(self):
        return (len(self.ids) - 1) // self.block_size

    def __getitem__(self, i):
        start = i * self.block_size
        return self.ids[start:start + self.block_size + 1]


def collate(chunks):
    data = torch.stack(chunks)
    return Batch(data[:, :-1], data[:, 1:])


class CharGRU(nn.Module):
    def __init__(self, vocab_size, block_size, dim=96):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(0.01 * torch.randn(block_size, dim), requires_grad=False)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.old_head = nn.Linear(dim, vocab_size)  # unused since the weights were tied

    def forward(self, inputs):
        x = self.embed(inputs) + self.positions[: inputs.shape[1]]
        out, _ = self.gru(x)
        return self.head(out)


def evaluate(model, loader, device):
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs)
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
    model.train()
    return total / tokens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    torch.manual_seed(0)
    job = hh.init()  # hh:
    device = job.device  # hh:

    text = make_text(2000, seed=0)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([stoi[c] for c in text])
    split = int(0.9 * len(ids))
    train_data, val_data = Chunks(ids[:split], args.block_size), Chunks(ids[split:], args.block_size)
    train_loader = DataLoader(train_data, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    val_loader = DataLoader(val_data, batch_size=64, collate_fn=collate)

    model = CharGRU(len(chars), args.block_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer, train_loader = job.prepare(model, optimizer, train_loader)  # hh: its dataset, batch, collate_fn
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train_data)} chunks of {args.block_size}")
    for epoch in job.epochs(args.epochs):  # hh:
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            job.backward(loss)  # hh:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        val_loss = evaluate(model, val_loader, device)
        job.log(val_ppl=math.exp(val_loss))  # hh: metrics.jsonl and the live table
        print(f"epoch {epoch}: train loss {loss.item():.4f}, val loss {val_loss:.4f}, val ppl {math.exp(val_loss):.3f}")


if __name__ == "__main__":
    main()
