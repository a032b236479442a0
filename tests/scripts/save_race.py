"""PyTorch's quickstart ends with `torch.save(model.state_dict(), "model.pth")` and loads it back
into a new model. Every rank runs both, and the ranks on one host write the same file at once: a
load must never find it half-written. Each rank saves and loads 100 times, in step with the other
(a barrier before each save), and writes what failed, the file's mode and what else the folder
holds to OUT/rank-N.json.

    invoke train --script tests/scripts/save_race.py -- OUT
"""

import json
import os
import sys

import torch

import hvdhetero as hh

out = sys.argv[1]
job = hh.init()
model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 10))
failed = []
for i in range(100):
    job.barrier()
    torch.save(model.state_dict(), os.path.join(out, "model.pth"))
    try:
        model.load_state_dict(torch.load(os.path.join(out, "model.pth"), weights_only=True))
    except Exception as e:  # noqa: BLE001
        failed.append(f"{type(e).__name__}: {str(e)[:80]}")
job.barrier()
with open(os.path.join(out, f"rank-{job.rank}.json"), "w") as f:
    json.dump({"failed": failed, "mode": oct(os.stat(os.path.join(out, "model.pth")).st_mode & 0o777),
               "files": sorted(os.listdir(out))}, f)
