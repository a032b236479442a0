"""Our Horovod wheel: cache key, patches, and that the installed build carries them."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, VENV_BIN, requires_root, run_cmd
from hvdhetero.cluster import horovod_build as hb
from hvdhetero.cluster import inventory as inv


def _spec(**changes):
    base = hb.BuildSpec(horovod="0.28.1", patch_set="p", torch="2.14.1", python="cp311",
                        platform="linux-x86_64", build_env=(("A", "1"),))
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("field,value", [
    ("horovod", "0.28.2"), ("patch_set", "q"), ("torch", "2.14.1+cu130"), ("python", "cp312"),
    ("platform", "macosx-14.0-arm64"), ("build_env", (("A", "2"),)), ("transport", "tcp"),
    ("mpi", "openmpi-4.1.8"),
])
def test_cache_key_changes_with_everything_the_binary_depends_on(field, value):
    assert _spec().key == _spec().key
    assert _spec(**{field: value}).key != _spec().key


def test_an_mpi_build_is_its_own_variant_and_a_gloo_build_keeps_its_key():
    """The key of a Gloo-only build is what it was before MPI builds existed (caches stay
    valid); each Open MPI version is a build of its own (the library links that MPI's ABI)."""
    gloo = _spec()
    blob = {f.name: getattr(gloo, f.name) for f in dataclasses.fields(gloo) if f.name != "mpi"}
    before = hb.hashlib.sha256(hb.json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]
    assert gloo.key == before
    assert _spec(mpi="openmpi-4.1.8").key != _spec(mpi="openmpi-4.1.7").key
    env = _spec(mpi="openmpi-4.1.8", build_env=tuple(sorted(hb.BUILD_ENV.items()))).variables()
    assert env["HOROVOD_WITH_MPI"] == "1" and "HOROVOD_WITHOUT_MPI" not in env
    assert _spec(build_env=tuple(sorted(hb.BUILD_ENV.items()))).variables()["HOROVOD_WITHOUT_MPI"] == "1"


def test_an_mpi_build_needs_open_mpi_in_the_env_and_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(hb, "target_facts", lambda python: {"torch": "2.14.1", "openmpi": None, "python": "cp311",
                                                            "platform": "linux-x86_64"})
    with pytest.raises(hb.BuildError, match="needs PyPI's openmpi.*set pins.backend: mpi.*invoke provision"):
        hb.spec_for("/env/bin/python", mpi=True)
    assert hb.spec_for("/env/bin/python").mpi == ""


def test_patch_set_hash_covers_names_and_contents(tmp_path):
    a = tmp_path / "0001-a.patch"
    a.write_text("x")
    before = hb.patch_set_hash([a])
    a.write_text("y")
    assert hb.patch_set_hash([a]) != before


def test_our_patches_apply_cleanly_to_the_pypi_sdist(tmp_path):
    sdist = hb.fetch_sdist(sys.executable, hb.HOROVOD_VERSION, hb.default_cache())
    src = hb.unpack(sdist, tmp_path)
    for patch in hb.patch_files():
        proc = subprocess.run(["patch", "-p1", "--batch", "--forward", "-i", str(patch)], cwd=src,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{patch.name} does not apply:\n{proc.stdout}{proc.stderr}"
    assert "set(CMAKE_CXX_STANDARD 20)" in (src / "CMakeLists.txt").read_text()
    context = (src / "horovod/common/gloo/gloo_context.cc").read_text()
    assert "gloo_iface_ = global_context.gloo_iface_;" in context
    assert "#if defined(__linux__) && !defined(HOROVOD_GLOO_TRANSPORT_UV)" in context
    uv = src / "third_party/gloo/gloo/transport/uv"
    assert "wire::decode(bytes.data(), bytes.size())" in (uv / "address.cc").read_text()
    assert '"${libuv_INCLUDE_DIRS}"' in (src / "third_party/gloo/cmake/Dependencies.cmake").read_text()


def test_installed_horovod_is_our_build_for_this_env():
    info = hb.installed_build(sys.executable)
    assert info is not None, "horovod in .venv is not our patched build: run ci/setup"
    assert info["patches"] == [p.name for p in hb.patch_files()]
    assert info["patch_set"] == hb.patch_set_hash(hb.patch_files())
    pins = inv.load(inv.default_path()).pins
    assert info["transport"] == pins.transport
    assert info["key"] == hb.spec_for(sys.executable, transport=pins.transport).key


def test_check_build_lists_pytorch_and_gloo():
    out = run_cmd([VENV_BIN / "horovodrun", "--check-build"], timeout=120).stdout
    assert "[X] PyTorch" in out and "[X] Gloo" in out


def test_cached_wheel_is_reused(tmp_path):
    """Second build for the same env is a cache hit: same file, no compiler run."""
    first = hb.build_wheel(sys.executable)
    messages = []
    assert hb.build_wheel(sys.executable, log=messages.append) == first
    assert messages == [f"horovod: cached wheel {first}"]


@requires_root
@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare (util-linux)")
def test_job_runs_when_hostname_resolves_to_an_address_not_on_this_host(tmp_path):
    """Stock 0.28.1 builds its process-set Gloo device from the hostname, not from
    HOROVOD_GLOO_IFACE; where the hostname resolves elsewhere (Ubuntu's 127.0.1.1 on a
    multi-host job) it fails. Here, in a private network namespace, the hostname maps to an
    address no interface has: only a build with our patch 0003 can run the job."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.213.0.99 hvdtest-elsewhere\n")
    script = (
        "set -e; ip link set lo up; hostname hvdtest-elsewhere; "
        f"mount --bind {hosts} /etc/hosts; "
        f"exec {VENV_BIN / 'horovodrun'} -np 2 -H localhost:2 --gloo --start-timeout 60 "
        f"{sys.executable} {ROOT / 'tests/jobs/allreduce.py'}"
    )
    proc = run_cmd(["unshare", "--net", "--uts", "--mount", "--propagation", "private", "sh", "-c", script],
                   timeout=180, check=False, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("sum 1") == 2


def test_a_failed_build_says_the_compilers_first_errors_not_only_pips_traceback():
    """Seen on the GPU image (gcc 13): the message held only pip's traceback ending in
    'cmake --build ... returned non-zero exit status 2'; the cause was hundreds of lines up."""
    from hvdhetero.cluster.horovod_build import failure_excerpt

    output = "\n".join(["/usr/bin/g++-13 " + "-I/x " * 500 + "-c gloo/types.cc",
                        "In file included from gloo/types.cc:9:",
                        "gloo/types.h:66:11: error: 'uint8_t' does not name a type",
                        *[f"noise {i}" for i in range(200)],
                        "subprocess.CalledProcessError: Command 'cmake --build .' returned non-zero exit status 2."])
    excerpt = failure_excerpt(output)
    assert "In file included from gloo/types.cc:9:" in excerpt and "'uint8_t' does not name a type" in excerpt
    assert excerpt.index("uint8_t") < excerpt.index("returned non-zero exit status 2"), excerpt
    assert "noise 10" not in excerpt and len(excerpt.splitlines()) < 25 and len(excerpt) < 2000, excerpt
    assert failure_excerpt("a\nb") == "a\nb", "no compiler error: the output's end, as before"
