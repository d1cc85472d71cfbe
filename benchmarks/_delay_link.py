"""A wide-area link in user space: per-sender rate without burst, a bounded queue and a fixed one-way delay.

This machine's kernel has no netem (only tbf, htb and pfifo), so delay cannot come from ``tc``. Instead every
namespace that takes part gets a persistent TUN device (``add_tun``), and one relay process (``RelayProcess``, which
runs ``python _delay_link.py relay CONFIG``) reads every IP packet that a namespace sends into its TUN device and
writes it into the TUN device of the namespace that owns the destination address, at the time a real link would
deliver it. For a packet that port ``i`` (a namespace's TUN device) sends at time ``t``:

    start = max(t, free_i)                  the sender's link is still busy with its earlier packets: FIFO
    drop if start - t > queue_i             its queue is full (tail drop, like tbf's ``latency`` bound)
    free_i = start + wire_bytes / rate_i    serialisation at the link rate; no burst, so small packets wait too
    deliver into the destination at free_i + delay_i

so between two ports the one-way delay is the SENDER's ``delay_i`` and the round trip is ``delay_i + delay_j`` (2 x
delay when all ports are alike). The rate is per sender, like tbf on each namespace's egress: a receiver's own link is
not a bottleneck.

Sites (a mixed cluster): a port may name its site (``Port.site``). A packet between two ports of the same site crosses
that site's LAN: it is written into the destination at once, without the sender's rate, queue or delay (it does not
touch ``free_i``), and is counted as ``lan_packets``/``lan_bytes`` instead of ``wire_bytes``/``frames``, so the
counters show what crossed sites. Ports without a site (the default) share none with anyone: every packet takes the
wide-area link as above. With sites [0, 0, 1, 1] only the traffic between the two pairs is slow.

Why the rate is applied here and not by tbf on the TUN device: the TUN devices are opened with virtio-net headers and
TCP segmentation offload, so the kernel hands the relay TCP super-packets of up to 64 KiB (TCP sizes them to about
1 ms of its sending rate) and takes them back whole: a Python relay then handles 10-40 times fewer packets than with
1500-byte frames, which matters on a 2-core machine shared with the ranks. tbf would split every super-packet larger
than its burst back into 1500-byte frames. The relay charges each super-packet the bytes of the frames it stands for
(one IP/TCP header per 1500-byte segment; the MTU stays 1500, so TCP behaves as on a real wide-area path), and the
link's clock is one number per sender, so rate and delay come from the same arithmetic. A super-packet is delivered
whole when its last segment would have arrived (store and forward of at most ~1 ms of data at the sending rate).

The relay only ever writes into the TUN devices it was given, inside namespaces the caller created; a packet for any
other address is dropped and counted. It exits when its standard input closes (the launcher died or let go), on
SIGTERM, and, through PR_SET_PDEATHSIG, when the launching process dies.

Validation: ``measure(...)`` runs a UDP echo (a ping: round-trip times) and a time-bounded TCP bulk transfer between
two namespaces and returns the measured RTTs and receive rate, to be printed and saved with any benchmark run.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import math
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# <linux/if_tun.h>
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
VNET_HDR = 10  # struct virtio_net_hdr: flags u8, gso_type u8, hdr_len u16, gso_size u16, csum_start u16, csum_off u16
GSO_TCPV4, GSO_UDP, GSO_TCPV6, GSO_UDP_L4 = 1, 3, 4, 5
CLONE_NEWNET = 0x40000000
READ_SIZE = 65536 + VNET_HDR + 64
PROBE_PORT = 5601  # only ever on addresses inside the caller's own namespaces

_CMD_TIMEOUT = 30


class DelayLinkError(RuntimeError):
    pass


@dataclass(frozen=True)
class Port:
    """One namespace's attachment to the relay: its TUN device and the link its packets leave on."""

    ns: str
    ifname: str
    addr: str  # the IPv4 address of ``ifname``; packets for it are written into this port
    rate_mbit: float | None  # None: no rate limit (delay only)
    delay_ms: float  # one-way delay of every packet this port sends
    queue_ms: float = 100.0  # a packet that would wait longer than this for the link is dropped
    site: int | None = None  # packets to a port of the same site skip the link above (None: no site, all shaped)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    if proc.returncode != 0:
        raise DelayLinkError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def add_tun(ns: str, ifname: str, addr: str, prefix: int = 24, mtu: int = 1500) -> None:
    """A persistent TUN device ``ifname`` inside namespace ``ns`` (it dies with the namespace), up, with ``addr``."""
    _run(["ip", "-n", ns, "tuntap", "add", "dev", ifname, "mode", "tun", "vnet_hdr"])
    _run(["ip", "-n", ns, "link", "set", "dev", ifname, "mtu", str(mtu)])
    _run(["ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", ifname])
    _run(["ip", "-n", ns, "link", "set", "dev", ifname, "up"])


def unavailable_reason() -> str | None:
    """``None`` when TUN devices can be made here (the relay needs them), else why not."""
    if not sys.platform.startswith("linux"):
        return "TUN devices need Linux"
    if os.geteuid() != 0:
        return "TUN devices in network namespaces need root"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TUN support in this kernel or container)"
    return None


# ====================================================================================================================
# The relay (runs in its own process)
# ====================================================================================================================


def _setns(fd: int, what: str) -> None:
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


def _attach(ns: str, ifname: str) -> int:
    """Open the persistent TUN device ``ifname`` of namespace ``ns``; returns a non-blocking fd."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)  # the relay is single-threaded: setns moves the whole process
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target, ns)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
        except OSError:
            os.close(fd)
            raise
        try:  # super-packets and checksum offload: far fewer packets through Python (see the module docstring)
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
        except OSError:
            pass  # plain 1500-byte packets then: slower, still correct
    finally:
        _setns(home, "back home")
        os.close(home)
        os.close(target)
    return fd


def wire_bytes(pkt: bytes) -> tuple[int, int]:
    """(bytes on the wire, frames) of one packet as read with its virtio-net header: a super-packet counts as the
    1500-byte-MTU segments it will become, each with its own IP and TCP/UDP header."""
    ip_len = len(pkt) - VNET_HDR
    gso_type, gso_size = pkt[1] & 0x7F, struct.unpack_from("<H", pkt, 4)[0]
    if gso_type == 0 or gso_size == 0 or ip_len < 20:
        return ip_len, 1
    ihl = (pkt[VNET_HDR] & 0x0F) * 4 if pkt[VNET_HDR] >> 4 == 4 else 40
    if gso_type in (GSO_TCPV4, GSO_TCPV6) and len(pkt) > VNET_HDR + ihl + 12:
        hdr = ihl + (pkt[VNET_HDR + ihl + 12] >> 4) * 4
    else:
        hdr = ihl + 8
    frames = max(1, math.ceil((ip_len - hdr) / gso_size))
    return ip_len + (frames - 1) * hdr, frames


class Relay:
    """The event loop: read from every port, queue per sender, deliver when due. Single-threaded."""

    def __init__(self, ports: list[Port]) -> None:
        self.ports = ports
        self.fds = [_attach(p.ns, p.ifname) for p in ports]
        self.by_addr = {socket.inet_aton(p.addr): i for i, p in enumerate(ports)}
        self.rate = [None if not p.rate_mbit else p.rate_mbit * 1e6 / 8 for p in ports]  # bytes per second
        self.delay = [p.delay_ms / 1000 for p in ports]
        self.queue = [p.queue_ms / 1000 for p in ports]
        self.site = [p.site for p in ports]
        self.free_at = [0.0] * len(ports)
        self.pending: list[collections.deque] = [collections.deque() for _ in ports]  # (due, dst index, packet)
        n = len(ports)
        self.stats = [dict(rx_packets=0, rx_bytes=0, wire_bytes=0, frames=0, delivered=0, queue_drops=0,
                           unroutable=0, write_errors=0, max_queue_us=0, lan_packets=0, lan_bytes=0)
                      for _ in range(n)]
        self.late = [collections.deque(maxlen=200_000) for _ in ports]  # microseconds after the due time
        self.t_start = time.monotonic()
        self.scheduling = "normal"
        self.dead: set[int] = set()  # ports whose device failed: no longer watched (an RT process must never spin)

    def _receive(self, i: int, now: float) -> None:
        fd, st = self.fds[i], self.stats[i]
        for _ in range(256):  # a bounded batch, so one busy sender cannot starve the delivery of the others
            try:
                pkt = os.read(fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                st["read_error"] = str(err)
                self.dead.add(i)
                return
            if len(pkt) < VNET_HDR + 20:
                continue
            st["rx_packets"] += 1
            st["rx_bytes"] += len(pkt) - VNET_HDR
            dst = self.by_addr.get(pkt[VNET_HDR + 16:VNET_HDR + 20]) if pkt[VNET_HDR] >> 4 == 4 else None
            if dst is None or dst == i:
                st["unroutable"] += 1
                continue
            if self.site[i] is not None and self.site[i] == self.site[dst]:
                self._deliver_lan(st, dst, pkt)
                continue
            size, frames = wire_bytes(pkt)
            rate = self.rate[i]
            if rate is None:
                done = now
            else:
                start = max(now, self.free_at[i])
                if start - now > self.queue[i]:
                    st["queue_drops"] += 1
                    continue
                st["max_queue_us"] = max(st["max_queue_us"], int((start - now) * 1e6))
                done = self.free_at[i] = start + size / rate
            st["wire_bytes"] += size
            st["frames"] += frames
            self.pending[i].append((done + self.delay[i], dst, pkt))

    def _deliver_lan(self, st: dict, dst: int, pkt: bytes) -> None:
        """A packet within one site: written at once (a LAN next to the wide-area link), never queued behind the
        sender's wide-area packets."""
        st["lan_packets"] += 1
        st["lan_bytes"] += len(pkt) - VNET_HDR
        try:
            os.write(self.fds[dst], pkt)
        except OSError:
            st["write_errors"] += 1

    def _deliver(self, now: float) -> float | None:
        """Write every packet that is due; returns the next due time (None: nothing queued)."""
        nxt = None
        for i, q in enumerate(self.pending):
            st, late = self.stats[i], self.late[i]
            while q and q[0][0] <= now:
                due, dst, pkt = q.popleft()
                try:
                    os.write(self.fds[dst], pkt)
                    st["delivered"] += 1
                except OSError:
                    st["write_errors"] += 1
                late.append(int((now - due) * 1e6))
            if q and (nxt is None or q[0][0] < nxt):
                nxt = q[0][0]
        return nxt

    def report(self) -> dict:
        out = []
        for p, st, late in zip(self.ports, self.stats, self.late):
            lat = sorted(late)

            def q(f):
                return lat[min(len(lat) - 1, int(f * len(lat)))] / 1000 if lat else None

            out.append(dict(asdict(p), **st, late_ms_p50=q(0.5), late_ms_p99=q(0.99),
                            late_ms_max=lat[-1] / 1000 if lat else None))
        cpu = os.times()
        return {"uptime_s": time.monotonic() - self.t_start, "cpu_s": cpu.user + cpu.system,
                "scheduling": self.scheduling, "ports": out}

    def serve(self, control_in, control_out) -> None:
        ctl = control_in.fileno()
        watch = [ctl, *self.fds]
        index = {fd: i for i, fd in enumerate(self.fds)}
        buf = b""
        nxt = None
        while True:
            if self.dead:
                watch = [ctl, *(fd for i, fd in enumerate(self.fds) if i not in self.dead)]
            now = time.monotonic()
            timeout = None if nxt is None else max(0.0, nxt - now)
            ready, _, _ = select.select(watch, [], [], timeout)
            now = time.monotonic()
            for fd in ready:
                if fd == ctl:
                    chunk = os.read(ctl, 4096)
                    if not chunk:
                        return  # the launcher closed our stdin (or died): stop
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if line.strip() == b"stats":
                            control_out.write(json.dumps(self.report()) + "\n")
                            control_out.flush()
                else:
                    self._receive(index[fd], now)
            nxt = self._deliver(time.monotonic())

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _realtime() -> str:
    """Lowest real-time priority (SCHED_FIFO 1), if allowed; returns the scheduling class the relay got.

    The relay stands in for network hardware, so the ranks' computation must not hold its packets: with 4 ranks and
    other jobs on 2 cores, normal scheduling delivered packets 5-10 ms late (p99) and up to 20 ms; SCHED_FIFO 1 kept
    it to 0.1-0.25 ms (max 1.5 ms). It is safe for the machine: the relay sleeps in select() between packets, does
    bounded work per packet, its load is bounded by the link rates (about 10 % of a core at 100 Mbit/s), and the
    kernel's RT throttling leaves other tasks their share even so."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "SCHED_FIFO 1"
    except (OSError, AttributeError):
        return "normal (real-time scheduling not permitted)"


def relay_main(config: str) -> int:
    cfg = json.loads(config)
    ports = [Port(**p) for p in cfg["ports"]]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    scheduling = _realtime() if cfg.get("realtime", True) else "normal"
    relay = Relay(ports)
    relay.scheduling = scheduling
    try:
        sys.stdout.write("ready " + json.dumps({"pid": os.getpid(), "ports": len(ports)}) + "\n")
        sys.stdout.flush()
        relay.serve(sys.stdin, sys.stdout)
    finally:
        relay.close()
    return 0


# ====================================================================================================================
# The launcher's handle on a relay process
# ====================================================================================================================


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RelayProcess:
    """Starts the relay for ``ports`` and waits until it has attached every TUN device; ``stop()`` ends it."""

    def __init__(self, ports: list[Port], start_timeout: float = 30.0, realtime: bool = True) -> None:
        self.ports = list(ports)
        config = {"ports": [asdict(p) for p in self.ports], "realtime": realtime}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "relay", json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True, preexec_fn=_die_with_parent)
        try:
            line = self._readline(start_timeout)
            if not line.startswith("ready "):
                raise DelayLinkError(f"the relay did not start: {line!r} {self._stderr()}")
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        try:
            return (self.proc.stderr.read() or "").strip()[-2000:]
        except (OSError, ValueError):
            return ""

    def _readline(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise DelayLinkError(f"no answer from the relay within {timeout:g} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=5)
            raise DelayLinkError(f"the relay exited ({self.proc.returncode}): {self._stderr()}")
        return line.strip()

    def stats(self, timeout: float = 10.0) -> dict:
        """Counters per port since the relay started (packets, bytes, drops, lateness of delivery)."""
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self._readline(timeout))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """Idempotent: close its stdin (it exits), then SIGTERM, then SIGKILL its process group."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.proc.pid, sig)  # its own session: only the relay
                    except ProcessLookupError:
                        break
                    try:
                        self.proc.wait(timeout=timeout)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass


# ====================================================================================================================
# Validation: a ping and a bulk transfer between two namespaces
# ====================================================================================================================


def probe_server(addr: str, deadline_s: float) -> int:
    """In the destination namespace: echo UDP datagrams; take one TCP stream and report when its bytes arrived."""
    end = time.monotonic() + deadline_s
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((addr, PROBE_PORT))
    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((addr, PROBE_PORT))
    lst.listen(1)
    print("ready", flush=True)
    conn, t_accept, marks, total = None, None, [], 0
    while time.monotonic() < end:
        watch = [udp, conn if conn is not None else lst]
        ready, _, _ = select.select(watch, [], [], max(0.0, min(1.0, end - time.monotonic())))
        for s in ready:
            if s is udp:  # echo, with the arrival time: all namespaces share CLOCK_MONOTONIC, so one-way delays show
                data, peer = udp.recvfrom(2048)
                udp.sendto(data[:56] + struct.pack("<d", time.monotonic()), peer)
            elif s is lst:
                conn, _ = lst.accept()
                t_accept = time.monotonic()
            else:
                data = conn.recv(1 << 20)
                if not data:
                    conn.close()
                    print(json.dumps({"accept": t_accept, "marks": marks, "bytes": total}), flush=True)
                    return 0
                total += len(data)
                marks.append((time.monotonic(), total))
    print(json.dumps({"accept": t_accept, "marks": marks, "bytes": total, "timed_out": True}), flush=True)
    return 1


def probe_client(addr: str, pings: int, seconds: float) -> int:
    """In the source namespace: ``pings`` UDP round trips, one at a time, then a TCP stream for ``seconds``."""
    rtts, fwd, back = [], [], []
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.connect((addr, PROBE_PORT))
    udp.settimeout(2.0)
    for k in range(pings):
        t = time.monotonic()
        udp.send(struct.pack("<Id", k, t) + bytes(52))  # 64 bytes, like ping's default
        try:
            while True:
                data = udp.recv(2048)
                if struct.unpack_from("<I", data)[0] == k:
                    break
            t_back = time.monotonic()
            t_there = struct.unpack_from("<d", data, 56)[0]
            rtts.append((t_back - t) * 1000)
            fwd.append((t_there - t) * 1000)
            back.append((t_back - t_there) * 1000)
        except socket.timeout:
            rtts.append(None)
        time.sleep(0.005)
    t0 = time.monotonic()
    conn = socket.create_connection((addr, PROBE_PORT), timeout=10)
    connect_ms = (time.monotonic() - t0) * 1000
    block, sent = bytes(1 << 16), 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sent += conn.send(block)
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(60)
    conn.recv(1)  # the server closes once it has read everything
    conn.close()
    cc = None
    try:
        cc = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    except OSError:
        pass
    print(json.dumps({"rtt_ms": rtts, "fwd_ms": fwd, "back_ms": back, "connect_ms": connect_ms, "sent": sent,
                      "congestion_control": cc}), flush=True)
    return 0


def _summarize_transfer(server: dict, bin_s: float = 0.1) -> dict:
    """Receive rates of the TCP payload: over the whole transfer (handshake and TCP's start-up included, so it can only
    under-report the link), and ``steady``: the median of the rates in ``bin_s`` intervals over the second half. A
    median, because after a lost packet the receiver gets everything queued behind the hole at once: one interval
    then shows several times the link rate and the one before it next to nothing."""
    marks = server["marks"]
    out = {"bytes": server["bytes"], "seconds": None, "mbit_s": None, "steady_mbit_s": None}
    if len(marks) < 2 or server.get("accept") is None:
        return out
    t_first, t_last = marks[0][0], marks[-1][0]
    out["seconds"] = t_last - server["accept"]
    out["mbit_s"] = server["bytes"] * 8 / 1e6 / max(1e-9, out["seconds"])
    mid = t_first + (t_last - t_first) / 2
    n_bins = int((t_last - mid) / bin_s)
    if n_bins >= 3:
        got = [0] * n_bins
        prev = next((b for t, b in reversed(marks) if t < mid), 0)
        for t, b in marks:
            if t < mid:
                continue
            k = int((t - mid) / bin_s)
            if k < n_bins:
                got[k] += b - prev
            prev = b
        got.sort()
        out["steady_mbit_s"] = got[n_bins // 2] * 8 / 1e6 / bin_s
    return out


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None


def measure(src_ns: str, dst_ns: str, dst_addr: str, pings: int = 20, seconds: float = 2.0,
            timeout: float = 60.0) -> dict:
    """RTT (UDP echo, ``pings`` samples; also each direction's one-way delay) and TCP throughput (``seconds`` of
    sending; 0: none) from ``src_ns`` to ``dst_addr`` in ``dst_ns``. Throughput: TCP payload per second at the
    receiver, over the whole transfer (``mbit_s``, start-up included) and in the second half (``steady_mbit_s``, what
    the link sustains; see ``_summarize_transfer``). The payload is at most 1448/1500 of the link rate (IP and TCP
    headers with timestamps in every 1500-byte frame)."""
    me = os.path.abspath(__file__)
    server = subprocess.Popen(["ip", "netns", "exec", dst_ns, sys.executable, me, "probe-server", dst_addr,
                               str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, preexec_fn=_die_with_parent)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 30)
        if not ready or server.stdout.readline().strip() != "ready":
            why = server.stderr.read() if server.poll() is not None else "no answer within 30 s"
            raise DelayLinkError(f"probe server did not start: {why}")
        client = subprocess.run(["ip", "netns", "exec", src_ns, sys.executable, me, "probe-client", dst_addr,
                                 str(pings), str(seconds)], capture_output=True, text=True, timeout=timeout,
                                preexec_fn=_die_with_parent)
        if client.returncode != 0:
            raise DelayLinkError(f"probe client failed ({client.returncode}): {client.stderr.strip()[-2000:]}")
        out, err = server.communicate(timeout=timeout)
        if server.returncode != 0:
            raise DelayLinkError(f"probe server failed ({server.returncode}): {err.strip()[-2000:]}")
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    got = json.loads(client.stdout.strip().splitlines()[-1])
    rtts = [r for r in got["rtt_ms"] if r is not None]
    ordered = sorted(rtts)
    result = {
        "rtt_ms_min": ordered[0] if ordered else None,
        "rtt_ms_median": ordered[len(ordered) // 2] if ordered else None,
        "rtt_ms_max": ordered[-1] if ordered else None,
        "rtt_samples": got["rtt_ms"], "ping_lost": sum(r is None for r in got["rtt_ms"]),
        # one way, from the shared monotonic clock: there (src -> dst) and back (dst -> src), medians and minima
        "owd_ms_there": _median(got["fwd_ms"]), "owd_ms_back": _median(got["back_ms"]),
        "owd_ms_there_min": min(got["fwd_ms"], default=None), "owd_ms_back_min": min(got["back_ms"], default=None),
        "tcp_connect_ms": got["connect_ms"], "congestion_control": got["congestion_control"],
    }
    result.update(_summarize_transfer(json.loads(out.strip().splitlines()[-1])))
    return result


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "relay":
        sys.exit(relay_main(sys.argv[2]))
    if cmd == "probe-server":
        sys.exit(probe_server(sys.argv[2], float(sys.argv[3])))
    if cmd == "probe-client":
        sys.exit(probe_client(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
    print("usage: _delay_link.py relay CONFIG | probe-server ADDR DEADLINE | probe-client ADDR PINGS SECONDS "
          "(used by benchmarks/_netns.py; see the module docstring)", file=sys.stderr)
    sys.exit(2)
