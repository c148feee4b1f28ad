"""deploy/prometheus/alerts.yml, checked offline: the rules parse (promtool), every adamps_
metric they name is one the code exposes, and each alert fires on the series its fault
produces (promtool's rule unit tests)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.test_deploy_grafana import METRIC_RE, metric_names

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_prometheus_loads_the_alerts() -> None:
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose


def test_every_metric_in_the_alerts_is_defined_by_the_code() -> None:
    exposed = metric_names.exposed_metrics()
    names = {m for r in rules() for m in METRIC_RE.findall(r["expr"])}
    assert names and names <= set(exposed), names - set(exposed)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("needs the Debian package 'prometheus' (it ships promtool)")
    return path


#: per alert: the input series of its fault, and the labels it must fire with
FIRES = {
    "AdampsPsCorruptRecords": (
        'adamps_ps_corrupt_records_total{instance="ps-1",where="load"}',
        "0 0 3 3 3",
        {"where": "load", "instance": "ps-1"},
    ),
    "AdampsDigestConflict": (
        'adamps_controller_digest_conflicts{instance="c-1"}',
        "0 0 1 1 1",
        {"instance": "c-1"},
    ),
    "AdampsPsNotDurable": (
        'adamps_ps_durable{instance="ps-1"}',
        "1 1 0 0 0 0 0 0",
        {"instance": "ps-1"},
    ),
    "AdampsControllerJournalNotWritable": (
        'adamps_controller_journal_writable{instance="c-1"}',
        "1 1 0 0 0 0 0 0",
        {"instance": "c-1"},
    ),
    "AdampsPsFlushStarved": (
        'adamps_ps_flush_starved{instance="ps-1"}',
        "0 0 1 1 1 1 1 1",
        {"instance": "ps-1"},
    ),
    # age grows by a minute a minute past an interval of 60 s: over 3 intervals at 4 min
    "AdampsCheckpointStale": (
        [
            ('adamps_controller_checkpoint_age_seconds{instance="c-1"}', "0 60 120 180 240"),
            ('adamps_controller_checkpoint_interval_seconds{instance="c-1"}', "60 60 60 60 60"),
        ],
        None,
        {"instance": "c-1"},
    ),
}


def test_every_alert_fires_on_its_fault(tmp_path: Path) -> None:
    tool = promtool()
    names = {r["alert"] for r in rules()}
    assert names == set(FIRES), names ^ set(FIRES)
    tests = []
    for name, (series, values, labels) in FIRES.items():
        rule = next(r for r in rules() if r["alert"] == name)
        tests.append(
            {
                "interval": "1m",
                "input_series": [
                    {"series": k, "values": v}
                    for k, v in (series if values is None else [(series, values)])
                ],
                "alert_rule_test": [
                    {"eval_time": "0m", "alertname": name, "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": name,
                        "exp_alerts": [
                            {
                                "exp_labels": {**rule.get("labels", {}), **labels},
                                "exp_annotations": {
                                    k: re.sub(
                                        r"\{\{ \$labels\.(\w+) \}\}",
                                        lambda m, labels=labels: labels[m[1]],
                                        v,
                                    )
                                    for k, v in rule.get("annotations", {}).items()
                                },
                            }
                        ],
                    },
                ],
            }
        )
    spec = tmp_path / "alerts_test.yml"
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    spec.write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "tests": tests}))
    out = subprocess.run(
        [tool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
