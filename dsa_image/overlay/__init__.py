"""The overlay tool: record, apply, revert and verify an overlay over a vLLM site."""
