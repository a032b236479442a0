"""hvdhetero's commands: `invoke --list` shows them, `invoke --help TASK` their options.

Each task is thin: it calls one function of the package and turns its errors into a message
and an exit code (see errors.py: 1 failed, 2 bad input, 3 unreachable).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from invoke import Exit, task
from invoke.parser import Argument

from hvdhetero import checks
from hvdhetero.bench.options import BenchOptions
from hvdhetero.cluster import inventory as inv
from hvdhetero.cluster import launch
from hvdhetero.cluster import run_dir as run_dirs
from hvdhetero.cluster import submit
from hvdhetero.config import JobConfig, check_micro_batch
from hvdhetero.errors import HvdHeteroError
from hvdhetero.options import Option, Options, from_fields
from hvdhetero.recipes.options import RecipeOptions, check_argv, recipe_argv

try:  # Invoke's parser state machine (see _words_after_report)
    from invoke.parser.parser import ParseMachine
except ImportError:  # another Invoke: `invoke report -- RUN_A RUN_B` still works
    ParseMachine = None

ROOT = Path(__file__).resolve().parent
RUNS = Path(os.environ.get("HVDHETERO_RUNS") or ROOT / "runs")
"""Where runs go by default (and where --resume latest looks)."""
_REMOTE_HELP = {
    "hosts": "comma-separated inventory hosts (default: the inventory's default_hosts)",
    "accept_new_host_keys": "record the key of a host not yet in known_hosts (a changed key is still refused)",
    "inventory": "inventory file (default inventory.yaml or $HVDHETERO_INVENTORY)",
}


def _named_value_errors(set_value):
    """Invoke casts option values (`--epochs x` through int) while it parses the command line,
    before any task runs, and a value that does not cast ended in a traceback. This makes it
    our bad-input error for every option alike: the option, the value, the type wanted, exit 2."""

    @functools.wraps(set_value)
    def checked(self, value, cast=True):
        try:
            return set_value(self, value, cast)
        except ValueError:
            wanted = {int: "an integer", float: "a number"}.get(self.kind, getattr(self.kind, "__name__", "?"))
            raise Exit(f"error: --{self.name.replace('_', '-')} must be {wanted}, got {value!r}", code=2) from None

    return checked


Argument.set_value = _named_value_errors(Argument.set_value)


def _user_errors(fn):
    """Our errors end the task with their message and exit code, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HvdHeteroError as err:
            raise Exit(f"error: {err}", code=err.exit_code) from None

    return wrapper


@task
def setup(c):
    """Set up this checkout: system packages, .venv, torch, our patched Horovod (runs ci/setup)."""
    c.run(str(ROOT / "ci" / "setup"), pty=False)


@task
def test(c):
    """Run the test suite (runs ci/test, which sets up first if needed)."""
    c.run(str(ROOT / "ci" / "test"), pty=False)


_SCRIPT = Option("script", "", "your training script (written on `import hvdhetero as hh`); its own arguments go "
                 "after `--`")
_WORKDIR = Option("workdir", "", "with --script: the folder each rank starts in, shipped to remote hosts (default: "
                  "the script's)")
_LAUNCH = (Option("dry_run", False, "print the horovodrun command and exit"),
           Option("verbose", False, "also print the horovodrun command before it runs"))
_ENGINE_FIXED = ("run_dir", "overlap", "resume", "plan_only", "hosts")
"""JobConfig fields that are not train's options: the run directory is train's own, the others are
the launcher's (--resume, invoke plan) or the API's (overlap)."""
_RECIPE_TRAIN = ("dataset", "model", "epochs", "batch_size", "lr", "optimizer", "data_dir", "download")
TRAIN = Options(
    Option("hosts", None, _REMOTE_HELP["hosts"]), Option("inventory", None, _REMOTE_HELP["inventory"]),
    _SCRIPT, _WORKDIR, from_fields(RecipeOptions, only=_RECIPE_TRAIN, prefix="built-in recipe: "),
    Option("run_dir", None, "metrics.jsonl and saved files go here (default runs/<time>-<dataset or script>)"),
    from_fields(JobConfig, exclude=_ENGINE_FIXED),
    Option("resume", "", "RUN_DIR or latest: continue that run from its newest checkpoint, with its own options "
           "and inventory file (--hosts, --inventory and --launcher may differ: a host fewer re-balances)"),
    Option("launcher", "", "what starts the ranks: horovodrun (the default; mpirun under pins.backend mpi) or ray "
           "(a Ray cluster on the hosts: invoke ray up; docs/ray.md); --resume: the run's own unless given"),
    Option("ray_address", "", "with --launcher ray: the cluster's IP:PORT (default: the one invoke ray up started "
           "on the first host)"),
    *_LAUNCH,
    Option("all_ranks_output", False, "show every rank's output on the console, each line behind [rank N] "
           "(default: rank 0's; the others' is in RUN_DIR/rank-N.log)"))
"""invoke train's options: the engine's are JobConfig's fields (declared there, once, with their
docstrings as --help), the recipe's RecipeOptions', the rest the launch's own."""
_RUN_OPTIONS = TRAIN.defaults(set(TRAIN.options) - {"hosts", "inventory", "resume", "dry_run", "run_dir", "verbose",
                                                    "all_ranks_output", "launcher", "ray_address"})
"""train's options that --resume takes from the run, with their defaults."""


@task(help=TRAIN.help, auto_shortflags=False)
@_user_errors
@TRAIN.body
def train(c, **given):
    """Train your --script (or the built-in recipe) on the inventory's hosts, one model together.
    Started by horovodrun (Gloo), mpirun (pins.backend mpi) or a Ray cluster (--launcher ray);
    without options: digits on 2 CPU ranks here. Arguments after `--` go to the script."""
    run_dir, script = given["run_dir"], given["script"]
    checks.one_of("launcher", given["launcher"] or "horovodrun", ("horovodrun", "ray"))
    if given["resume"]:
        changed = [checks.flag(k) for k, v in given.items()
                   if k in _RUN_OPTIONS and (v != _RUN_OPTIONS[k] or checks.flag(k) in _written())]
        changed += (["--run-dir"] if run_dir else []) + (["arguments after --"] if _script_args() else [])
        try:
            request, run_dir = submit.resumed(given["resume"], RUNS, given["hosts"], given["inventory"], changed,
                                              given["launcher"], given["ray_address"])
        except run_dirs.Finished as said:
            print(said)
            return
    else:
        request = submit.Request(given["hosts"], given["inventory"],
                                 {f.name: given[f.name] for f in fields(JobConfig) if f.name not in _ENGINE_FIXED},
                                 script, given["workdir"], recipe_argv({k: given[k] for k in _RECIPE_TRAIN}, script),
                                 _script_args(), given["launcher"] or "horovodrun", given["ray_address"])
    run_dir, _ = submit.submit(request, RUNS, run_dir, name=Path(request.script).stem if request.script
                               else given["dataset"], recipe_check=check_argv, dry_run=given["dry_run"],
                               verbose=given["verbose"], all_ranks=given["all_ranks_output"])
    if not given["dry_run"]:
        print(f"run directory: {run_dir}")


SWEEP = Options(
    Option("space", "", "the search space: a YAML file, one distribution per script option (docs/sweep.md), e.g. "
           "lr: {loguniform: [1.0e-4, 1.0e-1]}"),
    Option("trials", 12, "trials in all (each one host's job)"),
    Option("hosts", None, "comma-separated inventory hosts; each runs one trial at a time (default: the "
           "inventory's default_hosts)"),
    Option("inventory", None, _REMOTE_HELP["inventory"]),
    _SCRIPT, _WORKDIR,
    from_fields(RecipeOptions, only=("dataset", "model", "batch_size", "lr", "optimizer", "data_dir"),
                prefix="built-in recipe: "),
    Option("metric", "test_loss", "what a trial is judged by: a scalar the script logs each epoch with "
           "job.log(NAME=...) (the recipe logs test_loss and test_accuracy); a trial's value is its last"),
    Option("mode", "min", "min or max: whether a lower or a higher --metric is better"),
    Option("budget", 0, "epochs each trial runs (the recipe's --epochs; a script gets --epochs=N); 0: their own"),
    Option("prune", False, "stop a trial at an epoch's end when the median pruner judges it worse than the "
           "others at that epoch"),
    Option("seed", 0, "the sampler's seed (the same seed asks the same parameters)"),
    Option("env", "", "environment variables for every trial's ranks, as invoke train's --env (OMP_NUM_THREADS=1,...)"),
    Option("timeout", 0, "seconds after which no trial starts (Optuna's optimize(timeout=)): the running ones end, "
           "then the sweep; --resume goes on (0: none)"),
    Option("run_dir", None, "the sweep's folder (default runs/<time>-sweep-<space>)"),
    Option("resume", "", "SWEEP_DIR: continue that sweep (its finished trials kept; --hosts, --inventory and "
           "--timeout may differ)"))


@task(help=SWEEP.help, auto_shortflags=False)
@_user_errors
@SWEEP.body
def sweep(c, **given):
    """Hyper-parameter sweep (Optuna): trials of your --script spread over every host.
    Trials of your --script (or the built-in recipe), one per host at a time, placed by each
    host's measured speed so that the sweep ends no later than the fastest host alone. Arguments
    after `--` go to every trial's script."""
    from hvdhetero.sweep import run as sweeps

    if given["resume"]:
        defaults = SWEEP.defaults()
        changed = [checks.flag(k) for k, v in given.items()
                   if k not in ("resume", "hosts", "inventory", "timeout")
                   and (v != defaults[k] or checks.flag(k) in _written())]
        changed += ["arguments after --"] if _script_args() else []
        if changed:
            raise Exit(f"error: --resume continues the sweep with its own options (its sweep.json): "
                       f"{', '.join(changed)} cannot change there (--hosts and --inventory can)", code=2)
        folder = sweeps.resume(given["resume"], ROOT, given["hosts"], given["inventory"] or "", _timeout(given))
    else:
        if not given["space"]:
            raise Exit("error: --space is required: a YAML file of the parameters to try (docs/sweep.md)", code=2)
        script = str(Path(given["script"]).resolve()) if given["script"] else ""
        recipe = recipe_argv({k: given[k] for k in ("dataset", "model", "batch_size", "lr", "optimizer", "data_dir")},
                             script, epochs=given["budget"] or RecipeOptions.epochs)  # with --script: refused if given
        recipe = [] if script else recipe
        inventory = str(Path(given["inventory"] or inv.default_path()).resolve())
        hosts = [h.name for h in inv.load(inventory).select(given["hosts"])]
        request = sweeps.Request(inventory, hosts, str(Path(given["space"]).resolve()), given["trials"],
                                 given["metric"], given["mode"], given["budget"], given["prune"], given["seed"],
                                 script, given["workdir"], recipe, _script_args(), env=given["env"])
        timeout = _timeout(given)
        folder = sweeps.start(request, sweeps.new_folder(given["run_dir"], RUNS, Path(given["space"]).stem), ROOT,
                              check_argv, [checks.flag(f.name) for f in fields(RecipeOptions)], timeout)
    print(f"sweep directory: {folder}")


def _timeout(given: dict) -> float:
    """invoke sweep's --timeout, checked: seconds >= 0."""
    try:
        timeout = float(given["timeout"])
    except (TypeError, ValueError):
        timeout = -1.0
    if not timeout >= 0 or timeout == float("inf"):
        raise Exit(f"error: --timeout must be seconds >= 0 (0: none), got {given['timeout']!r}", code=2)
    return timeout


PLAN = Options(
    Option("hosts", None, "comma-separated inventory hosts to weigh (default: the inventory's default_hosts)"),
    Option("inventory", None, _REMOTE_HELP["inventory"]),
    Option("script", "", "your training script: the plan runs it up to job.prepare, on every host"), _WORKDIR,
    from_fields(RecipeOptions, only=("dataset", "model", "batch_size", "data_dir"), prefix="built-in recipe: "),
    from_fields(JobConfig, only=("compression", "precision", "micro_batch", "slowdown")),
    Option("out", "", "also write the plan as JSON here"), *_LAUNCH)


@task(help=PLAN.help, auto_shortflags=False)
@_user_errors
@PLAN.body
def plan(c, hosts, inventory, script, workdir, dataset, model, batch_size, data_dir, compression, precision,
         micro_batch, slowdown, out, dry_run, verbose):
    """Time the hosts and the link on your model, and say which hosts and --sync to train with.
    Measures each host's speed on the model and the link between them, predicts samples/s for
    every subset of hosts and sync mode, and says which to use. Arguments after `--` go to the
    script."""
    checks.writable_file("out", out)
    recipe = recipe_argv(dict(dataset=dataset, model=model, batch_size=batch_size, data_dir=data_dir), script,
                         epochs=1)
    settings = dict(compression=compression, micro_batch=check_micro_batch(micro_batch), precision=precision,
                    slowdown=float(slowdown), plan_only=True)
    request = submit.Request(hosts, inventory, settings, script, workdir, recipe, _script_args())
    with tempfile.TemporaryDirectory(prefix="hvdhetero-plan-") as scratch:
        _, results = submit.submit(request, RUNS, scratch, name="plan", recipe_check=check_argv,
                                   dry_run=dry_run, verbose=verbose)
    if out and results:
        Path(out).write_text(json.dumps(results[-1], indent=1) + "\n")


@task(help={"out": "folder for the figures and report.html (default: RUN_DIR/report; with several runs, "
                      "report-vs-<the others' names> inside the first)",
            "run": "a run directory (or give them as plain words: invoke report RUN_A RUN_B)"},
      iterable=["run"])
@_user_errors
def report(c, run=None, out=""):
    """Figures and one self-contained report.html for a run, several runs overlaid, or a sweep.
    Loss, accuracy, samples/s per rank, batch split and step time for a run, or several
    overlaid: invoke report RUN_DIR [RUN_DIR ...] (without
    run directories: the newest run under runs/). For a sweep: invoke report SWEEP_DIR (the
    best trial, the metric against trial and time, each parameter's effect, which host ran what)."""
    from hvdhetero.bench import report as rep
    from hvdhetero.bench import runs as rd

    folders = [Path(f) for f in [*(run or []), *_script_args()]] or [rd.newest(RUNS)]
    from hvdhetero.bench import sweep_report

    if any(sweep_report.is_sweep(f) for f in folders):
        if len(folders) > 1:
            raise Exit("error: a sweep's folder is reported on its own: invoke report SWEEP_DIR", code=2)
        target = Path(out) if out else folders[0] / "report"
        page, drawn = rd.writing(target, lambda: sweep_report.write(sweep_report.read(folders[0]), target))
        print("\n".join(str(f.path) for f in drawn) + f"\nreport: {page}")
        return
    runs = rd.read_runs(folders)  # every run read (bad input: exit 2) before anything is written
    target = Path(out) if out else rd.default_out(folders)
    page, drawn = rd.writing(target, lambda: rep.write(runs, target))
    print("\n".join(str(f.path) for f in drawn) + f"\nreport: {page}")


def _words_after_report(handle):
    """`invoke report RUN_A RUN_B` as written: Invoke gives a task one word per positional
    argument it declares and reads any further word as a task's name ("No idea what 'runs/A'
    is!"). After `report`, a word that names no task and is no option's value is a run
    directory (`--` RUN_DIR ... works too)."""

    @functools.wraps(handle)
    def handled(self, token):
        context = self.context
        if (context is not None and context.name == "report" and not token.startswith("-")
                and not self.waiting_for_flag_value and token not in self.contexts):
            context.args["run"].value = token  # a list argument: each word appended
            return None
        return handle(self, token)

    return handled


if ParseMachine is not None:
    ParseMachine.handle = _words_after_report(ParseMachine.handle)


def _written() -> set[str]:
    """The options written on the command line before `--` (--trials=12 or --trials 12): --resume
    refuses one it cannot change even where its value is the default (--trials 12 was taken silently)."""
    argv = sys.argv[:sys.argv.index("--")] if "--" in sys.argv else sys.argv
    return {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}


def _script_args() -> list[str]:
    """What follows `--` on the command line, token for token (Invoke keeps it as one string)."""
    argv = sys.argv
    return argv[argv.index("--") + 1:] if "--" in argv else []


@task(help={"install": "also install it into this checkout's .venv"})
@_user_errors
def build_horovod(c, install=False):
    """Build (or fetch from the cache) our patched Horovod wheel for this env and print its path."""
    from hvdhetero.cluster import horovod_build

    if install:
        horovod_build.install()
    else:
        print(horovod_build.build_wheel())


BENCH = Options(Option("hosts", None, "comma-separated inventory hosts (default: local, 2 CPU ranks)"),
                Option("inventory", None, _REMOTE_HELP["inventory"]), from_fields(BenchOptions))


@task(help=BENCH.help, auto_shortflags=False)
@_user_errors
@BENCH.body
def bench(c, hosts, inventory, **given):
    """Benchmark hvdhetero against plain Horovod and each rank alone, in one job; prints ratios.
    Also --allreduce, --to-accuracy and --sweep: docs/benchmarks.md."""
    options = BenchOptions(**{**given, "repeats": checks.integer("repeats", given["repeats"])})  # bad values: exit 2
    inventory_ = inv.load(inventory or inv.default_path())
    selected = inventory_.select(hosts)
    options.fits(selected)
    if options.mode == "sweep":
        from hvdhetero.bench import sweep_bench

        sweep_bench.run(str(inventory or inv.default_path()), [h.name for h in selected], options, RUNS, ROOT,
                        check_argv, [checks.flag(f.name) for f in fields(RecipeOptions)])
        return
    if options.mode == "to_accuracy":
        from hvdhetero.bench import accuracy

        accuracy.run(inventory, selected, options, RUNS, _script_args())
        return
    if options.mode == "allreduce":
        from hvdhetero.bench import allreduce as allreduce_bench

        result = allreduce_bench.compare(inventory_, list(selected), options.transport_list, options.size_list,
                                         repeats=options.repeats or 10, rounds=options.rounds,
                                         backends=options.backend_list())
        print(allreduce_bench.render(result))
        if options.out:
            Path(options.out).write_text(json.dumps(result, indent=1))
        return
    argv, env = launch.bench_command(inventory_, selected, options.throughput_flags())
    env["HOROVOD_CYCLE_TIME"] = str(options.cycle_time_ms)
    if options.dry_run or options.verbose:
        print(launch.printable(argv, env))
    if not options.dry_run:
        launch.run(argv, env, rank_hosts=launch.rank_hosts(selected))


@task(help=_REMOTE_HELP)
@_user_errors
def check(c, hosts=None, accept_new_host_keys=False, inventory=None):
    """Pre-flight: SSH keys and host keys, same versions everywhere, interfaces, peers reachable."""
    inventory_ = inv.load(inventory or inv.default_path())
    submit.preflight(inventory_, inventory_.select(hosts), accept_new_host_keys)
    print("check: all hosts ready")


@task(help={
    **_REMOTE_HELP,
    "install_system_packages": "install missing compilers/cmake/libuv with apt (sudo) or brew",
    "dry_run": "connect and print each host's plan; change nothing",
})
@_user_errors
def provision(c, hosts=None, accept_new_host_keys=False, install_system_packages=False, dry_run=False,
              inventory=None):
    """Install matching envs on the hosts over SSH (torch, our Horovod, this hvdhetero); idempotent."""
    from hvdhetero.cluster import remote_provision

    inventory_ = inv.load(inventory or inv.default_path())
    reports = remote_provision.provision(inventory_, list(inventory_.select(hosts)),
                                         accept_new=accept_new_host_keys,
                                         install_system=install_system_packages, dry_run=dry_run)
    print(remote_provision.table(reports))
    code = remote_provision.exit_code(reports)
    if code:
        raise Exit("provision: some hosts are not ready (see the table)", code=code)


@task(positional=["action"], help={
    "action": "up (start the head on the first host, the others join it), down (stop every host's node and "
              "what runs in it) or status",
    "hosts": _REMOTE_HELP["hosts"], "inventory": _REMOTE_HELP["inventory"],
    "port": "the head's port (up)",
})
@_user_errors
def ray(c, action, hosts=None, inventory=None, port=0):
    """A Ray cluster on the inventory's hosts, for train --launcher ray: invoke ray up|down|status."""
    from hvdhetero.cluster import ray_cluster, ray_node

    checks.one_of("action", action, ("up", "down", "status"))
    inventory_ = inv.load(inventory or inv.default_path())
    selected = list(inventory_.select(hosts))
    if action == "up":
        results = ray_cluster.up(inventory_, selected, port or ray_node.PORT)
    else:
        results = (ray_cluster.down if action == "down" else ray_cluster.status)(inventory_, selected)
    print(ray_cluster.table(results))
    if ray_cluster.failed(results):
        raise Exit(f"ray {action}: some hosts failed (see above)", code=1)


@task(help={
    "src": "local directory to push (e.g. data, holding MNIST/ or cifar-10-batches-py/)",
    "dest": "directory on each host; relative = under that host's home (default: same as --src)",
    "hosts": _REMOTE_HELP["hosts"],
    "inventory": _REMOTE_HELP["inventory"],
})
@_user_errors
def push_data(c, src="data", dest=None, hosts=None, inventory=None):
    """Push a dataset directory to the hosts with rsync over ssh (host keys checked)."""
    inventory_ = inv.load(inventory or inv.default_path())
    errors = launch.push(inventory_, inventory_.select(hosts), src, dest or src)
    for host, error in errors.items():
        print(f"{host}: {'failed: ' + error if error else 'ok'}")
    if any(errors.values()):
        raise Exit(f"push-data: failed for {', '.join(h for h, e in errors.items() if e)}", code=1)
