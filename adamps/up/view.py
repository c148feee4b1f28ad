"""What `adamps up` reads of its cluster: the controllers' /cluster and the trainers' /metrics
(one Reading per look, for the progress view, progress.jsonl and the plot), and at the end the
trainers' summary lines and replica 0's history."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adamps.client.rpc import get_text
from adamps.up.cluster import LocalCluster
from adamps.up.procs import Proc


def scrape(addr: str, timeout: float = 1.0) -> dict[str, float]:
    """Sample name -> value of a process's /metrics (unlabelled samples only); {} if no answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = get_text(addr, "/metrics", timeout)
    except (OSError, ValueError):  # no answer, not 200, not text
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


@dataclass
class Reading:
    """One look at the cluster, for the progress view and the plot."""

    time: float
    epoch: int = 0  #: the epoch replica 0 trains
    completed: int = 0  #: the last epoch complete (epoch-end rule)
    accuracy: float | None = None  #: held-out accuracy at the last epoch end
    images_per_s: float = 0.0  #: sum over the replicas
    loss: dict[str, float] = field(default_factory=dict)  #: replica -> recent training loss
    servers_live: int | None = None
    servers_total: int | None = None
    under_replicated: int | None = None
    trainers_running: int = 0

    def status(self, epochs: int) -> str:
        """The progress view's text after its bar of complete epochs (which shows the time)."""
        acc = "-" if self.accuracy is None else f"{self.accuracy * 100:.1f}%"
        srv = "?" if self.servers_live is None else f"{self.servers_live}/{self.servers_total}"
        under = "?" if self.under_replicated is None else str(self.under_replicated)
        return (
            f"epoch {max(self.epoch, 1)}/{epochs} | held-out acc {acc} | "
            f"{self.images_per_s:,.0f} images/s | servers up {srv} | "
            f"under-replicated buckets {under} | trainers {self.trainers_running}"
        )


def read_cluster(
    cluster: LocalCluster, trainers: list[tuple[str, Proc, str]], last: Reading | None = None
) -> Reading:
    """A new reading; what cannot be read now (replica 0 finished) is kept from `last`."""
    r = Reading(time=time.time())
    if last is not None:
        r.epoch, r.completed, r.accuracy = last.epoch, last.completed, last.accuracy
    view = cluster.cluster()
    if view is not None:
        states = [s.get("state") for s in view.get("servers", {}).values()]
        r.servers_live = sum(1 for s in states if s == "live")
        r.servers_total = len(cluster.servers)
        r.under_replicated = int(view.get("under_replicated", 0)) + int(view.get("unassigned", 0))
    for i, (_name, proc, addr) in enumerate(trainers):
        if not proc.alive:
            continue
        r.trainers_running += 1
        m = scrape(addr)
        if not m:
            continue
        r.images_per_s += m.get("adamps_trainer_images_per_second", 0.0)
        if m.get("adamps_trainer_loss"):
            r.loss[str(i)] = m["adamps_trainer_loss"]
        if i == 0:
            r.epoch = int(m.get("adamps_trainer_epoch", 0))
            r.completed = int(m.get("adamps_trainer_completed_epoch", 0))
            acc = m.get("adamps_trainer_heldout_accuracy", 0.0)
            if acc > 0:
                r.accuracy = acc
    return r


def trainer_summary(proc: Proc) -> dict[str, Any] | None:
    """The JSON line `adamps train` prints last (its figures), from its log."""
    try:
        lines = proc.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{") and '"replica"' in line:
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def read_history(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out
