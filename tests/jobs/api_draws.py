"""An imbalanced dataset drawn by weight, as one-device scripts do: the script's DataLoader has
torch's WeightedRandomSampler (10 rare samples of 100 weighted 9 times the others, 200 draws an
epoch). Two epochs through job.epochs; every rank records the labels it was dealt. Rank 0
prints, as JSON, each rank's labels per epoch and len(loader).

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_draws.py RUN_DIR
"""

import json
import sys

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import hvdhetero as hh

job = hh.init(run_dir=sys.argv[1], micro_batch="0")
y = torch.arange(100)
weights = [9.0] * 10 + [1.0] * 90
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
loader = DataLoader(TensorDataset(y.float().view(-1, 1), y), batch_size=20,
                    sampler=WeightedRandomSampler(weights, num_samples=200))
model, optimizer, loader = job.prepare(model, optimizer, loader)
dealt = []
for epoch in job.epochs(2):
    dealt.append([])
    for x, labels in loader:
        dealt[-1] += labels.tolist()
        job.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
every = hvd.allgather_object(dealt)
if job.is_main:
    print("API_DRAWS " + json.dumps({"dealt": every, "steps": len(loader)}), flush=True)
