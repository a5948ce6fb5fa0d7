"""The checkpoint workers' links: the listening socket rank 0's trainer opens, the
rendezvous that tells every rank where it is, and framed JSON connections.

Frames are an 8-byte little-endian length and a JSON object, refused above a cap (a tiny one,
:data:`HELLO_MAX`, until the peer has said who it is); nothing is unpickled. The protocol that
runs over them: :mod:`mithril_async.worker.peers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import struct
from typing import Any

from mithril_async.errors import DistributedError
from mithril_async.save.coordinator import Coordinator, innermost

__all__ = ["HELLO_MAX", "MAX_FRAME", "Conn", "rendezvous"]

HEAD = struct.Struct("<Q")
#: the largest frame a worker accepts from a peer that said who it is
MAX_FRAME = 256 << 20
#: the largest frame read from a connection before it said who it is
HELLO_MAX = 4096


# ---------------------------------------------------------------- the trainers' side
def _listen() -> tuple[socket.socket, str]:
    """A listening TCP socket on the address the job uses for rank 0 (``MASTER_ADDR``),
    else on this host's address; the socket and the host the other ranks connect to."""
    hosts = [h for h in (os.environ.get("MASTER_ADDR"), _host_address()) if h]
    errors: list[str] = []
    for host in hosts:
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                host, 0, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.bind(addr)
                sock.listen(socket.SOMAXCONN)
            except OSError:
                sock.close()
                raise
            return sock, str(sock.getsockname()[0])
        except OSError as err:
            errors.append(f"{host}: {err}")
    raise DistributedError("rank 0 could not open the checkpoint workers' socket ("
                           + "; ".join(errors) + ")")


def _host_address() -> str | None:
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return None


def rendezvous(coordinator: Coordinator) -> tuple[dict[str, Any], socket.socket | None]:
    """Every trainer of the job at once (one broadcast on its checkpoint group): where rank
    0's workers listen, with the secret and the timeout every worker uses, and (rank 0) the
    listening socket, to hand to each worker it starts and close when it is done."""
    from mithril_async.distributed import DistCoordinator

    coordinator = innermost(coordinator)  # under a layer's wrapper (the tier commit)
    if not isinstance(coordinator, DistCoordinator):
        raise DistributedError("checkpoint workers of several ranks need the manager's own "
                               f"torch.distributed coordinator, not {type(coordinator).__name__}")
    sock: socket.socket | None = None
    doc: dict[str, Any] | None = None
    if coordinator.rank == 0:
        try:
            sock, host = _listen()
            doc = {"host": host, "port": int(sock.getsockname()[1]),
                   "secret": secrets.token_hex(16), "timeout_s": coordinator.timeout_s}
        except DistributedError as err:  # every rank learns it: none waits for the others
            doc = {"error": str(err)}
    try:
        got = coordinator.broadcast_from_zero(doc, "agree_worker_address")
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if not isinstance(got, dict) or "error" in got:
        raise DistributedError(str(got.get("error") if isinstance(got, dict) else
                                   "rank 0 sent no address for the checkpoint workers"))
    return got, sock


# ---------------------------------------------------------------- connections
class Conn:
    """One framed connection between two workers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer: int | None) -> None:
        self.reader, self.writer, self.peer = reader, writer, peer
        sock = writer.get_extra_info("socket")
        if sock is not None:  # small messages answer each other: none waits for an ACK
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        #: why the connection ended (None while it is up)
        self.lost: str | None = None

    def post(self, msg: dict[str, Any]) -> None:
        """Queue ``msg`` for sending (sent as the socket takes it)."""
        body = json.dumps(msg, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise DistributedError(f"a {msg.get('op')} message of {len(body)} bytes exceeds "
                                   f"the checkpoint workers' limit of {MAX_FRAME}")
        if self.lost is not None:
            raise ConnectionError(self.lost)
        self.writer.write(HEAD.pack(len(body)) + body)

    async def flush(self, timeout: float) -> None:
        await asyncio.wait_for(self.writer.drain(), timeout)

    async def recv(self, limit: int) -> dict[str, Any]:
        (n,) = HEAD.unpack(await self.reader.readexactly(HEAD.size))
        if n > limit:
            raise ValueError(f"a frame of {n} bytes exceeds {limit}")
        msg = json.loads(await self.reader.readexactly(n))
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise ValueError("a frame that is no message")
        return msg

    def close(self) -> None:
        self.writer.close()
