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
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

SUBNET = "10.77.0"  # /24, used only inside the namespaces created here
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


class Lab:
    """The namespaces, links and shapers of one benchmark process; a context manager that always tears down."""

    def __init__(self, prefix: str = "clapbn", tag: str | None = None) -> None:
        self.tag = tag or f"{prefix}{os.getpid()}"
        self.created: list[str] = []  # namespaces, in creation order
        self.stages: list[Endpoint] = []
        self.loopback: Endpoint | None = None
        self.shaping: dict | None = None

    # ------------------------------------------------------------------ building
    def _add_namespace(self, name: str) -> str:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        # no IPv6 router solicitations and the like: the counters then hold only the benchmark's own traffic
        _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"], check=False)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

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
            ns = self._add_namespace(f"{self.tag}r{i}")
            veth, port, addr = f"v{i}", f"p{i}", f"{SUBNET}.{i + 1}"
            _run(["ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", veth, "netns", ns])
            _run(["ip", "-n", switch, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth])
            _run(["ip", "-n", ns, "link", "set", veth, "up"])
            self.stages.append(Endpoint(ns, veth, addr))
        return list(self.stages)

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
    def counters(self) -> dict[str, dict]:
        """Per stage veth: interface byte/packet counters and the tbf qdisc's (overlimits: packets held back)."""
        out: dict[str, dict] = {}
        for ep in self.stages:
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
            out[ep.ifname] = row
        return out

    @staticmethod
    def delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
        return {name: {k: v - before[name].get(k, 0) for k, v in row.items() if isinstance(v, int)}
                for name, row in after.items() if name in before}

    # ------------------------------------------------------------------ running and cleaning up
    @staticmethod
    def command(ep: Endpoint, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ep.ns, *argv]

    def teardown(self) -> list[str]:
        """Delete the namespaces this object created (idempotent); returns the ones that could not be deleted."""
        failed = []
        while self.created:
            name = self.created.pop()
            if _run(["ip", "netns", "del", name], check=False).returncode != 0:
                failed.append(name)
        self.stages, self.loopback, self.shaping = [], None, None
        if failed:
            print(f"warning: could not delete network namespaces {failed}", file=sys.stderr)
        return failed

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()
