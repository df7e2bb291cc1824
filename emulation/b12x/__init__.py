"""An emulation of b12x for validation, NOT b12x: never installed, never in an image.

It stands in for one b12x release, the one installed beside vLLM (or named by
DSA_B12X_EMULATED_RELEASE where none is; ``_release``): for 0.30.2 ``b12x.attention.indexer``,
for 1.5.1 ``b12x.attention.dsa_indexer._impl``, each with the names, signatures and semantics
of that release's functions that the dsa-image overlay of its vLLM base calls, computed in torch
by ``dsa_image.runtime.indexer_reference`` (``_emulated_indexer``), so the overlay's b12x path can run
on GPUs b12x has no kernels for. See ``b12x_emulation.py``.
"""

from ._release import current

EMULATION = True
# Which release: decided at import, and an ImportError when there is none to stand in for.
RELEASE = current()
