"""b12x 1.5.1's ``b12x.attention.dsa_indexer`` package, emulated: only ``_impl``, the module
whose functions the vLLM 0.33.0 overlay calls (the planned public surface, ``plan``/``bind``/
``run``, is not emulated). Importable only when the emulated release is 1.5.1."""

from ..._release import require

require(__name__)
