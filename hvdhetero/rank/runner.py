"""What horovodrun starts on every slot: the job's settings, then the training script.

    python -m hvdhetero.rank.runner --job-json '{...}' [--workdir DIR] [--mpi-host ADDRESS]
                                    (--module M | --script PATH) [-- ARGS]

It puts the job's settings where `hh.init()` finds them, moves into the script's working
directory (shipped to remote hosts by the launcher), and runs the script as `__main__` with its
own arguments: the built-in recipe (`--module hvdhetero.recipes.train`) and a user's script
alike. If the script raises, the rank prints one tagged summary line (host, rank, exception, its
last frames and the whole traceback) for the launcher to show instead of a traceback wall (the
traceback goes to the rank's log, RUN_DIR/rank-N.log on the launcher's machine), and exits 1 at
once (horovodrun then stops the other ranks).
"""

from __future__ import annotations

import argparse
import gc
import os
import runpy
import socket
import sys
import traceback

from hvdhetero import progress
from hvdhetero.config import ENV_VAR, JobConfig
from hvdhetero.errors import HvdHeteroError
from hvdhetero.rank import current

FRAMES = 4
"""Frames of the traceback the summary shows (the innermost ones)."""

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""hvdhetero's own folder: frames there are left out of the summary of an error of ours (a
ConfigError refusing the script's call listed four frames of job.prepare's checks)."""

RECIPES = os.path.join(PACKAGE, "recipes") + os.sep
"""The built-in recipe's folder: the script, where no --script is given."""


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m hvdhetero.rank.runner", description=__doc__.split("\n")[0])
    parser.add_argument("--job-json", default="{}", help="the job's settings (JobConfig as JSON, from the launcher)")
    parser.add_argument("--workdir", default="", help="run the script from here (~ = this host's home)")
    parser.add_argument("--mpi-host", default="", help="started by mpirun (backend mpi) on this inventory address")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--module", help="a module to run as __main__ (the built-in recipe)")
    what.add_argument("--script", help="a script to run as __main__, relative to --workdir")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, after --")
    args = parser.parse_args(argv)
    if args.args[:1] == ["--"]:
        args.args = args.args[1:]
    return args


def main(argv: list[str] | None = None) -> None:
    # The collector is off until the script starts (run_script): importing Horovod, torch and
    # torch._dynamo makes ~1M objects, and it searched them for cycles again and again as they
    # came (a two-rank job of a 4-input model: 8.2 s -> 7.5 s a job, 6 runs each, alternated).
    gc.disable()
    args = parse_args(argv)
    config = JobConfig.from_json(args.job_json)
    os.environ[ENV_VAR] = config.to_json()
    if args.mpi_host:
        as_horovodrun_would(args.mpi_host, config)
    progress.heartbeat(int(os.environ.get("HOROVOD_RANK", 0)), host_name(config))
    from hvdhetero.rank import host

    host.hide_gpus(host.settings(config.hosts))  # before the script asks torch for CUDA
    # A Hydra app's @hydra.main catches any error, prints it and exits 1: the console said only
    # "SystemExit: 1" (no error, no line). Raised whole, it is reported as any other script's.
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    if args.workdir:
        os.chdir(os.path.expanduser(args.workdir))
    exit_with = None
    try:
        try:
            if config.elastic:  # Horovod elastic: the script runs again from the top after every reset
                from hvdhetero.rank import elastic

                host.set_gloo_interface(host.settings(config.hosts))  # Horovod's notification service binds it
                elastic.run(lambda: run_script(args))
            else:
                run_script(args)
        except SystemExit as done:
            if done.code not in (None, 0):
                fail(config, f"SystemExit: {done.code}{usage_error(done)}", [])
            exit_with = done
        if current.job is not None:  # a loop of the script's own: rank 0's end record and its job.log values
            current.job.finish()
    except BaseException as err:  # noqa: BLE001 - every failure of the script is reported the same way
        from hvdhetero.rank import saving

        fail(config, said(err) + saving.in_an_earlier_run(err, config.run_dir), frames_of(err), traceback.format_exc())
    ended()
    if exit_with is not None:
        raise exit_with


def usage_error(done: SystemExit) -> str:
    """What argparse said before it exited (a script's argument it refused: `argument --use_bn:
    ignored explicit argument 'True'`), read from its `error` frame in the exit's traceback, as
    ": prog: error: message" (and Hydra's "(usage: prog [overrides ...])": a Hydra app takes
    key=value); "" for any other exit."""
    tb = done.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "error" and frame.f_globals.get("__name__") == "argparse":
            parser, message = frame.f_locals.get("self"), frame.f_locals.get("message")
            prog = getattr(parser, "prog", "")
            hydra = any(getattr(a, "dest", "") == "overrides" for a in getattr(parser, "_actions", ()))
            return (f": {prog}: error: {message}{f' (usage: {prog} [overrides ...])' if hydra else ''}"
                    if message else "")
        tb = tb.tb_next
    return ""


def said(err: BaseException) -> str:
    """A failure in one line for the console: `Type: message`; for a process the script started
    (torch.multiprocessing.spawn's ProcessRaisedException, whose text is that process's whole
    traceback) the process's own error, its last line (the rank log keeps the traceback)."""
    text = str(err)
    if type(err).__name__ == "ProcessRaisedException" and text.strip():
        return f"{type(err).__name__}: a process the script started failed: {text.strip().splitlines()[-1]}"
    return f"{type(err).__name__}: {text}"


def ended() -> None:
    """The script ended well (returned, or sys.exit(0)): what it should know, then DONE, after
    which quiet (Horovod's shutdown) is not frozen."""
    left_early_hint()
    never_joined_hint()
    print(progress.done_line(job_step()), flush=True)


def job_step() -> int | None:
    """The job's global step now (the launcher tells a rank that ended early from the others by it),
    None before job.prepare."""
    job = current.job
    try:
        return int(job.train_state.step) if job is not None and getattr(job, "training", None) is not None else None
    except Exception:  # noqa: BLE001 - a job half torn down (an elastic reset) says no step
        return None


def left_early_hint() -> None:
    """A script that ended normally after leaving job.epochs' loop with `break`: say what that
    lost and what ends a run properly (rank 0 only)."""
    job = current.job
    if job is not None and getattr(job, "left_epochs", None) is not None and job.is_main:
        print(f"hvdhetero: the script left job.epochs' loop in epoch {job.left_epochs} (break or return): that epoch "
              "has no record and the run's end record no parameter digests; call job.stop() instead to end after "
              "the epoch with both", flush=True)


def never_joined_hint() -> None:
    """A script that ended without job.prepare (or hh.init) ran on every rank alone, each on all
    of its data, as busy as one and no faster: say so (rank 0 only), since nothing else does."""
    size = int(os.environ.get("HOROVOD_SIZE", "1"))
    if size < 2 or os.environ.get("HOROVOD_RANK", "0") != "0":
        return
    job = current.job
    hvd = sys.modules.get("horovod.torch")
    if job is None and hvd is not None and hvd.is_initialized():
        return  # a plain Horovod script (or our allreduce bench): it shares what it shares itself
    if job is None and {"-h", "--help"} & set(sys.argv[1:]):
        return  # `invoke train --script x.py -- --help`: the script printed its help and ended
    if job is None:
        missing = "never called hh.init() nor job.prepare(...)"
    elif job.config.plan_only:  # invoke plan times the model inside job.prepare and ends the job there
        return
    elif getattr(job, "training", None) is None:
        missing = "never called job.prepare(model, optimizer, dataset, global_batch=...)"
    else:
        return
    print(f"hvdhetero: the script {missing}: each of the {size} ranks ran it on its own and no gradient was "
          "shared; README.md, 'Your own model', shows the lines that make it one job", flush=True)


def as_horovodrun_would(address: str, config: JobConfig) -> None:
    """Under mpirun: this rank's place and host in the variables horovodrun sets (the rank side
    reads those), from Open MPI's own; and the NIC the bytes go on: the host's own for MPI and
    Gloo, else (none named) Gloo's is the one towards another host of the job."""
    for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"):  # Open MPI's OMPI_COMM_WORLD_<name>
        os.environ["HOROVOD_" + name] = os.environ.get("OMPI_COMM_WORLD_" + name, "0" if "RANK" in name else "1")
    os.environ["HOROVOD_HOSTNAME"] = address
    # This env's Open MPI (the PyPI wheel lives in the env itself): mpirun hands every rank its
    # own install path as PMIx's, which on another host is another env, or nothing; with the
    # two prefixes apart, MPI_Init never returned on the test hosts.
    os.environ["OPAL_PREFIX"] = os.environ["PMIX_INSTALL_PREFIX"] = sys.prefix
    for stream in (sys.stdout, sys.stderr):  # whole lines per write: mpirun tags each write, not each line
        stream.reconfigure(line_buffering=True, write_through=False)
    iface = config.hosts.get(address, {}).get("interface")
    if iface:  # this host's NIC for MPI's own bytes, read at MPI_Init (see cluster/mpi.py)
        os.environ["OMPI_MCA_btl_tcp_if_include"] = iface
    else:
        from hvdhetero import netinfo

        others = [a for a in config.hosts if a != address] or [address]
        iface = netinfo.interface_towards(others[0])
    if iface:
        os.environ["HOROVOD_GLOO_IFACE"] = iface


def run_script(args) -> None:
    """The script (or module) as __main__, with its own arguments; torch seeded with --seed
    first, so that the script's own torch.manual_seed, before hh.init() or after, is the one
    that counts (hh.init() seeds only a script that did not: rank/job.py)."""
    import torch
    import torch._dynamo  # torch.optim imports it at the first step (~1.7 s); here the collector is off

    from hvdhetero.rank import averaging, clipping, saving

    averaging.install()  # before the script imports update_bn: over the prepared loader, the ranks' statistics averaged
    clipping.install()  # before the script imports it: torch's clip_grad_norm_ on the whole model is the job's
    saving.install()  # and a torch.save to a path is written whole before another rank on the host reads it
    torch.manual_seed(JobConfig.from_json(os.environ[ENV_VAR]).seed)
    current.runner_seed = torch.initial_seed()
    gc.enable()  # the script's own objects are collected as in any process
    if args.module:
        sys.argv = [args.module, *args.args]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args.script)
        sys.argv = [script, *args.args]
        if os.path.dirname(script) not in sys.path:
            sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")


def frames_of(err: BaseException) -> list:
    """The traceback's frames, less Python's and this module's; of an error of ours (a refusal of
    the script's call), only those outside hvdhetero: where the script made the call."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith("<frozen") and f.filename != __file__]
    if isinstance(err, HvdHeteroError):  # (the built-in recipe is the script there: its frames stay)
        frames = [f for f in frames if not f.filename.startswith(PACKAGE) or f.filename.startswith(RECIPES)] or frames
    return frames


def shown(frames: list) -> list:
    """The frames a failure's summary shows: the innermost FRAMES, and before them the innermost
    frame of the user's own code where those are all in libraries (a BatchNorm's error raised four
    frames deep in torch showed no line of the script)."""
    last = list(frames[-FRAMES:])
    yours = [f for f in frames if not _library(f.filename)]
    if yours and yours[-1] not in last:
        last = [yours[-1], *last[1:]]
    return last


def _library(filename: str) -> bool:
    """A frame of an installed package (torch, horovod, ours), not of the user's script."""
    return "site-packages" in filename or "dist-packages" in filename or filename.startswith((PACKAGE, "<"))


def host_name(config: JobConfig) -> str:
    """This rank's host as the inventory names it (horovodrun knows its address)."""
    address = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    return config.hosts.get(address, {}).get("name") or address


def fail(config: JobConfig, what: str, frames, full: str = "") -> None:
    """Report this rank's failure in one tagged line (the launcher keeps the whole traceback in
    the rank's log), exit 1 now."""
    print(progress.failure_line(host_name(config), what, [f"{f.filename}:{f.lineno} in {f.name}: "
                                                         f"{(f.line or '').strip()}" for f in shown(frames)],
                                full, step=job_step()), flush=True)
    sys.stderr.flush()
    os._exit(1)  # Horovod's atexit shutdown would wait on peers stuck in a collective with us


if __name__ == "__main__":
    main()
