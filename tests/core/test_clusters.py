"""Clusters found by name (adamps.clusters): where the cluster file lives, what it holds (mode
0600), and the one rule by which every command finds the controllers and the token when none
is given; an authorization error names the token used and where the cluster's token is."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from adamps import clusters
from adamps.client.rpc import RpcError

ENV = ("ADAMPS_CONTROLLERS", "ADAMPS_CLUSTER", "ADAMPS_TOKEN", "ADAMPS_TOKEN_FILE",
       "ADAMPS_LOCAL_TOKEN_FILE")  # fmt: skip


@pytest.fixture(autouse=True)
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    return tmp_path


def make(tmp: Path, name: str, controllers: list[str], token: str) -> Path:
    tok = tmp / f"{name}.token"
    tok.write_text(token + "\n")
    return clusters.write(name, {"controllers": controllers, "token_file": str(tok)})


def test_the_file_is_under_xdg_config_home_with_mode_0600(config_home: Path) -> None:
    path = make(config_home, "local", ["127.0.0.1:7101"], "t" * 64)
    assert path == config_home / "cfg" / "adamps" / "clusters" / "local.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_without_xdg_the_file_is_under_home(config_home: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert clusters.cluster_file("x") == config_home / "home" / ".config/adamps/clusters/x.json"


def test_nothing_given_the_local_cluster_gives_addresses_and_token(config_home: Path) -> None:
    make(config_home, "local", ["127.0.0.1:7101", "127.0.0.1:7102"], "a" * 64)
    t = clusters.resolve(who="test")
    assert t.controllers == ["127.0.0.1:7101", "127.0.0.1:7102"]
    assert t.token == "a" * 64
    assert "local" in t.token_from and "local.token" in t.token_from


def test_a_named_cluster_by_flag_or_environment(config_home: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    make(config_home, "local", ["127.0.0.1:7101"], "a" * 64)
    make(config_home, "big", ["127.0.0.1:7201"], "b" * 64)
    assert clusters.resolve(cluster="big").controllers == ["127.0.0.1:7201"]
    monkeypatch.setenv("ADAMPS_CLUSTER", "big")
    t = clusters.resolve()
    assert (t.controllers, t.token) == (["127.0.0.1:7201"], "b" * 64)


def test_flags_and_variables_come_before_the_file(config_home: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    make(config_home, "local", ["127.0.0.1:7101"], "a" * 64)
    t = clusters.resolve(controllers="127.0.0.1:9000", token="given")
    assert (t.controllers, t.token, t.token_from) == (["127.0.0.1:9000"], "given", "--token")
    monkeypatch.setenv("ADAMPS_CONTROLLERS", "127.0.0.1:9001")
    monkeypatch.setenv("ADAMPS_TOKEN", "from-env")
    t = clusters.resolve()
    assert (t.controllers, t.token) == (["127.0.0.1:9001"], "from-env")
    monkeypatch.delenv("ADAMPS_TOKEN")
    (config_home / "f.token").write_text("from-file\n")
    monkeypatch.setenv("ADAMPS_TOKEN_FILE", str(config_home / "f.token"))
    assert clusters.resolve().token == "from-file"


def test_given_addresses_of_a_known_cluster_use_its_token(config_home: Path) -> None:
    make(config_home, "big", ["127.0.0.1:7201", "127.0.0.1:7202"], "b" * 64)
    t = clusters.resolve(controllers="http://127.0.0.1:7202")
    assert t.token == "b" * 64


def test_no_cluster_falls_back_to_7000_and_the_local_token(config_home: Path) -> None:
    t = clusters.resolve()
    assert t.controllers == ["127.0.0.1:7000"]
    assert (config_home / "cfg" / "adamps" / "local-token").read_text().strip() == t.token


def test_an_unknown_or_bad_name_is_refused_naming_it(config_home: Path) -> None:
    with pytest.raises(clusters.ClusterError, match=r"no cluster 'nope'.*nope\.json.*--name nope"):
        clusters.resolve(cluster="nope")
    with pytest.raises(clusters.ClusterError, match=r"cluster name '\.\./x'"):
        clusters.resolve(cluster="../x")


def test_a_missing_token_file_is_named(config_home: Path) -> None:
    path = make(config_home, "local", ["127.0.0.1:7101"], "a" * 64)
    os.unlink(config_home / "local.token")
    with pytest.raises(clusters.ClusterError, match="local.token"):
        clusters.resolve()
    assert path.exists()


def test_unauthorized_names_the_token_used_and_where_the_clusters_is(config_home: Path) -> None:
    make(config_home, "local", ["127.0.0.1:7101"], "a" * 64)
    t = clusters.resolve(controllers="127.0.0.1:7101", token="wrong")
    msg = clusters.explain(RpcError("unauthorized", "wrong cluster token"), t)
    assert "the token used came from --token" in msg
    assert f"cluster 'local' is in {config_home / 'local.token'}" in msg
    other = clusters.explain(RpcError("not_found", "no server"), t)
    assert "token used" not in other
