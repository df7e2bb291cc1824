"""Runs at the start of every Python process with this directory on PYTHONPATH (validation
only). With DSA_B12X_EMULATION=1 it installs the emulation's hooks (b12x_emulation.install):
a server started so runs the overlay's b12x path on the emulation in all its processes, and
DSA_INDEXER_TAP_DIR adds the prefill top-k recorder. Without it nothing is patched: the
overlay's start-up checks run as in production (the glue harness shows their refusal first)."""

import os

if os.environ.get("DSA_B12X_EMULATION") == "1":
    import b12x_emulation

    b12x_emulation.install(tap_dir=os.environ.get("DSA_INDEXER_TAP_DIR"))
