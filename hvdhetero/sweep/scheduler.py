"""A sweep's loop: the Optuna study, the hosts' clocks, which trial runs where and when.

The study lives on the launcher: Optuna with ask-and-tell and a SQLite file in the sweep's
folder (no storage server anywhere). A trial's metric comes back without shared storage: the
trial's launcher keeps rank 0's progress lines, which carry the script's `job.log` scalars, in
TRIAL_DIR/progress.jsonl (cluster/console.py); each epoch's value is reported to the study (a
loop of the script's own over a source with no end: each value at the global step it was logged
at), and with --prune a trial the median pruner judges worse than the others at the same epoch
(step) is stopped.

Which host runs what is policy/sweep.py's rule: every host starts a trial (running is how its
speed is measured); once a trial's end can be told from its progress, a trial that would end
after the fast hosts alone would have done it is stopped and run again on a faster host, and a
free host starts a trial only where the plan gives it one. The sweep so ends no later than the
fastest host alone would.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hvdhetero.errors import ConfigError, HvdHeteroError, LaunchError
from hvdhetero.policy import sweep as policy
from hvdhetero.sweep import board, records
from hvdhetero.sweep.hosts import HOST_FAILURES, Hosts
from hvdhetero.sweep import space as spaces
from hvdhetero.sweep.request import Request, train_command
from hvdhetero.sweep.trial import Trial

STUDY_FILE = "study.db"
STUDY_NAME = "hvdhetero-sweep"
POLL_S = 0.5
STOP_GRACE_S = 30.0
"""A stopped trial gets this long to end (invoke train stops its ranks within 15 s of SIGTERM);
then its whole session is killed."""


class Sweep:
    """One sweep, from its folder: the study, the hosts' clocks, the running trials."""

    def __init__(self, request: Request, folder: Path, tasks_root: Path, out=None, timeout: float = 0.0):
        import optuna

        self.request, self.folder, self.tasks_root = request, folder, tasks_root
        self.timeout = timeout
        """--timeout: seconds after which no trial starts (Optuna's optimize(timeout=)); 0: none."""
        self.began: float | None = None
        """When this run launched its first trial (--timeout counts from there: the checks before do not count)."""
        self.timed_out = False
        """--timeout has passed (said once)."""
        self.board = board.Board(out or sys.stdout, self.board_rows, self.board_title, request.metric)
        self.space = spaces.load(request.space, request.script)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1) if request.prune \
            else optuna.pruners.NopPruner()
        self.study = optuna.create_study(
            storage=f"sqlite:///{folder / STUDY_FILE}", study_name=STUDY_NAME, load_if_exists=True,
            direction="minimize" if request.mode == "min" else "maximize", pruner=pruner,
            sampler=optuna.samplers.TPESampler(seed=request.seed))
        if self.study.trials:  # resumed: seeded as at the start, it would ask the first trials' parameters again
            self.study.sampler = optuna.samplers.TPESampler(seed=request.seed + len(self.study.trials))
        if not self.study.trials:
            for params in request.enqueued:
                self.study.enqueue_trial(params)
        self.records = records.read(folder / records.TRIALS_FILE)
        self.running: dict[str, Trial] = {}
        """What each busy host runs (a trial being stopped included: its host is busy until it ends)."""
        self.pending: list[tuple[Any, list[str]]] = []
        """Trials stopped on a slow host, to run again elsewhere (with the hosts they were stopped on)."""
        self.reported: dict[int, set[int]] = {}
        """The epochs each trial reported to the study (a trial may run on two hosts at the end)."""
        self.hosts = Hosts(request.hosts, self.records, request.budget)
        """Each host's speed and failures, a whole trial's length (sweep/hosts.py)."""
        self.last_error = ""
        self.told_alone: set[str] = set()
        """Hosts whose trials' ranks were said to train slower together than one alone (once each)."""

    def clocks(self, now: float) -> dict[str, policy.HostClock]:
        return self.hosts.clocks(now, self.running)

    def done(self) -> int:
        return sum(1 for r in self.records if r["state"] in ("complete", "pruned", "failed"))

    def under_way(self) -> set[int]:
        """The trials running somewhere (not one being stopped: moved, pruned (counted done), cut; nor a short one)."""
        return {t.trial.number for t in self.running.values() if not t.stopping and not t.short}

    def left(self) -> int:
        """Trials not started yet (those waiting to run again included)."""
        return self.request.trials - self.done() - len(self.under_way())

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        self.say(f"{self.request.trials} trials of {self.space.path.name} on {', '.join(self.request.hosts)}"
                 + (f"; {self.done()} done already" if self.done() else "") + f" ({self.folder})")
        while self.done() < self.request.trials or self.running:
            now = time.time()
            for trial in list(self.running.values()):
                self.poll(trial, now)
            if self.done() >= self.request.trials or self.out_of_time(now):
                self.cut_short_trials()
                if not self.running:  # (out of time: what ran has ended)
                    break
            else:
                self.start_trials(time.time())
                if not self.running:
                    raise LaunchError("no host is left to run the sweep's trials (" + ", ".join(
                        f"{h}: {HOST_FAILURES} failed trials in a row" for h in sorted(self.hosts.dropped))
                        + f"); the last said: {self.last_error}")
            time.sleep(POLL_S)

    def out_of_time(self, now: float) -> bool:
        """--timeout has passed: no trial starts from now on (the running ones end as they would)."""
        if not self.timeout or self.began is None or now - self.began < self.timeout:
            return False
        if not self.timed_out:
            self.timed_out = True
            self.say(f"--timeout {self.timeout:g} s: no trial starts from now on; "
                     + (f"{len(self.under_way())} running end as they would" if self.under_way() else "none is running"))
        return True

    def poll(self, trial: Trial, now: float) -> None:
        """What a running trial's progress says since the last poll: its values to the study (pruned?),
        a short trial of a loop cut once its last value is in, its end judged; it ended, or is killed
        once a stop outlasts STOP_GRACE_S."""
        trial.read()
        self.hosts.length_of(trial)
        if not trial.stopping:
            self.report(trial)
        if not trial.stopping and trial.cut_at and self.cut_due(trial):
            self.cut(trial)
        if not trial.stopping:
            self.judge(trial, now)
        if trial.proc.poll() is not None:
            trial.read()  # what it wrote last (its end record)
            if not trial.stopping:
                self.report(trial, prune=False)
            self.ended(trial)
        elif trial.stopping and now - trial.stopped_at > STOP_GRACE_S:
            trial.kill()

    def cut_due(self, trial: Trial) -> bool:
        """A short trial of a loop: its value at cut_at is in (finite or not: a diverged one ends too),
        or it went an interval past it without logging one there."""
        logged = trial.epoch_values(self.request.metric)
        return max(logged, default=-1) >= trial.cut_at or \
            (trial.last is not None and trial.last[1] >= trial.cut_at + (self.hosts.interval or 0))

    def start_trials(self, now: float) -> None:
        for host in self.hosts.order():
            if host in self.running or host in self.hosts.dropped:
                continue
            if self.left() <= 0:
                self.back_up(host, now)
                continue
            measured = self.hosts.per_trial(host) is not None
            if measured and not policy.should_start(host, now, self.left(), self.clocks(now)):
                self.start_short(host, now)
                continue
            waiting = next((i for i, (_, left_on) in enumerate(self.pending) if host not in left_on), None)
            if waiting is not None:
                trial, stopped_on = self.pending.pop(waiting)
            elif self.left() > len(self.pending):  # a new trial, the ones waiting kept for other hosts
                trial, stopped_on = self.space.ask(self.study), []
            elif self.pending:  # only trials this host stopped are left, and the plan gives it one now:
                trial, stopped_on = self.pending.pop(0)  # run again here rather than wait for a host that may never
            else:
                continue
            self.launch(trial, host, stopped_on)

    def start_short(self, host: str, now: float) -> None:
        """--prune: a host the plan gives no whole trial runs a short one (policy.short_budget), a
        new trial of the epochs it ends before the sweep's planned end, judged at its last one
        (told pruned: the sampler learns from it; not one of --trials). A loop over a source with
        no end takes no --epochs: its short trial runs as a whole one and is cut once it logged its
        value at the last multiple of the values' interval that fits."""
        hosts = self.hosts
        if not (self.request.prune and hosts.length and host in hosts.speeds):
            return
        startup_s, unit_s = hosts.speeds[host]
        units = policy.short_budget(host, now, self.left(), self.clocks(now), startup_s, unit_s, hosts.length)
        if hosts.looped:
            steps = hosts.cut_steps(units)
            if steps:
                self.launch(self.space.ask(self.study), host, [], short=steps, cut_at=steps)
        elif units >= 1 and (self.request.budget or not self.request.script):
            self.launch(self.space.ask(self.study), host, [], short=units)

    def cut_short_trials(self) -> None:
        """The sweep's trials are done: short trials still running end here, judged as they stand."""
        for trial in list(self.running.values()):
            if trial.short and not trial.stopping:
                self.cut(trial)

    def cut(self, trial: Trial) -> None:
        """A short trial stopped where it stands (the sweep's end, or its cut_at step's value in): told
        pruned with its values, recorded."""
        import optuna

        trial.stop("cut")
        self.study.tell(trial.trial, state=optuna.trial.TrialState.PRUNED)
        values = trial.values
        self.record({**self.describe(trial, time.time(), values, []), "state": "short",
                     "value": values[max(values)] if values else None,
                     trial.short_unit(): trial.short})

    def back_up(self, host: str, now: float) -> None:
        """Nothing left to start: a free host runs a copy of the trial running elsewhere that it
        would end first (the first copy to finish counts, the other is stopped). A trial with no
        estimate yet counts as ending late once it ran longer than a whole trial takes here."""
        mine = self.hosts.per_trial(host)
        if mine is None:
            return
        copies = {}
        for trial in self.running.values():
            copies.setdefault(trial.trial.number, []).append(trial)
        late = []
        for number, running in copies.items():
            if len(running) > 1 or running[0].stopping or running[0].short:
                continue
            trial = running[0]
            end = trial.expected_end()
            if (end is not None and end > now + mine) or (end is None and now - trial.started > mine):
                late.append((end if end is not None else math.inf, trial))
        if late:
            end, trial = max(late, key=lambda x: x[0])
            when = f"would end in {end - now:.0f} s" if end != math.inf else \
                f"has run {now - trial.started:.0f} s and cannot tell its end yet"
            self.say(f"trial {trial.trial.number} on {trial.host} {when}; {host} would end it in {mine:.0f} s: "
                     f"running it there too, the first to finish counts")
            self.launch(trial.trial, host, [trial.host])

    def launch(self, trial, host: str, stopped_on: list[str], short: int = 0, cut_at: int | None = None) -> None:
        base = self.folder / "trials" / f"{trial.number:03d}"
        run_dir, n = base, 1
        while run_dir.exists():
            run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
        run_dir.mkdir(parents=True)
        self.began = self.began or time.time()
        args = self.request.trial_args(self.space, trial.params) + ([f"--epochs={short}"] if short and not cut_at
                                                                    else [])
        self.running[host] = Trial.start(trial, host, run_dir, train_command(self.tasks_root, self.request, host,
                                                                             run_dir, args), stopped_on, short, cut_at)
        again = " (again)" if stopped_on else \
            f" (short: {short} of {self.hosts.length} {self.running[host].short_unit()})" if short else ""
        self.say(f"trial {trial.number} on {host}{again}: {' '.join(self.space.argv(trial.params))}")

    def copies(self, trial: Trial) -> list[Trial]:
        """The other hosts' copies of the same trial."""
        return [t for t in self.running.values() if t.trial.number == trial.trial.number and t is not trial]

    def report(self, trial: Trial, prune: bool = True) -> None:
        """Each new epoch's metric to the study; with --prune, a trial judged worse is told pruned
        and recorded now, and stopped (every copy: their hosts are free once they have ended)."""
        import optuna

        reported = self.reported.setdefault(trial.trial.number, set())
        for epoch, value in trial.epoch_values(self.request.metric).items():
            if epoch in trial.values or not math.isfinite(value):
                continue
            trial.values[epoch] = value
            if epoch in reported:
                continue
            reported.add(epoch)
            trial.trial.report(value, epoch)
            if prune and self.request.prune and trial.trial.should_prune():
                copies = self.copies(trial)
                for copy in [trial, *copies]:
                    copy.stop("pruned")
                self.study.tell(trial.trial, state=optuna.trial.TrialState.PRUNED)
                self.record({**self.describe(trial, time.time(), trial.values, copies),
                             "state": "short" if trial.short else "pruned", "value": value,
                             **({trial.short_unit(): trial.short} if trial.short else {})})
                at = "step" if trial.by_step else "epoch"
                self.say(f"trial {trial.trial.number} on {trial.host}: pruned at {at} {epoch} "
                         f"({self.request.metric} {value:.4g})")
                return

    def describe(self, trial: Trial, now: float, values: dict[int, float], others: list[Trial]) -> dict:
        """A trial's record in trials.jsonl, but its state and value."""
        return {"number": trial.trial.number, "host": trial.host, "params": trial.trial.params,
                "argv": self.space.argv(trial.trial.params), "values": {str(e): v for e, v in values.items()},
                "started": round(trial.started, 3), "ended": round(now, 3), "seconds": round(now - trial.started, 3),
                "run_dir": str(trial.run_dir.relative_to(self.folder)),
                "stopped_on": list(dict.fromkeys([*trial.stopped_on, *(t.host for t in others)])),
                **({"values_at": "step"} if trial.by_step else {}),  # a source with no end: values by the step
                **({"steps": trial.steps} if trial.looped and trial.steps else {})}

    def judge(self, trial: Trial, now: float) -> None:
        """Once its end can be told: does it go on here (policy.keep_running)?"""
        end = trial.expected_end()
        if trial.judged or end is None:
            return
        trial.judged = True
        self.hosts.judged(trial)
        if trial.short or self.out_of_time(now):  # (after --timeout a stopped trial would run nowhere)
            return
        if longest := self.hosts.longest(trial.host):  # an estimate made in a first epoch that its loop leaves
            end = min(end, trial.started + longest)  # early (a pass's length unknown yet) overshoots
        clocks = self.clocks(now)
        if len(clocks) > 1 and not self.copies(trial) and not trial.stopped_on and \
                not policy.keep_running(trial.host, now, end, self.left(), clocks):
            there = policy.moved_to(trial.host, now, clocks)
            again = clocks[there].next_end(now)
            trial.stop("moved")
            self.pending.append((trial.trial, [*trial.stopped_on, trial.host]))
            self.say(f"trial {trial.trial.number} on {trial.host}: would end in {end - now:.0f} s; run again on "
                     f"{there} it would end in {again - now:.0f} s, and the sweep sooner: stopped, to run there")

    def ended(self, trial: Trial) -> None:
        import optuna

        del self.running[trial.host]
        if trial.stopping:  # moved, superseded, pruned (recorded then) or interrupted
            return
        code, now = trial.proc.returncode, time.time()
        seconds = now - trial.started
        values = trial.epoch_values(self.request.metric)
        others = self.copies(trial)
        record = self.describe(trial, now, values, others)
        if trial.short:
            self.study.tell(trial.trial, state=optuna.trial.TrialState.PRUNED if values and code == 0
                            else optuna.trial.TrialState.FAIL)
            if code and self.space.hint(trial.said()):  # a parameter the script refuses: every trial would
                raise ConfigError(f"trial {trial.trial.number} on {trial.host}: {trial.said()} (its output: "
                                  f"{trial.run_dir / 'trial.log'}){self.space.hint(trial.said())}")
            value = values[max(values)] if values and code == 0 else None
            self.record({**record, "state": "short", "value": value, trial.short_unit(): trial.short,
                         **({} if code == 0 else {"error": trial.said(), "exit_code": code})})
            self.say(f"trial {trial.trial.number} on {trial.host}: short trial of {trial.short} {trial.short_unit()}: "
                     + (f"{self.request.metric} {value:.4g}" if value is not None else f"failed (exit {code})"))
            return
        if code == 0:
            if not values:
                self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
                logged = ", ".join(sorted(trial.logged_names)) or "nothing"
                raise ConfigError(f"trial {trial.trial.number} on {trial.host} ended without logging "
                                  f"--metric {self.request.metric} (it logged {logged}): name one of those, or "
                                  f"log it from the script with job.log({self.request.metric}=...); its run: "
                                  f"{trial.run_dir}")
            value = values[max(values)]
            if not math.isfinite(value):
                where = "its last " + ("step logged" if trial.by_step else "epoch")
                self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
                self.record({**record, "state": "failed", "value": None, "exit_code": 0,
                             "error": f"{self.request.metric} is {value} at {where} (diverged?)"})
                self.say(f"trial {trial.trial.number} on {trial.host}: failed: {self.request.metric} is {value} at "
                         f"{where} (diverged?)")
                for other in others:
                    other.stop("superseded")
                return
            for other in others:
                other.stop("superseded")
            self.hosts.finished(trial, seconds)
            if trial.host not in self.told_alone and (slower := trial.slower_than_alone()):
                self.told_alone.add(trial.host)  # once a host: every trial there would say it
                self.say(f"trials on {trial.host} run slower than one of its ranks would alone; trial "
                         f"{trial.trial.number}'s run said: {slower}")
            self.study.tell(trial.trial, value)
            self.record({**record, "state": "complete", "value": value})
            self.say(f"trial {trial.trial.number} on {trial.host}: {self.request.metric} {value:.4g} "
                     f"in {seconds:.1f} s{self.best_note()}")
            return
        said = trial.said()
        hint = self.space.hint(said)  # the script's argparse refused a parameter of the space
        if code == 2 or hint:  # bad input is no host's fault: every trial would say the same
            self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
            raise ConfigError(f"trial {trial.trial.number} on {trial.host}: {said} (its output: "
                              f"{trial.run_dir / 'trial.log'}){hint}")
        self.last_error = said
        self.say(f"trial {trial.trial.number} on {trial.host}: failed (exit {code}): {said}")
        if self.hosts.failed(trial.host):
            self.say(f"host {trial.host}: {HOST_FAILURES} trials failed in a row there; it gets no more")
        if not others:  # a copy still running elsewhere may yet finish it
            self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
            self.record({**record, "state": "failed", "value": None, "error": said, "exit_code": code})

    def best_note(self) -> str:
        best = self.best()
        return f" (best so far: trial {best['number']}, {best['value']:.4g})" if best else ""

    def best(self) -> dict | None:
        return records.best(self.records, self.request.mode)

    def record(self, record: dict) -> None:
        self.records.append(record)
        records.append(self.folder / records.TRIALS_FILE, record)

    def interrupt(self) -> None:
        """Stop every running trial (Ctrl-C, an error): they stay running in the study, and
        --resume asks them again. Bounded: a trial that does not end in STOP_GRACE_S is killed.
        One whose run had ended already, not yet seen, is taken as it ended: a Ctrl-C dropped a
        trial that had trained its every epoch, and --resume ran it again."""
        try:
            for trial in [t for t in self.running.values() if not t.stopping and t.proc.poll() is not None]:
                with contextlib.suppress(HvdHeteroError):  # what it says (a metric it never logged) can wait
                    trial.read()  # what it wrote last (its end record), as poll reads it
                    self.report(trial, prune=False)
                    self.ended(trial)
        finally:
            self._stop_running()

    def _stop_running(self) -> None:
        for trial in self.running.values():
            trial.stopping = ""
            trial.stop("interrupted")
        deadline = time.monotonic() + STOP_GRACE_S
        for trial in self.running.values():
            try:
                trial.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                trial.kill()
                trial.proc.wait()
        self.running.clear()

    def say(self, text: str) -> None:
        self.board.say(f"sweep: {text}")

    def board_rows(self) -> list[dict]:
        rows = []
        for t in sorted(self.running.values(), key=lambda t: t.trial.number):
            values = t.values
            rows.append({"trial": t.trial.number, "host": t.host, "params": " ".join(self.space.argv(t.trial.params)),
                         "epoch": t.where(), "metric": values[max(values)] if values else None,
                         "seconds": board.elapsed(t.started),
                         "state": t.stopping or (f"short ({t.short} {t.short_unit()})" if t.short else "running")})
        return rows

    def board_title(self) -> str:
        best = self.best()
        return (f"{self.done()} of {self.request.trials} trials done; {self.request.metric} "
                + (f"best {best['value']:.4g} (trial {best['number']})" if best else "best: none yet"))

    def summary(self) -> str:
        return records.summary(self.records, self.request.metric, self.request.mode)
