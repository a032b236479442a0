"""`invoke sweep`: a hyper-parameter sweep across the inventory's hosts, one trial per host at a
time, each an ordinary one-host `invoke train` job (pre-flight, env allowlist, run directory,
rank logs) in a session of its own.

    sweep_dir = run(Request(...), tasks_root=ROOT, runs=RUNS)       # or resume(SWEEP_DIR, ...)

The study lives on the launcher: Optuna with ask-and-tell and a SQLite file in the sweep's
folder (no storage server anywhere). A trial's metric comes back without shared storage: the
trial's launcher keeps rank 0's progress lines, which carry the script's `job.log` scalars, in
TRIAL_DIR/progress.jsonl (cluster/console.py); each epoch's value is reported to the study, and
with --prune a trial the median pruner judges worse than the others at the same epoch is stopped.

Which host runs what is policy/sweep.py's rule: every host starts a trial (running is how its
speed is measured); once a trial's end can be told from its progress, a trial that would end
after the fast hosts alone would have done it is stopped and run again on a faster host, and a
free host starts a trial only where the plan gives it one. The sweep so ends no later than the
fastest host alone would.

SWEEP_DIR holds sweep.json (what was asked: --resume continues it), study.db, trials.jsonl (one
record per ended trial: host, parameters, state, value per epoch, times; invoke report reads it)
and trials/NNN (each trial's run directory, its console output in trial.log).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hvdhetero import checks
from hvdhetero.cluster import console
from hvdhetero.errors import ConfigError, HvdHeteroError, LaunchError, SpaceError
from hvdhetero.policy import sweep as policy
from hvdhetero.sweep import board
from hvdhetero.sweep import space as spaces

SWEEP_FILE = "sweep.json"
STUDY_FILE = "study.db"
TRIALS_FILE = "trials.jsonl"
STUDY_NAME = "hvdhetero-sweep"
POLL_S = 0.5
STOP_GRACE_S = 30.0
"""A stopped trial gets this long to end (invoke train stops its ranks within 15 s of SIGTERM);
then its whole session is killed."""
ESTIMATE_AFTER = (0.05, 2.0)
"""A trial's end is estimated once it has gone this fraction further and this many seconds
since its first progress line (the steps before include start-up: data, calibration)."""
HOST_FAILURES = 2
"""A host whose trials failed this many times in a row is given no more (a host down, a broken env)."""


@dataclass
class Request:
    """What `invoke sweep` was asked (sweep.json: --resume reads it back)."""

    inventory: str
    hosts: list[str]
    space: str
    trials: int
    metric: str = "test_loss"
    mode: str = "min"
    budget: int = 0
    """Epochs a trial runs (the recipe's --epochs; a script gets --epochs N); 0: the recipe's or the script's own."""
    prune: bool = False
    seed: int = 0
    script: str = ""
    workdir: str = ""
    recipe: list[str] = field(default_factory=list)
    script_args: list[str] = field(default_factory=list)
    enqueued: list[dict] = field(default_factory=list)
    """Parameters the first trials take, in order, before the sampler asks (invoke bench --sweep:
    the fastest host alone runs the very trials the sweep ran)."""

    def check(self) -> None:
        checks.integer("trials", self.trials)
        if self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        checks.one_of("mode", self.mode, ("min", "max"))
        if not self.metric.isidentifier():
            raise ConfigError(f"--metric must be the name a script logs with job.log(NAME=...), got {self.metric!r}")
        if self.budget < 0:
            raise ConfigError(f"--budget must be epochs > 0 (0: the script's own), got {self.budget}")

    def trial_args(self, space: spaces.Space, values: dict[str, Any]) -> list[str]:
        """What follows `--` in a trial's invoke train: the script's (or recipe's) arguments, the budget, the values."""
        budget = ["--epochs", str(self.budget)] if self.budget and self.script else []
        return [*self.script_args, *budget, *space.argv(values)]


def train_command(tasks_root: Path, request: Request, host: str, run_dir: Path, args: list[str],
                  dry_run: bool = False) -> list[str]:
    """One trial: invoke train on `host` alone."""
    what = ["--script", request.script, *(["--workdir", request.workdir] if request.workdir else [])] \
        if request.script else request.recipe
    return [sys.executable, "-m", "invoke", "--search-root", str(tasks_root), "train", "--inventory",
            request.inventory, "--hosts", host, "--run-dir", str(run_dir), *what,
            *(["--dry-run"] if dry_run else []), "--", *args]


def extremes(space: spaces.Space) -> list[dict[str, Any]]:
    """Values that reach each end of every parameter (each choice), the others at their low end:
    what the checks before a sweep try."""
    def low(p):
        return p.choices[0] if p.kind == "choice" else p.low

    base = {p.name: low(p) for p in space.params}
    out = [base]
    for p in space.params:
        for value in (p.choices[1:] if p.kind == "choice" else (p.high,)):
            out.append({**base, p.name: value})
    return out


def check_before(request: Request, space: spaces.Space, tasks_root: Path, recipe_check,
                 recipe_flags: list[str]) -> None:
    """Everything a trial would refuse, refused before the sweep starts (exit 2): a parameter the
    built-in recipe does not take (`recipe_flags`: its options), the recipe's checks
    (`recipe_check`) with each end of every parameter on every host, and invoke train's own
    checks of one trial per host (--dry-run: nothing contacted or written)."""
    request.check()
    if not request.script:
        from hvdhetero.cluster import inventory as inv

        for p in space.params:
            if f"--{p.name}" not in recipe_flags:
                raise SpaceError(space.path, p.line, p.name, f"the built-in recipe has no option --{p.name}; it "
                                 f"takes {', '.join(f[2:] for f in recipe_flags)} (or sweep your own --script)")
        hosts = inv.load(request.inventory).select(request.hosts)
        for values in extremes(space):
            for host in hosts:
                try:
                    recipe_check([*request.recipe, *request.trial_args(space, values)], [host])
                except ConfigError as err:
                    p = next((p for p in space.params if f"--{p.name}" in str(err)), space.params[0])
                    raise SpaceError(space.path, p.line, p.name, f"the built-in recipe refuses "
                                     f"{' '.join(space.argv(values))} on host {host.name}: {err}") from None
    for host in request.hosts:
        proc = subprocess.run(train_command(tasks_root, request, host, Path(os.devnull),
                                            request.trial_args(space, extremes(space)[0]), dry_run=True),
                              capture_output=True, text=True, timeout=120)
        if proc.returncode:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            error = ConfigError if proc.returncode == 2 else LaunchError
            raise error(f"a trial on host {host} would fail: {said[-1] if said else f'exit {proc.returncode}'}")


@dataclass
class Trial:
    """A trial running on a host."""

    trial: Any
    """optuna.trial.Trial"""
    host: str
    run_dir: Path
    proc: subprocess.Popen
    started: float
    stopped_on: list[str] = field(default_factory=list)
    """Hosts where a copy of this trial was stopped (too slow there)."""
    offset: int = 0
    first: tuple[float, float] | None = None
    """(launcher time, fraction done) of its first progress line."""
    position: tuple[int, int] | None = None
    """(epoch, epochs) of its last progress line."""
    last: tuple[float, float] | None = None
    values: dict[int, float] = field(default_factory=dict)
    """The metric at each epoch's end, as reported."""
    logged: list[dict] | None = None
    """Every job.log of the run (its end record)."""
    logged_names: set[str] = field(default_factory=set)
    seen: dict[int, dict] = field(default_factory=dict)
    """The scalars rank 0 had logged by each epoch's end, from its progress lines."""
    judged: bool = False
    """keep_running asked (once, at its first estimate)."""
    stopping: str = ""
    """Why we stopped it: pruned, moved, superseded (a copy finished first), interrupted, cut."""
    short: int = 0
    """A short trial's epochs (--prune: extra work of a host the plan gives no whole trial; not one of --trials)."""
    stopped_at: float = 0.0

    def read(self) -> None:
        """New lines of its progress.jsonl."""
        path = self.run_dir / console.PROGRESS_FILE
        try:
            with path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        whole = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if "progress" in record:
                self.progressed(record["at"], record["progress"])
            elif record.get("result", {}).get("event") == "end":
                self.logged = record["result"].get("logs", [])
                for entry in self.logged:
                    self.logged_names.update(k for k in entry if k not in ("epoch", "step"))

    def progressed(self, at: float, p: dict) -> None:
        if p.get("epochs") and p.get("steps"):
            self.position = (int(p["epoch"]), int(p["epochs"]))
            done = (p["epoch"] + p["step"] / p["steps"]) / p["epochs"]
            self.first = self.first or (at, done)
            self.last = (at, done)
        logged = p.get("logged") or {}
        self.logged_names.update(logged)
        epochs = p.get("logged_epochs") or {}
        for key, value in logged.items():  # each scalar at the epoch it was logged in
            epoch = epochs.get(key, p.get("logged_epoch"))
            if epoch is not None:
                self.seen.setdefault(int(epoch), {})[key] = value

    def speed(self) -> tuple[float, float] | None:
        """(start-up seconds, seconds an epoch) from its progress, once its end can be told."""
        if self.expected_end() is None or self.position is None:
            return None
        (t0, f0), (t1, f1) = self.first, self.last
        whole = (t1 - t0) / (f1 - f0)
        return max(0.0, t0 - self.started - f0 * whole), whole / self.position[1]

    def expected_end(self) -> float | None:
        """When it will end, from its progress (None until that can be told)."""
        if self.first is None or self.last is None:
            return None
        (t0, f0), (t1, f1) = self.first, self.last
        if f1 - f0 < ESTIMATE_AFTER[0] or t1 - t0 < ESTIMATE_AFTER[1]:
            return None
        return t1 + (1.0 - f1) * (t1 - t0) / (f1 - f0)

    def epoch_values(self, metric: str) -> dict[int, float]:
        """The metric at each epoch it was logged in (the end record's last value an epoch wins)."""
        out = {}
        for epoch, logged in sorted(self.seen.items()):
            if isinstance(logged.get(metric), (int, float)):
                out[int(epoch)] = float(logged[metric])
        for entry in self.logged or []:
            if isinstance(entry.get(metric), (int, float)):
                out[int(entry["epoch"])] = float(entry[metric])
        return out


class Sweep:
    """One sweep, from its folder: the study, the hosts' clocks, the running trials."""

    def __init__(self, request: Request, folder: Path, tasks_root: Path, out=None):
        import optuna

        self.request, self.folder, self.tasks_root = request, folder, tasks_root
        self.board = board.Board(out or sys.stdout, self.board_rows, self.board_title, request.metric)
        self.space = spaces.load(request.space)
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
        self.records = read_records(folder / TRIALS_FILE)
        self.running: dict[str, Trial] = {}
        """What each busy host runs (a trial being stopped included: its host is busy until it ends)."""
        self.pending: list[tuple[Any, list[str]]] = []
        """Trials stopped on a slow host, to run again elsewhere (with the hosts they were stopped on)."""
        self.reported: dict[int, set[int]] = {}
        """The epochs each trial reported to the study (a trial may run on two hosts at the end)."""
        self.durations: dict[str, list[float]] = {h: [] for h in request.hosts}
        for r in self.records:
            if r["state"] == "complete" and r["host"] in self.durations:
                self.durations[r["host"]].append(r["seconds"])
        self.speeds: dict[str, tuple[float, float]] = {}
        """Each host's measured (start-up seconds, seconds an epoch), from its last trial judged: its
        whole trial's estimate until one completes, and what a short trial's epochs are sized by."""
        self.epochs = request.budget or None
        """Epochs of a whole trial (--budget, else as the trials' progress says)."""
        self.failures = {h: 0 for h in request.hosts}
        self.last_error = ""
        self.dropped: set[str] = set()

    # -- the clocks ---------------------------------------------------------------------------

    def per_trial(self, host: str) -> float | None:
        """Seconds a whole trial takes on `host`: its finished trials' mean, else as its speed says."""
        done = self.durations[host][-3:]
        if done:
            return sum(done) / len(done)
        if host in self.speeds:
            startup_s, epoch_s = self.speeds[host]
            return startup_s + self.epochs * epoch_s
        return None

    def clocks(self, now: float) -> dict[str, policy.HostClock]:
        known = [t for h in self.request.hosts if (t := self.per_trial(h)) is not None]
        guess = min(known, default=1.0)  # a host not measured yet: as fast as the fastest known
        out = {}
        for host in self.request.hosts:
            if host in self.dropped:
                continue
            t = self.per_trial(host) or guess
            trial = self.running.get(host)
            free_at = now
            if trial is not None and not trial.stopping:
                whole = t if not trial.short or host not in self.speeds else \
                    self.speeds[host][0] + trial.short * self.speeds[host][1]
                free_at = trial.expected_end() or trial.started + whole
            out[host] = policy.HostClock(t, max(free_at, now))
        return out

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
                trial.read()
                if not trial.stopping:
                    self.report(trial)
                if not trial.stopping:
                    self.judge(trial, now)
                if trial.proc.poll() is not None:
                    trial.read()  # what it wrote last (its end record)
                    if not trial.stopping:
                        self.report(trial, prune=False)
                    self.ended(trial)
                elif trial.stopping and now - trial.stopped_at > STOP_GRACE_S:
                    _kill_session(trial.proc)
            if self.done() >= self.request.trials:
                self.cut_short_trials()
            else:
                self.start_trials(time.time())
                if not self.running:
                    raise LaunchError("no host is left to run the sweep's trials (" + ", ".join(
                        f"{h}: {HOST_FAILURES} failed trials in a row" for h in sorted(self.dropped))
                        + f"); the last said: {self.last_error}")
            time.sleep(POLL_S)

    def start_trials(self, now: float) -> None:
        for host in self.order():
            if host in self.running or host in self.dropped:
                continue
            if self.left() <= 0:
                self.back_up(host, now)
                continue
            measured = self.per_trial(host) is not None
            if measured and not policy.should_start(host, now, self.left(), self.clocks(now)):
                self.start_short(host, now)
                continue
            waiting = next((i for i, (_, left_on) in enumerate(self.pending) if host not in left_on), None)
            if waiting is not None:
                trial, stopped_on = self.pending.pop(waiting)
            elif self.left() > len(self.pending):  # a new trial, the ones waiting kept for other hosts
                trial, stopped_on = self.study.ask(self.space.distributions()), []
            else:
                continue
            self.launch(trial, host, stopped_on)

    def start_short(self, host: str, now: float) -> None:
        """--prune: a host the plan gives no whole trial runs a short one (policy.short_budget), a
        new trial of the epochs it ends before the sweep's planned end, judged at its last one
        (told pruned: the sampler learns from it; not one of --trials)."""
        if not (self.request.prune and self.epochs and host in self.speeds and
                (self.request.budget or not self.request.script)):
            return
        startup_s, epoch_s = self.speeds[host]
        epochs = policy.short_budget(host, now, self.left(), self.clocks(now), startup_s, epoch_s, self.epochs)
        if epochs >= 1:
            self.launch(self.study.ask(self.space.distributions()), host, [], short=epochs)

    def cut_short_trials(self) -> None:
        """The sweep's trials are done: short trials still running end here, judged as they stand."""
        import optuna

        for trial in list(self.running.values()):
            if trial.short and not trial.stopping:
                self.stop(trial, "cut")
                self.study.tell(trial.trial, state=optuna.trial.TrialState.PRUNED)
                values = trial.values
                self.record({**self.describe(trial, time.time(), values, []), "state": "short",
                             "value": values[max(values)] if values else None, "epochs": trial.short})

    def back_up(self, host: str, now: float) -> None:
        """Nothing left to start: a free host runs a copy of the trial running elsewhere that it
        would end first (the first copy to finish counts, the other is stopped). A trial with no
        estimate yet counts as ending late once it ran longer than a whole trial takes here."""
        mine = self.per_trial(host)
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
            when = "is not under way yet" if end == math.inf else f"would end in {end - now:.0f} s"
            self.say(f"trial {trial.trial.number} on {trial.host} {when}; {host} would end it in {mine:.0f} s: "
                     f"running it there too, the first to finish counts")
            self.launch(trial.trial, host, [trial.host])

    def order(self) -> list[str]:
        """Free hosts in the order they are offered a trial: measured ones fastest first, then the
        others as the inventory lists them."""
        hosts = self.request.hosts
        return sorted(hosts, key=lambda h: (self.per_trial(h) is None, self.per_trial(h) or 0.0, hosts.index(h)))

    def launch(self, trial, host: str, stopped_on: list[str], short: int = 0) -> None:
        base = self.folder / "trials" / f"{trial.number:03d}"
        run_dir, n = base, 1
        while run_dir.exists():
            run_dir, n = base.with_name(f"{base.name}-{n}"), n + 1
        run_dir.mkdir(parents=True)
        args = self.request.trial_args(self.space, trial.params) + (["--epochs", str(short)] if short else [])
        with (run_dir / "trial.log").open("w") as log:
            proc = subprocess.Popen(train_command(self.tasks_root, self.request, host, run_dir, args),
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_stop_with_parent)
        self.running[host] = Trial(trial, host, run_dir, proc, time.time(), stopped_on, short=short)
        again = " (again)" if stopped_on else f" (short: {short} of {self.epochs} epochs)" if short else ""
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
                    self.stop(copy, "pruned")
                self.study.tell(trial.trial, state=optuna.trial.TrialState.PRUNED)
                self.record({**self.describe(trial, time.time(), trial.values, copies),
                             "state": "short" if trial.short else "pruned", "value": value,
                             **({"epochs": trial.short} if trial.short else {})})
                self.say(f"trial {trial.trial.number} on {trial.host}: pruned at epoch {epoch} "
                         f"({self.request.metric} {value:.4g})")
                return

    def describe(self, trial: Trial, now: float, values: dict[int, float], others: list[Trial]) -> dict:
        """A trial's record in trials.jsonl, but its state and value."""
        return {"number": trial.trial.number, "host": trial.host, "params": trial.trial.params,
                "argv": self.space.argv(trial.trial.params), "values": {str(e): v for e, v in values.items()},
                "started": round(trial.started, 3), "ended": round(now, 3), "seconds": round(now - trial.started, 3),
                "run_dir": str(trial.run_dir.relative_to(self.folder)),
                "stopped_on": list(dict.fromkeys([*trial.stopped_on, *(t.host for t in others)]))}

    def judge(self, trial: Trial, now: float) -> None:
        """Once its end can be told: does it go on here (policy.keep_running)?"""
        end = trial.expected_end()
        if trial.judged or end is None:
            return
        trial.judged = True
        self.speeds[trial.host] = trial.speed()
        self.epochs = self.epochs or trial.position[1]
        if trial.short:
            return
        clocks = self.clocks(now)
        if len(clocks) > 1 and not self.copies(trial) and not trial.stopped_on and \
                not policy.keep_running(trial.host, now, end, self.left(), clocks):
            alone = policy.sweep_end(now, self.left() + 1, {h: c for h, c in clocks.items() if h != trial.host})
            self.stop(trial, "moved")
            self.pending.append((trial.trial, [*trial.stopped_on, trial.host]))
            self.say(f"trial {trial.trial.number} on {trial.host}: would end in {end - now:.0f} s, after the "
                     f"other hosts could have done it (in {alone - now:.0f} s): stopped, to run elsewhere")

    def stop(self, trial: Trial, why: str) -> None:
        if trial.stopping:
            return
        trial.stopping, trial.stopped_at = why, time.time()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(trial.proc.pid, signal.SIGTERM)

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
            value = values[max(values)] if values and code == 0 else None
            self.record({**record, "state": "short", "value": value, "epochs": trial.short,
                         **({} if code == 0 else {"error": _last_line(trial.run_dir / "trial.log"), "exit_code": code})})
            self.say(f"trial {trial.trial.number} on {trial.host}: short trial of {trial.short} epochs: "
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
                self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
                self.record({**record, "state": "failed", "value": None, "exit_code": 0,
                             "error": f"{self.request.metric} is {value} at its last epoch (diverged?)"})
                self.say(f"trial {trial.trial.number} on {trial.host}: failed: {self.request.metric} is {value} at "
                         "its last epoch (diverged?)")
                for other in others:
                    self.stop(other, "superseded")
                return
            for other in others:
                self.stop(other, "superseded")
            self.study.tell(trial.trial, value)
            self.failures[trial.host] = 0
            self.durations[trial.host].append(seconds)
            self.record({**record, "state": "complete", "value": value})
            self.say(f"trial {trial.trial.number} on {trial.host}: {self.request.metric} {value:.4g} "
                     f"in {seconds:.1f} s{self.best_note()}")
            return
        said = _last_line(trial.run_dir / "trial.log")
        if code == 2:  # bad input is no host's fault: every trial would say the same
            self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
            raise ConfigError(f"trial {trial.trial.number} on {trial.host}: {said} (its output: "
                              f"{trial.run_dir / 'trial.log'})")
        self.failures[trial.host] += 1
        self.last_error = said
        self.say(f"trial {trial.trial.number} on {trial.host}: failed (exit {code}): {said}")
        if self.failures[trial.host] >= HOST_FAILURES:
            self.dropped.add(trial.host)
            self.say(f"host {trial.host}: {HOST_FAILURES} trials failed in a row there; it gets no more")
        if not others:  # a copy still running elsewhere may yet finish it
            self.study.tell(trial.trial, state=optuna.trial.TrialState.FAIL)
            self.record({**record, "state": "failed", "value": None, "error": said, "exit_code": code})

    def best_note(self) -> str:
        best = self.best()
        return f" (best so far: trial {best['number']}, {best['value']:.4g})" if best else ""

    def best(self) -> dict | None:
        complete = [r for r in self.records if r["state"] == "complete"]
        if not complete:
            return None
        pick = min if self.request.mode == "min" else max
        return pick(complete, key=lambda r: r["value"])

    def record(self, record: dict) -> None:
        self.records.append(record)
        path = self.folder / TRIALS_FILE
        with path.open("a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():  # a line cut short (the sweep killed mid-write) ends here, not in this record
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(json.dumps(record).encode() + b"\n")

    def interrupt(self) -> None:
        """Stop every running trial (Ctrl-C, an error): they stay running in the study, and
        --resume asks them again. Bounded: a trial that does not end in STOP_GRACE_S is killed."""
        for trial in self.running.values():
            trial.stopping = ""
            self.stop(trial, "interrupted")
        deadline = time.monotonic() + STOP_GRACE_S
        for trial in self.running.values():
            try:
                trial.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_session(trial.proc)
                trial.proc.wait()
        self.running.clear()

    def say(self, text: str) -> None:
        self.board.say(f"sweep: {text}")

    def board_rows(self) -> list[dict]:
        rows = []
        for t in sorted(self.running.values(), key=lambda t: t.trial.number):
            values = t.values
            epoch = f"{t.position[0] + 1}/{t.position[1]}" if t.position else "starting"
            rows.append({"trial": t.trial.number, "host": t.host, "params": " ".join(self.space.argv(t.trial.params)),
                         "epoch": epoch, "metric": values[max(values)] if values else None,
                         "seconds": board.elapsed(t.started),
                         "state": t.stopping or (f"short ({t.short} epochs)" if t.short else "running")})
        return rows

    def board_title(self) -> str:
        best = self.best()
        return (f"{self.done()} of {self.request.trials} trials done; {self.request.metric} "
                + (f"best {best['value']:.4g} (trial {best['number']})" if best else "best: none yet"))

    def summary(self) -> str:
        rows = sorted(self.records, key=lambda r: r["number"])
        lines = [f"{'trial':>5}  {'host':<10} {'state':<9} {self.request.metric:>12} {'seconds':>8}  parameters"]
        for r in rows:
            value = f"{r['value']:.4g}" if isinstance(r.get("value"), (int, float)) else "-"
            lines.append(f"{r['number']:>5}  {r['host']:<10} {r['state']:<9} {value:>12} {r['seconds']:>8.1f}  "
                         f"{' '.join(r['argv'])}")
        best = self.best()
        if best:
            lines.append(f"best: trial {best['number']} on {best['host']}, {self.request.metric} {best['value']:.6g}: "
                         f"{' '.join(best['argv'])}")
        return "\n".join(lines)


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _last_line(path: Path) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    errors = [l for l in lines if l.startswith("error:") or "hvdhetero:" in l]
    return (errors or lines or [""])[-1].strip()[:500]


def _stop_with_parent() -> None:
    """In a trial's process: SIGTERM (invoke train's clean stop) when the sweep dies, even by
    SIGKILL: a trial runs in a session of its own, which nothing else would stop. Linux only
    (PR_SET_PDEATHSIG); a Mac launcher relies on Ctrl-C's and SIGTERM's own stop."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def new_folder(run_dir: str, runs: Path, name: str) -> Path:
    folder = Path(run_dir).resolve() if run_dir else runs / f"{time.strftime('%Y%m%d-%H%M%S')}-sweep-{name}"
    if (folder / SWEEP_FILE).exists():
        raise ConfigError(f"--run-dir {folder} already holds a sweep: continue it with invoke sweep --resume {folder}, "
                          "or name another folder")
    return folder


def start(request: Request, folder: Path, tasks_root: Path, recipe_check, recipe_flags: list[str]) -> Path:
    """A new sweep: checked (exit 2, nothing written: check_before), then run in `folder`."""
    space = spaces.load(request.space)
    check_before(request, space, tasks_root, recipe_check, recipe_flags)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        (folder / SWEEP_FILE).write_text(json.dumps(asdict(request), indent=1) + "\n")
        return _run(request, folder, tasks_root)


@contextlib.contextmanager
def _locked(folder: Path):
    """One sweep at a time in a folder: a second (a --resume while it runs) would fail the first's trials."""
    import fcntl

    with (folder / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ConfigError(f"another invoke sweep is running in {folder}: wait for it, or stop it (Ctrl-C) "
                              "and resume") from None
        yield


def resume(folder: str, tasks_root: Path, hosts: str | None = None, inventory: str = "") -> Path:
    """Continue the sweep in `folder` with its own options (sweep.json), on `hosts` of `inventory`
    if given (else its own): its finished trials kept, those that were running asked again."""
    import optuna

    from hvdhetero.cluster import inventory as inv

    path = Path(folder).resolve()
    try:
        saved = json.loads((path / SWEEP_FILE).read_text())
        request = Request(**saved)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"--resume {folder}: {path / SWEEP_FILE} cannot be read ({err}): not a sweep invoke sweep "
                          "started") from None
    request.inventory = str(Path(inventory).resolve()) if inventory else request.inventory
    if hosts or inventory:
        request.hosts = [h.name for h in inv.load(request.inventory).select(hosts or request.hosts)]
    spaces.load(request.space)
    with _locked(path):
        (path / SWEEP_FILE).write_text(json.dumps(asdict(request), indent=1) + "\n")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{path / STUDY_FILE}")
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)  # not counted: trials.jsonl has no record of it
            study.enqueue_trial(t.params)
        return _run(request, path, tasks_root)


def _run(request: Request, folder: Path, tasks_root: Path) -> Path:
    sweep = Sweep(request, folder, tasks_root)
    try:
        with _terminate_as_interrupt():
            try:
                sweep.run()
            finally:
                sweep.board.close()  # a live table left running would draw over the messages that follow
    except KeyboardInterrupt:
        sweep.interrupt()
        print(f"sweep: stopped: {sweep.done()} of {request.trials} trials done; continue with\n"
              f"  invoke sweep --resume {folder}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except HvdHeteroError:
        sweep.interrupt()
        raise
    print(sweep.summary(), flush=True)
    return folder


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM and SIGHUP stop the sweep as Ctrl-C does (every trial stopped, the resume command said)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)
              if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
