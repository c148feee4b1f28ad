"""The Grafana dashboards and provisioning in deploy/grafana/, checked offline.

Every panel queries Prometheus with PromQL that parses (promtool), and every adamps_ metric a
query names is one the code defines, under the name prometheus-client exposes (a counter `x` is
scraped as `x_total`). tests/system/test_prometheus.py checks that the queries return data from
real processes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
METRIC_RE = re.compile(r"\badamps_[A-Za-z0-9_:]+")


def load_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_grafana_{name}", GRAFANA / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


metric_names = load_module("metric_names")


def panels() -> list[tuple[str, dict]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            if panel["type"] != "row":
                out.append((path.name, panel))
    return out


def test_dashboards_are_well_formed() -> None:
    assert {p.name for p in DASHBOARDS} >= {"adamps-cluster.json", "adamps-training.json"}
    uids = []
    for path in DASHBOARDS:
        model = json.loads(path.read_text())
        assert model["title"] and model["uid"] and isinstance(model["panels"], list)
        uids.append(model["uid"])
        ids = [p["id"] for p in model["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        for p in model["panels"]:
            grid = p["gridPos"]
            assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, (path.name, p["title"])
    assert len(uids) == len(set(uids))


def test_every_panel_has_a_promql_query_on_the_provisioned_datasource() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    found = panels()
    assert len(found) >= 12
    for name, panel in found:
        assert panel["datasource"]["uid"] == source["uid"], (name, panel["title"])
        assert panel["targets"], (name, panel["title"])
        for t in panel["targets"]:
            assert t["expr"].strip(), (name, panel["title"])
            assert t.get("datasource", panel["datasource"])["uid"] == source["uid"]


def test_every_metric_in_the_dashboards_is_defined_by_the_code() -> None:
    exposed = metric_names.exposed_metrics()
    # The extractor itself: a gauge keeps its name, a counter is scraped with _total.
    assert exposed.get("adamps_ps_loss_window_seconds") == "adamps_ps_loss_window_seconds"
    assert (
        "adamps_ps_updates_applied_total" in exposed and "adamps_ps_updates_applied" not in exposed
    )
    unknown = {}
    for name, panel in panels():
        for t in panel["targets"]:
            for metric in METRIC_RE.findall(t["expr"]):
                if metric not in exposed:
                    unknown[metric] = f"{name} / {panel['title']}"
    assert not unknown, f"metrics the code does not expose: {unknown}"


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs the Debian package 'prometheus' (it ships promtool)")
    rules = [
        {"record": f"adamps_check:q{i}", "expr": t["expr"]}
        for i, t in enumerate(t for _n, p in panels() for t in p["targets"])
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # promtool really parses: a broken expression fails.
    path.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "x", "rules": [{"record": "a:b", "expr": "sum(rate(x[1m])"}]}]}
        )
    )
    assert (
        subprocess.run(
            [promtool, "check", "rules", str(path)], capture_output=True, timeout=30
        ).returncode
        != 0
    )


def test_provisioning_points_at_the_mounted_dashboards() -> None:
    prov = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "adamps.yml").read_text())
    (provider,) = prov["providers"]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = dict(
        (v.split(":")[0], v.split(":")[1]) for v in compose["services"]["grafana"]["volumes"]
    )
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_dashboard_files_are_what_the_generator_writes_for_their_panels() -> None:
    """The JSON is generated (deploy/grafana/dashboards.py); no panel was hand-edited away from it."""
    gen = load_module("dashboards")
    for dash in gen.DASHBOARDS:
        committed = json.loads((GRAFANA / "dashboards" / f"{dash.uid}.json").read_text())
        spec = {p.title: p for _row, ps in dash.rows for p in ps}
        for p in committed["panels"]:
            if p["type"] == "row":
                continue
            assert p["title"] in spec, f"{dash.uid}: panel {p['title']!r} is not in the generator"
            assert [t["expr"] for t in p["targets"]] == [q for q, _ in spec[p["title"]].queries]
