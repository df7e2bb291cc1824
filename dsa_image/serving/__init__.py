"""Serving recipes (recipes/serve/) to launches: docker and vLLM command lines, the memory plan, workarounds."""
