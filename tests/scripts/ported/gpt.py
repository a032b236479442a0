"""gpt_single.py ported (the lines marked hh:). minGPT's way of training (its Trainer and
projects/chargpt): a Trainer class that picks its own device, a DataLoader whose RandomSampler
draws with replacement and never runs out (num_samples=int(1e10)), with 4 workers and pinned
memory, an endless loop that renews the iterator anyway and breaks at max_iters, a model whose
forward(idx, targets) returns (logits, loss), AdamW over two parameter groups (decay for the
matmul weights only), gradient clipping, and callbacks at each batch's end that print every 10
iterations and evaluate, sample and save a checkpoint every 100. A small character GPT over a
made-up text (no download).

    invoke train --script tests/scripts/ported/gpt.py -- --max-iters 300
"""

import argparse
import math
import os
import random
import time
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hvdhetero as hh  # hh:

job = hh.init()  # hh:


def make_text(sentences, seed):
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "my neighbour", "the old man", "her sister"]
    verbs = ["sees", "likes", "walks past", "waits for", "talks to"]
    objects = ["the river", "a red house", "the market", "his friend", "the garden"]
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(sentences))


class CharDataset(Dataset):
    """Every window of block_size + 1 characters: (its first block_size, the same shifted by one)."""

    def __init__(self, text, block_size):
        self.stoi = {c: i for i, c in enumerate(sorted(set(text)))}
        self.itos = {i: c for c, i in self.stoi.items()}
        self.block_size, self.text = block_size, text

    def get_vocab_size(self):
        return len(self.stoi)

    def __len__(self):
        return len(self.text) - self.block_size

    def __getitem__(self, idx):
        chunk = torch.tensor([self.stoi[c] for c in self.text[idx:idx + self.block_size + 1]], dtype=torch.long)
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=2, n_head=4, n_embd=64):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def configure_optimizers(self, config):
        decay = {p for m in self.modules() if isinstance(m, nn.Linear) for n, p in m.named_parameters()
                 if n == "weight"}
        groups = [{"params": [p for p in self.parameters() if p in decay], "weight_decay": config.weight_decay},
                  {"params": [p for p in self.parameters() if p not in decay], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=config.learning_rate, betas=config.betas)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.block_size:])
            idx = torch.cat((idx, logits[:, -1, :].argmax(dim=-1, keepdim=True)), dim=1)
        return idx


class Config(dict):
    __getattr__ = dict.__getitem__


class Trainer:
    def __init__(self, config, model, train_dataset):
        self.config, self.model, self.train_dataset = config, model, train_dataset
        self.callbacks = defaultdict(list)
        if config.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        else:
            self.device = config.device
        self.model = self.model.to(self.device)
        print("running on device", self.device)
        self.iter_num, self.iter_time, self.iter_dt = 0, 0.0, 0.0

    def add_callback(self, onevent, callback):
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)
        train_loader = DataLoader(
            self.train_dataset,
            sampler=torch.utils.data.RandomSampler(self.train_dataset, replacement=True, num_samples=int(1e10)),
            shuffle=False, pin_memory=True, batch_size=config.batch_size, num_workers=config.num_workers)
        model, self.optimizer, train_loader = job.prepare(model, self.optimizer, train_loader)  # hh:
        model.train()
        self.iter_num, self.iter_time = 0, time.time()
        data_iter = iter(train_loader)
        while True:
            try:
                batch = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                batch = next(data_iter)
            x, y = [t.to(self.device) for t in batch]
            logits, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            job.backward(self.loss)  # hh:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
            self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            now = time.time()
            self.iter_dt, self.iter_time = now - self.iter_time, now
            if config.max_iters is not None and self.iter_num >= config.max_iters:
                break


def evaluate(model, dataset, device, batches=8, batch_size=64):
    """The mean loss over a fixed set of held-out windows."""
    model.eval()
    gen = torch.Generator().manual_seed(0)
    losses = []
    with torch.no_grad():
        for _ in range(batches):
            idx = torch.randint(len(dataset), (batch_size,), generator=gen).tolist()
            x, y = (torch.stack(t).to(device) for t in zip(*(dataset[i] for i in idx)))
            losses.append(model(x, y)[1].item())
    model.train()
    return sum(losses) / len(losses)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-iters", type=int, default=300)
    parser.add_argument("--out-dir", default="out/chargpt")
    args = parser.parse_args()
    torch.manual_seed(3407)
    config = Config(device=job.device, num_workers=4, batch_size=64, learning_rate=5e-3, betas=(0.9, 0.95),  # hh:
                    weight_decay=0.1, grad_norm_clip=1.0, max_iters=args.max_iters)
    text = make_text(3000, seed=0)
    split = int(0.9 * len(text))
    train_dataset, val_dataset = CharDataset(text[:split], 32), CharDataset(text[split:], 32)
    model = GPT(train_dataset.get_vocab_size(), 32)
    print(f"number of parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    trainer = Trainer(config, model, train_dataset)

    def batch_end_callback(trainer):
        if trainer.iter_num % 10 == 0:
            loss = trainer.loss.item()
            print(f"iter_dt {trainer.iter_dt * 1000:.2f}ms; iter {trainer.iter_num}: train loss {loss:.5f}")
            job.log(train_loss=loss)  # hh: metrics.jsonl, the live table, invoke report
        if (trainer.iter_num + 1) % 100 == 0:
            val_loss = evaluate(trainer.model, val_dataset, trainer.device)
            context = torch.tensor([[train_dataset.stoi[c] for c in "the "]], device=trainer.device)
            sample = "".join(train_dataset.itos[int(i)] for i in trainer.model.generate(context, 40)[0])
            print(f"iter {trainer.iter_num + 1}: val loss {val_loss:.4f}; sample: {sample!r}")
            job.save(trainer.model.state_dict(), os.path.join(args.out_dir, "model.pt"))  # hh: under the run directory

    trainer.add_callback("on_batch_end", batch_end_callback)
    trainer.run()


if __name__ == "__main__":
    main()
