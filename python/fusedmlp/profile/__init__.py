"""The Linear -> MLP profiling study: `python -m fusedmlp.profile` (see cli.py)."""

from fusedmlp.profile.cli import main

__all__ = ["main"]
