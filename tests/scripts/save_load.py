"""The end of PyTorch's quickstart ported with `job.save` in place of its `torch.save(state,
"model.pth")`, its `torch.load("model.pth")` kept: job.save wrote into the run directory, so that
load would read the working folder's file, an older run's (a stale model, evaluated silently), or
none. Each case's error, or what loaded, goes to OUT/rank-N.json:
- best.pth: the working folder holds an older one;
- fresh.pth: the script's own torch.save wrote it too, after job.save (what it loads is this run's);
- none.pth: the working folder holds none.

    invoke train --script save_load.py -- OUT   (from a folder of its own holding an older best.pth)

With `-- OUT --load NAME` it only loads NAME, as a script's own --resume of what an earlier run saved.
"""

import json
import os
import sys

import torch

import hvdhetero as hh

job = hh.init()
model = torch.nn.Linear(4, 2)
if sys.argv[2:3] == ["--load"]:
    torch.load(sys.argv[3], weights_only=True)
said = {}
for name in ("best.pth", "fresh.pth", "none.pth"):
    job.save(model.state_dict(), name)
    if name == "fresh.pth":
        torch.save(model.state_dict(), name)
    try:
        said[name] = sorted(torch.load(name, weights_only=True))
    except FileNotFoundError as e:
        said[name] = str(e)
with open(os.path.join(sys.argv[1], f"rank-{job.rank}.json"), "w") as f:
    json.dump(said, f)
