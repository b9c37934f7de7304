"""The speed sweep: `python -m fusedmlp.bench` (see cli.py)."""

from fusedmlp.bench.cli import main

__all__ = ["main"]
