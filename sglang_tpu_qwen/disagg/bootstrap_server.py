"""The prefill server's bootstrap server: TCP on --disaggregation-bootstrap-port, serving its outbox.

Each decode-side receiver opens one connection per room and sends {"op": "fetch", "room", "version"};
this server streams the room's messages (wire.py) as the prefill produces them, then closes. A
connection that breaks before the last message cancels the room (the decode server went away), and so
does {"op": "cancel", "room"} (the decode side gave up: client abort or disconnect).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading

from sglang_tpu_qwen.disagg.layout import PROTOCOL_VERSION
from sglang_tpu_qwen.disagg.outbox import Outbox
from sglang_tpu_qwen.disagg.wire import Message, recv_message, send_message
from sglang_tpu_qwen.utils.errors import TransferError

logger = logging.getLogger(__name__)


class BootstrapServer:
    """Serves `outbox` on (host, port) from a daemon thread; one thread per connection."""

    def __init__(self, outbox: Outbox, host: str, port: int) -> None:
        self.outbox = outbox
        self._stop = threading.Event()
        handler = _handler_class(outbox, self._stop)
        self._server = _Server((host, port), handler, bind_and_activate=False)
        try:
            self._server.server_bind()
            self._server.server_activate()
        except OSError as e:
            self._server.server_close()
            raise OSError(f"cannot listen on the bootstrap port {host}:{port} ({e}); pick another with "
                          f"--disaggregation-bootstrap-port") from e
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="bootstrap-server", daemon=True)
        self._thread.start()
        logger.info("bootstrap server listening on %s:%d", host, self.port)

    def shutdown(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # a restarted prefill server gets its port back at once
    daemon_threads = True


def _handler_class(outbox: Outbox, stop: threading.Event) -> type[socketserver.BaseRequestHandler]:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                req = recv_message(sock).meta
                op, room = req.get("op"), int(req.get("room", -1))
            except (ConnectionError, TransferError, ValueError, TypeError) as e:
                logger.warning("bad bootstrap request from %s: %s", self.client_address, e)
                return
            if op == "cancel":
                outbox.cancel(room)
                return
            if op != "fetch":
                send_message(sock, Message({"kind": "error", "status": 400, "message": f"unknown op {op!r}"}))
                return
            if req.get("version") != PROTOCOL_VERSION:
                send_message(sock, Message({"kind": "error", "status": 500, "message":
                                            f"transfer protocol version {req.get('version')} is not "
                                            f"{PROTOCOL_VERSION} (update both servers)"}))
                return
            messages = outbox.fetch(room, stop)
            try:
                for msg in messages:
                    send_message(sock, msg)
            except TransferError as e:
                try:
                    send_message(sock, Message({"kind": "error", "status": e.status, "message": e.message}))
                except OSError:
                    pass
            except OSError as e:  # the decode server went away: fetch()'s cleanup cancels the room
                logger.warning("transfer of bootstrap_room %d to %s broke: %s", room, self.client_address, e)
            finally:
                messages.close()

    return Handler
