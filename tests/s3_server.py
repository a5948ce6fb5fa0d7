"""A real S3-compatible server for tests: moto's ``ThreadedMotoServer`` on 127.0.0.1, plus a
small fault-injecting HTTP proxy that can sit between a client and it.

Reusable from any test folder::

    from tests.s3_server import MotoS3
    with MotoS3() as s3:            # starts the server, dummy credentials in the env
        s3.endpoint_url, s3.bucket, s3.client (a sync boto3 client for inspection)

A real Ceph RGW with the same surface (:class:`S3Server`) is in :mod:`tests.rgw_server`.

Two deliberate adjustments, both documented where they are made:

- ``S3_UPLOAD_PART_MIN_SIZE`` is lowered (moto reads it when ``moto.settings`` is imported,
  and ``moto.s3.models`` copies it), so multipart tests need megabytes, not hundreds of them.
- moto checks ``If-None-Match`` / ``If-Match`` and then writes without a lock, so two
  concurrent conditional PUTs can both succeed there, unlike on S3. The server wraps its WSGI
  app so conditional writes are serialised, restoring S3's atomic semantics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

SMALL_PART = 256 * 1024
os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", str(SMALL_PART))
os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(16 << 20))

import boto3  # noqa: E402
import moto.s3.models  # noqa: E402
from moto.moto_server.threaded_moto_server import ThreadedMotoServer  # noqa: E402
from moto.moto_server.werkzeug_app import (  # noqa: E402
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server  # noqa: E402

from tests.ranks import free_port  # noqa: E402

# moto.s3.models copied the setting at import; make sure the small size is the one in force
moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = int(os.environ["S3_UPLOAD_PART_MIN_SIZE"])

DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
UNSET_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL")


class _SerialConditionalWrites:
    """WSGI wrapper running conditional PUT/POST requests one at a time (see module doc)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        conditional = environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH")
        if conditional and environ.get("REQUEST_METHOD") in ("PUT", "POST"):
            with self.lock:
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)  # type: ignore[no-any-return]


class _Server(ThreadedMotoServer):
    def _server_entry(self) -> None:
        app = _SerialConditionalWrites(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(
            self._ip_address, self._port, app, True, request_handler=MotoRequestHandler
        )
        self._server_ready_event.set()
        self._server.serve_forever()


class S3Server(Protocol):
    """What tests use of a server: :class:`MotoS3` or :class:`tests.rgw_server.CephRGW`."""

    #: "moto" or "rgw": for the few expectations that differ between servers
    kind: str
    bucket: str
    port: int
    endpoint_url: str
    #: a sync boto3 client, for inspecting the server behind the store's back
    client: Any

    @property
    def env(self) -> dict[str, str]: ...
    def unique_prefix(self, label: str = "t") -> str: ...
    def uploads(self, prefix: str) -> list[dict[str, Any]]: ...
    def objects(self, prefix: str) -> list[str]: ...


class BucketInspection:
    """The part of :class:`S3Server` that is the same on every server: dummy credentials for
    child processes and a look at the test bucket through ``client`` behind the store's back."""

    bucket: str
    client: Any

    @property
    def env(self) -> dict[str, str]:
        """Environment for a child process talking to this server (dummy credentials)."""
        return dict(DUMMY_ENV)

    def unique_prefix(self, label: str = "t") -> str:
        return f"{label}-{uuid.uuid4().hex[:12]}"

    def uploads(self, prefix: str) -> list[dict[str, Any]]:
        """In-progress multipart uploads under ``prefix``."""
        resp = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(resp.get("Uploads", []))

    def objects(self, prefix: str) -> list[str]:
        resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for o in resp.get("Contents", [])]


@contextlib.contextmanager
def dummy_env() -> Iterator[None]:
    """The suite's dummy credentials in ``os.environ`` (and no profile or endpoint from the
    machine's own AWS set-up) for the duration; the previous values come back after."""
    saved = {name: os.environ.get(name) for name in (*DUMMY_ENV, *UNSET_ENV)}
    os.environ.update(DUMMY_ENV)
    for name in UNSET_ENV:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class MotoS3(BucketInspection):
    """Context manager: moto S3 on a free loopback port, one bucket, dummy credentials."""

    kind = "moto"

    def __init__(self, bucket: str = "mithril-test") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server = _Server(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._env = contextlib.ExitStack()
        self.client: Any = None

    def __enter__(self) -> MotoS3:
        self._env.enter_context(dummy_env())
        self._server.start()
        self.client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()
        self._env.close()


# -- fault-injecting proxy -----------------------------------------------------------------
@dataclass
class ProxyRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body_size: int

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber" in self.query and "uploadId" in self.query

    @property
    def is_complete(self) -> bool:
        return self.method == "POST" and "uploadId" in self.query

    @property
    def is_create_multipart(self) -> bool:
        return self.method == "POST" and "uploads" in self.query


@dataclass
class Fault:
    """Fail requests matching ``match``. ``action``: ``"500"``; ``"503"`` (SlowDown);
    ``"reset"`` (close the connection without answering); ``"stall"`` (answer nothing for
    3 s, then reset); ``"truncate"`` (forward, but cut the response body in half);
    ``"200error"`` (a 200 OK whose body is an S3 <Error>); ``"delay"`` (forward after 0.3 s);
    ``"hold"`` (answer nothing until :meth:`FaultProxy.clear` or ``released.set()``, then reset:
    a request provably in flight for as long as a test needs, whatever the machine's speed).
    Quirks of real S3-compatible servers (Ceph RGW), applied to matching requests:
    ``"empty_etag"`` (forward, then blank the ``<ETag>`` of the response body, as RGW's
    CompleteMultipartUpload does); ``"unquoted_if_match"`` (a server comparing ``If-Match``
    with the stored ETag *without* quotes: a quoted value never matches, 412; an unquoted one
    is quoted again for moto, which compares quoted); ``"missing_412"`` (a conditional PUT on a
    missing key answers 412, not moto's 404); ``"rgw_if_match"`` (both of the last two).
    In front of RGW (``FaultProxy.upstream_quotes_if_match`` False) the unquoted value is
    forwarded as it is, since RGW itself compares unquoted. The opposite, a relay *mending*
    RGW for clients that cannot cope with it (benchmarks/bench_s3.py): ``"fill_etag"``
    answers a CompleteMultipartUpload whose ``<ETag>`` is empty with the ETag S3 defines
    (MD5 of the parts' binary MD5s, ``-<parts>``), computed from the parts the request lists,
    in the body and as an ``ETag`` header.
    Servers or relays the store must see through: ``"ignore_if_match"`` (the request is
    forwarded without its ``If-Match`` header: a server that ignores it, which the
    conditional-write probe must catch) and
    ``"no_etag"`` (forward, then drop the ``ETag`` header of the answer: a successful PUT
    answered without its ETag).
    ``times=None`` fails forever."""

    match: Callable[[ProxyRequest], bool]
    action: str = "500"
    times: int | None = 1
    hits: int = 0
    released: threading.Event = field(default_factory=threading.Event)


#: actions that forward the request upstream (so its body is read first)
_FORWARDED = ("pass", "delay", "truncate", "empty_etag", "unquoted_if_match", "missing_412",
              "rgw_if_match", "fill_etag", "ignore_if_match", "no_etag")
_ETAG_ELEMENT = re.compile(rb"<ETag>.*?</ETag>", re.DOTALL)
_PART_ETAG = re.compile(rb"<ETag>\s*(?:&quot;|\")?([0-9a-fA-F]{32})(?:&quot;|\")?\s*</ETag>")


def multipart_etag(complete_request: bytes) -> bytes:
    """S3's ETag of a multipart object (quoted), from the CompleteMultipartUpload request
    body listing its parts' ETags: MD5 of the binary part MD5s, then ``-<number of parts>``."""
    md5s = [bytes.fromhex(m.decode()) for m in _PART_ETAG.findall(complete_request)]
    return b'"%s-%d"' % (hashlib.md5(b"".join(md5s)).hexdigest().encode(), len(md5s))


def _with_body(response: bytes, payload: bytes, status: bytes | None = None) -> bytes:
    """``response`` with its body replaced by ``payload`` (Content-Length kept right) and,
    given ``status`` (e.g. ``b"412 Precondition Failed"``), its status line too."""
    head, _, _ = response.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if status is not None:
        lines[0] = lines[0].split(b" ", 1)[0] + b" " + status
    kept = [ln for ln in lines if not ln.lower().startswith((b"content-length:",
                                                               b"transfer-encoding:"))]
    return b"\r\n".join([*kept, b"Content-Length: %d" % len(payload)]) + b"\r\n\r\n" + payload


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>injected by FaultProxy</Message><RequestId>fault</RequestId></Error>"
)


@dataclass
class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 (own thread + event loop) in front of ``upstream``.

    Every request is forwarded on a fresh upstream connection and answered with
    ``Connection: close``, which keeps the proxy tiny; the client just reconnects.
    """

    upstream_port: int
    #: whether the server behind compares If-Match quoted (moto) or unquoted (Ceph RGW)
    upstream_quotes_if_match: bool = True
    faults: list[Fault] = field(default_factory=list)
    log: list[ProxyRequest] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def __post_init__(self) -> None:
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-proxy")

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        assert self._ready.wait(60), "the fault proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        # finish (cancel) stalled handlers inside the loop: a coroutine left pending would be
        # finalised later by the GC at an arbitrary point of some other test
        self.clear()  # releases held requests
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def fail(
        self, match: Callable[[ProxyRequest], bool], action: str = "500", times: int | None = 1
    ) -> Fault:
        fault = Fault(match, action, times)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            for fault in self.faults:
                fault.released.set()
            self.faults.clear()
            self.log.clear()
            self.max_in_flight = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, limit=1 << 20)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    def _decide(self, req: ProxyRequest) -> tuple[str, Fault | None]:
        with self._lock:
            self.log.append(req)
            for fault in self.faults:
                if (fault.times is None or fault.hits < fault.times) and fault.match(req):
                    fault.hits += 1
                    return fault.action, fault
        return "pass", None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        size = int(headers.get("content-length", "0"))
        url = urlsplit(target)
        req = ProxyRequest(
            method, url.path, parse_qs(url.query, keep_blank_values=True), headers, size
        )
        action, fault = self._decide(req)
        body = b""
        if action in _FORWARDED:
            if headers.get("expect", "").lower() == "100-continue":  # botocore sends it
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await writer.drain()
                lines = [ln for ln in lines if not ln.lower().startswith("expect:")]
            body = await reader.readexactly(size)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if action == "reset":
                writer.transport.abort()
                return
            if action == "hold" and fault is not None:  # in flight until released
                while not fault.released.is_set():
                    await asyncio.sleep(0.01)
                writer.transport.abort()
                return
            if action == "stall":  # never answer: the client's read timeout must fire
                await asyncio.sleep(3)
                writer.transport.abort()
                return
            if action in ("500", "503", "200error"):
                status, code = {
                    "500": ("500 Internal Server Error", "InternalError"),
                    "503": ("503 Slow Down", "SlowDown"),
                    "200error": ("200 OK", "InternalError"),
                }[action]
                payload = _ERROR_BODY.format(code=code).encode()
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                    + payload
                )
            elif action == "delay":  # a slow but successful request
                await asyncio.sleep(0.3)
                writer.write(await self._forward(lines, headers, body))
            elif action == "truncate":  # headers and half the body, then a reset
                response = await self._forward(lines, headers, body)
                head, _, payload = response.partition(b"\r\n\r\n")
                writer.write(head + b"\r\n\r\n" + payload[: len(payload) // 2])
                await writer.drain()
                writer.transport.abort()
                return
            elif action == "empty_etag":  # RGW's CompleteMultipartUpload: <ETag></ETag>
                response = await self._forward(lines, headers, body)
                payload = response.partition(b"\r\n\r\n")[2]
                writer.write(_with_body(response, _ETAG_ELEMENT.sub(b"<ETag></ETag>", payload)))
            elif action == "fill_etag":  # mend RGW's empty completion ETag
                response = await self._forward(lines, headers, body)
                head, _, payload = response.partition(b"\r\n\r\n")
                if _status(response) == 200 and b"<ETag></ETag>" in payload:
                    etag = multipart_etag(body)
                    payload = payload.replace(b"<ETag></ETag>",
                                              b"<ETag>%s</ETag>" % etag.replace(b'"', b"&quot;"))
                    response = _with_body(head + b"\r\nETag: " + etag + b"\r\n\r\n", payload)
                writer.write(response)
            elif action == "ignore_if_match":  # a server that never looks at If-Match
                lines = [ln for ln in lines if not ln.lower().startswith("if-match:")]
                writer.write(await self._forward(lines, headers, body))
            elif action == "no_etag":  # the answer, without its ETag header
                head, sep, payload = (await self._forward(lines, headers, body)).partition(
                    b"\r\n\r\n")
                kept = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"etag:")]
                writer.write(b"\r\n".join(kept) + sep + payload)
            elif action in ("unquoted_if_match", "missing_412", "rgw_if_match"):
                writer.write(await self._quirky_conditional(action, lines, headers, body))
            else:
                writer.write(await self._forward(lines, headers, body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            with self._lock:
                self.in_flight -= 1
            writer.close()

    async def _quirky_conditional(
        self, action: str, lines: list[str], headers: dict[str, str], body: bytes
    ) -> bytes:
        """A conditional PUT answered the way RGW does (see :class:`Fault`)."""
        precondition = _with_body(
            b"HTTP/1.1 412 Precondition Failed\r\nContent-Type: application/xml\r\n"
            b"Connection: close\r\n\r\n",
            _ERROR_BODY.format(code="PreconditionFailed").encode(),
        )
        value = headers.get("if-match")
        if value is not None and action in ("unquoted_if_match", "rgw_if_match"):
            if value.startswith('"'):
                return precondition  # compared raw with the unquoted stored ETag: no match
            if self.upstream_quotes_if_match:
                lines = [f'If-Match: "{value}"' if ln.lower().startswith("if-match:") else ln
                         for ln in lines]
        response = await self._forward(lines, headers, body)
        if (value is not None and action in ("missing_412", "rgw_if_match")
                and _status(response) == 404):
            return precondition
        return response

    async def _forward(self, lines: list[str], headers: dict[str, str], body: bytes) -> bytes:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            kept = [ln for ln in lines[1:] if ln and not ln.lower().startswith("connection:")]
            request = "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode()
            up_writer.write(request + body)
            await up_writer.drain()
            response = await up_reader.read()
        finally:
            up_writer.close()
        # tell the client this connection ends here, so it never reuses a closing socket
        head, sep, rest = response.partition(b"\r\n\r\n")
        head_lines = [
            ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")
        ]
        return b"\r\n".join([*head_lines, b"Connection: close"]) + sep + rest


@contextlib.contextmanager
def fault_proxy(server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(server.port, upstream_quotes_if_match=server.kind != "rgw") as proxy:
        yield proxy


def wait_until(cond: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll ``cond`` until it holds; ``timeout`` is a safety net for a condition that never
    comes, not a measure of speed (keep it generous: the machine may be loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()
