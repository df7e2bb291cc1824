"""GPU-run records: their raw files packed and checked, and the release check of the docs' claims."""
