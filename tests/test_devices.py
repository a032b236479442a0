"""Device resolution as a pure function, and the real CPU device on this machine."""

import os

import pytest
import torch

from hvdhetero.rank import devices
from hvdhetero.errors import ConfigError

CPU_ONLY = {"cuda": False, "mps": False, "cpu": True}
PC = {"cuda": True, "mps": False, "cpu": True}
MAC = {"cuda": False, "mps": True, "cpu": True}
EVERYTHING = {"cuda": True, "mps": True, "cpu": True}


@pytest.fixture(autouse=True)
def _restore_threads():
    # CPUDevice.setup changes the process-wide thread count; don't leak it into other tests.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "requested, have, expected",
    [
        ("auto", CPU_ONLY, "cpu"),
        ("auto", PC, "cuda"),
        ("auto", MAC, "mps"),
        ("auto", EVERYTHING, "cuda"),
        ("cpu", EVERYTHING, "cpu"),
        ("mps", EVERYTHING, "mps"),
        ("cuda", PC, "cuda"),
        ("CUDA", PC, "cuda"),
        (" auto ", MAC, "mps"),
    ],
)
def test_resolve(requested, have, expected):
    assert devices.resolve(requested, have) == expected


def test_resolve_missing_keys_count_as_unavailable():
    assert devices.resolve("auto", {"cpu": True}) == "cpu"


def test_resolve_unavailable_device_says_what_and_how_to_fix():
    with pytest.raises(ConfigError) as err:
        devices.resolve("cuda", MAC, host="mac-mini")
    message = str(err.value)
    assert "'cuda' was requested but is not available on mac-mini" in message
    assert "(available: mps, cpu)" in message
    assert "`device:` for this host in inventory.yaml" in message
    assert "`auto`" in message


def test_resolve_unknown_name_lists_allowed():
    with pytest.raises(ConfigError, match=r"unknown device 'tpu'; allowed: auto, cuda, mps, cpu"):
        devices.resolve("tpu", EVERYTHING)


def test_available_on_this_machine():
    have = devices.available()
    assert list(have) == list(devices.AUTO_ORDER)
    assert have["cpu"] is True
    assert have["cuda"] == torch.cuda.is_available()


def test_select_cpu():
    device = devices.select("cpu", local_rank=1, local_size=2)
    assert isinstance(device, devices.CPUDevice)
    assert device.torch_device == torch.device("cpu")
    assert torch.get_num_threads() >= 1
    threads = torch.get_num_threads()
    assert device.describe() == f"cpu ({threads} thread{'s' if threads != 1 else ''})"
    assert device.memory_allocated() == 0
    device.synchronize()
    x = torch.ones(3, device=device.torch_device)
    assert x.sum().item() == 3


def test_cpu_setup_splits_cores_among_local_ranks():
    devices.CPUDevice().setup(local_rank=0, local_size=10_000)
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("machine, mine, local_size, threads", [
    (8, 8, 2, 4),   # not pinned: the ranks on this machine split its cores
    (8, 4, 2, 4),   # pinned to its share by pin_local_rank: that share, not half of it
    (2, 1, 1, 1),   # a test host pinned to one core: one thread, not two taking turns on it
])
def test_cpu_threads_follow_the_cores_this_rank_may_use(monkeypatch, machine, mine, local_size, threads):
    monkeypatch.setattr(devices.os, "cpu_count", lambda: machine)
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(mine)))
    devices.CPUDevice().setup(local_rank=0, local_size=local_size)
    assert torch.get_num_threads() == threads


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                    reason="this machine has an accelerator")
def test_accelerators_unavailable_here():
    assert not devices.CUDADevice.is_available()
    assert not devices.MPSDevice.is_available()
    assert devices.select("auto").name == "cpu"
    with pytest.raises(ConfigError, match="'mps' was requested but is not available"):
        devices.select("mps")


def test_mps_env_enables_cpu_fallback():
    assert devices.MPS_ENV == {"PYTORCH_ENABLE_MPS_FALLBACK": "1"}


def test_select_flushes_denormal_floats_to_zero():
    """Adam drove small weights into the denormal range, where x86 takes ~100x per operation
    (a CPU step crept from 70 to 200 ms in one benchmark): every rank flushes them to zero."""
    torch.set_flush_denormal(False)
    try:
        assert (torch.tensor([1e-30]) * 1e-10).item() != 0.0  # a denormal, kept
        devices.select("cpu")
        assert (torch.tensor([1e-30]) * 1e-10).item() == 0.0
    finally:
        torch.set_flush_denormal(False)


def test_deterministic_asks_for_repeatable_kernels_before_any_cuda_work(monkeypatch):
    """--deterministic: what a CUDA rank needs for a run and its resume to end bit-exact (the GPU
    test resumes with it, tests/gpu); here, that the switches are set."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    try:
        devices.deterministic()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:]


@pytest.mark.parametrize("named, cores, shares", [
    (["cpu", "cpu"], 16, [range(0, 8), range(8, 16)]),            # CPU ranks alone: an even split, as before
    (["cuda", "cpu"], 16, [range(0, 2), range(2, 16)]),           # the GPU check's machine: 2 and 14
    (["cpu", "cuda", "cpu"], 16, [range(2, 9), range(0, 2), range(9, 16)]),
    (["mps", "cpu"], 2, [range(0, 1), range(1, 2)]),              # too few cores to keep 2: an even split
    (["cuda", "cuda"], 16, [range(0, 8), range(8, 16)]),          # no CPU rank to leave cores to
])
def test_gpu_ranks_keep_two_cores_and_the_cpu_ranks_split_the_rest(named, cores, shares):
    assert devices.core_shares(named, list(range(cores))) == [list(r) for r in shares]


def test_a_cpu_rank_beside_a_cuda_rank_takes_the_cores_the_cuda_rank_leaves(monkeypatch):
    """device: cuda,cpu on 16 cores: the CPU rank is pinned to 14 of them and runs 14 threads (it
    had 8, beside the CUDA rank's 16 threads floating over all 16; issue 32), the CUDA rank runs 2."""
    from hvdhetero.rank import host as rank_host

    pinned = {}
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(devices.os, "sched_setaffinity", lambda pid, cores: pinned.update(cores=list(cores)))
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 16)
    threads = torch.get_num_threads()
    try:
        for local_rank in (1, 0):
            monkeypatch.setenv("HOROVOD_LOCAL_RANK", str(local_rank))
            monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "2")
            rank_host.pin_cpu_rank({"device": "cuda,cpu"})
            if local_rank == 1:
                assert pinned.pop("cores") == list(range(2, 16))
                monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(2, 16)))
                devices.CPUDevice().setup(local_rank=1, local_size=2)
                assert torch.get_num_threads() == 14
                torch.set_num_threads(16)
        assert "cores" not in pinned and torch.get_num_threads() == devices.ACCELERATOR_CORES, "the CUDA rank's"
        monkeypatch.setenv("HOROVOD_LOCAL_RANK", "0")
        torch.set_num_threads(16)
        rank_host.pin_cpu_rank({"device": "cuda"})  # a GPU rank alone on its machine keeps its threads
        assert torch.get_num_threads() == 16 and "cores" not in pinned
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device, local_rank, hidden", [
    ("cuda,cpu", 1, True), ("cuda,cpu", 0, False), ("cpu", 0, True), ("auto", 0, False), ("cuda", 0, False)])
def test_a_cpu_rank_on_a_gpu_machine_sees_no_gpu(monkeypatch, device, local_rank, hidden):
    """device: cuda,cpu: the CPU rank's torch sees no CUDA device (CUDA_VISIBLE_DEVICES empty,
    before its first CUDA call), so a script's GradScaler("cuda") is off there and its
    `"cuda" if torch.cuda.is_available()` picks the CPU (on the GPU machine its GradScaler was
    on; issue 32). A GPU rank, or one whose device is chosen for it, keeps what it had."""
    from hvdhetero.rank import host as rank_host

    monkeypatch.setenv("HOROVOD_LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    rank_host.hide_gpus({"device": device})
    assert (os.environ["CUDA_VISIBLE_DEVICES"] == "") is hidden


def test_a_cpu_rank_started_by_the_runner_sees_no_gpu_before_the_script_runs_and_its_collector_on(tmp_path):
    """The runner hides the GPU before the script's first line (which may ask torch for CUDA
    before hh.init()); a real rank process, its script printing what it sees. The garbage
    collector, off while the runner imports torch, is on again for the script's own objects."""
    import json
    import subprocess
    import sys

    from hvdhetero.config import JobConfig

    script = tmp_path / "sees.py"
    script.write_text("import gc, os\nprint('SEES', repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n"
                      "print('COLLECTS', gc.isenabled())\n")
    config = JobConfig(run_dir=str(tmp_path), hosts={"localhost": {"name": "gpu", "device": "cuda,cpu"}})
    env = {**os.environ, "HOROVOD_HOSTNAME": "localhost", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_RANK": "1",
           "CUDA_VISIBLE_DEVICES": "0"}
    out = subprocess.run([sys.executable, "-m", "hvdhetero.rank.runner", "--job-json", config.to_json(),
                          "--script", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert "SEES ''" in out.stdout, (out.stdout, out.stderr, json.dumps(env.get("HOROVOD_HOSTNAME")))
    assert "COLLECTS True" in out.stdout, out.stdout
