"""Bad input against a real PS process: a 4xx with a JSON error naming the problem, no state
change (pulled values and versions compared), and the server keeps serving (healthz after each).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.client.rpc import SyncRpc
from adamps.up.procs import Proc, adamps_argv, free_port
from adamps.wire import protocol

pytestmark = pytest.mark.slow

TOKEN = "bad-input-token"
MAX_BODY = 1 << 20
SHAPE = (40, 50)


class Server:
    def __init__(self, proc: Proc, port: int) -> None:
        self.proc = proc
        self.port = port
        self.client = SyncRpc(f"http://127.0.0.1:{port}", TOKEN)

    def post(
        self,
        body: bytes | Iterator[bytes],
        *,
        token: str | None = TOKEN,
        path: str = "/rpc",
        chunked: bool = False,
    ) -> tuple[int, dict[str, Any]]:
        """A raw POST on a fresh connection; returns (status, JSON error body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/msgpack"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request("POST", path, body=body, headers=headers, encode_chunked=chunked)
            resp = conn.getresponse()
            data = resp.read()
        except (BrokenPipeError, ConnectionResetError) as exc:  # the server may stop reading early
            pytest.fail(f"connection dropped instead of a JSON error: {exc}")
        finally:
            conn.close()
        if resp.status == 200:
            return resp.status, protocol.decode(data)
        assert resp.getheader("Content-Type", "").startswith("application/json"), data[:200]
        return resp.status, json.loads(data)

    def state(self) -> tuple[bytes, Any]:
        pulled = self.client.call("pull", tensors=["w"])
        return pulled["tensors"]["w"].tobytes(), pulled["versions"]


def start_ps(root: Path, *args: str, data_port: bool = False) -> tuple[Proc, int, int]:
    """A real PS on fresh ports; retried, since a port that was free can be taken by a concurrent
    process before the PS binds it (the PS then exits at once; its log says so)."""
    for attempt in range(3):
        port, dport = free_port(), (free_port() if data_port else 0)
        argv = adamps_argv("ps", "--port", str(port), "--data-port", str(dport), *args)
        env = {"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"}
        proc = Proc(argv, root / f"ps-{attempt}.log", env=env, name="ps")
        try:
            proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
            return proc, port, dport
        except RuntimeError:
            proc.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root: Path = tmp_path_factory.mktemp("ps-bad-input")
    proc, port, _ = start_ps(
        root, "--data-dir", str(root / "lmdb"), "--max-body", str(MAX_BODY), "--debug-ops"
    )
    try:
        s = Server(proc, port)
        s.client.call(
            "create",
            name="w",
            shape=list(SHAPE),
            init={"kind": "uniform", "seed": 1},
            optimizer={"kind": "sgd", "lr": 0.1},
        )
        s.client.call("push_dense", tensor="w", delta=np.ones(SHAPE, np.float32))
        yield s
        s.client.close()
    finally:
        proc.stop()


def req(op: str, **fields: Any) -> bytes:
    return protocol.encode(protocol.request(op, **fields))


def ones(shape: tuple[int, ...] = SHAPE, dtype: Any = np.float32) -> np.ndarray:
    return np.ones(shape, dtype)


def raw_array(dtype: str, shape: list[int], data: bytes) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data": data}


def chunks_of(total: int, size: int = 64 << 10) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b"\x00" * size
        sent += size


CASES: dict[str, tuple[Callable[[], dict[str, Any]], int, str, str]] = {
    # name: (request kwargs for Server.post, HTTP status, error code, text the message must contain)
    "malformed msgpack": (lambda: {"body": b"\xc1\xc1 not msgpack"}, 400, "malformed", "msgpack"),
    "not a map": (lambda: {"body": protocol.encode([1, 2, 3])}, 400, "malformed", "map"),  # type: ignore[arg-type]
    "wrong version": (lambda: {"body": protocol.encode({"op": "pull", "v": 99})}, 400, "unsupported_version", "99"),
    "unknown op": (lambda: {"body": req("drop_everything")}, 400, "unknown_op", "drop_everything"),
    "unknown tensor": (lambda: {"body": req("push_dense", tensor="nope", delta=ones())}, 404, "unknown_tensor", "nope"),
    "unknown shard": (lambda: {"body": req("push_dense", shards={"w/9": ones((1, 50))})}, 404, "unknown_shard", "w/9"),
    "wrong dtype": (lambda: {"body": req("push_dense", tensor="w", delta=ones(dtype=np.float64))}, 400, "bad_dtype", "float64"),
    "unlisted dtype": (
        lambda: {"body": req("push_dense", tensor="w", delta=raw_array("float16", [40, 50], b"\0" * 4000))},
        400, "bad_dtype", "float16",
    ),
    "wrong shape": (lambda: {"body": req("push_dense", tensor="w", delta=ones((50, 40)))}, 400, "bad_shape", "delta"),
    "wrong byte length": (
        lambda: {"body": req("push_dense", tensor="w", delta=raw_array("float32", [40, 50], b"\0" * 7999))},
        400, "bad_length", "8000",
    ),
    "NaN": (lambda: {"body": req("push_dense", tensor="w", delta=np.where(np.eye(40, 50) > 0, np.nan, 1).astype(np.float32))}, 400, "non_finite", "delta"),
    "Inf in fc errors": (
        lambda: {"body": req("push_fc", tensor="w", a=ones((2, 50)), e=np.full((2, 40), np.inf, np.float32))},
        400, "non_finite", "'e'",
    ),
    "fc k mismatch": (lambda: {"body": req("push_fc", tensor="w", a=ones((2, 50)), e=ones((3, 40)))}, 400, "bad_shape", "rows k"),
    "fc shard twice": (
        lambda: {"body": req("push_fc", tensor="w", a=ones((2, 50)), e=ones((2, 40)), shards=["w/0", "w/0"])},
        400, "bad_request", "twice",
    ),
    "missing field": (lambda: {"body": req("push_fc", tensor="w", a=ones((2, 50)))}, 400, "bad_request", "'e'"),
    "create clash": (lambda: {"body": req("create", name="w", shape=[3])}, 409, "exists", "different definition"),
    "bad init": (lambda: {"body": req("create", name="z", shape=[3], init={"kind": "ones"})}, 400, "bad_request", "init kind"),
    "body over the limit": (lambda: {"body": b"\x80" * (MAX_BODY + 1)}, 413, "too_large", str(MAX_BODY)),
    "chunked body over the limit": (lambda: {"body": chunks_of(MAX_BODY + (256 << 10)), "chunked": True}, 413, "too_large", str(MAX_BODY)),
    "missing token": (lambda: {"body": req("push_dense", tensor="w", delta=ones()), "token": None}, 401, "unauthorized", "missing"),
    "wrong token": (lambda: {"body": req("push_dense", tensor="w", delta=ones()), "token": "guess"}, 401, "unauthorized", "wrong"),
    "flush without token": (lambda: {"body": b"{}", "token": None, "path": "/flush"}, 401, "unauthorized", "token"),
    "handler bug": (lambda: {"body": req("debug_fail")}, 500, "internal", "logged"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_and_changes_nothing(server: Server, case: str) -> None:
    make, status, code, text = CASES[case]
    before = server.state()
    got_status, body = server.post(**make())
    assert got_status == status, body
    assert body["error"]["code"] == code, body
    assert text in body["error"]["message"], body
    assert server.state() == before
    assert server.client.get_json("/healthz") == {"ok": True}
    assert server.proc.alive
    if code == "internal":  # logged with its traceback
        assert "RuntimeError: debug_fail" in server.proc.tail(200)


def test_a_good_push_still_works_after_all_that(server: Server) -> None:
    values, versions = server.state()
    r = server.client.call("push_dense", tensor="w", delta=ones())
    assert r["versions"] == {"w/0": versions["w"][0] + 1}
    after = np.frombuffer(server.state()[0], np.float32)
    np.testing.assert_allclose(after, np.frombuffer(values, np.float32) - 0.1, rtol=1e-6)
    status = server.client.get_json("/status")
    assert status["applied"]["dense"] >= 2
