"""``tspd demo --secure`` end to end: a TLS bootstrap server with a token, a TP 2
Prefill group and a Decode rank, each its own process with its own CURVE key pair,
Mooncake over TCP, every byte verified (docs/security.md)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("mooncake.engine")

from tspd.cli import main
from tspd.demo.orchestrate import DemoOptions, run_demo
from tspd.demo.workload import Workload

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]


async def test_the_secure_demo_serves_every_room_with_verified_bytes() -> None:
    summary = await run_demo(
        DemoOptions(
            workload=Workload(rooms=range(500, 540)),
            prefill_tp=2,
            decode_tp=1,
            timeout=120,
            secure=True,
        )
    )
    assert summary.ok, (summary.errors, summary.reasons)
    assert summary.succeeded == 40
    assert summary.bytes_verified > 0


def test_keys_generate_writes_private_secrets_and_refuses_to_overwrite(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The CLI's keys command writes what the secure roles read."""
    result = CliRunner().invoke(main, ["keys", "generate", str(tmp_path), "--name", "p0"])
    assert result.exit_code == 0, result.output
    assert "TSPD_CURVE_SECRET_KEY_FILE=" in result.output
    assert (tmp_path / "curve" / "p0.key_secret").stat().st_mode & 0o077 == 0
    again = CliRunner().invoke(main, ["keys", "generate", str(tmp_path), "--name", "p0"])
    assert again.exit_code != 0
    assert "--force" in again.output
