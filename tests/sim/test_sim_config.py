"""``tspd.sim.config``: shapes, faults and the command line that repeats a run."""

from __future__ import annotations

import pytest

from tspd.core.errors import ConfigError
from tspd.sim import Faults, InstanceShape, SimConfig, format_faults, parse_faults, parse_shapes
from tspd.sim.config import FAULT_DEFAULTS, format_shapes


def test_shapes_parse_and_print_back() -> None:
    shapes = parse_shapes("2xTP2,TP1,1xtp2dp2", what="Prefill", allow_dp=True)
    assert shapes == (InstanceShape(2, 2), InstanceShape(1, 1), InstanceShape(1, 2, 2))
    assert format_shapes(shapes) == "2xTP2,1xTP1,1xTP2DP2"


@pytest.mark.parametrize("text", ["2xTP", "TP0", "0xTP2", "3x", "2xTP2x", ""])
def test_bad_shapes_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="shape"):
        parse_shapes(text, what="Decode", allow_dp=False)


def test_decode_instances_have_no_dp_groups() -> None:
    with pytest.raises(ConfigError, match="no DP groups"):
        parse_shapes("1xTP2DP2", what="Decode", allow_dp=False)


def test_faults_parse_names_and_rates() -> None:
    faults = parse_faults("loss=0.01,dup=0.02,reorder,partition,crash")
    assert faults == Faults(
        loss=0.01,
        dup=0.02,
        reorder=FAULT_DEFAULTS["reorder"],
        partition=FAULT_DEFAULTS["partition"],
        crash=FAULT_DEFAULTS["crash"],
    )
    assert parse_faults("none") == Faults()
    assert not parse_faults("").any
    assert parse_faults("all") == Faults(**FAULT_DEFAULTS)
    assert parse_faults(format_faults(faults)) == faults
    assert format_faults(Faults()) == "none"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lose=0.1", "unknown fault 'lose'"),
        ("loss=x", "needs a number"),
        ("loss=2", "is a probability"),
        ("crash=-1", "must not be negative"),
    ],
)
def test_bad_faults_are_refused(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_faults(text)


def test_a_config_checks_its_model_and_capacity() -> None:
    with pytest.raises(ConfigError, match="TP=3"):
        SimConfig(prefill=(InstanceShape(1, 3),))
    with pytest.raises(ConfigError, match="do not fit"):
        SimConfig(num_pages=64, max_inflight=48)
    with pytest.raises(ConfigError, match="fencing"):
        SimConfig(fencing="loose")  # type: ignore[arg-type]


def test_the_command_line_names_everything_the_cli_sets() -> None:
    config = SimConfig(
        rooms=12,
        prefill=parse_shapes("1xTP2DP2", what="Prefill", allow_dp=True),
        decode=parse_shapes("1xTP1,2xTP4", what="Decode", allow_dp=False),
        faults=parse_faults("loss=0.5,crash"),
        fencing="strict",
    )
    assert config.command(9) == (
        "tspd sim --seed 9 --rooms 12 --prefill 1xTP2DP2 --decode 1xTP1,2xTP4 "
        "--faults loss=0.5,crash=1 --fencing strict"
    )


def test_settings_the_command_line_cannot_give_follow_as_a_comment() -> None:
    config = SimConfig(rooms=5, kv_heads=8)
    assert config.command(1).endswith("--fencing report  # and kv_heads=8")
    assert "#" not in SimConfig().command(1)
