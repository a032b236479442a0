"""The rank side's collectives, every one bounded in time.

Horovod's blocking calls (allreduce_, broadcast_, allgather_object, broadcast_object, barrier)
wait for ever for a rank that never joins, and its stall shutdown did not fire where one rank
waited in its gradients' allreduce and the other in a collective of its own (a script's
`if job.is_main: job.evaluate(...)`): both waited on, heartbeats beating, for ever. Each
collective here is Horovod's asynchronous form, polled by `wait`, which sleeps between polls
(no core burnt waiting for a slow rank) and gives up after `collective_timeout_s()` with
StalledCollective, saying what the script must do.

Link timings (autosync) keep Horovod's blocking calls: a poll's nap would be in the time.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import time
from typing import Any

import cloudpickle
import horovod.torch as hvd
import torch

NAP_S = (0.0002, 0.002)
"""`wait`'s first and longest sleep between polls."""
TIMEOUT_VAR = "HVDHETERO_COLLECTIVE_TIMEOUT_S"
COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits for the others in one collective before it ends the job: long enough
for what one rank may do alone between steps (rank 0 writing a checkpoint of several GB, its
own validation loop, torch.compile recompiling for a new share), short enough that a deadlock
is said in words the same session. DDP's default is 30 min."""
PATIENT = 6
"""Collectives that wait for a script's own work before training (job.prepare's first broadcast,
job.barrier: "rank 0 downloads, the others wait") wait this many times as long: a download or
tokenising on a slow host may take far longer than anything between two steps."""


class StalledCollective(RuntimeError):
    """A collective some rank never joined (`wait`'s bound)."""


_CALLS: list[str] = []
"""The script's calls (job.evaluate(), job.save()) whose collectives run now, innermost last."""


@contextlib.contextmanager
def within(call: str):
    """The collectives in the block are `call`'s: a stall names the script's call (job.evaluate()),
    not which of its collectives (the settle of the replicas) came first."""
    _CALLS.append(call)
    try:
        yield
    finally:
        _CALLS.pop()


@functools.cache
def collective_timeout_s() -> float:
    """COLLECTIVE_TIMEOUT_S, or the rank's HVDHETERO_COLLECTIVE_TIMEOUT_S (0: no limit); read once
    (wait runs for every bucket of every step)."""
    try:
        return max(0.0, float(os.environ.get(TIMEOUT_VAR) or COLLECTIVE_TIMEOUT_S))
    except ValueError:
        return COLLECTIVE_TIMEOUT_S


def patient_timeout_s() -> float:
    """The bound of a collective that waits for a script's own work (PATIENT times the bound; 0: none)."""
    return PATIENT * collective_timeout_s()


def wait(handle, what: str, limit: float | None = None):
    """hvd.synchronize(handle) without burning a core while the other ranks are not there yet.
    Horovod's own wait spins on sched_yield: a fast rank waiting a second for a slow one keeps a
    core busy all that second, which on a machine that runs anything else (a second rank of the
    job, the MPS driver thread, a browser) is taken from it. Polls instead, sleeping 0.2 ms,
    doubling to 2 ms: at most ~2 ms late, against Horovod's 5 ms cycle. `what`: the collective
    in words, for the message when the bound is passed; `limit`: seconds (0: none), by default
    collective_timeout_s()."""
    nap, since = NAP_S[0], time.monotonic()
    limit = collective_timeout_s() if limit is None else limit
    what = _CALLS[-1] if _CALLS else what
    while not hvd.poll(handle):
        time.sleep(nap)
        nap = min(2 * nap, NAP_S[1])
        if limit and time.monotonic() - since > limit:
            raise StalledCollective(
                f"rank {hvd.rank()} waited {limit:.0f} s for the other ranks to join its collective ({what}): "
                "another rank is in a call this one never makes, or still busy on its own. Every rank must make "
                "the same calls in the same order -- job.save, job.evaluate, job.barrier, job.epochs' loop, "
                "job.stop -- each on every rank and decided alike (not under `if job.is_main:`, not on a value "
                f"one rank computed alone); work one rank does alone for longer needs {TIMEOUT_VAR} raised "
                f"(--env {TIMEOUT_VAR}=SECONDS; 0: no limit)")
    return hvd.synchronize(handle)


def allreduce_(tensor: torch.Tensor, op, name: str, what: str = "", limit: float | None = None) -> torch.Tensor:
    """hvd.allreduce_ (in place, on a CPU tensor), bounded."""
    return wait(hvd.allreduce_async_(tensor, op=op, name=name), what or name, limit)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str, what: str = "",
               limit: float | None = None) -> torch.Tensor:
    """hvd.broadcast_ (in place, on a CPU tensor), bounded."""
    return wait(hvd.broadcast_async_(tensor, root_rank=root_rank, name=name), what or name, limit)


def barrier(name: str = "hvdhetero.barrier", what: str = "job.barrier()", limit: float | None = None) -> None:
    """Every rank gets here before any goes on (an allreduce of nothing), bounded."""
    allreduce_(torch.zeros(1), hvd.Sum, name, what, limit)


def allreduce_sum(values: list[float], name: str) -> list[float]:
    """Sum small lists of numbers across ranks (metrics, sample counts), in float64."""
    t = torch.tensor(values, dtype=torch.float64)
    allreduce_(t, hvd.Sum, name)
    return t.tolist()


def allgather_object(obj: Any, name: str, what: str = "") -> list[Any]:
    """Every rank's `obj` (small plain values: names, numbers, an error's text), in rank order,
    bounded; pickled as Horovod's own allgather_object pickles them."""
    data = _tensor(cloudpickle.dumps(obj))
    sizes = wait(hvd.allgather_async(torch.tensor([data.numel()], dtype=torch.int64), name=f"{name}.sz"),
                 what or name)
    gathered = memoryview(wait(hvd.allgather_async(data, name=f"{name}.t"), what or name).numpy())
    ends = torch.cumsum(sizes, 0).tolist()
    return [cloudpickle.loads(gathered[end - n:end]) for n, end in zip(sizes.tolist(), ends)]


def broadcast_object(obj: Any, root_rank: int, name: str, what: str = "", limit: float | None = None) -> Any:
    """`root_rank`'s `obj` on every rank (others pass None), bounded."""
    data = _tensor(cloudpickle.dumps(obj)) if hvd.rank() == root_rank else None
    return cloudpickle.loads(_broadcast_bytes(data, root_rank, name, what, limit))


def broadcast_loadable(state: Any, name: str) -> Any:
    """Rank 0's `state` (a checkpoint, an elastic commit: tensors and plain values) to every rank
    as torch.save bytes, read back with weights_only=True: nothing a peer sends is unpickled.
    Other ranks pass None."""
    data = None
    if hvd.rank() == 0:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = _tensor(buffer.getvalue())
    return torch.load(io.BytesIO(_broadcast_bytes(data, 0, name)), map_location="cpu", weights_only=True)


def _tensor(data: bytes) -> torch.Tensor:
    """`data` as the uint8 CPU tensor Horovod sends."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _broadcast_bytes(data: torch.Tensor | None, root_rank: int, name: str, what: str = "",
                     limit: float | None = None) -> bytes:
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    broadcast_(size, root_rank, f"{name}.size", what, limit)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, f"{name}.state", what, limit)
    return data.numpy().tobytes()
