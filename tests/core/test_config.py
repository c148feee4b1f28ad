"""adamps.config: precedence flags > env > TOML > defaults, and clear errors naming the value."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from adamps.config import ConfigError, add_arguments, field, load


@dataclass
class DemoConfig:
    host: str = field("127.0.0.1", help="address to bind")
    port: int = field(7000, help="port")
    lr: float = field(0.1, help="learning rate")
    sync: bool = field(True, help="fsync")
    peers: list[str] = field([], help="peer addresses")
    token: str = field("dev", help="cluster token")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p, DemoConfig)
    return p.parse_args(argv)


def test_precedence(tmp_path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[demo]\nport = 7100\nlr = 0.5\npeers = ["a:1", "b:2"]\n')
    env = {"ADAMPS_DEMO_PORT": "7200", "ADAMPS_TOKEN": "secret"}
    cfg = load(
        DemoConfig, "demo", parse(["--config", str(toml), "--lr", "0.25", "--no-sync"]), environ=env
    )
    assert (cfg.port, cfg.lr, cfg.sync, cfg.peers, cfg.token) == (
        7200,
        0.25,
        False,
        ["a:1", "b:2"],
        "secret",
    )
    assert load(DemoConfig, "demo", parse([]), environ={}) == DemoConfig()
    assert load(DemoConfig, "demo", parse(["--peers", "x:1,y:2"]), environ={}).peers == [
        "x:1",
        "y:2",
    ]


def test_bad_values_name_the_value_and_the_expectation(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"DemoConfig.port from --port: bad value 'seven'"):
        load(DemoConfig, "demo", parse(["--port", "seven"]), environ={})
    with pytest.raises(ConfigError, match=r"ADAMPS_DEMO_SYNC.*true or false"):
        load(DemoConfig, "demo", parse([]), environ={"ADAMPS_DEMO_SYNC": "maybe"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[demo]\nprot = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load(DemoConfig, "demo", parse(["--config", str(bad)]), environ={})
    bad.write_text("[demo\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(DemoConfig, "demo", parse(["--config", str(bad)]), environ={})
    with pytest.raises(ConfigError, match="No such file"):
        load(DemoConfig, "demo", parse(["--config", str(tmp_path / "missing.toml")]), environ={})


def test_the_peer_secrets_come_from_their_env_names_and_never_show_in_status() -> None:
    """Issue 28: $ADAMPS_PEER_TOKEN (controllers, servers), $ADAMPS_PS_SERVER_KEY; the Raft
    password comes from the peer token when one is set (a trainer holds the cluster token);
    /status shows none of them."""
    from adamps.config import to_dict
    from adamps.server.config import PsConfig
    from controller.config import ControllerConfig

    members = ["127.0.0.1:7010:7000"]
    env = {"ADAMPS_TOKEN": "t" * 32, "ADAMPS_PEER_TOKEN": "p" * 32}
    ctl = load(ControllerConfig, "controller", environ=env, args={"members": members})
    assert ctl.peer_token == "p" * 32
    assert "p" * 32 in ctl.password and "t" * 32 not in ctl.password
    plain = load(ControllerConfig, "controller", environ={"ADAMPS_TOKEN": "t" * 32},
                 args={"members": members})  # fmt: skip
    assert plain.password != ctl.password
    key = "ab" * 32
    ps = load(PsConfig, "ps", environ={**env, "ADAMPS_PS_SERVER_KEY": key})
    assert ps.own_key() == bytes.fromhex(key)
    for cfg in (ctl, ps):
        shown = to_dict(cfg)
        assert all(shown[k] == "***" for k in ("token", "peer_token") if k in shown)
        assert "p" * 32 not in repr(shown) and key not in repr(shown)
    with pytest.raises(ValueError, match="server_key must be 64 hex digits"):
        PsConfig(token="t" * 32, server_key="nothex")


def test_a_servers_pings_are_derived_from_its_failover_timeout() -> None:
    """Issue 36 (idle costs nothing): by default a primary pings four times per failover_after,
    what the secondaries' watchdog needs, not every 0.3 s whatever the timeout; an explicit
    interval is kept, and one the watchdog would fire between is refused, naming the bound."""
    from adamps.server.config import PsConfig

    tok = {"token": "t" * 32}
    assert PsConfig(**tok).ping_interval == pytest.approx(3.0 / 4)
    assert PsConfig(**tok).repl_settings.ping_interval == pytest.approx(0.75)
    assert PsConfig(**tok, failover_after=1.0).ping_interval == pytest.approx(0.25)
    assert PsConfig(**tok, ping_interval=0.2, failover_after=1.5).ping_interval == 0.2
    for bad in (-1.0, 3.0, 5.0):
        with pytest.raises(ValueError, match=r"ping_interval must be in \[0, failover_after"):
            PsConfig(**tok, ping_interval=bad)
