"""Gloo's uv transport address codec (patch 0006), byte for byte, as macOS and Linux write them.

tests/cpp/uv_address_tool.cc is compiled against the patched Horovod source with
AddressSanitizer and UndefinedBehaviorSanitizer: every case here feeds it the exact bytes an OS
puts in a sockaddr, or a wire address, and a read past the end of any input would abort it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from hvdhetero.cluster import horovod_build as hb

pytestmark = pytest.mark.skipif(not shutil.which("g++") or not shutil.which("pkg-config"),
                                reason="needs g++ and pkg-config (ci/setup installs them)")

PORT = "1388"  # 5000, network order
V4 = "0ad5000b"  # 10.213.0.11
V6 = "fe800000000000000a1b2cfffe3d4e5f"  # fe80::a1b:2cff:fe3d:4e5f
# struct sockaddr_in / sockaddr_in6 as each OS lays them out in memory (little-endian hosts).
LINUX_IN4 = "0200" + PORT + V4 + "00" * 8  # sa_family = 2 as a 2-byte host-order field
DARWIN_IN4 = "1002" + PORT + V4 + "00" * 8  # sin_len = 16, sin_family = 2
LINUX_IN6 = "0a00" + PORT + "00012345" + V6 + "05000000"  # AF_INET6 = 10, flow info, scope id 5
DARWIN_IN6 = "1c1e" + PORT + "00012345" + V6 + "05000000"  # sin6_len = 28, AF_INET6 = 30
# The portable form: version 1, family 4|6, port, flow info, 16 address bytes, scope id, seq.
WIRE_IN4 = "01" + "04" + PORT + "00000000" + V4 + "00" * 12 + "00000000" + "00000007"
WIRE_IN6 = "01" + "06" + PORT + "00012345" + V6 + "00000005" + "00000007"


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uvcodec")
    sdist = hb.fetch_sdist(sys.executable, hb.HOROVOD_VERSION, hb.default_cache())
    gloo = hb.patched_source(sdist, tmp) / "third_party" / "gloo"
    exe = tmp / "uv_address_tool"
    sources = [ROOT / "tests" / "cpp" / "uv_address_tool.cc", gloo / "gloo/transport/uv/address.cc",
               gloo / "gloo/transport/address.cc", gloo / "gloo/common/logging.cc"]
    libuv = subprocess.run(["pkg-config", "--cflags", "--libs", "libuv"], capture_output=True, text=True,
                           check=True).stdout.split()
    subprocess.run(["g++", "-std=c++17", "-g", "-O1", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", f"-I{gloo}", *map(str, sources), *libuv, "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30)
    return run


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("layout,sockaddr,wire", [
    ("linux", LINUX_IN4, WIRE_IN4), ("darwin", DARWIN_IN4, WIRE_IN4),
    ("linux", LINUX_IN6, WIRE_IN6), ("darwin", DARWIN_IN6, WIRE_IN6),
])
def test_both_layouts_encode_to_the_same_wire_bytes(tool, layout, sockaddr, wire):
    assert ok(tool("encode", layout, "7", sockaddr)) == wire


@pytest.mark.parametrize("wire,linux,darwin", [(WIRE_IN4, LINUX_IN4, DARWIN_IN4), (WIRE_IN6, LINUX_IN6, DARWIN_IN6)])
def test_a_mac_address_arrives_on_linux_as_the_linux_struct_and_back(tool, wire, linux, darwin):
    """macOS bytes -> wire -> Linux bytes, and Linux -> wire -> macOS: the round trip of a Mac + PC job."""
    assert ok(tool("decode", "linux", ok(tool("encode", "darwin", "7", darwin)))) == f"{linux} 7"
    assert ok(tool("decode", "darwin", ok(tool("encode", "linux", "7", linux)))) == f"{darwin} 7"


@pytest.mark.parametrize("seq,hex_", [("0", "00000000"), ("-1", "ffffffff"), ("258", "00000102"),
                                      ("2147483647", "7fffffff")])
def test_sequence_numbers_are_big_endian_and_signed(tool, seq, hex_):
    wire = ok(tool("encode", "linux", seq, LINUX_IN4))
    assert wire[-8:] == hex_
    assert ok(tool("decode", "linux", wire)).endswith(f" {seq}")


def test_the_real_address_class_publishes_and_reads_the_portable_form(tool):
    """gloo::transport::uv::Address itself (address.cc as built into Horovod) on this host."""
    assert ok(tool("address-bytes", "10.213.0.11", "5000", "7")) == WIRE_IN4
    assert ok(tool("address-parse", WIRE_IN4)) == "[10.213.0.11]:5000$7"
    v6 = ok(tool("address-bytes", "::1", "5000", "3"))
    assert v6 == "0106" + PORT + "00000000" + "00" * 15 + "01" + "00000000" + "00000003"
    assert ok(tool("address-parse", v6)) == "[::1]:5000$3"


@pytest.mark.parametrize("cut", [0, 1, 2, 16, 31])
def test_truncated_wire_address_is_rejected_without_overread(tool, cut):
    proc = tool("decode", "linux", WIRE_IN6[:2 * cut])
    assert proc.returncode == 3, proc.stderr  # an ASan/UBSan abort would be another code
    assert f"a uv transport address is 32 bytes in hvdhetero's portable format, the peer sent {cut}" in proc.stderr


def test_a_stock_peer_raw_sockaddr_is_refused_with_the_fix(tool):
    """What an unpatched Horovod publishes: sockaddr_storage (128 bytes) + int seq, padded to 136."""
    stock = (LINUX_IN4 + "00" * (128 - 16) + "07000000" + "00" * 4)
    proc = tool("address-parse", stock)
    assert proc.returncode == 3
    assert "the peer sent 136" in proc.stderr and "re-provision that host" in proc.stderr


@pytest.mark.parametrize("wire,message", [
    ("02" + WIRE_IN4[2:], "format version 2, this build reads version 1"),
    ("0105" + WIRE_IN4[4:], "family byte 5 is neither 4 (IPv4) nor 6 (IPv6)"),
    (WIRE_IN4[:24] + "01" + WIRE_IN4[26:], "IPv4 uv transport address has non-zero bytes after the address"),
    (WIRE_IN4[:8] + "00000001" + WIRE_IN4[16:], "carries IPv6 flow info or scope id"),
])
def test_malformed_wire_address_is_rejected(tool, wire, message):
    proc = tool("decode", "linux", wire)
    assert proc.returncode == 3 and message in proc.stderr


@pytest.mark.parametrize("layout,sockaddr,message", [
    ("linux", "02", "sockaddr too short for its family field: 1 bytes"),
    ("linux", LINUX_IN4[:2 * 15], "IPv4 sockaddr truncated: 15 of 16 bytes"),
    ("darwin", DARWIN_IN6[:2 * 27], "IPv6 sockaddr truncated: 27 of 28 bytes"),
    ("darwin", LINUX_IN6, "address family 0 is neither IPv4 nor IPv6 in the macOS sockaddr layout"),
    ("linux", DARWIN_IN4, "address family 528 is neither IPv4 nor IPv6 in the Linux sockaddr layout"),
])
def test_truncated_or_foreign_sockaddr_is_rejected(tool, layout, sockaddr, message):
    """Reading a sockaddr in the wrong layout is exactly stock Gloo's Mac + Linux failure; we name it."""
    proc = tool("encode", layout, "0", sockaddr)
    assert proc.returncode == 3 and message in proc.stderr


@pytest.mark.parametrize("hex_,expected", [("00000003", "3"), ("ffffffff", "-1")])
def test_pair_handshake_sequence_number(tool, hex_, expected):
    assert ok(tool("seq", hex_)) == expected


@pytest.mark.parametrize("hex_", ["", "000003", "0000000300"])
def test_pair_handshake_of_the_wrong_length_is_rejected(tool, hex_):
    proc = tool("seq", hex_)
    assert proc.returncode == 3 and "expected a 4-byte sequence number" in proc.stderr
