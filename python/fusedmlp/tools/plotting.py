"""matplotlib for the tools' charts. It is an optional extra ("study"), not a dependency of the
library, so the tools check for it before their long runs and say what to install."""

from __future__ import annotations

from types import ModuleType

INSTALL_HINT = "pip install 'fusedmlp[study]' (or just: pip install matplotlib)"


def require_matplotlib(tool: str) -> None:
    """Exits with what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"{tool} draws its charts with matplotlib, which is not installed; "
                         f"install it with: {INSTALL_HINT}") from None


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
