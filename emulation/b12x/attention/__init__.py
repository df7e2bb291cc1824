"""The emulated ``b12x.attention`` package: only the indexer of the emulated release
(``indexer`` for 0.30.2, ``dsa_indexer`` for 1.5.1)."""
