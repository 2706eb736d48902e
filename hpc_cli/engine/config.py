"""The engine's construction parameters as one record: :class:`EngineConfig`, built by hand (its
defaults are a small CPU engine's) or from a resolved profile (:meth:`EngineConfig.from_settings`).
:class:`~hpc_cli.engine.engine.Engine` takes one, or builds one from its keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from hpc_cli.model.config import ModelConfig

#: k where neither the settings nor the checkpoint's ``generation_config.json`` name one
DEFAULT_DRAFT_TOKENS = 3


@dataclass(frozen=True)
class EngineConfig:
    """What an :class:`~hpc_cli.engine.engine.Engine` is built with (besides its model).

    The profile keys each field comes from are named in :meth:`from_settings`; ``None`` means
    "derive it": ``kv_pages`` from free device memory (``device_memory_fraction``) or the context,
    ``max_model_len`` from the model (at most 32768), ``model_name`` from the model's name, the
    hybrid mode's options (``snapshot_slots`` ... ``coalesce``) from the mode's defaults.
    """

    kv_profile: str = "bf16"
    max_concurrency: int = 4
    prefill_chunk: int = 512
    kv_pages: int | None = None
    host_cache_mib: int = 0
    #: False: cache mode off whatever ``cache_mode`` says
    reuse: bool = True
    # the hybrid cache mode's options (another mode refuses them)
    snapshot_slots: int | None = None
    max_new_taps: int | None = None
    tap_ladder_tokens: int | None = None
    tap_min_gap_tokens: int | None = None
    coalesce: bool | None = None
    max_model_len: int | None = None
    concurrent_prefill: bool = False
    default_max_tokens: int = 256
    device_memory_fraction: float = 0.85
    #: builds the transfer engine (default :class:`~hpc_cli.memory.transfer.engine.TransferEngine`)
    transfer_factory: Callable | None = None
    model_name: str | None = None
    pending_timeout_ms: int = 600_000
    #: the resolved profile the engine was built from (``/v1/cache/stats``, the cache file's path)
    settings: Any = None
    #: a speculative backend's name or instance (docs/speculative.md)
    speculative: Any = None
    #: k; None: the model's recommendation (:attr:`ModelConfig.num_assistant_tokens`), else
    #: :data:`DEFAULT_DRAFT_TOKENS`
    num_draft_tokens: int | None = None
    drafter: str | None = None
    spec_rollback: str = "per_token"
    cuda_graphs: bool = True
    fused_kernels: bool = True
    #: on the CPU, keep freed memory in the process (``[engine] cpu_keep_memory``, hpc_cli.engine.cpu_memory)
    cpu_keep_memory: bool = True
    #: build each decode step's index while the device runs the step before (``[engine] decode_ahead``)
    decode_ahead: bool = True
    #: hand a decode step's tokens to the server once the next step is launched (``[engine]
    #: send_after_launch``); None: where launches are asynchronous (CUDA), True/False: always/never
    send_after_launch: bool | None = None
    #: ``[cache] transfer_copy``: the transfer engine's and the taps' copy method
    transfer_copy: str | None = None
    seed: int = 0
    #: a cache mode's name or instance (docs/cache-modes.md); None: ``hybrid``
    cache_mode: Any = None
    #: the mode's options as a profile resolves them (:func:`~hpc_cli.engine.binding.effective_options`)
    cache_options: Any = None

    @classmethod
    def from_settings(cls, resolved: Any) -> "EngineConfig":
        """The configuration a resolved profile (``hpc_cli.profiles``' resolved settings) asks for."""
        from hpc_cli import plugins
        from hpc_cli.engine.binding import effective_options

        s = resolved.settings
        mode = plugins.cache_mode(s.cache.mode)
        reuse = mode.reuses and not s.cache.no_prefix_reuse
        kv_pages = None if s.engine.kv_capacity == "auto" else int(s.engine.kv_capacity)
        return cls(kv_profile=s.kv.profile, max_concurrency=s.engine.max_concurrency,
                   prefill_chunk=s.engine.prefill_chunk, kv_pages=kv_pages,
                   host_cache_mib=s.cache.host_cache_mib if reuse else 0, reuse=reuse,
                   cache_mode=mode, cache_options=effective_options(mode, resolved.effective) if reuse else None,
                   max_model_len=s.model.max_model_len, concurrent_prefill=s.engine.concurrent_prefill,
                   default_max_tokens=s.engine.default_max_tokens,
                   device_memory_fraction=s.engine.device_memory_fraction,
                   pending_timeout_ms=s.engine.pending_timeout_ms,
                   model_name=s.server.served_model_name or s.model.name, settings=resolved,
                   speculative=s.speculative.backend, num_draft_tokens=s.speculative.num_draft_tokens,
                   drafter=s.speculative.drafter, cuda_graphs=s.engine.cuda_graphs,
                   fused_kernels=s.engine.fused_kernels, decode_ahead=s.engine.decode_ahead,
                   cpu_keep_memory=s.engine.cpu_keep_memory,
                   send_after_launch=None if s.engine.send_after_launch else False,
                   transfer_copy=s.cache.transfer_copy, seed=s.engine.seed)


def draft_tokens(asked: int | None, model_config: "ModelConfig") -> int:
    """The engine's k: ``speculative.num_draft_tokens`` where set, else the checkpoint's
    recommendation (``num_assistant_tokens`` of its ``generation_config.json``), else
    :data:`DEFAULT_DRAFT_TOKENS`."""
    if asked is not None:
        return asked
    return model_config.num_assistant_tokens or DEFAULT_DRAFT_TOKENS
