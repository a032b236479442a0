"""Karpathy's makemore MLP loop as its lecture writes it: the parameters a list of tensors (here
in an nn.ParameterList, as job.prepare takes a module), a batch drawn with torch.randint every
iteration, and the update by hand, `p.data += -lr * p.grad`. The optimizer given to job.prepare
never steps: the job says so. With --accumulate K the loop steps that optimizer every K batches
instead (gradients accumulated over them: nothing to say). Rank 0 prints its final loss.

    invoke train --script tests/scripts/by_hand.py -- --steps 80 [--accumulate 60]
"""

import argparse

import torch
import torch.nn.functional as F

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--accumulate", type=int, default=0)
args = parser.parse_args()

job = hh.init()
g = torch.Generator().manual_seed(2147483647)
Xtr = torch.randint(0, 27, (2000, 3), generator=g)
Ytr = (Xtr.sum(1) * 7) % 27
C = torch.randn((27, 10), generator=g)
W1 = torch.randn((30, 64), generator=g) * 0.2
b1 = torch.randn(64, generator=g) * 0.01
W2 = torch.randn((64, 27), generator=g) * 0.01
b2 = torch.zeros(27)
model = torch.nn.ParameterList([C, W1, b1, W2, b2])
C, W1, b1, W2, b2 = parameters = list(model)
optimizer = torch.optim.SGD(parameters, lr=0.1)


def batch():
    ix = torch.randint(0, Xtr.shape[0], (32,))
    return Xtr[ix], Ytr[ix]


model, optimizer, get_batch = job.prepare(model, optimizer, batch, loss_fn=lambda m, b: F.cross_entropy(
    (torch.tanh(m[0][b[0]].view(-1, 30) @ m[1] + m[2])) @ m[3] + m[4], b[1]))
for i in range(args.steps):
    Xb, Yb = get_batch()
    emb = C[Xb]
    h = torch.tanh(emb.view(-1, 30) @ W1 + b1)
    loss = F.cross_entropy(h @ W2 + b2, Yb)
    if args.accumulate:
        job.backward(loss / args.accumulate)
        if (i + 1) % args.accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
        continue
    for p in parameters:
        p.grad = None
    job.backward(loss)
    for p in parameters:
        p.data += -0.1 * p.grad
if job.is_main:
    print(f"final loss {loss.item():.4f}", flush=True)
