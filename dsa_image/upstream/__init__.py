"""vLLM's own tests as the overlay's gate: selection from the sdist, runs per side, the comparison."""
