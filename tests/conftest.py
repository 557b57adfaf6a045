"""Shared test configuration."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Mooncake: quiet logs; a hung peer fails a write after 5 s instead of 30 s.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("TSPD_HYPOTHESIS_PROFILE", "ci"))
