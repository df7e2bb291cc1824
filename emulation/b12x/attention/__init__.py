"""The emulated ``b12x.attention`` package: only ``indexer`` is emulated."""
