"""Every mistake job.prepare refuses, tried one after the other in one process (a job of one
rank: a script run without the launcher); prints each message as JSON."""

import json

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvdhetero as hh
from hvdhetero.config import JobConfig
from prefetching import one_ahead

job = hh.init(run_dir="/tmp/hvdhetero-prepare-errors")
data = TensorDataset(torch.randn(100, 4), torch.randint(2, (100,)))


class Stream(IterableDataset):
    def __iter__(self):
        yield from ()


cases = {
    "dataset smaller than the global batch": lambda m: (m, torch.optim.SGD(m.parameters(), 0.1), data),
    "global batch below the ranks": lambda m: (m, torch.optim.SGD(m.parameters(), 0.1), data),
    "model on another device": lambda m: (m.to(torch.float32).to("meta"), torch.optim.SGD(m.parameters(), 0.1), data),
    "optimizer of another model": lambda m: (m, torch.optim.SGD(nn.Linear(4, 2).parameters(), 0.1), data),
    "iterable dataset": lambda m: (m, torch.optim.SGD(m.parameters(), 0.1), Stream()),
    "dataset without a global batch": lambda m: (m, torch.optim.SGD(m.parameters(), 0.1), data),
    "loader with a sampler of its own": lambda m: (m, torch.optim.SGD(m.parameters(), 0.1), DataLoader(
        data, batch_size=10, sampler=DistributedSampler(data, num_replicas=2, rank=0))),  # a DDP script's
    "a graph in the batch function": lambda m: (m, torch.optim.SGD(m.parameters(), 0.1), lambda: (
        torch.randn(10, 4), torch.eye(10).to_sparse(), torch.randint(2, (10,)))),  # a GCN's features, adjacency
}
batches = {"dataset smaller than the global batch": 101, "global batch below the ranks": 0,
           "dataset without a global batch": None, "loader with a sampler of its own": None,
           "a graph in the batch function": None}
out = {}
for name, make in cases.items():
    model = nn.Linear(4, 2)
    args = make(model)
    try:
        job.prepare(*args, global_batch=batches.get(name, 10))
        out[name] = "accepted"
    except Exception as err:  # noqa: BLE001
        out[name] = f"{type(err).__name__}: {err}"
# a GAN's two models, each with its optimizer: what the job cannot do with them, and a tuple of no modules
for name, setting in {"several optimizers in micro-batches": {"micro_batch": "8"},
                      "several optimizers in rounds": {"sync": "local:4"},
                      "a tuple holding no model": {}}.items():
    gen, disc = nn.Linear(2, 4), nn.Linear(4, 1)
    pair = (gen, disc) if setting else (gen, "disc")
    try:
        hh.Job(JobConfig(run_dir="/tmp/hvdhetero-prepare-errors", **setting)).prepare(
            pair, (torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())), data, global_batch=10)
        out[name] = "accepted"
    except Exception as err:  # noqa: BLE001
        out[name] = f"{type(err).__name__}: {err}"
# a GAN's habit: its discriminator prepared, then its generator with their own optimizer
disc, gen = nn.Linear(4, 1), nn.Linear(2, 4)
_, disc_opt, loader = job.prepare(disc, torch.optim.Adam(disc.parameters()), data, global_batch=10)
try:
    job.prepare(gen, torch.optim.Adam(gen.parameters()), data, global_batch=10)
    out["a second model prepared"] = "accepted"
except Exception as err:  # noqa: BLE001
    out["a second model prepared"] = f"{type(err).__name__}: {err}"
# knowledge distillation's habit: the teacher prepared (and trained), then a student of its own in the job's loop
student = nn.Linear(4, 2)
try:
    for epoch in job.epochs(1):
        for x, _ in loader:
            job.backward(student(x).logsumexp(1).mean() - (student(x) * disc(x).detach()).mean())
            break
    out["a student trained after its teacher"] = "accepted"
except Exception as err:  # noqa: BLE001
    out["a student trained after its teacher"] = f"{type(err).__name__}: {err}"


def trained(batches):
    """A one-device loop's steps over `batches`: the discriminator's."""
    for x, _ in batches:
        disc_opt.zero_grad()
        job.backward(disc(x).mean())
        disc_opt.step()


try:  # apex's data_prefetcher: one batch fetched ahead, so the pass ends before the last batch's backward (fine)
    trained(one_ahead(loader))
    out["a loop fetching one batch ahead"] = "accepted"
except Exception as err:  # noqa: BLE001
    out["a loop fetching one batch ahead"] = f"{type(err).__name__}: {err}"
# a curriculum's habit: its DataLoader made anew once the prepared one's pass is over (each rank would train it whole)
try:
    trained(loader)
    trained(DataLoader(data, batch_size=10))
    out["a loader of its own after the prepared one's pass"] = "accepted"
except Exception as err:  # noqa: BLE001
    out["a loader of its own after the prepared one's pass"] = f"{type(err).__name__}: {err}"
# job.epochs given what a config or a loop holds: a float, a range of another step, nothing to count
for name, args in {"epochs from a float": (10.0,), "epochs from a range of step 2": (range(0, 10, 2),),
                   "no epochs": (0,), "an empty range of epochs": (range(1, 1),)}.items():
    try:
        next(job.epochs(*args))
        out[name] = "accepted"
    except Exception as err:  # noqa: BLE001
        out[name] = f"{type(err).__name__}: {err}"
print("PREPARE_ERRORS " + json.dumps(out), flush=True)
