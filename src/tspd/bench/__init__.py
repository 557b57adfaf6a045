"""Benchmarks behind ``tspd bench`` (measurements, never assertions)."""
