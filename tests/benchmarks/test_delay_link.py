"""The user-space delay link (``benchmarks/_delay_link.py``, driven through ``_netns.Lab``) against its configuration.

Real namespaces, a real relay process, real UDP and TCP: needs root and TUN devices, and is skipped with the reason
otherwise (except the packet arithmetic, which runs anywhere). Every test that builds links also checks that nothing
is left afterwards: no namespace, no interface in this namespace, no relay process.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _delay_link  # noqa: E402
from _netns import Lab, delay_unavailable_reason  # noqa: E402
from conftest import host_links, netns_names  # noqa: E402

DELAY_MS, RATE_MBIT = 20.0, 50.0
RTT_SLACK_MS = 15.0  # scheduling on a small shared machine, Python probes


# ----------------------------------------------------------------------------------------------------------- helpers


def _relay_processes(tag: str) -> list[int]:
    """Relay processes serving namespaces named with ``tag`` (their command line holds the namespace names)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path("/proc", pid, "cmdline").read_bytes()
        except OSError:
            continue
        if b"_delay_link.py\0relay" in cmd and tag.encode() in cmd:
            found.append(int(pid))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead: only its entry waits for the parent
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _leftovers(tag: str, before_links: set[str]) -> list[str]:
    left = [f"namespace {n}" for n in sorted(netns_names()) if n.startswith(tag)]
    left += [f"relay process {p}" for p in _relay_processes(tag)]
    ours = {f"{kind}{i}" for kind in "dvp" for i in range(8)}  # what Lab names its interfaces
    left += [f"interface {name} in this namespace" for name in sorted((host_links() - before_links) & ours)]
    return left


def _clean(tag: str) -> None:
    for pid in _relay_processes(tag):
        os.kill(pid, signal.SIGKILL)
    for name in netns_names():
        if name.startswith(tag):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.fixture
def lab_tag(request):
    """A unique namespace prefix; after the test, whatever carries it is a failure (and is removed)."""
    reason = delay_unavailable_reason()
    if reason:
        pytest.skip(f"delayed links need namespaces and TUN devices: {reason}")
    tag = f"cdl{os.getpid() % 100000}{request.node.name[5:11].replace('_', '')}"
    before = host_links()
    yield tag
    time.sleep(0.2)
    left = _leftovers(tag, before)
    _clean(tag)
    assert not left, f"left behind: {left}"


# ------------------------------------------------------------------------------------------------------------- tests


def test_a_delayed_link_has_its_round_trip_time_and_rate(lab_tag):
    d = DELAY_MS
    with Lab(tag=lab_tag) as lab:
        a, b = lab.build_delay_star(2)
        lab.set_delay_links(RATE_MBIT, d)
        relay_pid = lab.relay.pid
        m = lab.measure(a, b, pings=20, seconds=2.0)
        stats = lab.relay_stats()
    assert not _alive(relay_pid)
    assert m["ping_lost"] == 0
    # a packet is never early, and the median round trip is 2 x delay plus a little
    assert m["rtt_ms_min"] >= 2 * d, m["rtt_samples"]
    assert 2 * d <= m["rtt_ms_median"] <= 2 * d + RTT_SLACK_MS, m["rtt_samples"]
    assert m["owd_ms_there_min"] >= d and m["owd_ms_back_min"] >= d
    # the TCP payload rate: what the link sustains, and the whole transfer with TCP's start-up
    for key in ("steady_mbit_s", "mbit_s"):
        assert 0.6 * RATE_MBIT <= m[key] <= 1.1 * RATE_MBIT, (key, m[key])
    sender = next(p for p in stats["ports"] if p["addr"] == a.addr)
    assert sender["wire_bytes"] >= m["bytes"]  # it carried the transfer, headers included
    assert sender["write_errors"] == 0 and sender["unroutable"] == 0
    assert max(p["max_queue_us"] for p in stats["ports"]) <= 100_000  # the queue bound (default 100 ms) holds


def test_each_stage_link_delays_what_its_stage_sends(lab_tag):
    """Per-link settings: stage i's packets take delays[i] to reach anyone, so i <-> j takes delays[i] + delays[j]."""
    delays = [20.0, 5.0, 10.0]
    with Lab(tag=lab_tag) as lab:
        eps = lab.build_delay_star(3)
        lab.set_delay_links(100, delays)
        pairs = {(i, j): lab.measure(eps[i], eps[j], pings=10, seconds=0) for i, j in ((0, 1), (1, 2), (2, 0))}
    for (i, j), m in pairs.items():
        rtt = delays[i] + delays[j]
        assert rtt <= m["rtt_ms_min"] and m["rtt_ms_median"] <= rtt + RTT_SLACK_MS, ((i, j), m["rtt_samples"])
        assert delays[i] <= m["owd_ms_there_min"] and m["owd_ms_there"] <= delays[i] + RTT_SLACK_MS / 2, (i, j, m)
        assert delays[j] <= m["owd_ms_back_min"] and m["owd_ms_back"] <= delays[j] + RTT_SLACK_MS / 2, (i, j, m)


def test_within_a_site_packets_pass_at_once_and_between_sites_they_take_the_link(lab_tag):
    """A mixed cluster: stages 0 and 1 share a site (a LAN), stage 2 is behind the slow link."""
    d = DELAY_MS
    with Lab(tag=lab_tag) as lab:
        eps = lab.build_delay_star(3)
        lab.set_delay_links(RATE_MBIT, d, sites=[0, 0, 1])
        same = lab.measure(eps[0], eps[1], pings=10, seconds=0)
        cross = lab.measure(eps[1], eps[2], pings=10, seconds=0)
        stats = {p["addr"]: p for p in lab.relay_stats()["ports"]}
    assert same["ping_lost"] == cross["ping_lost"] == 0
    assert same["rtt_ms_median"] < d / 4, same["rtt_samples"]
    assert 2 * d <= cross["rtt_ms_min"] and cross["rtt_ms_median"] <= 2 * d + RTT_SLACK_MS, cross["rtt_samples"]
    # the LAN traffic is counted apart from what crossed sites
    first, second = stats[eps[0].addr], stats[eps[1].addr]
    assert first["lan_packets"] >= 10 and first["wire_bytes"] == 0, first
    assert second["lan_packets"] >= 10 and second["wire_bytes"] > 0, second
    assert stats[eps[2].addr]["lan_packets"] == 0


def test_nothing_is_left_when_the_body_raises(lab_tag):
    with pytest.raises(RuntimeError, match="the test body failed"):
        with Lab(tag=lab_tag) as lab:
            lab.build_delay_star(2)
            lab.set_delay_links(RATE_MBIT, DELAY_MS)
            relay_pid = lab.relay.pid
            assert _alive(relay_pid) and _relay_processes(lab_tag) == [relay_pid]
            assert {n for n in netns_names() if n.startswith(lab_tag)}
            raise RuntimeError("the test body failed")
    assert not _alive(relay_pid)
    # and the fixture asserts: no namespace, interface or relay process with this tag


def test_the_relay_dies_with_the_process_that_started_it(lab_tag):
    """SIGKILL leaves a launcher no time to clean up; its relay must still go (its namespaces are the fixture's)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        from _netns import Lab
        lab = Lab(tag={lab_tag!r})
        lab.build_delay_star(2)
        lab.set_delay_links(10, 5)
        print(lab.relay.pid, flush=True)
        time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        relay_pid = int(launcher.stdout.readline())
        assert _alive(relay_pid)
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(relay_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(relay_pid)
    _clean(lab_tag)  # what a killed launcher cannot delete: namespaces (not a leftover of the code under test)


def test_a_negative_delay_a_wrong_number_of_links_or_wrong_sites_are_refused(lab_tag):
    with Lab(tag=lab_tag) as lab:
        lab.build_delay_star(2)
        with pytest.raises(ValueError, match="negative"):
            lab.set_delay_links(10, [5, -1])
        with pytest.raises(ValueError, match="2 values"):
            lab.set_delay_links(10, [5, 5, 5])
        with pytest.raises(ValueError, match="one site number per stage, 2 in all"):
            lab.set_delay_links(10, 5, sites=[0, 1, 1])
        with pytest.raises(ValueError, match="integers"):
            lab.set_delay_links(10, 5, sites=[0, "1"])
        assert lab.relay is None


def test_a_super_packet_is_charged_every_frame_it_stands_for():
    """The rate applies to the 1500-byte frames a TCP super-packet becomes: one IP+TCP header per segment."""
    ip_hdr, tcp_hdr, payload, mss = 20, 32, 4000, 1448
    vnet = struct.pack("<BBHHHH", 1, _delay_link.GSO_TCPV4, ip_hdr + tcp_hdr, mss, ip_hdr, 16)
    ip = bytes([0x45]) + bytes(ip_hdr - 1)
    tcp = bytes(12) + bytes([(tcp_hdr // 4) << 4]) + bytes(tcp_hdr - 13)
    pkt = vnet + ip + tcp + bytes(payload)
    assert _delay_link.wire_bytes(pkt) == (ip_hdr + tcp_hdr + payload + 2 * (ip_hdr + tcp_hdr), 3)
    plain = struct.pack("<BBHHHH", 0, 0, 0, 0, 0, 0) + ip + bytes(100)
    assert _delay_link.wire_bytes(plain) == (ip_hdr + 100, 1)
