"""Bad values a user types get a message naming the value and what is expected, never a
traceback (docs/running.md, "Configuration"; an outside tester found these five): a port out of range,
a data directory that cannot be made, an unknown model, and `adamps up --train-arg` flags that
`adamps train` does not have or values of the wrong type (found before the cluster starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adamps.server.main import main as ps_main
from adamps.up.flags import UsageError, build_parser, check_args
from trainer.config import TrainConfig


def test_a_port_out_of_range_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert ps_main(["--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "70000" in err and "0..65535" in err and "Traceback" not in err


def test_an_unknown_model_is_named() -> None:
    with pytest.raises(ValueError, match="unknown model 'nosuchmodel'"):
        TrainConfig(model="nosuchmodel", ps=["http://127.0.0.1:1"], token="t" * 32)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"optimizer": "adamx"}, "optimizer must be one of ['sgd', 'adagrad', 'adam'"),
        ({"optimizer": "adam", "optimizer_args": '{"momentum": 0.9}'},
         "unknown field(s) ['momentum'] for optimizer 'adam'"),
        ({"optimizer": "sgd", "optimizer_args": "[1]"}, "optimizer_args must be a JSON object"),
        ({"optimizer": "rowwise_adagrad"}, "rowwise_adagrad is for tables"),
        # the servers' sgd takes any lr: a negative one trained uphill until a push overflowed
        ({"optimizer": "sgd", "lr": -0.05}, "lr must be >= 0 (as torch.optim), got -0.05"),
        ({"local_lr": -0.1}, "local_lr must be >= 0 (as torch.optim), got -0.1"),
    ],
)  # fmt: skip
def test_a_bad_optimizer_is_named_before_anything_starts(fields: dict, named: str) -> None:
    with pytest.raises(ValueError) as e:
        TrainConfig(ps=["http://127.0.0.1:1"], token="t" * 32, **fields)
    assert named in str(e.value)


def test_the_default_optimizer_is_torchs_adagrad() -> None:
    cfg = TrainConfig(ps=["http://127.0.0.1:1"], token="t" * 32)
    spec = cfg.optimizer_spec()
    assert spec["kind"] == "adagrad" and spec["initial_accumulator_value"] == 0.0
    assert spec["eps"] == 1e-10 and "initial_accumulator" not in spec
    args = '{"momentum": 0.9, "nesterov": true}'
    sgd = TrainConfig(ps=["http://127.0.0.1:1"], token="t" * 32, optimizer="sgd",
                      optimizer_args=args).optimizer_spec()  # fmt: skip
    assert sgd["momentum"] == 0.9 and sgd["nesterov"] is True


@pytest.mark.parametrize(
    "arg, named",
    [
        ("nosuch=1", "has no flag --nosuch"),
        ("lr=abc", "bad value 'abc'; expected float"),
        # found by each trainer after the cluster had started (adamps up exited 1)
        ("lr=-1", r"lr from --train-arg lr=-1: bad value .-1.; expected a number >= 0"),
        ("optimizer=lamb", "optimizer must be one of"),
        ('optimizer_args={"momentom": 0.9}', r"unknown field\(s\) \['momentom'\]"),
    ],
)
def test_up_checks_its_train_args_before_starting_anything(arg: str, named: str) -> None:
    with pytest.raises(UsageError, match=named):
        check_args(build_parser().parse_args(["--train-arg", arg]))
    check_args(build_parser().parse_args(["--train-arg", "optimizer=sgd"]))  # a good one passes


def test_a_data_dir_that_cannot_be_made_is_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "file").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "adamps", "ps", "--port", "0", "--data-dir",
         str(tmp_path / "file" / "sub")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "cannot run" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_no_answer_says_why() -> None:
    """A request nothing answered names why (refused here; a certificate that does not verify
    against a TLS server): a user's script saw only "no answer"."""
    from adamps.client.rpc import get_json

    with pytest.raises(ConnectionError, match=r"no answer \(.*[Rr]efused"):
        get_json("127.0.0.1:1", "/status", timeout=2.0)
