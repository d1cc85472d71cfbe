"""How a rejoining replica fetches a live peer's state: torchft's ``CheckpointTransport`` over HTTP, in the
pickle-free layout of :mod:`lightning_clapping.ft.wire`.

torchft's own transports unpickle what the peer sent (``HTTPTransport`` loads with ``weights_only=False``,
``PGTransport`` pickles its metadata); this one sends a JSON tree and raw tensor bytes. The sender encodes the state
when torchft asks for it (at the start of the step the rejoining replica joins, while the training thread waits for
the quorum), so what it serves is a snapshot: the optimizer step that follows cannot tear it. A request that comes before
the state is ready waits for it; the state of that one step is served until ``disallow_checkpoint`` (torchft calls
it at ``should_commit``) drops it.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lightning_clapping.ft import wire

log = logging.getLogger(__name__)


class _DualStackServer(ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 clients too
        super().server_bind()


class _IPv4Server(ThreadingHTTPServer):
    daemon_threads = True


class StateTransport:
    """Serves this rank's state to rejoining peers and fetches a peer's (see the module docstring). It has the
    methods of ``torchft.checkpointing.CheckpointTransport``, which torchft's ``Manager`` calls.

    Args:
        timeout: how long a fetch may take.
        host: the name or address peers reach this rank on (default: the host name, as torchft's own managers
            advertise themselves).
    """

    def __init__(self, timeout: timedelta, host: str | None = None) -> None:
        self._timeout = timeout
        self._host = host or socket.gethostname()
        self._ready = threading.Condition()
        self._step: int | None = None
        self._payload: bytes | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                parts = self.path.strip("/").split("/")
                if len(parts) != 2 or parts[0] != "state" or not parts[1].isdigit():
                    self.send_error(400, "expected /state/<step>")
                    return
                wanted = int(parts[1])
                with owner._ready:  # the peer may ask before this rank has encoded the step's state
                    owner._ready.wait_for(lambda: owner._step == wanted, timeout=owner._timeout.total_seconds())
                    step, payload = owner._step, owner._payload
                if payload is None or step != wanted:
                    self.send_error(409, f"serving step {step}, asked for {wanted}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("state server: " + fmt, *args)

        try:
            self._server: ThreadingHTTPServer = _DualStackServer(("::", 0), Handler)
        except OSError:  # no IPv6 on this host
            self._server = _IPv4Server(("0.0.0.0", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="clapping-ft-state", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._server.server_address[1]}/state/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        payload = wire.encode(state_dict)
        with self._ready:
            self._step, self._payload = step, payload
            self._ready.notify_all()
        log.info("serving %d bytes of step %d to replicas %s", len(payload), step, dst_ranks)

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._step = self._payload = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        url = f"{metadata}{step}"
        try:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:
                data = response.read()
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"replica {src_rank} did not serve its state of step {step} ({url}: {err})") from None
        return wire.decode(data)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)
