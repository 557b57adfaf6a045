"""Benchmarks behind ``tspd bench`` (measurements, never assertions)."""

__all__: list[str] = []
