"""adamps.wire.web on a real loopback socket: errors are JSON naming the problem, the server survives."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from adamps.client.rpc import AsyncRpc, RpcError
from adamps.metrics import new_registry
from adamps.up.procs import free_port
from adamps.wire import protocol
from adamps.wire import web as aweb

TOKEN = "t0ken"


@pytest.fixture
async def server():
    async def rpc(request: web.Request) -> web.Response:
        aweb.check_token(request)
        msg = await aweb.read_message(request, {"echo", "boom"})
        if msg["op"] == "boom":
            raise RuntimeError("a bug")
        x = protocol.require_array(msg, "x")
        return aweb.message_response({"rid": msg["rid"], "sum": float(x.sum())})

    app = aweb.make_app(
        registry=new_registry(), token=TOKEN, max_body=1 << 16, status=lambda: {"role": "test"}
    )
    app.router.add_post("/rpc", rpc)
    port = free_port()
    runner = await aweb.serve(app, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_rpc_and_open_endpoints(server: str) -> None:
    client = AsyncRpc(server, TOKEN)
    try:
        assert (await client.call("echo", x=np.ones(10, np.float32)))["sum"] == 10.0
        assert await client.get_json("/healthz") == {"ok": True}
        status = await client.get_json("/status")
        # every role's /status also names its threads (kernel id -> name: benchmarks/idle.py)
        assert status.pop("threads")
        assert status == {"role": "test"}
        async with aiohttp.ClientSession() as s, s.get(server + "/metrics") as r:
            assert r.status == 200 and "text/plain" in r.headers["Content-Type"]
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("token", "kwargs", "code"),
    [
        (None, {"x": np.ones(2, np.float32)}, "unauthorized"),
        ("wrong", {"x": np.ones(2, np.float32)}, "unauthorized"),
        (TOKEN, {"x": np.array([np.nan], np.float32)}, "non_finite"),
        (TOKEN, {"x": np.ones(2, np.float64)}, "bad_dtype"),
        (TOKEN, {}, "bad_request"),
    ],
)
async def test_bad_requests_are_json_4xx(server: str, token, kwargs, code: str) -> None:
    client = AsyncRpc(server, token)
    try:
        with pytest.raises(RpcError) as info:
            await client.call("echo", **kwargs)
        assert info.value.code == code and 400 <= info.value.http_status < 500
        assert (await client.get_json("/healthz"))["ok"]
    finally:
        await client.close()


async def test_raw_garbage_oversize_chunked_and_bugs(server: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as s:
        async with s.post(server + "/rpc", data=b"\xc1\xc1", headers=headers) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "malformed"
        big = protocol.encode(protocol.request("echo", x=np.ones(1 << 15, np.float32)))
        async with s.post(server + "/rpc", data=big, headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "too_large"

        async def chunks():
            for _ in range(32):
                yield b"\0" * 4096

        async with s.post(server + "/rpc", data=chunks(), headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "too_large"
        async with s.post(
            server + "/rpc", data=protocol.encode(protocol.request("boom")), headers=headers
        ) as r:
            body = await r.json()
            assert r.status == 500 and body["error"]["code"] == "internal"
        async with s.post(
            server + "/rpc",
            data=protocol.encode({"op": "zap", "v": 1, "rid": "r9"}),
            headers=headers,
        ) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["code"] == "unknown_op" and body["rid"] == "r9"
        async with s.get(server + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with s.get(server + "/healthz") as r:
            assert r.status == 200


def test_one_off_requests_report_the_status_of_a_text_body(tmp_path) -> None:
    """A health probe's body need not be JSON (Prometheus' /-/ready is text): the status counts."""
    import http.server
    import threading

    from adamps.client.rpc import http_json

    class Text(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Server is Ready.")

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Text)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert http_json(f"http://127.0.0.1:{server.server_port}/-/ready") == (200, None)
    finally:
        server.shutdown()
        server.server_close()


async def test_bad_request_line_and_client_gone_mid_body_log_one_line(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 39, finding 11: a 10 kB request line, and a client that disconnects in the middle
    of its body, each leave one warning line without a traceback (they were ERRORs with one),
    and the server keeps serving. Every role serves through `aweb.serve`, so this covers the
    controllers', the servers' and the data servers' HTTP ports alike."""
    import asyncio
    import logging

    port = int(server.rsplit(":", 1)[1])
    caplog.set_level(logging.DEBUG)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    assert (await reader.read(64)).startswith(b"HTTP/1.0 400")
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST /rpc HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    writer.write(head.encode() + b"Content-Length: 60000\r\n\r\n" + b"\0" * 1000)
    await writer.drain()
    await asyncio.sleep(0.2)  # the handler is reading the body
    writer.transport.abort()
    for _ in range(100):
        if any("went away" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.02)
    async with aiohttp.ClientSession() as s, s.get(server + "/healthz") as r:
        assert r.status == 200
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not noisy, [(r.name, r.levelname, r.getMessage()[:120]) for r in noisy]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("LineTooLong" in m for m in warned), warned
    assert any("went away during POST /rpc" in m for m in warned), warned
    assert all("\n" not in m for m in warned)


def _raw_exchange(server: str, head: bytes, body_pieces: int = 0) -> tuple[bytes, int]:
    """Sends a request head, then up to `body_pieces` pieces of 16 KiB of zeros until the
    server answers; returns (its answer, the body bytes sent before it came)."""
    port = int(server.rsplit(":", 1)[1])
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head)
        s.setblocking(False)
        piece = b"\0" * (16 << 10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                data = s.recv(65536)
                if data:
                    s.setblocking(True)
                    s.settimeout(1)
                    try:
                        while more := s.recv(65536):
                            data += more
                    except (TimeoutError, ConnectionError):
                        pass
                    return data, sent
            except BlockingIOError:
                pass
            if sent < body_pieces * len(piece):
                try:
                    sent += s.send(piece)
                except (BlockingIOError, ConnectionError):
                    time.sleep(0.01)
            else:
                time.sleep(0.01)
    return b"", sent


HEAD = f"POST /rpc HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode()


async def test_a_declared_length_past_the_limit_is_refused_before_the_body(server: str) -> None:
    """aiohttp reads a body before it compares it with client_max_size: a Content-Length of
    1 TiB was waited for (until the body timeout), a larger one read up to the limit, before
    the 413. Refused now from the head alone, no body byte sent."""
    head = HEAD + b"Content-Length: 1099511627776\r\n\r\n"
    reply, sent = await asyncio.to_thread(_raw_exchange, server, head)
    assert reply.startswith(b"HTTP/1.1 413") and b'"too_large"' in reply, reply[:300]
    assert b"1099511627776" in reply and sent == 0


async def test_one_huge_chunk_is_refused_once_the_limit_is_passed(server: str) -> None:
    """A chunked body names its size only in each chunk's own header, which aiohttp's parser
    keeps to itself: a chunk announced at 1 TiB is refused as soon as what arrived passes the
    limit (64 KiB here), the server holding at most the limit and one read, and serving on."""
    head = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"10000000000\r\n"
    reply, sent = await asyncio.to_thread(_raw_exchange, server, head, 64)
    assert reply.startswith(b"HTTP/1.1 413") and b'"too_large"' in reply, reply[:300]
    assert sent > 1 << 16  # refused for what arrived, not before
    async with aiohttp.ClientSession() as s, s.get(server + "/healthz") as r:
        assert r.status == 200
