"""The replication shell without its IO (issue 40, sans-IO): every event into the core through
one entry (``Carrier.step``: the input with the clock's reading, its ``Ready`` carried out at
once, a refusal handed to the ports) and every field of the ``Ready`` carried out through ports.
The server's asyncio ``Replicator`` (shell.py) is its ports there: owner threads, aiohttp peers,
the controllers' client, LMDB, time.monotonic(); the randomized simulation
(tests/core/test_replication_sim.py) gives it a simulated network, disk and clock, so every seed
runs this code as it ships (dask's worker state machine and its BaseWorker; TigerBeetle's
cluster.zig).

The ports, one object's methods: ``now()``; ``release_copy(b)``, ``hold_copy(b)`` and
``apply_batches(b, batches)`` (the store); ``settle(answer)`` (a push's waiter); ``send(msg,
done)`` and ``ping(member, buckets, done)`` (the peers: `done` gets the reply and error code,
or the stale buckets, from a later event); ``start_join(fetch)`` and ``stop_join(b)`` (a state
transfer, which feeds ``fetched``, ``install`` and ``install_persisted``); ``call(request)``
(the controllers: ``controller_answer`` takes their answer); ``can_persist()`` (the disk);
``poke(not_before)`` (the clock: an input may bring a deadline sooner); ``refuse(b, reject)``
(a refusal: raised, or returned); ``counted(ready)`` (metrics; the gauges of the primary
buckets are read off the core when scraped)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from adamps.client.rpc import RpcError
from adamps.core.replication.bucket import Reject
from adamps.core.replication.node import ReplCore
from adamps.core.replication.ready import ControllerAnswer, ControllerRequest, Fetch
from adamps.server.replication import disk

log = logging.getLogger("adamps.server.replication.shell")


class Carrier:
    """Feeds one server's core its events and carries out its Ready through `ports`. `debug`:
    the core's invariants checked after every input (ADAMPS_DEBUG_CORE=1; the simulation)."""

    def __init__(self, core: ReplCore, ports: Any, debug: bool = False) -> None:
        self.core, self.ports, self.debug = core, ports, debug
        #: set at stop: no call to the controllers is made any more
        self.closing = False
        #: inside ``batch()``: how deep, and the soonest "not before" its inputs brought
        self._depth = 0
        self._poke_at = float("inf")

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Several inputs of one event (a peer's frame of many buckets' messages, a peer's
        reply answering many): each input enters the core at once through ``step``, and their
        Ready is carried out once, after the last, before anything else runs (the block never
        awaits). Issue 36: a click-through step at RF 3 is ~46 messages per server, and each
        carried out its own Ready, checked it and woke the clock."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                at, self._poke_at = self._poke_at, float("inf")
                self.drain()
                self.ports.poke(at)

    def drain(self) -> None:
        """Carries out what the core decided, in the order of core/replication/ready.py; called
        after every input in the same event (batches are queued before anything else runs)."""
        core, p = self.core, self.ports
        if not core.has_ready():
            return
        rd = core.ready()
        core.advance()
        p.counted(rd)
        for b in rd.forget:
            p.release_copy(b)
        for b in rd.hold:
            p.hold_copy(b)
        for b, action in rd.applies:
            p.apply_batches(b, action.batches)
        for ans in rd.answers:
            p.settle(ans)
        for msg in rd.messages:  # its one answer (a reply or an error) goes back in
            p.send(msg, functools.partial(self.step, -1, core.answer, msg.rid))
        for b in rd.stop_joins:
            p.stop_join(b)
        for f in rd.fetches:
            p.start_join(f)
        for req in () if self.closing else rd.requests:
            p.call(req)
        if rd.heartbeat:
            self.step(-1, core.want_record)
        if rd.pings is not None:
            stale = functools.partial(self.step, -1, core.on_ping_reply, ahead=float("inf"))
            for member, buckets in rd.pings.items():
                p.ping(member, buckets, stale)

    def step(
        self, b: int, event: Callable[..., Any], *args: Any, ahead: float = 0.0, **kw: Any
    ) -> Any:
        """The one way an event enters the core: `event` (one of ReplCore's inputs) gets the
        clock's reading after `args`; the Ready it leaves is carried out at once (its batches
        reach the owner threads before anything else runs, before a peer's reply goes out), and
        a refusal goes to the ports as about bucket `b` (or the one it names). `ahead`: the
        input brings no deadline sooner (a ping: failover_after; an answer: none)."""
        now = self.ports.now()
        res = event(*args, now, **kw)
        if self._depth:  # carried out at the batch's end (``batch``)
            self._poke_at = min(self._poke_at, now + ahead)
        else:
            self.drain()
        if self.debug:
            self.core.validate()  # raised where the input came from (logged there)
        if not self._depth:
            self.ports.poke(now + ahead)
        if isinstance(res, Reject):
            return self.ports.refuse(b if res.bucket is None else res.bucket, res)
        return res

    def tick(self) -> None:
        """The clock's tick, with why this server cannot persist a transferred copy now."""
        disk.tell_blocked(self.core, self.ports.can_persist)
        self.step(-1, self.core.tick)

    def peer_message(self, m: dict[str, Any]) -> Any:
        """A peer's PREPARE, COMMIT or ping, decoded and re-checked: its reply."""
        # (the clock then need not walk every bucket for the core's next deadline)
        ahead = quiet_for(self.core, m["op"], m)
        return self.step(m.get("bucket", -1), self.core.step, m["sender"], m, ahead=ahead)

    # -- a joining copy's state transfer (core/replication/join.py) --------------------------------

    def fetched(self, f: Fetch, snap: dict[str, Any] | None) -> bool:
        """The snapshot fetched for `f` (None: the fetch failed): whether to install it."""
        epoch = None if snap is None else int(snap["epoch"])
        return bool(self.step(f.bucket, self.core.snapshot_fetched, f, epoch)) and snap is not None

    def install(self, f: Fetch, snap: dict[str, Any], put: Callable[[], object]) -> bool:
        """Installs a fitting snapshot: `put` queues its values into the store (ValueError:
        damaged on the way, nothing installed, fetched again); the core takes its position in
        the same event, so a flush cut sees both or neither. Not learning until persisted."""
        b = f.bucket
        try:
            put()
        except ValueError as exc:
            log.error("bucket %d: CORRUPT snapshot from %s: %s; again", b, f.primary, exc)
            self.step(b, self.core.snapshot_corrupt, f)
            return False
        committed, cepoch = int(snap["committed"]), int(snap.get("committed_epoch", 0))
        self.step(b, self.core.installed, b, committed, snap["dedup"], cepoch)
        return True

    def install_persisted(self, b: int, persisted: bool) -> None:
        """The installed copy is on disk, or could not be written (the flush holds it no more)."""
        self.step(b, self.core.install_persisted, b, persisted)

    # -- the controllers' answers -----------------------------------------------------------------

    def controller_answer(
        self, req: ControllerRequest, reply: Any, asked_at: float, exc: BaseException | None = None
    ) -> ControllerAnswer:
        """The controllers' answer to `req` (asked at `asked_at` on the core's clock) goes in as
        it is: their reply, their refusal (`exc` an RpcError), or none (any other `exc`: the
        outcome is unknown, the core decides)."""
        if exc is None:
            ans = ControllerAnswer(reply or {}, asked_at=asked_at)
        elif isinstance(exc, RpcError):
            ans = ControllerAnswer(None, exc.code, exc.extra.get("retry_after"))
        else:
            ans = ControllerAnswer(error="connection")
        self.step(req.bucket, self.core.controller_answer, req, ans)
        return ans


def controller_call(
    ops: Any, req: ControllerRequest, me: str, address: str, n_buckets: int,
    not_durable: Callable[[], str | None], copies: Any = None,
) -> Any:  # fmt: skip
    """The controllers' client operation (adamps.client.controller.ControllerOps: a coroutine
    of the server's client, a request of the simulation's) that `req` asks for, from server
    `me` at `address`. `copies`: those offered at registration (default: the core's)."""
    b, body = req.bucket, req.body
    if req.kind == "register":
        offered = body["copies"] if copies is None else copies
        return ops.register(me, address, offered, n_buckets=n_buckets)
    if req.kind == "heartbeat":
        return ops.heartbeat(me, body["known"], body["reports"], not_durable(), body.get("deltas"))
    if req.kind == "role_change":
        return ops.role_change(b, me, req.epoch, {me: list(req.position)})
    if req.kind == "drop_secondary":
        return ops.drop_secondary(b, me, req.epoch, req.member)
    if req.kind == "caught_up":
        return ops.caught_up(b, me, req.epoch, req.member, req.join)
    return ops.release(b, me, req.epoch)


def quiet_for(core: ReplCore, op: str, msg: dict[str, Any]) -> float:
    """How long after it a peer's replication message (checked) brings no deadline of `core`:
    a ping's only deadline is its buckets' watchdog, failover_after from now; so is a primary's
    PREPARE's or COMMIT's to a copy held as secondary, accepted or refused (what else it
    brings, a heartbeat, is a step of its own: tests/core/test_repl_core.py). Issue 36: two
    thirds of a server's inputs at RF 3, and each asked the core's deadline, a walk over every
    bucket (a tenth of a server's event loop, the convnet's profile). Else 0: ask."""
    if op == "repl_ping" or core.roles.get(msg.get("bucket", -1)) == "secondary":
        return core.settings.failover_after
    return 0.0
