"""Every host example runs as its own process, exits 0 and reports what it checked.

Each example is a small engine on 127.0.0.1 (``examples/``); running it as a
separate interpreter is the point -- the guest-mode one must work under a plain
``asyncio.run()`` in a process that never imported trio-asyncio.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CASES = {
    "asyncio_guest_engine.py": "asyncio guest engine",
    "trio_asyncio_engine.py": "trio-asyncio engine",
    "thread_engine.py": "thread engine",
    "trio_engine.py": "trio engine",
}


@pytest.mark.parametrize(("script", "label"), sorted(CASES.items()))
def test_example_runs_and_reports(script: str, label: str) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    assert lines[-1] == (
        f"{label}: 3 requests transferred, KV verified, 9 KV blocks published and read back"
    ), done.stdout + done.stderr
