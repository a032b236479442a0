"""A script as people write them for one GPU, ported with the README's ~10 lines: a BatchNorm
CNN, a tqdm bar over the loader, a checkpoint saved by rank 0 alone inside the loop (the DDP
habit), its own torch seed, settings read from the environment, the optimizer it made stepped
(--own-optimizer) rather than the one job.prepare returned; an epoch of 1,400 samples, whose last step holds 2 (1 + 1 would fail BatchNorm1d: one value a channel).
Run by tests/test_script.py through `invoke train --script`.

    OMP_NUM_THREADS=1 invoke train --script tests/scripts/wild.py --env WILD_TAG=x,OMP_NUM_THREADS -- --out DIR
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn  # imported before hh.init(), as scripts do
from tqdm import tqdm

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=233)
parser.add_argument("--out", required=True)
parser.add_argument("--break-at", type=int, default=-1, help="leave the epochs' loop as that epoch begins")
parser.add_argument("--seed", type=int, default=1, help="the script's own torch seed, before hh.init()")
parser.add_argument("--evaluate-on-rank-0-only", action="store_true", help="a mistake: job.evaluate is a collective")
parser.add_argument("--own-optimizer", action="store_true",
                    help="step the optimizer made here, not the one job.prepare returns (model, _, loader = ...)")
args = parser.parse_args()

torch.manual_seed(args.seed)
job = hh.init()
x, y = load_digits(return_X_y=True)
train_set = torch.utils.data.TensorDataset(torch.tensor(x[:1400] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8),
                                           torch.tensor(y[:1400]))
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                      nn.Linear(8 * 64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)).to(job.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))  # per batch, not prepared
if args.own_optimizer:
    model, _, loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size)
else:
    model, optimizer, loader = job.prepare(model, optimizer, train_set, global_batch=args.batch_size)
with open(os.path.join(args.out, f"init{job.rank}.json"), "w") as f:  # the weights every rank starts from
    json.dump([round(p.double().sum().item(), 12) for p in model.parameters()], f)
ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
ema_buffers = AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True)
sizes, norms, ends = [], [], 0
for epoch in job.epochs(args.epochs):
    if epoch == args.break_at:  # a script's early stop, as in one-device scripts (job.stop() is ours)
        break
    for i, (images, labels) in enumerate(tqdm(loader, desc=f"epoch {epoch}")):
        sizes.append(len(labels))
        job.backward(F.cross_entropy(model(images), labels))
        norms.append(float(job.clip_grad_norm_(5.0)))  # a number on every batch, micro-batches or not
        optimizer.step()
        optimizer.zero_grad()
        warmup.step()  # once a step, not once a chunk (rank/scheduling.py)
        ends += job.sync_gradients  # where an EMA of one's own would be updated: once a step, not once a chunk
        ema.update_parameters(model)  # torch's EMA: averages once a step (rank/averaging.py)
        ema_buffers.update_parameters(model)  # torchvision's reference scripts' kind: BatchNorm statistics averaged too
        if job.is_main and i == 2:
            job.save(model.state_dict(), f"epoch{epoch}-step{i}.pt")
            if args.evaluate_on_rank_0_only:
                job.evaluate(lambda b: {"right": (model(b[0]).argmax(1) == b[1]).sum()}, train_set)
swa = AveragedModel(model)  # the docs' SWA recipe's end: statistics recomputed over the training data
swa.update_parameters(model)
update_bn(loader, swa)
swa.eval()
job.evaluate(lambda b: {"right": (swa(b[0]).argmax(1) == b[1]).sum()}, train_set)  # its statistics kept through it


def buffers(m):
    return [round(b.double().sum().item(), 9) for b in m.buffers() if b.is_floating_point()]


with open(os.path.join(args.out, f"rank{job.rank}.json"), "w") as f:
    json.dump({"buffers": buffers(model), "ema_buffers": buffers(ema.module), "averaged_buffers": buffers(ema_buffers.module),
               "swa_buffers": buffers(swa.module), "sizes": sizes, "norms": norms, "steps": job.step, "ends": ends, "ema_updates": int(ema.n_averaged), "warmup_steps": warmup.last_epoch,
               "ema": [round(p.double().sum().item(), 12) for p in ema.module.parameters()],
               "final": [round(p.double().sum().item(), 12) for p in model.parameters()], "env": {k: os.environ.get(k) for k in ("WILD_TAG", "OMP_NUM_THREADS", "WILD_LIST", "WILD_SECRET")},
               "home": os.environ.get("HOME"),
               "seen": len(loader) * loader.batch_size, "of": len(loader.dataset)}, f)  # a one-device loop's arithmetic
