"""This rank's host, before and at the rendezvous: its NIC for Gloo, its CPU cores, its device
and straggler settings from the inventory (handed over by the launcher in the job's settings).
"""

from __future__ import annotations

import os
import threading

import horovod.torch as hvd
import torch

from hvdhetero import netinfo, progress
from hvdhetero.rank import devices
from hvdhetero.rank.worker import Worker


def settings(hosts: dict) -> dict:
    """This host's inventory settings, found by the name horovodrun gave it."""
    return hosts.get(os.environ.get("HOROVOD_HOSTNAME", ""), {})


def join(host: dict, pin: bool = True) -> None:
    """Set this host's Gloo NIC, give a CPU rank its cores, then rendezvous (idempotent)."""
    if hvd.is_initialized():
        return
    hide_gpus(host)
    set_gloo_interface(host)
    if pin:
        pin_cpu_rank(host)
    if os.environ.get("HOROVOD_CONTROLLER") != "mpi":
        hvd.init()  # Horovod: rendezvous with the other ranks (bounded by horovodrun and Gloo's timeout)
        return
    bound = start_bound(host, START_TIMEOUT_S)
    try:  # backend mpi: Horovod on mpi4py's COMM_WORLD (MPI_Init with THREAD_MULTIPLE)
        hvd.init(comm=mpi_comm())
    finally:
        bound.cancel()


START_TIMEOUT_S = 120.0
"""Under mpirun nothing else bounds a rank's start: MPI_Init and Horovod's first collectives
wait for ever on a peer that never comes or that disagrees (one rank's Horovod set up for Gloo's
bytes, the other's for MPI's, hung both)."""


def start_bound(host: dict, seconds: float, exit=os._exit) -> threading.Timer:
    """A timer (started) that, unless cancelled within `seconds`, reports this rank's failure in
    the launcher's one tagged line and exits 1, which ends the job."""
    def expired():
        what = (f"the job's start (MPI_Init and hvd.init) did not finish within {seconds:.0f} s: another rank "
                "never joined, or the ranks disagree on how Horovod runs (check every host with: invoke check)")
        # the runner set HOROVOD_RANK from Open MPI's variables before the script started
        print(progress.failure_line(host.get("name") or os.environ.get("HOROVOD_HOSTNAME", ""), what), flush=True)
        exit(1)

    timer = threading.Timer(seconds, expired)
    timer.daemon = True
    timer.start()
    return timer


def mpi_comm():
    """mpi4py's COMM_WORLD when mpirun started this rank (backend mpi), else None."""
    if os.environ.get("HOROVOD_CONTROLLER") != "mpi":
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD


def set_gloo_interface(host: dict) -> None:
    """Horovod: Gloo takes one interface name for all ranks, but each host may call its NIC
    differently (en0 on a Mac, enp3s0 on a PC). Use this host's from the inventory, else the
    NIC that routes to the launcher's rendezvous server."""
    iface = host.get("interface")
    rendezvous = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if not iface and rendezvous:
        iface = netinfo.interface_towards(rendezvous)
    if iface:
        os.environ["HOROVOD_GLOO_IFACE"] = iface


def rank_device(host: dict) -> str:
    """This rank's device as the inventory names it: the host's, or with one per slot
    (`device: cuda,cpu`) the one at this rank's local rank (horovodrun's, set before Horovod starts)."""
    return slot_device(host, int(os.environ.get("HOROVOD_LOCAL_RANK", 0)))


def slot_device(host: dict, local_rank: int) -> str:
    """The device the inventory names for local rank `local_rank` of this host."""
    named = str(host.get("device") or "auto").split(",")
    return named[local_rank % len(named)].strip().lower()


def hide_gpus(host: dict) -> None:
    """A CPU rank on a machine with a GPU (`device: cuda,cpu`, or `device: cpu` there) sees no
    CUDA device, as on a machine without one: a script's `"cuda" if torch.cuda.is_available()
    else "cpu"` keeps its model on the CPU, its GradScaler("cuda") and autocast("cuda") are off
    there as on the Mac, and the rank makes no CUDA context in the GPU rank's memory. Only
    before this process's first CUDA call (the driver reads CUDA_VISIBLE_DEVICES once): the
    runner calls it before the script runs, join before Horovod starts. A script started without
    the runner (plain horovodrun) that asks torch about CUDA before hh.init() keeps seeing the GPU
    (torch.cuda.is_initialized() does not tell that the driver has read the variable)."""
    if rank_device(host) == "cpu" and not torch.cuda.is_initialized():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pin_cpu_rank(host: dict) -> None:
    """CPU ranks sharing a machine get a core share each (horovodrun sets the local rank/size;
    the launcher sets `machine_share` for one machine run as several hosts, under --elastic).
    Beside CPU ranks a GPU rank (`device: cuda,cpu`) runs ACCELERATOR_CORES threads, and the CPU
    ranks split the cores it leaves (devices.core_shares)."""
    mine = rank_device(host)
    if host.get("machine_share"):
        if mine == "cpu":
            devices.pin_local_rank(*map(int, host["machine_share"]))
        return
    local_size = int(os.environ.get("HOROVOD_LOCAL_SIZE", 1))
    named = [slot_device(host, i) for i in range(local_size)]
    if mine == "cpu":
        devices.pin_local_rank(int(os.environ.get("HOROVOD_LOCAL_RANK", 0)), local_size, named)
    elif mine in devices.ACCELERATORS and "cpu" in named:
        torch.set_num_threads(min(torch.get_num_threads(), devices.ACCELERATOR_CORES))


def make_rank(host: dict, slowdown: float) -> Worker:
    """This rank's device and straggler factor: the host's own, times the job's `slowdown` on
    the last rank (experiments)."""
    device = devices.select(rank_device(host), hvd.local_rank(), hvd.local_size())
    factor = float(host.get("slowdown") or 1.0)
    if hvd.rank() == hvd.size() - 1:
        factor *= slowdown
    return Worker(device=device, slowdown=factor, max_batch=host.get("max_batch"))


def one_hot(value: float) -> list[float]:
    """A list with `value` at this rank's place: summed across ranks, every rank's value."""
    out = [0.0] * hvd.size()
    out[hvd.rank()] = value
    return out
