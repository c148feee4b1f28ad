"""Issue 12 item 2: no role runs on a well-known token; without one, only on loopback."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from adamps import config as aconfig
from adamps.security import token as tokens
from adamps.server.config import PsConfig
from controller.config import ControllerConfig
from dataserver.config import DataServerConfig
from trainer.config import TrainConfig


@pytest.fixture(autouse=True)
def local_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cfg" / "local-token"
    monkeypatch.setenv("ADAMPS_LOCAL_TOKEN_FILE", str(path))
    monkeypatch.delenv("ADAMPS_TOKEN", raising=False)
    return path


def test_loopback_only_without_a_token_uses_a_private_random_local_token(local_file: Path):
    a = PsConfig(host="127.0.0.1").token
    assert a and a not in tokens.WELL_KNOWN and len(a) >= 32
    assert stat.S_IMODE(os.stat(local_file).st_mode) == 0o600
    # Every role of the same user on this machine agrees (a hand-started loopback cluster works).
    assert ControllerConfig(members=["127.0.0.1:7010:7000"]).token == a
    assert DataServerConfig(host="localhost").token == a
    assert TrainConfig(controllers=["127.0.0.1:7000"]).token == a
    assert (
        ControllerConfig(members=["127.0.0.1:7010:7000"]).password != "adamps-raft:adamps-dev-token"
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: PsConfig(host="0.0.0.0"),
        lambda: DataServerConfig(host="10.1.2.3"),
        lambda: ControllerConfig(members=["127.0.0.1:7010:7000"], bind_host="0.0.0.0"),
        lambda: ControllerConfig(members=["127.0.0.1:7010:7000", "10.0.0.2:7010:7000"], member=0),
        lambda: TrainConfig(controllers=["10.0.0.2:7000"]),
    ],
)
def test_no_token_beyond_loopback_refuses_to_start(make, local_file: Path) -> None:
    with pytest.raises(ValueError, match="no cluster token"):
        make()
    assert not local_file.exists()


@pytest.mark.parametrize("bad", sorted(tokens.WELL_KNOWN))
def test_well_known_tokens_are_refused_even_on_loopback(bad: str) -> None:
    with pytest.raises(ValueError, match="well-known"):
        PsConfig(host="127.0.0.1", token=bad)
    with pytest.raises(aconfig.ConfigError, match="well-known"):
        aconfig.load(ControllerConfig, "controller", {}, environ={"ADAMPS_TOKEN": bad})


def test_a_given_token_is_used_as_is() -> None:
    assert PsConfig(host="0.0.0.0", token="s3cret-s3cret").token == "s3cret-s3cret"


def test_a_local_token_file_readable_by_others_is_refused(local_file: Path) -> None:
    local_file.parent.mkdir(parents=True)
    local_file.write_text("x" * 64)
    local_file.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0600"):
        PsConfig(host="127.0.0.1")


def test_the_cli_refuses_to_start_without_a_token_beyond_loopback(capsys) -> None:
    from adamps.server import main as ps_main

    assert ps_main.main(["--host", "0.0.0.0", "--port", "1"]) == 2
    assert "no cluster token" in capsys.readouterr().err


@pytest.mark.parametrize(
    "host, expected",
    [("127.0.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("127.5.5.5", True), ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("", False)],
)  # fmt: skip
def test_is_loopback(host: str, expected: bool) -> None:
    assert tokens.is_loopback(host) is expected
