"""An elastic commit under --sync diloco:2 --overlap-sync holds what a resume needs, exactly, and
costs no exposed exchange. Two ranks train (the outer Nesterov momentum non-zero); the commit
due (--commit-every 5) is taken at the round's end, step 6, while that round (the third) is
still in flight, and completed at the next round's end (step 8) when it lands. A second run of
the same job without commits flushes at step 6 instead: its state there is what the commit
must hold. A fresh Job's prepare then puts the commit into a fresh model and optimizer, as after
a reset: rank 0 as a survivor (its own commit), rank 1 as a newcomer (rank 0's, through the
broadcast). The model has a tied weight (one tensor under two names), whose every name the
commit must fill, and a frozen one, which no exchange carries and the commit keeps as it was. Rank 0 prints, per rank, what differs from the flushed state.

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/elastic_commit.py RUN_DIR
"""

import copy
import json
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import hvdhetero as hh
from hvdhetero.config import JobConfig
from hvdhetero.rank import elastic
from hvdhetero.recipes import data, models

run_dir = sys.argv[1]
train, _, info = data.load("digits", "unused")
elastic.COMMITS = elastic.Commits()  # what rank/runner.py's elastic.run sets up


def prepared(seed, commits=True):
    # an equal split: both runs take the same steps on the same samples, whatever the timings
    job = hh.Job(JobConfig(run_dir=run_dir, sync="diloco:2", overlap_sync=True, micro_batch="0", equal_split=True,
                           **({"elastic": True, "commit_every": 5} if commits else {})))
    torch.manual_seed(seed)
    model = models.build("cnn", info).eval()  # eval: no dropout
    head = model[-1]
    head.register_parameter("tied", head.weight)  # one tensor, two names (an LM's embedding and head)
    head.register_parameter("frozen", torch.nn.Parameter(torch.randn(3), requires_grad=False))  # not exchanged
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return job, *job.prepare(model, optimizer, train, global_batch=48,
                             loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def differences(a, b, at="") -> list[str]:
    """Where two states differ (tensors bit for bit), as key paths."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        return [] if same else [at]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{at} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{at}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{at} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at}: {a!r} != {b!r}"]


def run_steps(job, model, optimizer, loader, until, at=None):
    """Steps until `until`; `at(step)` after each."""
    for x, y in loader:
        job.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if at is not None:
            at(job.step)
        if job.step == until:
            return


# the run with commits: the commit taken at 6 completes when its round lands, at 8
job, model, optimizer, loader = prepared(seed=0)
seen = {}
run_steps(job, model, optimizer, loader, until=9, at=lambda step: seen.setdefault(step, (
    (elastic.COMMITS.state or {}).get("step"), job.strategy.sync.unsettled, job.strategy.sync.applied)))
committed = elastic.COMMITS.state
job.close()

# the same run without commits, flushed at step 6: what the commit must hold
job, model, optimizer, loader = prepared(seed=0, commits=False)
run_steps(job, model, optimizer, loader, until=6)
job.strategy.one_model(job.step)
live = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
        "sync": copy.deepcopy(job.strategy.sync.state_dict())}
outer_momentum = sum(float(s["momentum_buffer"].norm()) for s in live["sync"]["outer"]["state"].values())
rank0_optimizer = hvd.broadcast_object(live["optimizer"], root_rank=0, name="commit.rank0_optimizer")
job.close()

if hvd.rank() == 1:
    elastic.COMMITS.state = None  # a newcomer: no commit of its own
job, model, optimizer, loader = prepared(seed=1 + hvd.rank())  # other weights than the run's
result = {"committed_step": committed["step"], "rounds": live["sync"]["rounds"], "applied": live["sync"]["applied"],
          # per step of the first run: (the step of the commit held, a round in flight, rounds applied)
          "seen": {step: seen[step] for step in sorted(seen)},
          "outer_momentum": outer_momentum, "step": job.step, "round_origin": job.strategy.sync.clock.origin,
          "unsettled": job.strategy.sync.unsettled,
          "model": differences(model.state_dict(), live["model"]),
          "sync": differences(job.strategy.sync.state_dict(), live["sync"]),
          # a survivor keeps its own inner optimizer state; a newcomer starts from rank 0's
          "optimizer": differences(optimizer.state_dict(), live["optimizer"] if hvd.rank() == 0 else rank0_optimizer),
          "own_optimizer": differences(optimizer.state_dict(), live["optimizer"])}
results = hvd.allgather_object(result, name="commit.results")
if hvd.rank() == 0:
    print("ELASTIC_COMMIT " + json.dumps(results), flush=True)
