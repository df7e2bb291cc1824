"""An emulation of b12x for validation, NOT b12x: never installed, never in an image.

``b12x.attention.indexer`` here has the names, signatures and semantics of b12x 0.30.2's
that the dsa-image overlay calls, computed in torch by ``dsa_image.indexer_reference``, so the
overlay's b12x path can run on GPUs b12x has no kernels for. See ``b12x_emulation.py``.
"""

EMULATION = True
