"""The one message a failed job ends with on the console: the first rank that failed, where, what
and its last frames (the rank side sends them in one tagged line: progress.failure_line), or,
where that failure only follows from a peer that ended its script early, that peer's early end;
with what to do about a failure people meet in their first hour (a DDP script's own process
group or its wrapper, a device the script names itself). supervise.py raises it; the rank logs hold the rest.
"""

from __future__ import annotations

import re


def left_early(ended: dict[int, tuple[int | None, str]] | None, rank: int, host: str, theirs: int | None = None) -> str:
    """The line naming the first other rank that had ended its script (`ended`: rank -> (its job
    step then, its host)) while `rank` went on, and what to do; "" where none had."""
    other = _ended_first(ended, rank)
    if other is None:
        return ""
    step, other_host = ended[other]
    return (f"rank {other} on host {other_host} ended its script{_after(step)} while rank {rank} on host {host} went "
            f"on{_after(theirs) if theirs != step else ''}: every rank must take the same steps and make the same job "
            "calls; a loop that stops early on one rank's own numbers (its loss, an evaluation of its own) stops that "
            "rank alone: decide on what every rank gets alike (job.evaluate's sums, job.reduce's) and end alike: "
            "job.stop() in job.epochs, a break on every rank in a loop of the script's own; one "
            "that starts where a file of the script's own says (a snapshot only one host holds, torchrun's way of "
            "going on) starts there alone: resume with --resume, the job's checkpoints, which every rank loads "
            "(docs/api.md)")


def _ended_first(ended: dict[int, tuple[int | None, str]] | None, rank: int) -> int | None:
    """The lowest rank other than `rank` that had ended its script (`ended`), or None."""
    return min((r for r in ended or {} if r != rank), default=None)


def summary(failures: list[dict], ended: dict[int, tuple[int | None, str]] | None = None) -> str:
    """One message for the console: the first rank that failed, where, what, its last frames.
    Where that failure is a collective left without a peer and a peer had ended its script
    (`ended`: rank -> (its job step then, its host)), the message is that peer's early end: the
    failure only follows from it."""
    first = failures[0]
    early = left_early(ended, first["rank"], first["host"], first.get("step"))
    cause = first["rank"]  # whom a later rank's collective was left without
    if early and _left_alone(first["error"]):
        lines = [early, f"  rank {first['rank']} then failed: {first['error'].split('. ')[0]}"]
        cause = _ended_first(ended, first["rank"])
    else:
        lines = [f"rank {first['rank']} on host {first['host']} failed: {first['error']}"]
    lines += [f"  {frame}" for frame in first["frames"]]
    if torchrun := TORCHRUN_VARIABLE.search(first["error"]):
        lines.append(f"  the script reads torchrun's {torchrun.group(1)}, which invoke train does not set: the rank is "
                     "job.rank, the ranks job.size, this rank's device job.device; drop torch.distributed's set-up "
                     "(init_process_group, the DDP wrapper, the DistributedSampler) and pass the model, optimizer and "
                     "DataLoader to job.prepare (docs/api.md, 'From a DDP script')")
    elif _own_distributed(first):
        lines.append("  the script starts torch.distributed itself (a DDP or torchrun habit), which hvdhetero does "
                     "for it: remove init_process_group, the DistributedDataParallel wrapper and the "
                     "DistributedSampler, pass the model, optimizer and DataLoader to job.prepare, and make a "
                     "dist.all_reduce(t) of metrics t = job.reduce(t) (docs/api.md, 'From a DDP script')")
    elif _any(first["error"], WRAPPER_GONE):
        lines.append("  where that was DDP's wrapper, which a port drops: `model.module` is `model` now, and "
                     "`with model.no_sync():` goes (each job.backward reduces; --micro-batch accumulates a step's "
                     "chunks for you) (docs/api.md, 'From a DDP script')")
    if _any(first["error"], NO_SUCH_DEVICE):
        lines.append(f"  the script names a device itself (`.cuda()`, `device=\"cuda\"`, `\"mps\"`), which host "
                     f"{first['host']} has not: move the model and tensors with `.to(job.device)`, each rank's own "
                     "device: CUDA on the PC, MPS on the Mac, else the CPU (docs/api.md, 'Scripts as users write "
                     "them')")
    elif _any(first["error"], TWO_DEVICES):
        lines.append("  tensors on two devices: a device the script chose itself (`\"cuda\" if "
                     "torch.cuda.is_available() else \"cpu\"` is the CPU on a Mac) beside the batches' job.device: "
                     "use `device = job.device` for every `.to(device)` (docs/api.md, 'Scripts as users write them')")
    if (missing := MISSING_MODULE.search(first["error"])) and not missing.group(1).startswith("_"):
        name = missing.group(1)
        top = name.split(".")[0]
        of = f" (of {top}: not there, or a version without it)" if top != name else ""
        lines.append(f"  host {first['host']} has no module {name}{of}: a module of yours belongs in the --workdir "
                     "folder, which every host gets a copy of (not in .hvdheteroignore); a package goes into the "
                     f".venv of this machine's ranks (.venv/bin/pip install {top}, by its pip name) and into a remote "
                     "host's through the inventory's pins.packages (name==version), then invoke provision "
                     "(docs/hosts.md)")
    if first.get("log"):
        lines.append(f"  full traceback and output: {first['log']}")
    others = list(dict.fromkeys(  # once each: a rank's DataLoader workers may fail with it
        f"rank {f['rank']} ({f['error'].split(':')[0]}{f', left without rank {cause}' if _left_alone(f['error']) else ''})"
        for f in failures[1:]))
    if others:
        lines.append(f"  then also: {', '.join(others)}")
    lines.append("  the other ranks were stopped")
    return "\n".join(lines)


LEFT_ALONE = ("HorovodInternalError", "Horovod has been shut down", "StalledCollective")
"""A rank's failure that a peer's absence explains: its Horovod was shut down under it (the peer's
process ended), or one of our collectives waited for it in vain (rank/collectives.py)."""


DISTRIBUTED = ("using env:// rendezvous", "Default process group has not been initialized")
"""torch.distributed's errors for a process group the script would start (init_process_group without
torchrun's variables) or assumes started (DDP, DistributedSampler, dist.get_rank())."""


TORCHRUN_VARIABLE = re.compile(r"KeyError: '((?:LOCAL_|GROUP_|ROLE_)?RANK|(?:LOCAL_)?WORLD_SIZE|MASTER_ADDR|"
                               r"MASTER_PORT)'")
"""os.environ[...] of a variable torchrun sets for each process (LOCAL_RANK before init_process_group)."""

WRAPPER_GONE = ("object has no attribute 'module'", "object has no attribute 'no_sync'")
"""torch's errors for DDP's wrapper reached after the port dropped it: model.module, model.no_sync()."""

NO_SUCH_DEVICE = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver on your system",
                  "not linked with support for mps devices")
"""torch's errors for a device the rank's host has not: `.cuda()` on a Mac (a build without CUDA)
or on a PC without a driver, `"mps"` on Linux."""

MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
"""A module the script imports that the rank's host lacks: a package not installed there, or a
module of the script's own folder that was not shipped (a C module of Python's own, `_lzma`, is
neither)."""

TWO_DEVICES = ("Expected all tensors to be on the same device",)
"""torch's error for an operation across devices: on a Mac, a script's own `device` (the CPU where
it asks only for CUDA) beside the batches job.prepare's loader puts on MPS."""


def _own_distributed(failure: dict) -> bool:
    return _any(failure["error"], DISTRIBUTED)


def _left_alone(error: str) -> bool:
    return _any(error, LEFT_ALONE)


def _any(error: str, words: tuple[str, ...]) -> bool:
    return any(w in error for w in words)


def _after(steps: int | None) -> str:
    return f" after {steps} steps" if steps is not None else ""
