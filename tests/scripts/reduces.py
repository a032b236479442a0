"""job.reduce as a port of a DDP script uses it: each rank counts over its share of the epoch
(the transfer-learning tutorial's running_loss and running_corrects), then the counts are summed
over the ranks once the loop is done. `inloop` calls it inside the loop instead (refused);
`mismatch` with a key on rank 0 that rank 1 lacks (refused on both).

    invoke train --script tests/scripts/reduces.py [-- inloop|mismatch]
"""

import json
import sys

import torch
from torch.utils.data import TensorDataset

import hvdhetero as hh
from hvdhetero.errors import ConfigError

job = hh.init()
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(96, 4, generator=g), torch.randint(0, 2, (96,), generator=g))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16)
for epoch in job.epochs(1):
    running_loss, running_corrects, seen, batches = 0.0, torch.tensor(0, device=job.device), 0, 0
    for inputs, labels in loader:
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = torch.nn.functional.cross_entropy(outputs, labels)
        job.backward(loss)
        optimizer.step()
        running_loss += loss.item() * inputs.size(0)
        running_corrects += torch.sum(outputs.argmax(1) == labels)
        seen, batches = seen + len(inputs), batches + 1
        if sys.argv[1:] == ["inloop"]:
            job.reduce(seen)
    mine = {"loss": running_loss, "corrects": running_corrects, "seen": seen, "batches": batches,
            "any": batches > 3, "flags": torch.tensor([batches > 3, True])}
    total = job.reduce(mine)
    largest = job.reduce((seen, batches), op="max")
    # a dict filled in the order each rank met its keys: summed by key
    ordered = job.reduce({"x": 1, "y": 2} if job.rank == 0 else {"y": 20, "x": 10})
    if sys.argv[1:] == ["mismatch"]:
        job.reduce({"a": 1} if job.rank == 0 else {"b": 1})
try:
    job.reduce(running_loss, op="mean")
    refused = ""
except ConfigError as e:
    refused = str(e)
print("REDUCED " + json.dumps({
    "mine": {**mine, "corrects": int(mine["corrects"]), "flags": mine["flags"].tolist()},
    "total": {**total, "corrects": total["corrects"].item(), "flags": total["flags"].tolist()},
    "types": {k: type(v).__name__ for k, v in total.items()},
    "tensor": [str(total["corrects"].device), str(total["corrects"].dtype), str(total["flags"].dtype)],
    "largest": largest, "largest_type": type(largest).__name__, "refused": refused, "ordered": ordered}), flush=True)
