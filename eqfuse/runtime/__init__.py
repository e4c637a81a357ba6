"""Loading, caching, autotuning and running compiled graphs; ``load_exported`` runs an
exported one (``eqfuse export``) without Triton."""

from .exported import load_exported

__all__ = ["load_exported"]
