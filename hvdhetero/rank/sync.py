"""Syncing every H steps instead of every step: local SGD and DiLoCo, optionally overlapped.

With `--sync local:H` or `--sync diloco:H` each rank steps its own optimizer on its own share's
gradient (nothing crosses the link), and every H optimizer steps the ranks' parameters meet in
one allreduce, each rank weighted by the samples it processed in the round, w_i = n_i / sum(n):

    local:H    theta = sum_i w_i theta_i                         (weighted parameter averaging)
    diloco:H   delta = sum_i w_i (theta_start - theta_i)          (the round's pseudo-gradient)
               theta = theta_start after one outer Nesterov SGD step on delta (lr 0.7, momentum 0.9)

local:1 with plain SGD is exactly step sync: sum_i w_i (theta - lr g_i) = theta - lr sum_i w_i g_i.
With `--inner-steps by-speed` a slower rank merges its shares of several steps into one optimizer
step: its change counts per global step of the round (x H / its steps) and is added to the
average of the ranks that took every step (weights summing to 1 among them) instead of being
averaged in with them, so a host that adds a few steps of its own never shrinks the round of the
host that took all of them (`_apply_pending`).
The inner optimizer's state (momentum, Adam moments) stays each rank's own, as in the papers;
the outer optimizer's state is float32 on the CPU and identical on every rank (same inputs).
Floating-point buffers (BatchNorm statistics) are averaged by samples (under by-speed too).

Overlapped (`--overlap-sync`): the allreduce of round r runs in Horovod's background thread while
round r+1 computes, and is applied one round late. Every rank keeps the global model theta_g
(the same on every rank) and its own progress of the round, d_i = (round start) - (round end):

    end of round r:   wait for round r-1's mean change D_{r-1} = sum_i w_i d_i^{r-1};
                      theta_g <- outer step on D_{r-1}  (local: theta_g - D_{r-1}; diloco: Nesterov)
                      this rank continues from theta_g - d_i^r  (its own round r progress kept)
                      start the allreduce of w_i d_i^r  (applied at the end of round r+1)

So at any time a rank's model is the global model with every round up to r-1 applied plus its
own unexchanged progress of round r. What the delay costs: each rank's round r+1 starts without
the other ranks' round r work (it sees it one round later), as in streaming DiLoCo's overlapped
communication and "eager updates"; with H steps per round the information from the other ranks
is H..2H steps old instead of 0..H. Without overlap, local:H is the same rule with theta_g = the
round's average, so the two differ only by when the others' progress arrives.

Between exchanges every rank has its own model. Where one model matters, `flush` applies the
round in flight and exchanges the partial one at once: job.evaluate, job.save and the end of
job.epochs call it (not every epoch's end: that cost one exposed exchange an epoch). A script
that saves the model itself between those gets its rank's own replica. Where a model some
rounds old will do, `global_model` lends the global model theta_g (the same on every rank, every
round applied so far) for a block, with nothing exchanged: job.evaluate(..., exchange=False), the
model DiLoCo evaluates. It lacks the ranks' progress since the last round that landed: 0..1
round without overlap, 1..2 rounds overlapped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

from hvdhetero.errors import ConfigError
from hvdhetero.policy.round_clock import RoundClock
from hvdhetero.rank.host import one_hot
from hvdhetero.rank.collectives import wait
from hvdhetero.rank.reducer import WIRE_DTYPES


def exchanged_tensors(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What a round's exchange carries: the trainable parameters and the floating-point buffers
    (`invoke plan` times the link on the same bytes)."""
    return ([p for p in model.parameters() if p.requires_grad],
            [b for b in model.buffers() if b.is_floating_point()])


def _cpu(tensors) -> list[torch.Tensor]:
    return [t.detach().to("cpu", torch.float32, copy=True) for t in tensors]


class ParameterSync:
    """Counts a rank's steps and samples; every `every` steps, the exchange."""

    def __init__(self, model: torch.nn.Module, kind: str, every: int, global_batch: int, compression: str = "none",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, overlap: bool = False, settings=None):
        self.kind, self.every, self.overlap, self.global_batch = kind, every, overlap, global_batch
        self.wire = WIRE_DTYPES[compression]
        self._carry(model)
        self.outer = None
        if kind == "diloco":
            self.outer = torch.optim.SGD(self.start, lr=outer_lr, momentum=outer_momentum, nesterov=True)
        self.clock = RoundClock(every, overlap)
        """Where this rank's rounds end (policy/round_clock.py): the round's global and optimizer steps."""
        self.steps = self.samples = 0
        self.seconds = 0.0
        self._mark: float | None = None
        """When this rank's previous step ended (None after a pause)."""
        self.rounds = 0
        self.applied = 0
        """Rounds whose mean change is in the global model (overlapped: one behind `rounds`)."""
        self._pending = None
        """Overlap: the Horovod handles of the round in flight (counts, changes) and its global
        steps."""
        self.last_exchange_s = 0.0
        """Seconds the last exchange blocked this rank (waiting for the slower one included)."""
        self.wait_s = 0.0
        """Of those, seconds waiting for the round applied (its slowest rank, then the link)."""
        self.landed_steps = 0
        """The global steps of the round applied last (H; a flush's part round fewer, an overlapped
        round run on to its epoch's end more)."""
        self.inner_steps: list[int] = []
        """Every rank's optimizer steps in the round applied last (fewer than H on a rank that
        merged steps: --inner-steps by-speed)."""
        self.link_late = False
        """Whether the round applied was still on the link (or a rank had not sent it) when this
        rank came to apply it."""
        self.on_landed: Callable[[], None] | None = None
        """Called each time a round has been applied, on every rank at the same step, with
        nothing in flight (an elastic commit taken with a round in flight completes there)."""
        self.settings = settings
        """The optimizer's settings (rank/replicas.py's Replicas): a checksum of each rank's rides
        with the round's counts, and where any differs from rank 0's when the round lands, every
        rank takes rank 0's (a scheduler stepped on a rank's own loss halved its lr alone)."""

    def after_step(self, samples: int, seconds: float, steps: int = 1,
                   epoch_left: int | None = None) -> tuple[list[float], list[float]] | None:
        """Record one optimizer step of this rank (`seconds`: its compute), spanning `steps`
        global steps (more than 1 when it merged them: --inner-steps by-speed); at the round's
        end exchange, and return what `exchange` returns, else None. Overlapped, given the
        steps left in the epoch (`epoch_left`), a round that would leave fewer than H of them
        runs on to the epoch's end instead (`RoundClock.due`). Rounds and the timings
        the balancer hears count global steps, whatever each rank merged.

        A step's seconds here are the whole time since the previous step ended: what makes a
        rank late at the round's end is everything it does per step (the optimizer's update,
        the loader, the script's own lines), not only forward and backward. Fed compute alone,
        the balancer left a 12x-slower rank ~4% behind the fast one every round (the fast rank
        waited 0.1-0.5 s per 4.5 s round), because the update costs both ranks alike while the
        slow one had 20x fewer samples to spread it over. The first step after a pause
        (an evaluation, an epoch's end) counts its compute only."""
        now = time.perf_counter()
        self.steps += steps
        self.clock.took(steps)
        self.samples += samples
        self.seconds += max(seconds, now - self._mark) if self._mark is not None else seconds
        times = self.exchange() if self.clock.due(epoch_left) else None
        self._mark = time.perf_counter()
        return times

    def _carry(self, model: torch.nn.Module) -> None:
        """What the exchange carries from now on: `model`'s trainable parameters and floating-point
        buffers, each round starting at them as they are."""
        self.params, self.buffers = exchanged_tensors(model)
        self.start = _cpu(self.params)
        """The round's start: the global model (without overlap, also this rank's round start)."""
        self.start_buffers = _cpu(self.buffers)
        self.local_start: list[torch.Tensor] | None = None
        self._local_buffers: list[torch.Tensor] | None = None
        """Overlap: this rank's own round start (global model minus its unexchanged progress)."""

    def retarget(self, model: torch.nn.Module) -> None:
        """The model's trainable parameters changed (a backbone unfrozen, a new head), with the
        ranks holding one model (a flush just now, nothing in flight): the exchange carries those
        from here on, each round starting at the model as it is. The outer optimizer's momentum
        stays with each parameter it had; a new one starts without."""
        if self.unsettled:
            raise RuntimeError("ParameterSync.retarget() with a round in flight: flush() first")
        kept = {}
        if self.outer is not None:
            for p, start in zip(self.params, self.start):
                state = self.outer.state.get(start)
                if state:
                    kept[id(p)] = state
        self._carry(model)
        if self.outer is not None:
            group = {k: v for k, v in self.outer.param_groups[0].items() if k != "params"}
            self.outer = torch.optim.SGD(self.start, **group)
            for p, start in zip(self.params, self.start):
                if id(p) in kept:
                    self.outer.state[start] = kept[id(p)]

    @property
    def round_steps(self) -> int:
        """Global steps taken in the round in progress (0: between rounds)."""
        return self.clock.steps

    def exchanged_names(self, model: torch.nn.Module) -> dict[str, int]:
        """Each name in `model`'s state dict whose tensor a round's exchange carries, with its place
        in params + buffers (and in start + start_buffers): a tied weight is one place under
        several names; a module's extra state (no tensor) and a frozen parameter are never here."""
        place = {id(t): i for i, t in enumerate(self.params + self.buffers)}
        return {name: place[id(t)] for name, t in model.state_dict(keep_vars=True).items() if id(t) in place}

    def state_dict(self) -> dict:
        """The global model, the outer optimizer and the round counts (after a flush: nothing in
        flight, no partial round)."""
        if self.unsettled:
            raise RuntimeError("ParameterSync.state_dict() with a round in flight: flush() first")
        return self.landed_state()

    def landed_state(self) -> dict:
        """What `state_dict` would hold after a flush at the end of the last round applied: its
        global model and outer state, every round launched by then applied. Live tensors: copy
        them to keep them."""
        return {"start": self.start, "start_buffers": self.start_buffers, "rounds": self.applied,
                "applied": self.applied, "outer": self.outer.state_dict() if self.outer is not None else None}

    def load_state_dict(self, state: dict) -> None:
        mine, saved = self.start + self.start_buffers, state["start"] + state["start_buffers"]
        if len(mine) != len(saved) or any(m.shape != s.shape for m, s in zip(mine, saved)):
            raise ConfigError(f"the checkpoint's rounds carried {len(state['start'])} trainable parameters, this run's "
                              f"{len(self.start)}: the model's trainable parameters changed during the run (a backbone "
                              "unfrozen, a head made) and are not so at job.prepare now; make the same parameters "
                              "trainable before job.prepare as at the checkpoint (a script that unfreezes at epoch k "
                              "does so before job.prepare when it resumes past k)")
        for m, s in zip(mine, saved):
            m.copy_(s)
        self.rounds, self.applied = state["rounds"], state["applied"]
        if self.outer is not None and state["outer"] is not None:
            self.outer.load_state_dict(state["outer"])

    def land(self) -> None:
        """The exchange in flight, if any, waited for and applied (the script ends)."""
        self._apply_pending()

    def pause_clock(self) -> None:
        """Training pauses (an evaluation, an epoch's end): the next step counts its compute only."""
        self._mark = None

    @property
    def unsettled(self) -> bool:
        """Whether the ranks' models may differ: a partial round, or a round still in flight."""
        return bool(self.clock.steps) or self._pending is not None

    def flush(self) -> tuple[list[float], list[float]] | None:
        """One model on every rank now: the round in flight applied, the partial round exchanged."""
        return self.exchange(wait=True) if self.unsettled else None

    def exchange(self, wait: bool = False) -> tuple[list[float], list[float]] | None:
        """The round's end, on every rank together (collectives): launch this round's exchange;
        apply the previous one (overlapped) or this one (not, or `wait`: a flush). Returns every
        rank's mean step seconds and mean samples per step in the round applied (for the
        balancer: what that round ran, whatever the split is now), or None when none was.

        Nothing here waits for the other ranks to reach this round's end: the round's sample
        counts travel with it (asynchronously too), so a rank that finishes a round first goes
        on with the next, and only applying a round waits for it. Overlapped, a rank late by
        less than a round costs the others nothing (with a blocking count first, the fast rank
        of a 12x-slower pair waited 0.1-0.6 s in most 2.3 s rounds: the slow rank's step times
        vary by more than the balancer can split for)."""
        started = time.perf_counter()
        times, self.wait_s, self.link_late = None, 0.0, False
        steps, updates = self.clock.steps, self.clock.updates
        if steps:
            times = self._apply_pending()  # the round in flight first (none without overlap)
            mine = self._progress()
            # Scaled by samples over the round's nominal total (fp16 on the wire keeps its range);
            # the true total arrives with it and corrects the scale (a short last step).
            nominal = float(steps * self.global_batch)
            flat = torch.cat([t.reshape(-1) for t in mine]).mul_(self.samples / nominal) if mine else torch.zeros(0)
            # A rank that merged steps (--inner-steps by-speed) took fewer, bigger optimizer steps
            # and moved that much less: its parameters' change counts per global step of the
            # round (normalized averaging, as FedNova's), and `_apply_pending` adds it to the
            # other ranks' instead of averaging it in. Buffers (running statistics) as they are.
            flat[:sum(p.numel() for p in self.params)].mul_(steps / updates)
            settings = one_hot(self.settings.settings_sum()) if self.settings is not None else []
            self._launch(flat, [float(self.samples), *one_hot(self.seconds / steps), *one_hot(self.samples / steps),
                                *one_hot(updates), *one_hot(self.steps), *settings], steps, self.clock.origin + steps)
            self.rounds += 1
            self.samples, self.seconds = 0, 0.0
            # the next round's counts start at 0; its origin is set by the job, which knows the
            # global step (Rounds._exchanged, rank/strategy.py)
            self.clock.steps = self.clock.updates = 0
            if self.overlap and not wait:
                self._continue_from_global(mine)
                self.last_exchange_s = time.perf_counter() - started
                return times
        while self._pending is not None:  # without overlap, or flushing: every round lands now
            times = self._apply_pending() or times
        self._continue_from_global(None)
        self.last_exchange_s = time.perf_counter() - started
        return times

    @contextlib.contextmanager
    def global_model(self):
        """The model's parameters and buffers hold the global model for the block (every round
        applied so far, none of this rank's unexchanged progress), this rank's own after it (kept
        on the CPU meanwhile). Nothing crosses the link, and every rank lends the same model."""
        mine = self.params + self.buffers
        own = [t.detach().to("cpu", copy=True) for t in mine]
        try:
            with torch.no_grad():
                for t, glob in zip(mine, self.start + self.start_buffers):
                    t.copy_(glob.view_as(t))
            yield
        finally:
            with torch.no_grad():
                for t, kept in zip(mine, own):
                    t.copy_(kept.view_as(t))

    # -- the exchange's parts -----------------------------------------------------------------

    def _outer_step(self, deltas) -> None:
        for start, delta in zip(self.start, deltas):
            start.grad = delta.view_as(start).clone()
        self.outer.step()

    def _progress(self) -> list[torch.Tensor]:
        """This rank's change over the round (round start - now), parameters then buffers."""
        starts = self.local_start or self.start
        bstarts = self._local_buffers if self.local_start is not None else self.start_buffers
        now = [p.detach().to("cpu", torch.float32) for p in self.params]
        bnow = [b.detach().to("cpu", torch.float32) for b in self.buffers]
        return [s - p for s, p in zip(starts, now)] + [s - b for s, b in zip(bstarts, bnow)]

    def _launch(self, flat: torch.Tensor, counts: list[float], round_steps: int, end: int) -> None:
        """`end`: the global step the round ends at."""
        # Horovod's background thread reduces both (overlapped: while the next round computes).
        counts_handle = hvd.allreduce_async_(torch.tensor(counts, dtype=torch.float64), op=hvd.Sum,
                                             name=f"hvdhetero.sync.counts.{self.rounds}")
        handle = hvd.allreduce_async_(flat.to(self.wire), op=hvd.Sum, name=f"hvdhetero.sync.params.{self.rounds}")
        self._pending = (counts_handle, handle, round_steps, end)

    def _apply_pending(self) -> tuple[list[float], list[float]] | None:
        """Wait for the previous round's exchange and step the global model with it; returns
        that round's mean step seconds and mean samples per step of every rank (None when
        nothing was in flight)."""
        if self._pending is None:
            return None
        (counts_handle, handle, round_steps, end), self._pending = self._pending, None
        self.link_late = not hvd.poll(handle)
        waited = time.perf_counter()
        total, *rest = wait(counts_handle, "a parameter exchange").tolist()
        n = len(rest) // (4 if self.settings is None else 5)
        self.inner_steps = [int(u) for u in rest[2 * n:3 * n]]
        self.landed_steps = round_steps
        steps = [int(s) for s in rest[3 * n:4 * n]]
        if len(set(steps)) > 1:
            raise RuntimeError(f"the ranks reached round {self.applied + 1}'s exchange at different global steps "
                               f"{steps}: with --inner-steps by-speed the ranks meet only at a round's or an epoch's "
                               "end; call job.evaluate/job.save (or a collective of your own) at epochs' ends, "
                               "not every N steps")
        flat = wait(handle, "a parameter exchange").to(torch.float32)
        self.wait_s = time.perf_counter() - waited
        if self.settings is not None:  # alike on every rank, so every rank enters its collective or none does
            self.settings.same_settings(rest[4 * n:], end)
        # Parameters: the ranks that took every step of the round split each global batch between
        # them, as step sync does, and their changes average (by samples, weights summing to 1);
        # a rank that merged steps took steps of its own on samples they never saw, and its change
        # (per global step, see `exchange`) adds to theirs: each of its steps counts by its batch
        # over theirs, as an asynchronous worker's would. So the round moves the model at least as
        # far as the ranks that took every step alone would have. Buffers average by samples.
        nominal = float(round_steps * self.global_batch)  # what `exchange` divided the changes by
        full = [updates >= round_steps for updates in self.inner_steps]
        every_step = total if all(full) else sum(per_step * round_steps
                                                 for per_step, f in zip(rest[n:2 * n], full) if f)
        params = sum(t.numel() for t in self.start)
        flat[:params].mul_(nominal / (every_step or total))
        flat[params:].mul_(nominal / total)
        chunks = list(flat.split([t.numel() for t in self.start + self.start_buffers]))
        deltas, bdeltas = chunks[:len(self.start)], chunks[len(self.start):]
        if self.kind == "diloco":
            self._outer_step(deltas)
        else:
            for s, d in zip(self.start, deltas):
                s.sub_(d.view_as(s))
        for s, d in zip(self.start_buffers, bdeltas):
            s.sub_(d.view_as(s))
        self.applied += 1
        if self.on_landed is not None:
            self.on_landed()
        return rest[:n], rest[n:2 * n]

    def _continue_from_global(self, progress: list[torch.Tensor] | None) -> None:
        """This rank's model := the global model minus its own unexchanged progress (none: the
        global model itself)."""
        n = len(self.start)
        own = progress[:n] if progress is not None else [None] * n
        bown = progress[n:] if progress is not None else [None] * len(self.buffers)
        new = [s - d if d is not None else s.clone() for s, d in zip(self.start, own)]
        bnew = [s - d if d is not None else s.clone() for s, d in zip(self.start_buffers, bown)]
        with torch.no_grad():
            for p, v in zip(self.params, new):
                p.copy_(v.view_as(p))
            for b, v in zip(self.buffers, bnew):
                b.copy_(v.view_as(b))
        self.local_start, self._local_buffers = (new, bnew) if progress is not None else (None, None)
