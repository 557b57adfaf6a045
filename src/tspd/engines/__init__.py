"""Transfer engines behind one small synchronous protocol; only the shell offloads them."""

__all__: list[str] = []
