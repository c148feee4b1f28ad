"""The vocabulary of the dashboards' panel tables: a panel (title, unit, PromQL), a dashboard of
rows of panels, and the PromQL helpers the tables share. deploy/grafana/dashboards.py renders them."""

from __future__ import annotations

from dataclasses import dataclass, field

RATE = "1m"  # rate window: >= 4 scrapes at the Compose file's 5 s scrape interval


@dataclass
class Panel:
    title: str
    #: (PromQL, legend) pairs
    queries: list[tuple[str, str]]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    #: (row title, panels)
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)


def rate(metric: str, by: str = "instance") -> str:
    return f"sum by ({by}) (rate({metric}[{RATE}]))"


def quantile(q: float, metric: str, by: str = "instance") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))"
