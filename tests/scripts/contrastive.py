"""SimCLR's step as people write it: two noisy views of each sample, one encoder, the NT-Xent loss
over the similarity matrix of all 2N views (the loss depends on the whole batch). Ported with
job.gather: every rank computes the loss of the whole global batch from every rank's views.
Rank 0 saves the final parameters to RUN_DIR/params.pt and prints the last loss.

    invoke train --script tests/scripts/contrastive.py -- [--no-gather] [--slow-data 0.001]
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hvdhetero as hh

parser = argparse.ArgumentParser()
parser.add_argument("--no-gather", action="store_true", help="each rank's loss over its own share (the naive port)")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--slow-data", type=float, default=0.0, help="rank 1 waits this long a sample for its data")
args = parser.parse_args()
job = hh.init()
torch.manual_seed(0)
x = torch.randn(512, 16)
views = TensorDataset(x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))  # fixed views: runs compare


class Slow(torch.utils.data.Dataset):  # rank 1 slow at its data: the balancer gives it less (an uneven split)
    def __len__(self):
        return len(views)

    def __getitem__(self, i):
        if job.rank == 1:
            time.sleep(args.slow_data)
        return views[i]

encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
optimizer = torch.optim.SGD(encoder.parameters(), lr=0.2)
encoder, optimizer, loader = job.prepare(encoder, optimizer, DataLoader(Slow(), batch_size=64))


def nt_xent(z: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """z: [2N, d], view 1 of each sample then view 2; each view's positive is the other one."""
    z = F.normalize(z, dim=1)
    n = z.shape[0] // 2
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
    return F.cross_entropy(sim, targets)


for epoch in job.epochs(args.epochs):
    for a, b in loader:
        z1, z2 = encoder(a), encoder(b)
        if args.no_gather:
            z = torch.cat([z1, z2])
        else:  # every rank's view 1 rows, then every rank's view 2 rows: the one device's layout
            z = torch.cat([job.gather(z1), job.gather(z2)])
        loss = nt_xent(z)
        job.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
if job.is_main:
    torch.save({k: v.detach().clone() for k, v in encoder.state_dict().items()}, job.run_dir / "params.pt")
    print(f"last loss {loss.item():.6f}", flush=True)
