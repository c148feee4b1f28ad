"""Periodic checkpoints, run by whichever controller leads (issue 24).

Every controller runs this loop; only the leader acts. When the replicated record says one is
due (controller/ckpt_record.py), the leader commits ``begin``, takes an incremental checkpoint
of the cluster into ``checkpoint_dir`` through its own HTTP API (adamps/checkpoint/save_restore.py: each
bucket cut on its primary, only shards changed since the newest complete checkpoint written),
prunes to ``checkpoint_keep`` and commits ``done`` with its size and duration. The save runs in
a worker thread: the leader's other duties (heartbeats, leases) go on meanwhile. A leader that
dies midway leaves a directory without a manifest; the next leader finds the record still due
and takes a checkpoint under a new name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from adamps.checkpoint import series as ckpt_series
from adamps.checkpoint.save_restore import Cluster, save
from adamps.wire import ride
from controller import ckpt_record
from controller.config import ControllerConfig
from controller.ctl_metrics import ControllerMetrics
from controller.raft_node import NotLeader, RaftNode
from controller.state import ReplicatedCluster

log = logging.getLogger("controller.checkpoints")


class CheckpointSchedule:
    """The loop and its soft state (event-loop thread)."""

    def __init__(
        self,
        cfg: ControllerConfig,
        cluster: ReplicatedCluster,
        raft: RaftNode,
        m: ControllerMetrics,
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.raft = raft
        self.m = m
        self.root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        #: the checkpoint this node is taking (name), for /status
        self.running: str | None = None
        #: wall-clock time before which this node does not try again after a failure
        self._retry_at = 0.0
        m.ckpt_interval.set(cfg.checkpoint_interval)

    def status(self) -> dict[str, Any]:
        rec = self.cluster.read(lambda m: dict(m.checkpoint_record()))
        return {
            "consistent": self.cfg.checkpoint_consistent,
            "interval": self.cfg.checkpoint_interval,
            "keep": self.cfg.checkpoint_keep,
            "dir": self.cfg.checkpoint_dir,
            "running": self.running,
            **rec,
        }

    async def run(self) -> None:
        if self.cfg.checkpoint_interval <= 0 or self.root is None:
            return
        period = min(1.0, self.cfg.checkpoint_interval / 4)
        while True:
            await ride.sleep(period)  # with another timer's wake-up when one is due (issue 36)
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except NotLeader:
                pass
            except Exception:
                log.exception("checkpoint schedule step failed")

    async def _step(self) -> None:
        if not (self.raft.is_leader() and self.raft.is_ready()) or self.running is not None:
            return
        now = time.time()
        rec = self.cluster.read(lambda m: dict(m.checkpoint_record()))
        if now < self._retry_at or not ckpt_record.due(rec, self.cfg.checkpoint_interval, now):
            return
        term = self.raft.term
        name = ckpt_series.name_of(rec["count"] + 1, term)
        await self.raft.commit("x_checkpoint", "begin", {"name": name, "term": term}, now)
        self.running = name
        try:
            summary = await asyncio.to_thread(self._take, name)
        except Exception as exc:
            self.m.ckpt_failures.inc()
            # Not again at once: whatever failed (no servers yet, a disk) likely still does.
            self._retry_at = time.time() + min(self.cfg.checkpoint_interval, 10.0)
            log.warning("periodic checkpoint %s failed: %s", name, exc)
            return
        finally:
            self.running = None
        await self.raft.commit("x_checkpoint", "done", {**summary, "started": now}, time.time())
        log.info(
            "checkpoint %s: %d bytes written in %.2fs", name, summary["written_bytes"],
            summary["seconds"],
        )  # fmt: skip

    def _take(self, name: str) -> dict[str, Any]:
        """One checkpoint (worker thread): incremental on the newest complete one."""
        assert self.root is not None
        self.root.mkdir(parents=True, exist_ok=True)
        base = ckpt_series.newest(self.root)
        controllers = [f"http://{a}" for a in self.cfg.http_addresses]
        cluster = Cluster(controllers, self.cfg.token, retry_for=30.0)
        try:
            manifest = save(
                cluster, self.root / name, base=base, consistent=self.cfg.checkpoint_consistent
            )
        finally:
            cluster.close()
        ckpt_series.prune(self.root, self.cfg.checkpoint_keep)
        return ckpt_series.summary(manifest, name)
