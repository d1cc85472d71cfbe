"""What the liveness watchdog does to a hung peer: end it where this rank can, else cut this rank's links to it.

* A peer in the same process space (same boot and PID namespace, and the same host name: :func:`process_space`) is
  killed (:func:`kill`, SIGKILL, which also ends a stopped process), after :func:`same_process` has checked its
  start time so that a reused pid is never hit. Its sockets close, so every rank blocked in a gloo transfer with it
  gets "Connection closed by peer" at once. A process that already ended is not hung (nothing is done).
* Otherwise (another host, or no permission to kill) this process's own TCP connections to it are shut down
  (Linux): every rank publishes the local endpoints of its TCP connections (:func:`local_endpoints`, from
  ``/proc``), and ``shutdown()`` of the matching sockets (:func:`shutdown_connections_to`) makes a gloo wait on
  that peer fail at once with "Connection closed by peer" (the descriptors stay gloo's, and the connections to
  other ranks keep working). Nothing torch 2.13 offers wakes a blocked gloo ``work.wait()`` from another thread:
  ``ProcessGroup.abort()``, the gloo backend's ``abort()`` and ``shutdown()`` and
  ``distributed_c10d._abort_process_group()`` all return at once and leave the wait blocked (tested). The hung
  process itself stays on its host (stopped, or failing on its first transfer once it resumes): end it there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from typing import Any


def process_space() -> str:
    """Identifies where a pid means the same process: the kernel boot and the PID namespace (host name elsewhere)."""
    parts = []
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return "/".join(parts) or socket.gethostname()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot, from /proc), or None."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def same_process(pid: int, start: int | None) -> bool:
    """Whether ``pid`` is still the process that registered (not ended, not a zombie, not a reused pid)."""
    fields = _stat_fields(int(pid))
    if fields is None:
        return _pid_exists(int(pid)) if start is None else False
    if fields[0] in ("Z", "X"):
        return False
    return start is None or int(fields[19]) == int(start)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def socket_inodes() -> frozenset[str] | None:
    """The inodes of this process's sockets (None where /proc is missing)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    inodes = set()
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{name}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    return frozenset(inodes)


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


def _tcp_connections(inodes: frozenset[str]) -> dict[str, tuple[tuple[str, int], tuple[str, int], str]]:
    """inode -> (local, remote, state) of this process's established TCP connections."""
    found = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError):
            with open(table) as f:
                lines = f.read().splitlines()[1:]
            for line in lines:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "01" and cols[9] in inodes:  # 01: ESTABLISHED
                    found[cols[9]] = (_address(cols[1]), _address(cols[2]), cols[3])
    return found


def local_endpoints(inodes: frozenset[str]) -> list[tuple[str, int]]:
    """The local (ip, port) of this process's established TCP connections whose socket inodes are ``inodes``: what
    a peer needs to find, among its own connections, those to this process. Raises OSError or ValueError when
    /proc cannot be read as expected."""
    return sorted({tuple(local) for local, _, _ in _tcp_connections(inodes).values()})


def kill(pid: int) -> bool:
    """SIGKILL ``pid`` (which also ends a stopped process); False when it is gone or another user's."""
    try:
        os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def shutdown_connections_to(endpoints: list[list[Any]]) -> int:
    """Shut down this process's TCP connections whose far end is one of ``endpoints``; returns how many.

    ``shutdown()`` (not ``close()``: the descriptor stays gloo's) makes a gloo wait on that connection fail at once
    with "Connection closed by peer", and the far end sees the connection close too.
    """
    wanted = {(str(ip), int(port)) for ip, port in endpoints}
    if not wanted:
        return 0
    fds: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    fds[link[8:-1]] = int(name)
    closed = 0
    for inode, (_, remote, _) in _tcp_connections(frozenset(fds)).items():
        if remote in wanted:
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


__all__ = ["kill", "local_endpoints", "process_space", "same_process", "shutdown_connections_to", "socket_inodes",
           "start_time"]
