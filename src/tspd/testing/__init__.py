"""Public test helpers: contract builders, fake engines, hypothesis strategies."""

__all__: list[str] = []
