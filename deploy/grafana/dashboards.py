"""Writes the Grafana dashboards in deploy/grafana/dashboards/ from their panel tables
(cluster_dashboard.py, training_dashboard.py).

    python deploy/grafana/dashboards.py          # regenerate the JSON files
    python deploy/grafana/dashboards.py --check  # list panels whose metrics the code lacks

Why generated: the panels are one readable table (title, unit, PromQL), the JSON boilerplate is
the same for all of them, and the generator can tell which expected metric names the code does
not define yet. A panel whose metrics are not all defined by the code is left out of the JSON
(and printed), so a dashboard never shows a query that can only be empty.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_dashboard import CLUSTER  # noqa: E402
from dashboard_model import Dashboard, Panel  # noqa: E402
from metric_names import exposed_metrics  # noqa: E402
from training_dashboard import TRAINING  # noqa: E402

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "adamps-prometheus"}
METRIC_RE = re.compile(r"\badamps_[A-Za-z0-9_:]+")

DASHBOARDS = [CLUSTER, TRAINING]


def panel_metrics(panel: Panel) -> set[str]:
    return {m for expr, _legend in panel.queries for m in METRIC_RE.findall(expr)}


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
        for i, (expr, legend) in enumerate(panel.queries)
    ]
    out: dict = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": targets,
    }
    if panel.kind == "timeseries":
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}
        }
    return out


def render(dash: Dashboard, defined: set[str]) -> tuple[dict, list[tuple[str, list[str]]]]:
    """The dashboard's JSON model, and the (panel, missing metrics) left out."""
    panels: list[dict] = []
    left_out: list[tuple[str, list[str]]] = []
    pid, y = 1, 0
    for row_title, row_panels in dash.rows:
        kept = []
        for p in row_panels:
            missing = sorted(panel_metrics(p) - defined)
            if missing:
                left_out.append((p.title, missing))
            else:
                kept.append(p)
        if not kept:
            continue
        panels.append(
            {"id": pid, "type": "row", "title": row_title, "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        pid, y, x = pid + 1, y + 1, 0
        for p in kept:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    model = {
        "uid": dash.uid,
        "title": dash.title,
        "description": dash.description,
        "tags": ["adamps"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "templating": {"list": []},
        "links": [],
        "panels": panels,
    }
    return model, left_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report; write nothing")
    args = ap.parse_args(argv)
    defined = set(exposed_metrics())
    for dash in DASHBOARDS:
        model, left_out = render(dash, defined)
        path = OUT / f"{dash.uid}.json"
        if not args.check:
            path.write_text(json.dumps(model, indent=2) + "\n")
        n = sum(1 for p in model["panels"] if p["type"] != "row")
        print(f"{path.relative_to(OUT.parents[2])}: {n} panels")
        for title, missing in left_out:
            print(f"  left out {title!r}: the code does not define {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
