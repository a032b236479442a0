"""Allreduce throughput of our Horovod builds: Gloo's uv transport against tcp, and Open MPI.

    invoke bench --allreduce [--sizes-mb 1,16,64] [--transports uv,tcp] [--backends gloo,mpi] [--out FILE]

--backends mpi (an inventory with pins.backend: mpi, whose build has MPI beside Gloo) adds a job
started by our mpirun command with Open MPI moving the bytes, on the same build and inputs.

A cluster with a Mac needs Gloo's uv transport everywhere (macOS has no other); this measures
what that costs against stock Linux's tcp. On this machine both builds take turns in one run:
the one installed in the env, and the other installed from the wheel cache into a directory
that shadows it through PYTHONPATH (~/.cache/hvdhetero/overlay/<key>). On remote hosts the
installed build is measured.

Every job allreduces (Sum) the same seeded float32 tensors, so besides the timing each reports
the sha256 of its results: the two transports must give bit-identical sums. Rank 0 writes the
job's JSON; the launcher prints medians over rounds and the uv/tcp ratios.

The module is both sides: `main()` runs in each rank (horovodrun), the rest on the launcher and
imports neither torch nor horovod.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hvdhetero.cluster import horovod_build
from hvdhetero.cluster import launch, mpi
from hvdhetero.config import JobConfig
from hvdhetero.errors import ConfigError, LaunchError
from hvdhetero.cluster.inventory import Host, Inventory

JOB_TIMEOUT_S = 600
DEFAULT_SIZES_MB = (1, 16, 64)


# ---- rank side -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    import horovod.torch as hvd
    import torch

    from hvdhetero.rank import host as rank_host

    parser = argparse.ArgumentParser(prog="python -m hvdhetero.bench.allreduce")
    parser.add_argument("--sizes-mb", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hosts-json", default="{}")
    args = parser.parse_args(argv)
    rank_host.join(rank_host.settings(json.loads(args.hosts_json)), pin=False)
    try:
        from horovod import hvdhetero_build
        sizes = []
        for mb in [float(s) for s in args.sizes_mb.split(",")]:
            n = int(mb * 2**20) // 4
            gen = torch.Generator().manual_seed(args.seed * 1000 + hvd.rank())
            x = torch.randn(n, generator=gen, dtype=torch.float32)
            digests, seconds = set(), []
            for i in range(args.warmup + args.repeats):
                hvd.barrier()  # Horovod: all ranks start the allreduce together
                t0 = time.perf_counter()
                y = hvd.allreduce(x, op=hvd.Sum, name=f"allreduce.{mb}")
                dt = time.perf_counter() - t0
                digests.add(hashlib.sha256(y.numpy().tobytes()).hexdigest())
                if i >= args.warmup:
                    seconds.append(dt)
            # The slowest rank's time is the collective's time.
            worst = hvd.allreduce(torch.tensor(seconds, dtype=torch.float64), op=hvd.Max, name=f"t.{mb}")
            median = statistics.median(worst.tolist())
            algbw = n * 4 / median / 1e9
            sizes.append({"mb": mb, "median_s": median, "algbw_gb_per_s": algbw,
                          "busbw_gb_per_s": algbw * 2 * (hvd.size() - 1) / hvd.size(),
                          "sha256": sorted(digests)[0], "repeatable": len(digests) == 1})
        if hvd.rank() == 0:
            moved_by_mpi = hvd.mpi_enabled() and not hvd.gloo_enabled()  # Open MPI's TCP moved the bytes
            result = {"transport": hvdhetero_build.BUILD.get("transport"), "mpi": moved_by_mpi,
                      "patch_set": hvdhetero_build.BUILD["patch_set"], "ranks": hvd.size(), "sizes": sizes}
            Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        hvd.shutdown()


# ---- launcher side ---------------------------------------------------------------------------

def overlay(python: str, transport: str, log=print) -> Path:
    """A directory holding our Horovod built with `transport`, to put on PYTHONPATH: the
    cached wheel installed with --target, published atomically, reused when present."""
    spec = horovod_build.spec_for(python, transport=transport)
    target = horovod_build.default_cache() / "overlay" / f"{spec.horovod}-{spec.key}"
    if (target / "horovod" / f"{horovod_build.MARKER_MODULE}.py").exists():
        return target
    wheel = horovod_build.build_wheel(python, log=log, spec=spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                               str(Path(tmp) / "t"), str(wheel)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise LaunchError(f"could not install {wheel} into an overlay:\n{proc.stderr[-2000:]}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(Path(tmp) / "t", target)
    return target


def compare(inventory: Inventory, hosts: list[Host], transports: list[str], sizes_mb: list[float],
            repeats: int = 10, rounds: int = 3, log=print, backends: tuple[str, ...] = ("gloo",)) -> dict:
    """Run the allreduce job `rounds` times per transport (and under mpirun, with "mpi" in
    `backends`: Open MPI moving the bytes, same build), the engines taking turns."""
    if "gloo" not in backends:
        transports = []
    unknown = [t for t in transports if t not in horovod_build.TRANSPORTS]
    if unknown or not (transports or "mpi" in backends):
        raise ConfigError(f"--transports {','.join(transports)}: choose from {', '.join(horovod_build.TRANSPORTS)}")
    if not hosts:
        raise ConfigError(f"{inventory.path}: no hosts selected; name some with --hosts")
    python = launch.env_python(inventory, hosts[0]) if hosts[0].is_local else None
    if python is None and transports not in ([inventory.pins.transport], []):
        raise ConfigError(f"on remote hosts only the installed build can be measured: use --transports "
                          f"{inventory.pins.transport} (the uv/tcp comparison runs on this machine's local host)")
    installed = horovod_build.installed_build(python) if python else {"transport": inventory.pins.transport}
    if installed is None:
        raise ConfigError(f"{python} has no Horovod built by hvdhetero: run ci/setup")
    if "mpi" in backends and not installed.get("mpi"):
        raise ConfigError(f"--backends mpi: {inventory.path} has no Horovod built with MPI where it runs; set "
                          "pins.backend: mpi and run ci/setup (or invoke provision)")
    paths = {t: None if t == installed.get("transport") else overlay(python, t, log) for t in transports}
    flags = ["--sizes-mb", ",".join(f"{s:g}" for s in sizes_mb), "--repeats", str(repeats)]
    engines = [*transports, *(["mpi"] if "mpi" in backends else [])]
    runs: dict[str, list[dict]] = {t: [] for t in engines}
    with tempfile.TemporaryDirectory(prefix="hvdhetero-allreduce-") as tmp:
        for r in range(rounds):
            for t in engines:
                out = Path(tmp) / f"{t}-{r}.json"
                job_flags = [*flags, "--out", str(out)]
                if t == "mpi":  # mpirun's ranks: the runner maps Open MPI's rank variables
                    argv, env = mpi.command(inventory, hosts, JobConfig(hosts=launch.host_settings(hosts)),
                                            ["--module", "hvdhetero.bench.allreduce", "--", *job_flags, "--hosts-json",
                                             json.dumps(launch.host_settings(hosts), sort_keys=True)])
                    env["HOROVOD_CPU_OPERATIONS"] = "mpi"  # this engine is Open MPI's TCP, whatever pins.mpi_ops says
                else:
                    argv, env = launch.job(inventory, hosts, ["hvdhetero.bench.allreduce", *job_flags])
                env["HOROVOD_CYCLE_TIME"] = "1"  # ms: measure the transport, not Horovod's batching wait
                if t != "mpi" and paths[t] is not None:
                    env["PYTHONPATH"] = str(paths[t])
                log(f"allreduce: round {r + 1}/{rounds}, {'Open MPI' if t == 'mpi' else 'transport ' + t}")
                proc = subprocess.run(argv, env=launch.forwarded_env(env), capture_output=True, text=True,
                                      timeout=JOB_TIMEOUT_S)
                if proc.returncode != 0 or not out.exists():
                    raise LaunchError(f"allreduce job ({t}) failed with exit {proc.returncode}:\n"
                                      f"{(proc.stdout + proc.stderr)[-3000:]}")
                job = json.loads(out.read_text())
                ran = "mpi" if job.get("mpi") else job["transport"]
                if ran != t:
                    raise LaunchError(f"asked for {t} but the job ran {ran}")
                runs[t].append(job)
    return summarize(runs)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians over rounds per transport and size; ratios against tcp; digest agreement:
    bit-identical means every repeat of every job gave the same sums for a size, whatever
    the transport."""
    table: dict[str, dict] = {}
    for t, jobs in runs.items():
        rows = {}
        for i, size in enumerate(jobs[0]["sizes"]):
            per_round = [j["sizes"][i] for j in jobs]
            rows[f"{size['mb']:g}"] = {
                "mb": size["mb"], "median_s": statistics.median(s["median_s"] for s in per_round),
                "algbw_gb_per_s": statistics.median(s["algbw_gb_per_s"] for s in per_round),
                "busbw_gb_per_s": statistics.median(s["busbw_gb_per_s"] for s in per_round),
                "sha256": sorted({s["sha256"] for s in per_round}),
            }
        table[t] = {"ranks": jobs[0]["ranks"], "sizes": rows}
    digests = {t: {mb: row["sha256"] for mb, row in v["sizes"].items()} for t, v in table.items()}
    repeatable = all(s["repeatable"] for jobs in runs.values() for j in jobs for s in j["sizes"])
    result = {"transports": table,
              "bit_identical": repeatable
              and len({json.dumps(d, sort_keys=True) for d in digests.values()}) == 1
              and all(len(h) == 1 for d in digests.values() for h in d.values())}
    for a, b in (("uv", "tcp"), ("mpi", "uv")):
        if a in table and b in table:
            result[f"{a}_vs_{b}"] = {mb: table[a]["sizes"][mb]["algbw_gb_per_s"] / row["algbw_gb_per_s"]
                                     for mb, row in table[b]["sizes"].items()}
    return result


def render(result: dict) -> str:
    lines = [f"{'engine':<10}{'MB':>6}{'median ms':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for t, v in result["transports"].items():
        for mb, row in v["sizes"].items():
            lines.append(f"{t:<10}{mb:>6}{row['median_s'] * 1e3:>12.2f}{row['algbw_gb_per_s']:>12.3f}"
                         f"{row['busbw_gb_per_s']:>12.3f}")
    for a, b in (("uv", "tcp"), ("mpi", "uv")):
        if f"{a}_vs_{b}" in result:
            lines.append(f"{a} / {b} throughput: "
                         + ", ".join(f"{mb} MB {r:.3f}x" for mb, r in result[f"{a}_vs_{b}"].items()))
    lines.append("results bit-identical across engines and rounds: "
                 + ("yes" if result["bit_identical"] else "NO"))
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
