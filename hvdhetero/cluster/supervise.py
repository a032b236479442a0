"""Running the horovodrun command that launch.py builds: in the foreground, its ranks' output
relayed to the console (and, with a run directory, kept as rank-N.log), every rank watched for
silence, the whole job stopped when one fails, and the failure said once in words -- which rank,
on which host, what ended it, and the checkpoint and command that resume the run. Under
--elastic a rank that dies or goes silent is dropped instead while enough hosts are left
(cluster/elastic_hosts.py decides).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from hvdhetero import progress
from hvdhetero.cluster import checkout, console, elastic_hosts, failure, lines, live
from hvdhetero.cluster import run_dir as run_dirs
from hvdhetero.errors import LaunchError

# What horovodrun may forward to remote ranks: it copies its own environment into every rank's
# command line, so it gets this allowlist, never the launcher's whole environment (secrets).
FORWARDED = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "SSH_AUTH_SOCK", "TMPDIR")


def forwarded_env(env: dict[str, str]) -> dict[str, str]:
    return {**{k: os.environ[k] for k in FORWARDED if k in os.environ}, **env}


def require(program: str) -> None:
    """LaunchError (exit 1) where the program that starts the ranks is not there: checked before
    the run directory is written (a --dry-run needs none)."""
    if not (Path(program).exists() or (os.sep not in program and shutil.which(program))):
        raise LaunchError(f"{program} not found: run ci/setup (or invoke provision) first")


def run(argv: Sequence[str], env: dict[str, str], cwd: str | Path | None = None,
        run_dir: str | Path | None = None, rank0_host: str | None = None,
        watch: elastic_hosts.Watch | None = None, rank_hosts: Sequence[str] = (),
        all_ranks: bool = False, stdin_pipe: bool = False) -> list[dict]:
    """Run the job in the foreground, its ranks' output relayed to the console; returns the
    results rank 0 reported (progress.RESULT_TAG). A rank that fails, dies or goes silent for
    progress.SILENT_S ends the job with one message naming it (and, for a training run with a
    `run_dir`, its newest checkpoint and the command that resumes); nothing of the job is left
    running on this machine. The ranks' progress is a live table on the console (cluster/live.py);
    with a `run_dir`, every rank's whole output is kept there as rank-N.log, and the console shows
    rank 0's (every rank's with `all_ranks`, console.relay). Under elastic (a
    `watch`) a rank that dies or goes silent is dropped instead (a silent one killed) while at
    least --min-hosts hosts are left. With `stdin_pipe` the command's stdin is a pipe kept open until
    the job ends (the Ray driver, over ssh, ends when it closes)."""
    require(argv[0])
    silent_s = float(os.environ.get("HVDHETERO_SILENT_S") or (elastic_hosts.SILENT_S if watch else progress.SILENT_S))
    logs = console.RankLogs(run_dir) if run_dir is not None else None
    try:
        with _stop_on_terminate():
            return _run(argv, env, cwd, run_dir, rank0_host, watch, silent_s, logs, rank_hosts, all_ranks, stdin_pipe)
    except _Terminated as terminated:  # the job was stopped on the way out (_run's BaseException)
        if terminated.results is not None:  # after every rank had finished: the run is whole, and ends here
            if run_dir is not None:
                run_dirs.mark_ended(run_dir, terminated.results)
            print(f"hvdhetero: {terminated.name} came after every rank had finished its script: the run is complete",
                  file=sys.stderr, flush=True)
        else:
            print(f"hvdhetero: {terminated.name}: the job was stopped" + resume_hint(run_dir, rank0_host),
                  file=sys.stderr, flush=True)
        raise SystemExit(128 + terminated.signum) from None
    finally:
        if watch is not None:
            watch.finish()  # a silent rank whose host did not answer yet: killed once it does (bounded)


class _Terminated(BaseException):
    """SIGTERM, SIGHUP or SIGINT reached the launcher (`kill`, a closed terminal, a service
    stopped, Ctrl-C)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name
        self.results: list[dict] | None = None
        """Rank 0's results where every rank had finished its script before the signal came."""
        if signum == signal.SIGINT:
            self.name = "Ctrl-C (SIGINT)"


@contextlib.contextmanager
def _stop_on_terminate():
    """While the job runs, SIGTERM, SIGHUP and Ctrl-C (SIGINT) stop it, saying so with the resume
    command, instead of ending the launcher on the spot: Python's default for the first two runs
    no cleanup, which left horovodrun and its ranks running, and Ctrl-C's KeyboardInterrupt ended
    in Invoke's silent exit 1. A second signal while the job is being stopped is ignored (the stop is
    bounded: cluster/supervise.py _stop), and so is one that comes while the job is already being
    stopped for another reason. A signal ignored already stays ignored (`nohup invoke train`).
    Only the main thread can take signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    wanted = [s for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT) if signal.getsignal(s) is not signal.SIG_IGN]

    def stop(signum, frame):
        for s in wanted:
            signal.signal(s, signal.SIG_IGN)
        if not _STOPPING.is_set():
            raise _Terminated(signum)

    before = {s: signal.signal(s, stop) for s in wanted}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _run(argv, env, cwd, run_dir, rank0_host, watch: elastic_hosts.Watch | None, silent_s: float,
         logs: console.RankLogs | None, rank_hosts: Sequence[str], all_ranks: bool = False,
         stdin_pipe: bool = False) -> list[dict]:
    alive: dict[int, tuple[float, str]] = {}
    exits: dict[int, int] = {}
    failures: list[dict] = []
    done: set[int] = set()  # ranks that said DONE: _watched sees them first, the relay stops watching them
    ended: dict[int, tuple[int | None, str]] = {}  # those ranks' (job step, host) when they said it
    lingered = False
    with subprocess.Popen(list(argv), env=forwarded_env(env), cwd=cwd, stdout=subprocess.PIPE,
                          stdin=subprocess.PIPE if stdin_pipe else None,
                          stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1) as proc:
        results: list[dict] = []
        try:
            # Without a run directory (bench, plan) nothing keeps the other ranks' lines: all shown.
            hidden = (f"hvdhetero: the other ranks' output is in {logs.path(1).parent}/rank-N.log "
                      "(--all-ranks-output shows it here)") if logs is not None else ""
            console.relay(_watched(proc, alive, exits, silent_s, logs, watch, expected=len(rank_hosts), done=done,
                                   ended=ended),
                          live.display_for(sys.stdout), results=results, alive=alive,
                          all_ranks=all_ranks or logs is None, hidden_note=hidden, failures=failures, finished=done)
        except _Lingering as lingering:  # every rank is done; what is left of the job is stuck on the way out
            _stop(proc)
            lingered = True
            print(f"hvdhetero: every rank finished, but the job's launcher (horovodrun, mpirun or the Ray driver) "
                  f"had not exited {lingering.seconds:.0f} s later (a host's connection stuck on the way out?): "
                  "stopped it",
                  file=sys.stderr, flush=True)
        except _Silent as silent:
            _stop(proc)
            # left waiting by a rank that had ended its script (Horovod's shutdown can hang the other
            # rank whole, its heartbeat too): the early end is what to fix
            early = failure.left_early(ended, silent.rank, silent.host)
            raise LaunchError((f"{early}\n  rank {silent.rank} then gave no response for {silent.seconds:.0f} s; "
                               "the job was stopped" if early else
                               f"rank {silent.rank} on host {silent.host}: no response for {silent.seconds:.0f} s "
                               f"(frozen, asleep or cut off); the job was stopped") + _ended(watch)
                              + _output_hint(logs, silent.rank) + resume_hint(run_dir, rank0_host)) from None
        except elastic_hosts.TooFew:
            _stop(proc)
            last = watch.dropped[-1]
            raise LaunchError(f"rank {last['rank']} on host {last['host']} {last['what']}; the other ranks were "
                              f"stopped" + _ended(watch) + resume_hint(run_dir, rank0_host)) from None
        except elastic_hosts.ScriptFailed as failed:  # a script's own error is no host failure: the job ends
            _stop(proc)
            raise LaunchError(failure.summary([failed.failure]) + resume_hint(run_dir, rank0_host)) from None
        except _Terminated as stopped:  # Ctrl-C, SIGTERM: the job must not outlive the launcher
            _stop(proc)
            if rank_hosts and len(done) == len(rank_hosts) and not failures:
                stopped.results = results  # every rank had finished its script: the launcher was on its way out
            raise
        except BaseException:  # anything else: the job must not outlive the launcher
            _stop(proc)
            raise
        finally:
            if logs is not None:
                logs.close()
    for failed in failures:
        if logs is not None and logs.has(failed["rank"]):
            failed["log"] = str(logs.path(failed["rank"]))
    if (watch is not None and proc.returncode == 0) or (lingered and not failures):
        return results  # ranks were dropped and the job went on; or every rank finished its work
    first = next(iter(exits.items()), None)
    if failures and not (first and (_signalled(first[1]) or first[1] == SSH_LOST)):
        raise LaunchError(failure.summary(failures, ended) + resume_hint(
            run_dir, rank0_host, fix_first=failures[0]["error"].startswith("ConfigError")))
    if proc.returncode == REFUSED and not (exits or failures or alive or results):
        # its reason is on the console already: no "training failed", no resume of a run that never began
        raise LaunchError("the job did not start: its launcher refused it, saying why above")
    if proc.returncode != 0 or failures:  # a rank killed first: the others' errors follow from it
        # a rank's host from its heartbeats, else from where horovodrun put it (one that failed
        # before its first heartbeat)
        hosts = {**dict(enumerate(rank_hosts)), **{r: h for r, (_, h) in alive.items()}}
        rank = next(iter(exits), None)
        raise LaunchError(died(exits, hosts, proc.returncode) + _ended(watch) + _output_hint(logs, rank)
                          + resume_hint(run_dir, rank0_host))
    return results


def _output_hint(logs: console.RankLogs | None, rank: int | None) -> str:
    """Where the rank's whole output is, if it was kept."""
    if logs is None or rank is None or not logs.has(rank):
        return ""
    return f"\n  its output: {logs.path(rank)}"


SSH_LOST = 255
"""ssh's own exit code: the connection to the host failed or was cut (a rank on another host)."""
ACTOR_LOST = -1000
"""The Ray driver's exit code for a rank whose actor or node died (cluster/ray_driver.py)."""
REFUSED = 2
"""A launcher's exit code for a job it refused to start, its reason printed (the Ray driver with no
node on the first host; horovodrun's argument errors): no rank began."""


def _signalled(code: int) -> bool:
    """An exit code that means a signal ended the process (-N from Python, 128+N from a shell;
    signals go up to 64, so 255 is ssh's, not a signal's)."""
    return code < 0 or 128 < code <= 128 + 64


EXIT_LINE = re.compile("^" + lines.EXITED)
MPI_EXIT_LINE = re.compile(r"^mpirun noticed that process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
MPI_HELP_RULE = re.compile(r"^-{40,}\s*$")
"""The dashed line that opens and closes each of Open MPI's help messages ("Primary job terminated
normally, but 1 process returned a non-zero exit code", "An MPI communication peer process has
unexpectedly disconnected")."""
MPI_NOISE = re.compile(r"^\[[^\]\s]+:\d+\] PMIX ERROR: ")


def _ended(watch: elastic_hosts.Watch | None) -> str:
    return watch.ended() if watch is not None else ""


FINISH_S = 60.0
"""How long the launcher's command (horovodrun, mpirun, the Ray driver's ssh) may take to exit
once every rank has said it is done (HVDHETERO_FINISH_S): Horovod's shutdown takes seconds; a
host that vanished after its rank finished would hold its ssh session open for the kernel's
TCP timeout (minutes to hours), and no rank is left to go silent."""


class _Lingering(Exception):
    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.seconds = seconds


class _Silent(Exception):
    def __init__(self, rank: int, host: str, seconds: float):
        super().__init__(rank, host, seconds)
        self.rank, self.host, self.seconds = rank, host, seconds


def _watched(proc: subprocess.Popen, alive: dict, exits: dict, silent_s: float,
             logs: console.RankLogs | None = None, watch: elastic_hosts.Watch | None = None,
             expected: int = 0, done: set[int] | None = None,
             ended: dict[int, tuple[int | None, str]] | None = None):
    """horovodrun's lines as they come (read by a thread), checking at least once a second that
    no rank seen so far has been silent for `silent_s`; notes the exit codes horovodrun prints;
    every line goes to the rank logs, if kept. Under elastic (`watch`) a silent rank is killed and
    a dead one dropped, until fewer than --min-hosts hosts are left. Once every rank (at least
    `expected` of them) has said it is done, the command has FINISH_S to exit (_Lingering).
    `ended` gets each done rank's job step and host (a rank that ended while others trained)."""
    incoming: queue.Queue = queue.Queue()
    done = set() if done is None else done
    ended = {} if ended is None else ended
    finish_s = float(os.environ.get("HVDHETERO_FINISH_S") or FINISH_S)
    all_done_at: float | None = None
    in_help = False  # inside one of Open MPI's dashed help blocks, printed once the ranks ran (left out)

    def read():
        spliced = lines.Spliced()  # a heartbeat inside a bar's line: the line made whole again
        try:
            proc.stdout.reconfigure(newline="\n")  # a "\r" ends no line: a progress bar's update (below)
            for line in proc.stdout:
                for part in lines.untangled(line):
                    for whole in spliced.feed(part):
                        for kept in lines.settled(whole):
                            incoming.put(kept)
        except (ValueError, OSError):  # the pipe closed under it: the job is being stopped, its end says why
            pass
        finally:
            for whole in spliced.rest():
                for kept in lines.settled(whole):
                    incoming.put(kept)
            incoming.put(None)

    threading.Thread(target=read, name="hvdhetero-relay", daemon=True).start()
    while True:
        try:
            line = incoming.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            return
        if line:
            if logs is not None:
                logs.write(line)
            if progress.DONE_TAG in line and (said := progress.PREFIX.match(line)):
                rank = int(said.group(1))
                done.add(rank)
                ended[rank] = (progress.done_step(line), alive.get(rank, (0, "?"))[1])
            match = EXIT_LINE.match(line) or MPI_EXIT_LINE.match(line)
            if match:
                code = int(match.group(2)) * (-1 if match.re is MPI_EXIT_LINE else 1)  # mpirun names the signal
                exits.setdefault(int(match.group(1)), code)
                if watch is not None:
                    rank = int(match.group(1))
                    watch.exited(rank, _what(code))
                    alive.pop(rank, None)
                    if watch.too_few(alive):
                        raise elastic_hosts.TooFew()
            prefix = progress.PREFIX.match(line)
            if watch is not None and not watch.read(line[prefix.end():] if prefix else line, bool(match)):
                continue  # horovodrun's exit line (the watch said it in words), Horovod's reset noise
            if prefix is None and (alive or done or exits):  # mpirun, once ranks ran: a rank that died is said
                # in words at the end; its help blocks about the job it aborts (21 lines) said it before that
                if MPI_HELP_RULE.match(line):
                    in_help = not in_help
                    continue
                if in_help or MPI_NOISE.match(line):
                    continue
            # Once a rank has ended, the rest is horovodrun stopping the others (its traceback,
            # the survivors' broken collectives): only our tagged lines go on to the relay.
            if watch is not None or not exits or any(tag in line for tag in (progress.ERROR_TAG, progress.RESULT_TAG,
                                                                             progress.ALIVE_TAG)):
                yield line
        now = time.monotonic()
        for rank, (seen, host) in sorted(alive.items()):
            if now - seen > silent_s and proc.poll() is None:
                if watch is None:
                    raise _Silent(rank, host, now - seen)
                watch.silent(rank, now - seen)
                del alive[rank]
                if watch.too_few(alive):
                    raise _Silent(rank, host, now - seen)
        if watch is not None:
            watch.tick()
        if done and len(done) >= expected and not alive.keys() - done and proc.poll() is None:
            all_done_at = all_done_at or now
            if now - all_done_at > finish_s:
                raise _Lingering(now - all_done_at)
        else:
            all_done_at = None


_STOPPING = threading.Event()
"""Set while _stop ends a job: a SIGTERM/SIGHUP then must not break into it (_stop_on_terminate)."""


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """End horovodrun and everything it started: SIGTERM (it stops its ranks: SIGTERM, then
    SIGKILL after 5 s, which ends a stopped process too), SIGKILL if it is still there."""
    _STOPPING.set()
    try:
        _stop_now(proc, grace_s)
    finally:
        _STOPPING.clear()


def _stop_now(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def died(exits: dict[int, int], hosts: dict[int, str], returncode: int) -> str:
    """What horovodrun reported of the first rank that ended badly, in words."""
    if not exits:
        return f"training failed: the job's launcher exited with {returncode} (see the rank output above)"
    rank, code = next(iter(exits.items()))  # horovodrun prints the first one first
    return f"rank {rank} on host {hosts.get(rank, '?')} {_what(code)}; the other ranks were stopped"


def _what(code: int) -> str:
    """A rank's exit code in words: killed by signal 9 (SIGKILL), exited with code 1."""
    if code == ACTOR_LOST:
        return ("lost its Ray actor (the actor was killed, or its node died or stopped answering: down, asleep "
                "or off the network)")
    if code == SSH_LOST:
        return "was cut off (exit 255: ssh lost the connection to its host: down, asleep or off the network)"
    if not _signalled(code):
        return f"exited with code {code}"
    signum = -code if code < 0 else code - 128
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by signal {signum} ({name})"


def resume_hint(run_dir: str | Path | None, rank0_host: str | None = None, fix_first: bool = False) -> str:
    """The newest checkpoint of a training run and the command that continues it (rank 0 writes
    them: on `rank0_host` when that is another machine); `fix_first`: the failure was the script's
    use of the API (a ConfigError), which a resume of the same script meets again."""
    if run_dir is None:
        return ""
    folder = Path(run_dir) / "checkpoints"
    saved = run_dirs.checkpoints(run_dir)
    if not saved and rank0_host:
        return (f"\n  checkpoints, if any, are on {rank0_host} in {folder}"
                f"\n  resume with: {checkout.invoke()} train --resume {shlex.quote(str(run_dir))}")
    if not saved and run_dirs.keeps_none(run_dir):
        return (f"\n  the run keeps no checkpoint (--keep-checkpoints 0; run directory {run_dir}): a new run starts "
                "from the beginning")
    if not saved:
        return f"\n  no checkpoint was written yet (run directory {run_dir}): a new run starts from the beginning"
    step, newest = saved[-1]
    return (f"\n  newest checkpoint: {newest} (step {step})"
            f"\n  {'once the script is changed as the error says, ' if fix_first else ''}resume with: "
            f"{checkout.invoke()} train --resume {shlex.quote(str(run_dir))}")
