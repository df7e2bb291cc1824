"""Importable, stdlib-only code behind scripts/: recipe, wheels, lock, bake, overlay."""
