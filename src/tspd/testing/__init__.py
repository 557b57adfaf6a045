"""Public test helpers: contract builders, fake engines, hypothesis strategies."""
