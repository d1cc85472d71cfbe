"""What the liveness watchdog does to a hung peer: end it where that is proven safe, else cut this rank's links to it.

* **Killing** goes through a pidfd only (:func:`verify`, then :func:`kill`). The pidfd is opened first
  (``os.pidfd_open``), then ``/proc/<pid>/stat`` must show the start time the peer published, the pidfd's own
  ``/proc/self/fdinfo`` entry must name that pid, and a null signal through the pidfd must be allowed. The pidfd
  then refers to the published process and to no other, however long it is held: ``signal.pidfd_send_signal``
  reaches that process or fails, and never a process that reused its pid. A peer is only considered when it runs
  under the same host name, the same kernel boot (``/proc/sys/kernel/random/boot_id``) and the same PID namespace;
  a peer that published no start time, a start time that differs, a platform without pidfds, or a process this
  user may not signal: no kill, the reason is said, and its connections are shut down instead. SIGKILL also ends a
  stopped process; its sockets close, so every rank blocked in a gloo transfer with it fails at once.
* **Shutting down connections** (Linux): every rank publishes the local endpoints of its TCP connections
  (:func:`local_endpoints`, from ``/proc``), and ``shutdown()`` of this process's sockets whose far end is one of
  them (:func:`shutdown_connections_to`) makes a gloo wait on that peer fail at once with "Connection closed by
  peer" (the descriptors stay gloo's, and the connections to other ranks keep working). A loopback endpoint
  (127.0.0.0/8, ::1) names a socket only inside one network namespace of one boot, so it is matched only when the
  peer published the same boot id and network namespace (:func:`same_network`); a host name proves nothing. Nothing
  torch 2.13 offers wakes a blocked gloo ``work.wait()`` from another thread: ``ProcessGroup.abort()``, the gloo
  backend's ``abort()`` and ``shutdown()`` and ``distributed_c10d._abort_process_group()`` all return at once and
  leave the wait blocked (tested).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError):
        with open(path) as f:
            return f.read().strip()
    return None


def _namespace(kind: str) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/ns/{kind}")
    return None


def identity(host: str) -> dict[str, Any]:
    """What a rank publishes so that others can tell where it runs: host name, pid, start time, kernel boot id and
    PID and network namespaces (None where unreadable: then nothing is proven, and nothing is killed or matched)."""
    pid = os.getpid()
    return {"host": host, "pid": pid, "start": start_time(pid), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": _namespace("pid"), "netns": _namespace("net")}


def _same(a: dict[str, Any], b: dict[str, Any], *keys: str) -> bool:
    return all(a.get(k) is not None and a.get(k) == b.get(k) for k in keys)


def same_network(peer: dict[str, Any] | None, mine: dict[str, Any]) -> bool:
    """Whether ``peer`` is proven to share this process's network namespace (same boot id and namespace inode)."""
    return bool(peer) and _same(peer, mine, "boot", "netns")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    text = _read(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    return text.rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, from /proc), or None."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


@dataclass
class Verdict:
    """Whether a peer's process may be killed: ``pidfd`` (open, checked) when it may, else ``why`` not."""

    pidfd: int | None = None
    why: str = ""
    ended: bool = False  # its process is proven to have ended (no such pid, or a zombie): it is not hung
    itself: bool = False  # the published pid is this very process (ranks simulated in one process)

    def close(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


def verify(peer: dict[str, Any] | None, mine: dict[str, Any]) -> Verdict:
    """Open a pidfd on the process ``peer`` published and check that it is that process (see the module's text)."""
    if not peer or not isinstance(peer.get("pid"), int):
        return Verdict(why="it never published its pid and start time")
    pid = peer["pid"]
    for key, what in (("boot", "kernel boot"), ("pidns", "PID namespace")):
        if peer.get(key) is None or mine.get(key) is None:
            return Verdict(why=f"its {what} is unknown (no /proc), so its pid proves nothing here")
    if peer.get("host") != mine.get("host") or not _same(peer, mine, "boot"):
        return Verdict(why=f"it runs on another host ({peer.get('host')}; this rank runs on {mine.get('host')})")
    if not _same(peer, mine, "pidns"):
        return Verdict(why="it runs in another PID namespace (another container), where its pid means another process")
    if pid == os.getpid():
        return Verdict(why="its pid is this process's own", itself=True)
    if peer.get("start") is None:
        return Verdict(why=f"it published no start time, so pid {pid} cannot be told from a process that reused it")
    if not (hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")):
        return Verdict(why="this Python has no pidfd (os.pidfd_open needs Python 3.9+ on Linux 5.3+)")
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return Verdict(why=f"no process has pid {pid} any more", ended=True)
    except OSError as err:
        return Verdict(why=f"os.pidfd_open({pid}) failed: {err}")
    verdict = Verdict(pidfd=fd)
    fields = _stat_fields(pid)  # read after opening: a match proves the pidfd holds the published process
    if fields is None or fields[0] in ("Z", "X"):
        verdict.why, verdict.ended = f"its process (pid {pid}) has ended", True
    elif len(fields) <= 19 or int(fields[19]) != int(peer["start"]):
        found = fields[19] if len(fields) > 19 else "unreadable"
        verdict.why = (f"pid {pid} now has start time {found}, not the {peer['start']} it published: the pid "
                       "belongs to another process")
    elif _pidfd_pid(fd) not in (None, pid):
        verdict.why = f"the pidfd opened on pid {pid} refers to pid {_pidfd_pid(fd)}"
    else:
        try:
            signal.pidfd_send_signal(fd, 0)
        except ProcessLookupError:
            verdict.why, verdict.ended = f"its process (pid {pid}) has ended", True
        except OSError as err:
            verdict.why = f"this user may not signal pid {pid} ({err.strerror})"
    if verdict.why:
        verdict.close()
    return verdict


def _pidfd_pid(fd: int) -> int | None:
    """The pid a pidfd refers to, from /proc/self/fdinfo (None where the kernel does not say)."""
    for line in (_read(f"/proc/self/fdinfo/{fd}") or "").splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    return None


def kill(verdict: Verdict) -> bool:
    """SIGKILL the process a checked pidfd holds (which also ends a stopped process); closes the pidfd."""
    if verdict.pidfd is None:
        return False
    try:
        signal.pidfd_send_signal(verdict.pidfd, signal.SIGKILL)
    except OSError:  # it ended meanwhile: nothing else can be hit through this pidfd
        return False
    finally:
        verdict.close()
    return True


def socket_inodes() -> frozenset[str] | None:
    """The inodes of this process's sockets (None where /proc is missing)."""
    found = _socket_fds()
    return None if found is None else frozenset(found)


def _socket_fds() -> dict[str, int] | None:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    fds = {}
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                fds[link[8:-1]] = int(name)
    return fds


def _address(hex_address: str) -> tuple[str, int]:
    """An address of /proc/net/tcp{,6} as (ip, port), an IPv4-mapped IPv6 address as plain IPv4."""
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[7:]
    return ip, int(port_hex, 16)


def _tcp_sockets(inodes: frozenset[str], state: str) -> dict[str, tuple[tuple[str, int], tuple[str, int]]]:
    """inode -> (local, remote) of this process's TCP sockets in ``state`` (01: established, 0A: listening)."""
    found = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        text = _read(table)
        for line in (text or "").splitlines()[1:]:
            cols = line.split()
            if len(cols) > 9 and cols[3] == state and cols[9] in inodes:
                found[cols[9]] = (_address(cols[1]), _address(cols[2]))
    return found


def local_endpoints(inodes: frozenset[str]) -> list[tuple[str, int]]:
    """The local (ip, port) of this process's established TCP connections whose socket inodes are ``inodes``: what
    a peer needs to find, among its own connections, those to this process. Raises OSError or ValueError when
    /proc cannot be read as expected. Kept for the last few sets of inodes: reading /proc/net/tcp can take tens of
    milliseconds on a host with many connections."""
    return list(_endpoints_of(inodes))


@functools.lru_cache(maxsize=4)
def _endpoints_of(inodes: frozenset[str]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted({tuple(local) for local, _ in _tcp_sockets(inodes, "01").values()}))


def listens_on(port: int) -> bool | None:
    """Whether this process holds a listening TCP socket on ``port`` (None where /proc cannot tell)."""
    fds = _socket_fds()
    if fds is None:
        return None
    return any(local[1] == port for local, _ in _tcp_sockets(frozenset(fds), "0A").values())


def is_loopback(ip: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(ip).is_loopback
    return False


def shutdown_connections_to(endpoints: list[list[Any]], same_network: bool) -> int:
    """Shut down this process's TCP connections whose far end is one of ``endpoints``; returns how many.

    Loopback endpoints are left out unless ``same_network`` (see :func:`same_network`): on another host, or in
    another network namespace, ``127.0.0.1:port`` names some other socket, maybe one of this process's own.
    ``shutdown()`` (not ``close()``: the descriptor stays gloo's) makes a gloo wait on that connection fail at once
    with "Connection closed by peer", and the far end sees the connection close too.
    """
    wanted = {(str(ip), int(port)) for ip, port in endpoints if same_network or not is_loopback(str(ip))}
    fds = _socket_fds() if wanted else None
    if not fds:
        return 0
    closed = 0
    for inode, (_, remote) in _tcp_sockets(frozenset(fds), "01").items():
        if remote not in wanted:
            continue
        try:
            sock = socket.socket(fileno=fds[inode])
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError:
            pass
        finally:
            sock.detach()
    return closed


__all__ = ["Verdict", "identity", "is_loopback", "kill", "listens_on", "local_endpoints", "same_network",
           "shutdown_connections_to", "socket_inodes", "start_time", "verify"]
