"""A small character-level transformer (GPT-style) trained on any text file, with no download:
by default Python's own LICENSE.txt, which every Python install has.

    invoke train --script examples/char_transformer.py                      # 2 CPU ranks here
    invoke train --hosts pc,mac --script examples/char_transformer.py -- --text book.txt --epochs 20

A text file you pass with --text is shipped to remote hosts with the script's folder when it
lies inside that folder (put big corpora on each host with `invoke push-data` instead). After
training, rank 0 prints a sample from the model.
"""

import argparse
import importlib.metadata
import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import hvdhetero as hh


def default_text() -> Path:
    """Python's LICENSE.txt, else the first license file torch ships: text found on any machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if stdlib.exists():
        return stdlib
    return next(Path(f.locate()) for f in importlib.metadata.distribution("torch").files or []
                if "LICENSE" in f.name.upper())


class Windows(torch.utils.data.Dataset):
    """Every `block`-character window of the text as (input, the same shifted by one)."""

    def __init__(self, ids: torch.Tensor, block: int):
        self.ids, self.block = ids, block

    def __len__(self):
        return len(self.ids) - self.block - 1

    def __getitem__(self, i):
        chunk = self.ids[i:i + self.block + 1]
        return chunk[:-1], chunk[1:]


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int = 128, heads: int = 4, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(block, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.triu(torch.full((block, block), float("-inf")), diagonal=1))

    def forward(self, ids):
        n = ids.shape[1]
        x = self.embed(ids) + self.position[:n]
        x = self.blocks(x, mask=self.causal[:n, :n], is_causal=True)
        return self.out(self.norm(x))


@torch.no_grad()
def sample(model, ids, block, length, device):
    model.eval()
    out = ids[:block].to(device)[None]
    for _ in range(length):
        logits = model(out[:, -block:])[:, -1]
        out = torch.cat([out, torch.multinomial(F.softmax(logits.float(), -1), 1)], dim=1)
    return out[0, block:].tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", type=Path, default=None, help="a UTF-8 text file (default: Python's LICENSE.txt)")
    parser.add_argument("--block", type=int, default=64, help="characters of context")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128, help="global: all ranks together")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-chars", type=int, default=0, help="use only the first N characters (0: all)")
    args = parser.parse_args()

    job = hh.init()
    text = (args.text or default_text()).read_text(encoding="utf-8", errors="replace")
    text = text[:args.max_chars] if args.max_chars else text
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    cut = int(0.9 * len(ids))
    train_set, test_set = Windows(ids[:cut], args.block), Windows(ids[cut:], args.block)

    model = CharGPT(len(vocab), args.block).to(job.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "position" not in n]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 or "position" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size)
    for epoch in job.epochs(args.epochs):
        model.train()
        for x, y in loader:
            with job.autocast():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            job.backward(loss)
            job.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def score(batch):
            x, y = batch
            return {"nll": F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum"),
                    "chars": y.numel()}

        test = job.evaluate(score, test_set, batch_size=64)
        bits = test["nll"] / test["chars"] / math.log(2)
        job.log(test_bits_per_char=bits)
        if job.is_main:
            print(f"epoch {epoch}: {bits:.3f} bits per character on held-out text", flush=True)
    job.save(model.state_dict(), "char_gpt.pt")
    if job.is_main:
        print("sample: " + "".join(vocab[i] for i in sample(model, ids, args.block, 200, job.device)), flush=True)


if __name__ == "__main__":
    main()
