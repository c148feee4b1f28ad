"""The Prometheus metric names the adamps code defines, found by reading its source (no imports).

Used by the dashboard generator (``deploy/grafana/dashboards.py``) and by the tests that check that
every metric a dashboard queries is one the code exposes. A metric is a call
``Counter|Gauge|Histogram|Summary|Info|Enum("adamps_...", ...)`` (``name=`` also counts); the
names it exposes follow prometheus-client's text format: a counter ``x`` is ``x_total``, a
histogram ``x`` is ``x_bucket``/``x_sum``/``x_count``, and so on.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The packages whose metrics a dashboard may use.
PACKAGES = ("adamps", "controller", "dataserver", "trainer")
KINDS = ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "GaugeMetricFamily")


def _kind_of(func: ast.expr) -> str | None:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name if name in KINDS else None


def _name_arg(call: ast.Call) -> str | None:
    node: ast.expr | None = call.args[0] if call.args else None
    for kw in call.keywords:
        if kw.arg == "name":
            node = kw.value
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def defined_metrics(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, str]:
    """{metric name as defined: kind} for every adamps_ metric in the packages' source."""
    found: dict[str, str] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except SyntaxError:  # a file being written by someone else right now
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and (kind := _kind_of(node.func)):
                    name = _name_arg(node)
                    if name and name.startswith("adamps_"):
                        found[name] = kind
    return found


def _const(node: ast.expr | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def metric_table(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[dict[str, str]]:
    """One row per metric: name (as scraped), kind, labels, help, defining file (for the docs)."""
    rows = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and (kind := _kind_of(node.func))):
                    continue
                name = _name_arg(node)
                if not (name and name.startswith("adamps_")):
                    continue
                args = {kw.arg: kw.value for kw in node.keywords}
                doc = args.get("documentation", node.args[1] if len(node.args) > 1 else None)
                labels = args.get(
                    "labelnames", args.get("labels", node.args[2] if len(node.args) > 2 else None)
                )
                label_list = (
                    [str(_const(e)) for e in labels.elts]
                    if isinstance(labels, ast.List | ast.Tuple)
                    else []
                )
                scraped = {"Counter": name.removesuffix("_total") + "_total"}.get(kind, name)
                rows[name] = {
                    "name": scraped,
                    # a collector's GaugeMetricFamily is a gauge when scraped
                    "kind": kind.removesuffix("MetricFamily").lower(),
                    "labels": ", ".join(label_list),
                    "help": str(_const(doc) or ""),
                    "file": path.relative_to(root).as_posix(),
                }
    return sorted(rows.values(), key=lambda r: r["name"])


def exposed_names(name: str, kind: str) -> set[str]:
    """The series names prometheus-client exposes for metric `name` of `kind`."""
    if kind == "Counter":
        base = name.removesuffix("_total")
        return {base + "_total", base + "_created"}
    if kind == "Histogram":
        return {name + s for s in ("_bucket", "_sum", "_count", "_created")}
    if kind == "Summary":
        return {name, name + "_sum", name + "_count", name + "_created"}
    if kind == "Info":
        return {name.removesuffix("_info") + "_info"}
    return {name}  # Gauge, Enum, GaugeMetricFamily (a collector's gauge)


def exposed_metrics(root: Path = ROOT) -> dict[str, str]:
    """{exposed series name: the metric name as defined} for the whole code base."""
    out: dict[str, str] = {}
    for name, kind in defined_metrics(root).items():
        for exposed in exposed_names(name, kind):
            out[exposed] = name
    return out


if __name__ == "__main__":
    # A Markdown table of every metric, for docs/operations.md.
    print("| metric | type | labels | meaning |")
    print("| --- | --- | --- | --- |")
    for row in metric_table():
        print(f"| `{row['name']}` | {row['kind']} | {row['labels']} | {row['help']} |")
