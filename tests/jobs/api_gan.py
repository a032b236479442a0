"""Two models, each with its optimizer, stepped in turn as DCGAN's loop does (pytorch/examples):
two unequal ranks against one process on the joined batch, through the public API.

    job.prepare((netG, netD), (optG, optD), data, scheduler=[schedG, schedD])
    netD.zero_grad(); job.backward(errD_real); job.backward(errD_fake); optD.step()
    netG.zero_grad(); job.backward(errG); optG.step()

Each sample carries its own noise vector, so the replay draws the same fakes. Cases, the last
rank 3x slower (calibration times `step_loss` on both models): after the backward, overlapped,
and overlapped under a loss scale (fp16's, set by hand; with SGD, whose steps a scale left in
would move, where Adam's would not), and overlapped with D frozen for G's backward and thawed
for its own every step, as pix2pix's set_requires_grad does; then one that checkpoints after step 2 and a run resumed
from it, whose step 3 must give the uninterrupted run's models and both optimizers' states bit
for bit. Last, `invoke plan`'s job on this GAN (plan_only): the plan weighs alone and step sync
only, and says why (a local/diloco mode it advised would be refused at prepare).

Run: horovodrun -np 2 -H localhost:2 --gloo python tests/jobs/api_gan.py RUN_DIR
"""

import contextlib
import copy
import io
import json
import sys

import horovod.torch as hvd
import torch
from torch import nn

import hvdhetero as hh
from hvdhetero import progress
from hvdhetero.config import JobConfig
from hvdhetero.rank import checkpoint, precision
from hvdhetero.recipes import data

STEPS = 3
GLOBAL_BATCH = 48
NZ = 8


class Noisy(torch.utils.data.Dataset):
    """digits' images in [0, 1], each with the noise vector its fake is made from."""

    def __init__(self, images):
        self.x = images.flatten(1) / 16.0
        self.z = torch.randn(len(self.x), NZ, generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.z[i]


def models(seed):
    torch.manual_seed(seed)
    net_g = nn.Sequential(nn.Linear(NZ, 256), nn.LeakyReLU(0.2), nn.Linear(256, 64), nn.Sigmoid())
    net_d = nn.Sequential(nn.Linear(64, 256), nn.LeakyReLU(0.2), nn.Linear(256, 1), nn.Sigmoid())
    return net_g, net_d


def optimizers(net_g, net_d, sgd=False):
    """DCGAN's Adams; or SGD, whose steps scale with the gradient (a loss scale left in shows; Adam's would not)."""
    if sgd:
        opt_g, opt_d = (torch.optim.SGD(n.parameters(), lr=2e-2, momentum=0.5) for n in (net_g, net_d))
    else:
        opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_g, opt_d)]
    return opt_g, opt_d, scheds


def gan_step(net_g, net_d, opt_g, opt_d, real, z, backward, freeze_d=False):
    """DCGAN's loop body (real label 1, fake 0, the generator trained to make D say 1);
    `freeze_d`: D's parameters need no gradient during G's backward (pix2pix's set_requires_grad)."""
    criterion = nn.BCELoss()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    net_d.requires_grad_(True)
    net_d.zero_grad()
    backward(criterion(net_d(real), ones))
    fake = net_g(z)
    backward(criterion(net_d(fake.detach()), zeros))
    opt_d.step()
    net_d.requires_grad_(not freeze_d)
    net_g.zero_grad()
    backward(criterion(net_d(fake), ones))
    opt_g.step()


def step_loss(nets, batch):
    """What calibration times (job.prepare's loss_fn): the models as given, in that order."""
    net_g, net_d = nets
    real, z = batch
    out = net_d(torch.cat([real, net_g(z)]))
    return nn.functional.binary_cross_entropy(out, torch.cat([torch.ones(len(real), 1), torch.zeros(len(z), 1)]))


def flat(*nets):
    return torch.cat([p.detach().reshape(-1) for n in nets for p in n.parameters()]).double()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def optimizer_tensors(opt):
    return [t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]


run_dir = sys.argv[1]
train, _, _ = data.load("digits", "unused")
dataset = Noisy(train.tensors[0])
results = {}
for case, overlap in (("after-backward", False), ("overlapped", True), ("loss-scaled", True), ("d-frozen", True)):
    job = hh.Job(JobConfig(run_dir=f"{run_dir}/{case}", slowdown=3.0, overlap=overlap))
    if case == "loss-scaled":  # --precision fp16's dynamic loss scale (on CUDA/MPS), switched on by hand
        job.loss_scale = precision.LossScale(scale=2.0 ** 10)
    net_g, net_d = models(1 + hvd.rank())  # each rank its own initial weights: prepare gives rank 0's
    opt_g, opt_d, scheds = optimizers(net_g, net_d, sgd=case == "loss-scaled")
    (net_g, net_d), (opt_g, opt_d), loader = job.prepare((net_g, net_d), (opt_g, opt_d), dataset,
                                                         global_batch=GLOBAL_BATCH, scheduler=scheds,
                                                         loss_fn=step_loss)
    ref_g, ref_d = copy.deepcopy(net_g), copy.deepcopy(net_d)
    ref_opt_g, ref_opt_d, ref_scheds = optimizers(ref_g, ref_d, sgd=case == "loss-scaled")
    steps, sizes = [], None
    for real, z in loader:
        gan_step(net_g, net_d, opt_g, opt_d, real, z, job.backward, freeze_d=case == "d-frozen")
        for s in scheds:
            s.step()
        steps.append(job.step)
        both = hvd.allgather_object((real, z), name=f"gan.joined.{case}.{job.step}")
        sizes = [len(r) for r, _ in both]
        gan_step(ref_g, ref_d, ref_opt_g, ref_opt_d, torch.cat([r for r, _ in both]), torch.cat([q for _, q in both]),
                 lambda loss: loss.backward())
        for s in ref_scheds:
            s.step()
        if job.step == STEPS:
            break
    results[case] = {"sizes": sizes, "lr0": ref_opt_g.defaults["lr"], "steps": steps,
                     "rel_err": rel(flat(net_g, net_d), flat(ref_g, ref_d)),
                     "d_moved": rel(flat(net_d), flat(models(1)[1])),
                     "lr": [opt_g.param_groups[0]["lr"], opt_d.param_groups[0]["lr"]],
                     "adam_steps": [float(opt.state_dict()["state"][0].get("step", STEPS)) for opt in (opt_g, opt_d)],
                     "same_on_ranks": len(set(hvd.allgather_object(flat(net_g, net_d).sum().item(),
                                                                   name=f"gan.digest.{case}"))) == 1,
                     "trainable_records": sum('"trainable"' in line for line in open(f"{run_dir}/{case}/metrics.jsonl"))
                     if hvd.rank() == 0 else None}


# An overflow in G's reduction at step 1 (its loss x1e38 on rank 0, scaled by 1024: inf): G skips
# step 1 alone, as one device's GradScaler would, and step 2 is whole, though G's gradients still
# hold step 1's infs while D's losses are reduced (DCGAN clears them only before errG).
job = hh.Job(JobConfig(run_dir=f"{run_dir}/overflow", equal_split=True))
job.loss_scale = precision.LossScale(scale=2.0 ** 10)
net_g, net_d = models(3)
opt_g, opt_d, _ = optimizers(net_g, net_d, sgd=True)
_, (opt_g, opt_d), loader = job.prepare((net_g, net_d), (opt_g, opt_d), dataset, global_batch=GLOBAL_BATCH)
moved = []
for real, z in loader:
    before = flat(net_g), flat(net_d)
    blow = 1e38 if job.step == 0 and hvd.rank() == 0 else 1.0
    criterion, ones, zeros = nn.BCELoss(), torch.ones(len(real), 1), torch.zeros(len(real), 1)
    net_d.zero_grad()
    job.backward(criterion(net_d(real), ones) + criterion(net_d(net_g(z).detach()), zeros))
    opt_d.step()
    net_g.zero_grad()
    job.backward(criterion(net_d(net_g(z)), ones) * blow)
    opt_g.step()
    moved.append([not torch.equal(before[0], flat(net_g)), not torch.equal(before[1], flat(net_d)),
                  job.loss_scale.scale])
    if job.step == STEPS:
        break
results["overflow"] = {"moved": moved, "skipped": job.loss_scale.skipped}

# G's loss backpropagated with torch's own backward (a port's line forgotten): refused at its step.
job = hh.Job(JobConfig(run_dir=f"{run_dir}/forgotten", equal_split=True))
net_g, net_d = models(4)
opt_g, opt_d, _ = optimizers(net_g, net_d)
_, (opt_g, opt_d), loader = job.prepare((net_g, net_d), (opt_g, opt_d), dataset, global_batch=GLOBAL_BATCH)
real, z = next(iter(loader))
net_d.zero_grad()
job.backward(nn.BCELoss()(net_d(real), torch.ones(len(real), 1)))
opt_d.step()
net_g.zero_grad()
nn.BCELoss()(net_d(net_g(z)), torch.ones(len(real), 1)).backward()
try:
    opt_g.step()
    results["forgotten"] = "stepped"
except RuntimeError as err:
    results["forgotten"] = str(err)


def run(resume):
    """Three steps at an equal split, a checkpoint after step 2 (or resumed from it)."""
    job = hh.Job(JobConfig(run_dir=f"{run_dir}/resume", equal_split=True, checkpoint_every=2, resume=resume))
    net_g, net_d = models(5)
    opt_g, opt_d, _ = optimizers(net_g, net_d)
    _, (opt_g, opt_d), loader = job.prepare([net_g, net_d], [opt_g, opt_d], dataset, global_batch=GLOBAL_BATCH)
    started = job.step
    for real, z in loader:
        gan_step(net_g, net_d, opt_g, opt_d, real, z, job.backward)
        if job.step == STEPS:
            break
    return started, [flat(net_g, net_d), *optimizer_tensors(opt_g), *optimizer_tensors(opt_d)]


_, whole = run(resume=False)
saved = checkpoint.newest(f"{run_dir}/resume") if hvd.rank() == 0 else None
started, resumed = run(resume=True)
results["resume"] = {"started_at": started, "bit_exact": all(torch.equal(a, b) for a, b in zip(whole, resumed))
                     and len(whole) == len(resumed)}
if saved is not None:
    state = saved[1]
    results["resume"]["checkpoint_step"] = state["step"]
    results["resume"]["optimizers_saved"] = [len(state[k]["state"]) for k in ("optimizer", "optimizer_2")]
job = hh.Job(JobConfig(run_dir=f"{run_dir}/plan", plan_only=True, slowdown=3.0))
net_g, net_d = models(7)
opt_g, opt_d, _ = optimizers(net_g, net_d)
printed = io.StringIO()
with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):  # the plan ends the job: exit 0
    job.prepare((net_g, net_d), (opt_g, opt_d), dataset, global_batch=GLOBAL_BATCH, loss_fn=step_loss)
if hvd.rank() == 0:
    said = printed.getvalue()
    full = json.loads(next(line for line in said.splitlines() if line.startswith(progress.RESULT_TAG))
                      [len(progress.RESULT_TAG):])
    results["plan"] = {"syncs": sorted({p["sync"] for p in full["predictions"]}), "step_only": full["step_only"],
                       "advised": full["advice"]["sync"],
                       "lines": [line for line in said.splitlines() if line.startswith(("local/diloco", "advice"))]}
    print("API_GAN " + json.dumps(results), flush=True)
