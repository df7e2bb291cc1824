"""The paired benchmark: overlay against stock, alternating rounds, median ratios."""
