"""Private network namespaces joined by shaped veth links: a slow cluster on one Linux machine (needs root).

``Lab`` builds, for one benchmark process, a star of ``n`` namespaces around a "switch" namespace that holds a bridge:

    namespace <tag>r<i>   veth v<i>, address <subnet>.<i+1>/24, egress shaped by tbf
            |
    namespace <tag>sw     veth p<i>, a port of bridge br0

and, on request, one more namespace ``<tag>lo`` with nothing but its loopback (the communication-free limit: every
rank in it talks over 127.0.0.1). ``<tag>`` is a prefix plus the process id, so concurrent runs never collide. The veth
pairs are created directly inside the namespaces (never in the caller's namespace), addresses are set only inside
them, so the benchmark's traffic cannot reach any other interface. ``teardown()`` deletes exactly the namespaces this
object created; a veth end dies with its namespace and takes its peer with it.

Links with a one-way delay (this kernel has no netem) use a second star through the same stage namespaces
(``build_delay_star``): each gets a TUN device ``d<i>`` with address ``<DELAY_SUBNET>.<i+1>/24``, and a user-space relay
process (``benchmarks/_delay_link.py``, started by ``set_delay_links``) moves every packet between those devices with
the configured rate (per sender, no burst), queue bound and delay; with ``sites`` only between stages of different
sites (within a site packets pass at once: a mixed cluster of LANs joined by slow links). A rank that should talk
over the delayed links uses the ``d<i>`` endpoint (its address and ``GLOO_SOCKET_IFNAME=d<i>``); the veth endpoints
stay as they are. The TUN devices die with their namespaces; ``teardown()`` stops the relay first (an open TUN device
would keep a deleted namespace alive).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _delay_link  # noqa: E402

SUBNET = "10.77.0"  # /24, used only inside the namespaces created here
DELAY_SUBNET = "10.77.1"  # /24 of the TUN devices behind the delay relay, also only inside these namespaces
_CMD_TIMEOUT = 30


@dataclass(frozen=True)
class Endpoint:
    """Where one rank runs: its namespace, the interface gloo should use, and that interface's address."""

    ns: str
    ifname: str
    addr: str


class NetnsError(RuntimeError):
    pass


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    if check and proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """``None`` when namespaces, veth, bridges and tbf can be used here, else why not (for a test skip)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install -y iproute2)"
    probe = f"clapprobe{os.getpid()}"
    try:
        with Lab(tag=probe) as lab:
            lab.build_star(1)
            lab.shape(100, "8kb", "100ms")
    except (NetnsError, OSError, subprocess.SubprocessError) as err:
        return f"network namespaces with veth/bridge/tbf do not work here: {err}"
    return None


def delay_unavailable_reason() -> str | None:
    """``None`` when delayed links (TUN devices and the user-space relay) work here, else why not."""
    reason = unavailable_reason() or _delay_link.unavailable_reason()
    if reason:
        return reason
    probe = f"clapdprobe{os.getpid()}"
    try:
        with Lab(tag=probe) as lab:
            lab.build_delay_star(2)
            lab.set_delay_links(100, 1)
    except (NetnsError, _delay_link.DelayLinkError, OSError, subprocess.SubprocessError) as err:
        return f"TUN devices with the user-space delay relay do not work here: {err}"
    return None


class Lab:
    """The namespaces, links and shapers of one benchmark process; a context manager that always tears down."""

    def __init__(self, prefix: str = "clapbn", tag: str | None = None) -> None:
        self.tag = tag or f"{prefix}{os.getpid()}"
        self.created: list[str] = []  # namespaces, in creation order
        self.stages: list[Endpoint] = []
        self.delay_stages: list[Endpoint] = []
        self.loopback: Endpoint | None = None
        self.shaping: dict | None = None
        self.delay_links: list[_delay_link.Port] | None = None
        self.relay: _delay_link.RelayProcess | None = None

    # ------------------------------------------------------------------ building
    def _add_namespace(self, name: str) -> str:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        # no IPv6 router solicitations and the like: the counters then hold only the benchmark's own traffic
        _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"], check=False)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _stage_namespace(self, i: int) -> str:
        """The namespace of stage endpoint ``i`` (shared by the veth and the delay star), made on first use."""
        name = f"{self.tag}r{i}"
        return name if name in self.created else self._add_namespace(name)

    def build_star(self, n: int) -> list[Endpoint]:
        """``n`` namespaces joined by a bridge; endpoint ``i`` is the one that should run global rank ``i``."""
        if self.stages:
            raise NetnsError("the star is already built")
        if not 1 <= n <= 200:
            raise ValueError(f"1..200 namespaces, got {n}")
        switch = self._add_namespace(f"{self.tag}sw")
        _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        for i in range(n):
            ns = self._stage_namespace(i)
            veth, port, addr = f"v{i}", f"p{i}", f"{SUBNET}.{i + 1}"
            _run(["ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", veth, "netns", ns])
            _run(["ip", "-n", switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth])
            _run(["ip", "-n", ns, "link", "set", veth, "up"])
            self.stages.append(Endpoint(ns, veth, addr))
        return list(self.stages)

    def build_delay_star(self, n: int, mtu: int = 1500) -> list[Endpoint]:
        """The same stage namespaces (made here if ``build_star`` has not) get a TUN device ``d<i>`` with address
        ``<DELAY_SUBNET>.<i+1>/24``; packets between them cross the relay once ``set_delay_links`` has started it.
        The MTU stays at a wide-area 1500 bytes, so TCP's segments and start-up are those of a real path."""
        if self.delay_stages:
            raise NetnsError("the delay star is already built")
        if not 2 <= n <= 200:
            raise ValueError(f"2..200 namespaces, got {n}")
        for i in range(n):
            ns = self._stage_namespace(i)
            ifname, addr = f"d{i}", f"{DELAY_SUBNET}.{i + 1}"
            try:
                _delay_link.add_tun(ns, ifname, addr, mtu=mtu)
            except _delay_link.DelayLinkError as err:
                raise NetnsError(str(err)) from err
            self.delay_stages.append(Endpoint(ns, ifname, addr))
        return list(self.delay_stages)

    def set_delay_links(self, rate_mbit, delay_ms, queue_ms=100.0, sites=None) -> list[_delay_link.Port]:
        """(Re)start the relay of the delay star. Each argument is one number for every stage's link, or a list with
        one per stage (per-link settings): what stage ``i`` sends is serialised at ``rate_mbit[i]`` (None: no limit,
        no burst), waits at most ``queue_ms[i]`` for its link (else it is dropped) and arrives ``delay_ms[i]`` later.
        ``sites``: one site number per stage namespace (endpoint ``i``), or None; what a stage sends to another of
        its own site skips all of that and arrives at once (a LAN), so the settings above apply between sites only.
        None (default): every packet takes its sender's link."""
        if not self.delay_stages:
            raise NetnsError("build_delay_star first")
        n = len(self.delay_stages)

        def per_stage(value, what):
            values = list(value) if isinstance(value, (list, tuple)) else [value] * n
            if len(values) != n:
                raise ValueError(f"{what}: one value for all stages or {n} values, got {len(values)}")
            return values

        rates, delays, queues = (per_stage(rate_mbit, "rate_mbit"), per_stage(delay_ms, "delay_ms"),
                                 per_stage(queue_ms, "queue_ms"))
        for d in delays:
            if d < 0:
                raise ValueError(f"a delay cannot be negative, got {d}")
        site_of = [None] * n if sites is None else self._check_sites(sites, n)
        ports = [_delay_link.Port(ep.ns, ep.ifname, ep.addr, None if r is None else float(r), float(d), float(q), s)
                 for ep, r, d, q, s in zip(self.delay_stages, rates, delays, queues, site_of)]
        self.stop_relay()
        self.relay = _delay_link.RelayProcess(ports)
        self.delay_links = ports
        return ports

    @staticmethod
    def _check_sites(sites, n: int) -> list[int]:
        """``sites`` as a list of ``n`` integers, or a ValueError that says what is expected."""
        values = list(sites) if isinstance(sites, (list, tuple)) else None
        if values is None or len(values) != n:
            raise ValueError(f"sites: one site number per stage, {n} in all, got {sites!r}")
        wrong = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
        if wrong:
            raise ValueError(f"sites: site numbers are integers, got {wrong} in {sites!r}")
        return values

    def stop_relay(self) -> None:
        if self.relay is not None:
            self.relay.stop()
            self.relay, self.delay_links = None, None

    def relay_stats(self) -> dict | None:
        """The running relay's counters per stage link (since it started), or None when none runs or it does not
        answer (then the links are down, and the runs on them fail and say so)."""
        if self.relay is None:
            return None
        try:
            return self.relay.stats()
        except (_delay_link.DelayLinkError, OSError, ValueError) as err:
            print(f"warning: the delay relay did not report its counters: {err}", file=sys.stderr)
            return None

    def build_loopback(self) -> Endpoint:
        """One namespace with only ``lo``: every rank placed there talks over 127.0.0.1, unshaped."""
        if self.loopback is None:
            self.loopback = Endpoint(self._add_namespace(f"{self.tag}lo"), "lo", "127.0.0.1")
        return self.loopback

    def shape(self, rate_mbit: float, burst: str, latency: str) -> None:
        """Limit every stage veth's egress to ``rate_mbit`` with a token bucket (replaces any previous shaping)."""
        for ep in self.stages:
            _run(["tc", "-n", ep.ns, "qdisc", "replace", "dev", ep.ifname, "root", "tbf",
                  "rate", f"{rate_mbit:g}mbit", "burst", burst, "latency", latency])
        self.shaping = {"rate_mbit": rate_mbit, "burst": burst, "latency": latency}

    # ------------------------------------------------------------------ reading counters
    def counters(self, endpoints: list[Endpoint] | None = None) -> dict[str, dict]:
        """Per stage interface (default: the veths): byte/packet counters, the tbf qdisc's (overlimits: packets held
        back) and, for the delay star's TUN devices, the relay's counters of what that stage sent (``relay_*``)."""
        out: dict[str, dict] = {}
        relay = None
        endpoints = self.stages if endpoints is None else endpoints
        stats = self.relay_stats() if any(ep in self.delay_stages for ep in endpoints) else None
        if stats is not None:
            relay = {p["ifname"]: p for p in stats["ports"]}
        for ep in endpoints:
            link = json.loads(_run(["ip", "-n", ep.ns, "-j", "-s", "link", "show", "dev", ep.ifname]).stdout)[0]
            stats = link.get("stats64") or link.get("stats") or {}
            row = {
                "ns": ep.ns,
                "tx_bytes": stats.get("tx", {}).get("bytes", 0),
                "tx_packets": stats.get("tx", {}).get("packets", 0),
                "rx_bytes": stats.get("rx", {}).get("bytes", 0),
                "rx_packets": stats.get("rx", {}).get("packets", 0),
            }
            qdiscs = json.loads(_run(["tc", "-n", ep.ns, "-j", "-s", "qdisc", "show", "dev", ep.ifname]).stdout or "[]")
            tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), None)
            if tbf is not None:
                row.update(qdisc_bytes=tbf.get("bytes", 0), qdisc_packets=tbf.get("packets", 0),
                           qdisc_overlimits=tbf.get("overlimits", 0), qdisc_drops=tbf.get("drops", 0))
            if relay is not None and ep.ifname in relay:
                port = relay[ep.ifname]
                row.update({f"relay_{k}": port[k] for k in ("wire_bytes", "frames", "queue_drops", "unroutable",
                                                             "write_errors", "lan_bytes")})
            out[ep.ifname] = row
        return out

    @staticmethod
    def delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
        return {name: {k: v - before[name].get(k, 0) for k, v in row.items() if isinstance(v, int)}
                for name, row in after.items() if name in before}

    @staticmethod
    def measure(src: Endpoint, dst: Endpoint, pings: int = 20, seconds: float = 2.0) -> dict:
        """Round-trip times (UDP echo) and TCP throughput from ``src`` to ``dst`` over whatever link joins them (see
        ``_delay_link.measure``): the check that a configured link is what it claims to be."""
        try:
            return _delay_link.measure(src.ns, dst.ns, dst.addr, pings=pings, seconds=seconds)
        except (_delay_link.DelayLinkError, subprocess.SubprocessError, ValueError) as err:
            raise NetnsError(f"measuring {src.addr} -> {dst.addr} failed: {err}") from err

    # ------------------------------------------------------------------ running and cleaning up
    @staticmethod
    def command(ep: Endpoint, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ep.ns, *argv]

    def teardown(self) -> list[str]:
        """Stop the relay, delete the namespaces this object created (idempotent); returns the ones that could not be
        deleted. The relay goes first: its open TUN devices would keep a deleted namespace alive."""
        failed = []
        try:
            self.stop_relay()
        except Exception as err:  # never let it keep the namespaces
            print(f"warning: could not stop the delay relay: {err}", file=sys.stderr)
        while self.created:
            name = self.created.pop()
            if _run(["ip", "netns", "del", name], check=False).returncode != 0:
                failed.append(name)
        self.stages, self.delay_stages, self.loopback, self.shaping = [], [], None, None
        if failed:
            print(f"warning: could not delete network namespaces {failed}", file=sys.stderr)
        return failed

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()
