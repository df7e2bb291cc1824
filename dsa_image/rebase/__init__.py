"""Carrying the overlay to a new vLLM base: three-way merge, change tracking, the report."""
