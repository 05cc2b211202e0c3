"""Bounded connections: how many client sockets the server holds, and for how long one
may keep it waiting for a request's headers.

Every socket costs a file descriptor. uvicorn accepts while the process has descriptors
left and never times out a connection that has not finished its first request's
headers, so 20K silent sockets used every descriptor: asyncio's accept then failed with
EMFILE (logging a traceback each time) and /health went unanswered. Here, each server
holds at most `max_connections` sockets (below the descriptor limit); when full, the
connection that has been waiting longest for headers makes room (a client with a request
in flight is never dropped), and one that takes over `header_timeout` is closed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ConnectionLimits

logger = logging.getLogger("stallfree.server")

# Descriptors kept for what is not a client socket: the model's files, pipes to compile
# processes and workers, the iteration log, the threads' event fds.
FD_RESERVE = 256
UVICORN_BACKLOG = 2048  # uvicorn.Config's default
ACCEPT_EMFILE = "socket.accept() out of system resource"


def raise_fd_limit() -> int:
    """Raises the soft open-file limit to the hard one (a default soft limit of 1024 is
    far below what a server holds); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. a hard limit of infinity the kernel refuses
            pass
    return soft


def accept_backlog(fd_limit: int) -> int:
    """uvicorn's listen backlog (2048), smaller under a small open-file limit: asyncio
    accepts up to a backlog's worth of sockets before their protocols run (and count
    them), so that many descriptors must be free beyond the connection cap."""
    if fd_limit == resource.RLIM_INFINITY:
        return UVICORN_BACKLOG
    return max(16, min(UVICORN_BACKLOG, (fd_limit - FD_RESERVE) // 4))


def fitted_limits(limits: ConnectionLimits, fd_limit: int) -> ConnectionLimits:
    """`limits` with max_connections lowered to leave FD_RESERVE descriptors and one
    accept batch (`accept_backlog`) free."""
    if fd_limit == resource.RLIM_INFINITY:
        return limits
    room = max(1, fd_limit - FD_RESERVE - accept_backlog(fd_limit))
    if limits.max_connections <= room:
        return limits
    logger.warning("--max-connections %d lowered to %d: the open-file limit is %d",
                   limits.max_connections, room, fd_limit)
    return ConnectionLimits(max_connections=room, header_timeout=limits.header_timeout)


@dataclass
class Occurrences:
    """Logs the first occurrence of an event, then at most one count a minute: a flood of
    hostile sockets must not become a flood of log lines."""

    message: str
    interval: float = 60.0
    count: int = 0
    unreported: int = 0
    last: float = field(default=float("-inf"))

    def __call__(self) -> None:
        self.count += 1
        self.unreported += 1
        now = time.monotonic()
        if now - self.last >= self.interval:
            logger.warning("%s (%d time(s) since the last report, %d in all)", self.message,
                           self.unreported, self.count)
            self.last, self.unreported = now, 0


def error_bytes(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body, for a connection that
    has no request (so uvicorn's machinery cannot answer it); it closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500
                                 else "invalid_request_error", "param": None,
                                 "code": "limit_exceeded"}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class ConnectionGuard:
    """One server's open connections, and those waiting for a request's headers (oldest
    first, each with its deadline)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: set[GuardedH11Protocol] = set()
        self.waiting: dict[GuardedH11Protocol, asyncio.TimerHandle] = {}  # insertion order
        cap = limits.max_connections
        self.refused = Occurrences(f"refusing connections: {cap} open, each with a request "
                                   "in flight (--max-connections)")
        self.evicted = Occurrences(f"closing connections that send no request to make room: "
                                   f"{cap} open (--max-connections)")
        self.expired = Occurrences(f"closing connections that sent no whole request headers "
                                   f"within {limits.header_timeout} s (--header-timeout)")

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Whether `conn` may stay; makes room by dropping the longest-waiting connection."""
        if len(self.open) >= self.limits.max_connections:
            if not self.waiting:
                self.refused()
                return False
            oldest = next(iter(self.waiting))
            self.evicted()
            oldest.drop(503, "Service Unavailable", "the server is at its connection limit and "
                        "closed this idle connection (this server's --max-connections)")
        self.open.add(conn)
        self.wait_for_headers(conn)
        return True

    def wait_for_headers(self, conn: GuardedH11Protocol) -> None:
        self.got_headers(conn)
        self.waiting[conn] = conn.loop.call_later(self.limits.header_timeout, self._expire, conn)

    def got_headers(self, conn: GuardedH11Protocol) -> None:
        timer = self.waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def closed(self, conn: GuardedH11Protocol) -> None:
        self.got_headers(conn)
        self.open.discard(conn)

    def _expire(self, conn: GuardedH11Protocol) -> None:
        self.waiting.pop(conn, None)
        self.expired()
        conn.drop(408, "Request Timeout", f"no whole request headers within "
                  f"{self.limits.header_timeout} s (this server's --header-timeout)")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with its connection counted and its header wait bounded by
    the class's `guard` (one subclass per server: `guarded_protocol`)."""

    guard: ClassVar[ConnectionGuard]

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.guard.admit(self):
            transport.write(error_bytes(503, "Service Unavailable", "too many connections, "
                                        "each with a request in flight; retry later (this "
                                        "server's --max-connections)"))
            transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # h11 leaves IDLE once a request's headers are whole (or the bytes are invalid).
        if self.conn.their_state is not h11.IDLE:
            self.guard.got_headers(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Kept alive and no pipelined request started: wait for the next one's headers.
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.guard.wait_for_headers(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self)
        super().connection_lost(exc)

    def drop(self, status: int, reason: str, message: str) -> None:
        """Closes a connection with no request in flight; one that sent part of a request
        gets a response saying why."""
        self.guard.closed(self)
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:
            self.transport.write(error_bytes(status, reason, message))
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...): its connections share one
    guard (a class attribute, since uvicorn builds each protocol from the class alone)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"guard": ConnectionGuard(limits)})


def log_accept_errors_once(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback each time accept() fails for want of descriptors (it
    retries every second); log the first and a count instead, others as before."""
    previous = loop.get_exception_handler()
    out_of_fds = Occurrences(f"{ACCEPT_EMFILE}: not accepting for now (raise the open-file "
                             "limit or lower --max-connections)")

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == ACCEPT_EMFILE:
            out_of_fds()
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
