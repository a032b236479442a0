"""A loop over steps of its own (max_steps, no job.epochs), checkpointed by hvdhetero every 4
steps, one pass's worth: the checkpoint after pass 0 is taken as pass 1's first step comes.
Rank 1 fails once, at step 5 (a marker file says it did). Run by tests/test_script.py: the
resumed run goes on from step 4 in pass 1 and stops at step 12, as one that never failed.

With --counted the loop is three passes counted by the script (`for _ in range(3)`), not by
job.step: resumed, it trains three whole passes again, which rank 0 says at the first step.

With --one-ahead the loop fetches one batch ahead (apex's data_prefetcher), rank 1 fails at step 7
instead, and each rank writes every batch it trains (job.step, the inputs' sum) to OUT/batchesR.jsonl.
With --count-first rank 0 alone counts the loader's samples in a pass of its own first (no backward).
With --look rank 0 alone looks at a batch (`next(iter(loader))`, a sample to log) after each
optimizer step, and each rank writes every batch it trains to OUT/batchesR.jsonl. With --keep-look
it looks before each batch's loss instead, and keeps that look's iterator open until the next.

    invoke train --script tests/scripts/own_loop_resume.py --checkpoint-every 4 -- --out DIR \
        [--counted] [--one-ahead] [--look | --keep-look]
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--counted", action="store_true")
parser.add_argument("--one-ahead", action="store_true")
parser.add_argument("--count-first", action="store_true")
parser.add_argument("--look", action="store_true")
parser.add_argument("--keep-look", action="store_true")
args = parser.parse_args()

job = hh.init()
x = torch.linspace(-1, 1, 64).view(-1, 1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, 3 * x), batch_size=16, shuffle=True)
model = torch.nn.Linear(1, 1).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = job.prepare(model, optimizer, loader)  # 4 steps a pass
marker = os.path.join(args.out, "failed-once")
fails_at = 7 if args.one_ahead else 5


def one_ahead(batches):
    """apex's data_prefetcher, as a generator: the next batch fetched before the one in hand is used."""
    it = iter(batches)
    ahead = next(it, None)
    while ahead is not None:
        batch, ahead = ahead, next(it, None)
        yield batch


if args.count_first and job.is_main:
    with torch.no_grad():
        print("COUNTED", sum(len(inputs) for inputs, _ in loader), flush=True)
batches = 0
for _ in range(3 if args.counted else 6):  # passes until 12 steps (at most 6: a pass that deals nothing ends it)
    if not args.counted and job.step >= 12:
        break
    for inputs, targets in (one_ahead(loader) if args.one_ahead else loader):
        if job.rank == 1 and not os.path.exists(marker) and job.step == fails_at:  # (read: rank 1's first run only)
            open(marker, "w").close()
            raise RuntimeError(f"rank 1 fails once, at step {fails_at}")
        if args.keep_look and job.is_main:
            kept = iter(loader)  # (the look before it, dropped)
            sample, _ = next(kept)
        if args.one_ahead or args.look or args.keep_look:
            with open(os.path.join(args.out, f"batches{job.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"step": job.step, "sum": round(float(inputs.sum()), 6)}) + "\n")
        job.backward(F.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
        batches += 1
        if args.look and job.is_main:
            sample, _ = next(iter(loader))
with open(os.path.join(args.out, f"rank{job.rank}.jsonl"), "a") as f:
    f.write(json.dumps({"step": job.step, "epoch": job.epoch, "batches": batches}) + "\n")
