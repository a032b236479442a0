"""A small one-rank job whose checkpoints hold every kind of part: model, momentum, a per-step LR
schedule, a job.track'ed object, the random states (dropout) and (with diloco) the sync state.
tests/test_checkpoint.py resumes checkpoints that earlier code wrote with this script
(tests/data/checkpoints/) and compares the end with an uninterrupted run of today's code.

Run: python tests/jobs/checkpoint_format.py RUN_DIR SYNC [--resume]   (prints FORMAT_END {...})
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import hvdhetero as hh
from hvdhetero.config import JobConfig
from hvdhetero.rank.evaluation import param_digest

run_dir, sync = sys.argv[1], sys.argv[2]
resume = "--resume" in sys.argv


class Counter:
    """A script's own state (job.track): how many batches it saw."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


# the host's name is the inventory's, the same wherever the test runs (a checkpoint's random states
# are restored only on the hosts that wrote them)
os.environ["HOROVOD_HOSTNAME"] = "fixture"
job = hh.Job(JobConfig(run_dir=run_dir, hosts={"fixture": {"name": "fixture"}}, sync=sync, micro_batch="0",
                       equal_split=True, checkpoint_every=3, checkpoint_minutes=0, keep_checkpoints=10, resume=resume,
                       seed=5))
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
torch.manual_seed(1)
nn = torch.nn
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
counter = Counter()
job.track("counter", counter)
model, optimizer, loader = job.prepare(model, optimizer, data, global_batch=16, scheduler=scheduler,
                                       loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
for epoch in job.epochs(2):  # 6 steps an epoch
    for x, y in loader:
        job.backward(F.cross_entropy(model(x), y))  # dropout: the random states matter
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counter.seen += 1
params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
print("FORMAT_END " + json.dumps({"digest": param_digest(model), "params": params, "lr": optimizer.param_groups[0]["lr"],
                                  "seen": counter.seen, "step": job.step}), flush=True)
