"""Speculative decoding: drafters (MTP, DFlash, DFlash2, oracle), the verify pass, acceptance and
the rollback of the GDN state (docs/speculative.md). The backends' cache metadata and the
behaviour contract live in :mod:`hpc_cli.spec_backend`; the engine drives :class:`SpecRuntime`."""

from hpc_cli.speculative.runtime import SpecRuntime

__all__ = ["SpecRuntime"]
