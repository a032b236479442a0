"""--elastic inside a rank: Horovod elastic around the user's whole script, commits in memory.

    python -m hvdhetero.rank.runner ...   # runner.main: elastic.run(script) when config.elastic

Horovod elastic retries a function from a sync point when a peer fails (HorovodInternalError)
or hosts change (HostsUpdatedInterrupt, raised at a commit). Our public API has no function to
retry, only the user's loop, so the function is the whole script: on a reset it runs again from
the top, `hh.init()` hands out a new Job for the new membership, and `job.prepare` fast-forwards
the fresh model, optimizer and loader to the last commit (as --resume does from a checkpoint,
rank/resume.py). A host that joins runs the very same script from the top, so survivors and
newcomers make the same collectives in the same order: none of them waits in a broadcast the
others never make (horovod#2652's hang), and the state is synced after every reset, removals
included (horovod#3494's deadlock comes from skipping that sync).

A commit is a CPU copy of resume.snapshot (this rank's own random states), taken every
--commit-every steps as a step begins and at every epoch's end; Horovod's commit() then checks
for hosts that came or went (one small broadcast) and raises HostsUpdatedInterrupt there.

With --sync local:H / diloco:H a commit waits for a round's end (the first after --commit-every
steps; an epoch's end only if a round ended there), where every rank has the same model, anchor
and outer optimizer state and is at the same step. So a reset restarts a round from a state
every rank agrees on: an exchange in flight at a failure dies with the old Job, never half
applied, and the next one is weighted by the new membership's samples. Each rank's inner
optimizer state is its own: a survivor keeps its own, a newcomer starts from rank 0's.

Overlapped, the round that just ended is still on the link at that point. Waiting for it (a
flush) would expose one exchange every commit, which with --commit-every below H is every
round: the overlap lost. Instead the commit is taken there without the model (`pending`) and
completed when that round lands, at the next round's end, before the next exchange is launched
(ParameterSync.on_landed): its model is then the global model with that round applied, and its
outer state the one after it, exactly what a flush at the commit's step would have left (one
model on every rank). Horovod's check for hosts that came or went is made there too, where
nothing is in flight. A failure before the commit completes goes back to the one before: up to
one round more redone.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import horovod.torch as hvd
import torch
from horovod.common.elastic import State

from hvdhetero.rank import checkpoint, current, resume
from hvdhetero.rank import collectives

if TYPE_CHECKING:
    from hvdhetero.rank.training import Training


class Commits(State):
    """Horovod's elastic State for our Job: the last commit, kept across resets (the process
    lives on; the Job is made anew)."""

    def __init__(self):
        super().__init__(bcast_object=lambda obj: collectives.broadcast_object(obj, 0, "hvdhetero.elastic.hosts",
                                                                               "an elastic commit's host check"),
                         get_rank=hvd.rank)
        self.state: dict[str, Any] | None = None
        self.pending: tuple[dict[str, Any], int, bool] | None = None
        """Overlapped: a commit waiting for its round to land (state without its model, the
        round it waits for, whether to check hosts then)."""
        self.reached = 0
        """The furthest step taken since the last commit (what a reset redoes)."""
        self.resets = 0
        self.reset_at: float | None = None
        self.started = time.perf_counter()

    def save(self) -> None:
        pass  # commit() puts the snapshot in `state` first (take)

    def restore(self) -> None:
        pass  # the commit stays; job.prepare loads it when the script runs again

    def sync(self) -> None:
        pass  # job.prepare syncs, the same collectives on survivors and newcomers

    def reset(self) -> None:
        """The membership changed: the next hh.init() builds a Job for it."""
        self.resets += 1
        self.reset_at = time.time()
        self.pending = None  # its round died with the old Job
        job = current.drop()
        if job is not None:
            self.reached = max(self.reached, job.train_state.step)
            job.close()


COMMITS: Commits | None = None


def run(script: Callable[[], None]) -> None:
    """Run `script` under Horovod elastic: again from the top after every reset."""
    global COMMITS
    COMMITS = Commits()
    hvd.elastic.run(lambda state: script())(COMMITS)


def running(config) -> Commits | None:
    """The commits when this job runs under --elastic, launched by the runner (which keeps them
    across resets); None otherwise (no --elastic, or the script run without the launcher)."""
    return COMMITS if config.elastic else None


def commit(t: Training, epoch_done: bool = False, check_hosts: bool = True) -> None:
    """Keep everything a resume needs in memory; then (check_hosts) raise HostsUpdatedInterrupt
    on every rank alike if hosts came or went. With local/diloco only between rounds (the Job
    calls it there), so that the commit holds one model and the outer state every rank agrees
    on; overlapped, with the round just ended in flight, it is completed (and the hosts checked)
    when that round lands (`_complete`), so that nothing is in flight at a reset here."""
    strategy = t.strategy
    landing = strategy.unsettled  # overlapped: the round just ended is in flight
    assert strategy.between_rounds, "an elastic commit in the middle of a local/diloco round"
    state = resume.snapshot(t, rng=checkpoint.rng_state(t.me.device.name), optimizer=t.optimizer.state_dict(),
                            epoch_done=epoch_done, landing=landing)
    state["metrics_host"] = socket.gethostname() if t.is_main else None  # whose metrics_offset it is
    t.train.last_commit = t.train.step
    if landing:
        COMMITS.pending = (_copied(state), strategy.rounds, check_hosts)
        strategy.sync.on_landed = lambda: _complete(t)
        return
    COMMITS.state, COMMITS.reached = _copied(state), t.train.step
    if check_hosts:
        COMMITS.check_host_updates()


def _complete(t: Training) -> None:
    """ParameterSync.on_landed: the round a pending commit waits for has landed (every rank at
    the same round's end, nothing in flight): the global model and outer state are now what a
    flush at the commit's step would have left; the commit holds them, then the hosts check."""
    sync = t.strategy.sync
    if COMMITS.pending is None or sync.applied < COMMITS.pending[1]:
        return
    (state, _, check_hosts), COMMITS.pending = COMMITS.pending, None
    state["sync"] = _copied(sync.landed_state())
    kept, live = state["sync"]["start"] + state["sync"]["start_buffers"], sync.params + sync.buffers
    # every name the snapshot left out: tied weights (an embedding and a head) are one tensor
    # under two names, and loading the commit puts the last of them into it
    for name, i in sync.exchanged_names(t.model).items():
        state["model"][name] = kept[i].view_as(live[i]).to(live[i].dtype)  # the sync's copy, shared
    COMMITS.state, COMMITS.reached = state, t.train.step
    if check_hosts:
        COMMITS.check_host_updates()


def rejoin(t: Training) -> str | None:
    """In job.prepare: every rank continues from the last commit (rank 0's, which a newcomer
    gets through one broadcast); None before the first commit."""
    mine = COMMITS.state["step"] if COMMITS.state is not None else -1
    steps = collectives.allgather_object(mine, "hvdhetero.elastic.steps")
    if steps[0] < 0:
        return None
    state = (COMMITS.state if len(set(steps)) == 1
             else collectives.broadcast_loadable(COMMITS.state if t.is_main else None, "hvdhetero.elastic"))
    own = COMMITS.state is not None and mine == state["step"]
    if own:  # a survivor keeps its own optimizer state (local/diloco: each rank's inner one differs)
        state = {**state, "optimizer": COMMITS.state["optimizer"]}
    was = state.get("hosts") or []
    resume.restore(t, _copied(state), COMMITS.state["rng"] if own else None)
    # what was written after the commit is redone; if rank 0 moved (its host was dropped), its records
    # are kept, less a line it was killed writing
    t.records.truncate(state["metrics_offset"] if state.get("metrics_host") == socket.gethostname() else None)
    step, hosts = t.train.step, t.host_names
    redone = max(0, COMMITS.reached - step)
    COMMITS.reached = step
    t.records.write("elastic", step=step, epoch=t.train.epoch, ranks=t.size, hosts=hosts, was=was,
                    redone_steps=redone, resets=COMMITS.resets,
                    reset_s=round(time.time() - COMMITS.reset_at, 3) if COMMITS.reset_at else None)
    if t.is_main:
        gone, came = sorted(set(was) - set(hosts)), sorted(set(hosts) - set(was))
        change = "; ".join(([f"dropped {', '.join(gone)}"] if gone else []) + ([f"joined {', '.join(came)}"]
                                                                                  if came else []))
        print(f"hvdhetero: elastic: {change or 'same hosts'}; continuing on {t.size} rank(s) "
              f"({', '.join(hosts)}) from the commit at step {step} ({redone} steps redone)", flush=True)
    return f"elastic commit at step {step}"


def _copied(obj):
    """`obj` with every tensor copied to the CPU (a commit must not change with the live model)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _copied(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copied(v) for v in obj)
    return obj
