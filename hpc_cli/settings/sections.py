"""The settings' sections (one pydantic model per profile table, spec §14.1), the whole
:class:`HpcSettings`, the environment variable of a key and :class:`ResolvedSettings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hpc_cli.model.config import MAX_DRAFT_TOKENS


ENV_PREFIX = "HPC_"
LAYERS = ("default", "profile", "env", "cli", "derived")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(_Section):
    name: str = Field("builtin:tiny", description="a checkpoint directory or builtin:NAME")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations; auto = bfloat16 on CUDA, float32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    max_model_len: int | None = Field(None, ge=64, description="context limit; default the model's")
    quantized_weights: Literal["auto", "held", "dequantized"] = Field(
        "auto", description="a FP8/NVFP4 checkpoint's Linear weights on CUDA: held as stored (less memory), "
                            "dequantized on load, or auto = FP8 held, NVFP4 held only when the dequantized "
                            "weights do not fit (its held kernels are slower)")
    merged_projections: bool = Field(True, description="multiply the projections that read one input (attention "
                                                       "q/k/v, the GDN input projections, an MLP's gate/up) as one "
                                                       "weight each (false: apart, for A/B runs)")


class EngineSettings(_Section):
    max_concurrency: int = Field(4, ge=1, le=8, description="lanes C (sequences decoding at once)")
    prefill_chunk: int = Field(512, ge=16, le=65536, description="tokens per prefill pass")
    kv_capacity: Literal["auto"] | int = Field(
        "auto", description="device KV pages of the main pool; auto = what the memory allows")
    device_memory_fraction: float = Field(0.85, gt=0, le=1,
                                          description="share of free device memory auto sizing may use")
    concurrent_prefill: bool = Field(False, description="admit while another lane prefills (needed by coalescing)")
    pending_timeout_ms: int = Field(600_000, ge=1, description="queue timeout of a waiting request")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request names none")
    cuda_graphs: bool = Field(True, description="replay decode and verify passes as CUDA graphs (dense models)")
    fused_kernels: bool = Field(True, description="run the norms, the MLP gate, the GDN conv and the GDN decode step "
                                                  "as fused Triton kernels on CUDA (false: torch's ops)")
    cpu_keep_memory: bool = Field(True, description="on the CPU, keep freed memory in the process (glibc: no trimming, "
                                                     "no mmap for blocks under 1 GiB), so passes do not fault their "
                                                     "buffers in again")
    decode_ahead: bool = Field(True, description="build each decode step's index while the device runs the step "
                                                 "before (CUDA graphs; false: each step builds its own)")
    send_after_launch: bool = Field(True, description="on CUDA, hand a decode step's tokens to the server once the "
                                                      "next step is launched, so that sending them overlaps the "
                                                      "device's work (false: as soon as they are chosen)")
    seed: int = Field(0, ge=-(1 << 63), lt=1 << 64,
                      description="base seed of sampling for requests that name no seed: the k-th request of a "
                                  "run draws from (seed, k); a request's own seed wins")


class KVSettings(_Section):
    profile: str = Field("bf16", description="KV storage profile (hpc-cli kv profiles)")


class SpeculativeSettings(_Section):
    backend: str = Field("none", description="speculative backend: none, mtp, dflash, dflash2")
    num_draft_tokens: int | None = Field(None, ge=1, le=MAX_DRAFT_TOKENS,
                                         description="k, drafts proposed per round; unset: the checkpoint's "
                                                     "generation_config.json num_assistant_tokens, else 3")
    drafter: str | None = Field(None, description="drafter checkpoint directory (dflash, dflash2)")


class CacheSettings(_Section):
    # extra keys are the option tables of cache modes ([cache.hybrid]); checked in _validate
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    mode: str = Field("hybrid", description="cache mode: hybrid, legacy, off or a plugin's (hpc-cli plugins)")
    host_cache_mib: int = Field(8192, ge=0, description="host slab pool size; 0 = device only")
    prefix_cache_file: Path | None = Field(None, description="keep the host tier across restarts (spec §5.5)")
    no_prefix_reuse: bool = Field(False, description="disable the cache entirely")
    transfer_copy: Literal["auto", "dma", "kernel"] = Field(
        "auto", description="how restores, write-through and taps move bytes on CUDA: the copy engines "
                            "(dma), the segment copy kernel, or auto (the kernel for jobs of small copies)")
    shared_cache: str | None = Field(None, description="URL of a shared cache tier below the host tier "
                                                       "(redis://HOST:PORT/DB), shared by replicas of one model "
                                                       "and profile (docs/shared-cache.md)")
    shared_cache_timeout_ms: int = Field(2000, ge=1, le=600_000,
                                         description="longest wait for one shared-tier call, and for a "
                                                     "request's lookup before it prefills without it")
    shared_cache_queue_mib: int = Field(256, ge=1, description="entries copied out for the shared tier and not "
                                                               "yet stored; past it new ones are not sent")


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                                                        "on every /v1 route; must not be empty")
    served_model_name: str | None = Field(None, description="the model id clients send; default the model name")
    tui: bool = Field(False, description="show the live cache view in the terminal")
    debug_timing: bool = Field(False, description="add usage.hpc_timing (seconds per request phase) to every "
                                                  "response; a request asks with \"hpc\": {\"timing\": true}")
    protect_metrics: bool | None = Field(None, description="require the API key on /metrics too; default on when "
                                                           "api_key is set")
    max_request_bytes: int = Field(16 << 20, ge=1024, description="largest request body; a larger one gets 413")
    max_fanout: int = Field(64, ge=1, description="most engine requests one HTTP request may make (n x prompts)")
    max_queued_requests: int = Field(256, ge=0, description="requests that may wait beyond the engine's lanes; "
                                                            "past it 429 with Retry-After")
    header_timeout_s: float = Field(10.0, gt=0, description="seconds a connection may take to send a request's "
                                                            "headers")
    body_timeout_s: float = Field(30.0, gt=0, description="seconds a request may take to send its body; "
                                                          "past it 408")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="the server's event loop: uvloop where it is installed (auto; a dependency on Linux "
                            "and macOS), or asyncio's own")
    exit_on_fatal: bool = Field(True, description="exit with status 3 once the engine stopped after an error, "
                                                  "so that a supervisor restarts the server")
    allow_remote_media: bool = Field(False, description="fetch http(s) image URLs in requests (off: images come "
                                                        "inline as base64 / data: URLs only)")
    max_image_bytes: int = Field(20 << 20, ge=1024, description="largest image a request may send or the server "
                                                                "may fetch, in bytes")
    max_image_pixels: int = Field(40_000_000, ge=1, description="most pixels (width x height) of an image before "
                                                                "it is resized")
    max_images_per_request: int = Field(16, ge=0, description="most images one request may hold")
    media_fetch_timeout_s: float = Field(10.0, gt=0, description="seconds a remote image may take to download")

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("an empty API key would turn authentication off; leave api_key unset instead")
        return value


class TuiSettings(_Section):
    refresh_hz: float = Field(4.0, gt=0, le=30, description="frames per second of the terminal view")


class ExpertsSettings(_Section):
    offload: bool = Field(False, description="keep MoE experts in host memory, the most-routed in device slots")
    budget_slots: int | None = Field(None, ge=0, description="device slots, one expert each (or budget_mib)")
    budget_mib: int | None = Field(None, ge=0, description="device MiB for slots, checked against free memory "
                                                            "after the KV pools are sized (or budget_slots)")
    profile_file: Path | None = Field(None, description="STRP residency profile (hpc-cli expert profile)")
    admission: Literal["profile", "first-routed", "per-layer-first-routed"] = Field(
        "profile", description="which experts get slots; none is ever evicted")
    verify: bool = Field(False, description="read every slot back at startup; a mismatch refuses to start")
    trace_file: Path | None = Field(None, description="write routing traces while serving (hpc-cli expert profile)")


class HpcSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", validate_assignment=True)

    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    kv: KVSettings = KVSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    cache: CacheSettings = CacheSettings()
    server: ServerSettings = ServerSettings()
    tui: TuiSettings = TuiSettings()
    experts: ExpertsSettings = ExpertsSettings()

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        # load_settings merges the layers itself (to know where each value came from).
        return (init_settings,)


SECTIONS = tuple(HpcSettings.model_fields)


#: environment variables that are not settings keys: switches read by a part of the process (a
#: bare model or transfer engine, a kernel, another command), each with what it does. The
#: settings' environment layer passes them by; any other ``HPC_*`` name must name a key.
PROCESS_ENV = {
    "HPC_LOAD_PLUGINS": "comma list of the third-party plugins to load (unset: all installed; empty: none; "
                        "built-ins always load); `hpc-cli plugins` lists them",
    "HPC_FUSED_KERNELS": "0 keeps torch's ops instead of the fused Triton kernels for a model used without an "
                         "engine (an engine follows `engine.fused_kernels`)",
    "HPC_CUDA_GRAPHS": "0 runs decode and verify passes eagerly for a model used without an engine (an engine "
                       "follows `engine.cuda_graphs`)",
    "HPC_TRANSFER_COPY": "auto / dma / kernel: the transfer engine's copy method where `cache.transfer_copy` is "
                         "unset; dma also makes a state tap a torch copy instead of the segment-copy kernel on CUDA",
    "HPC_SEG_TABLE_HOST": "0 uploads a transfer job's segment table to the device instead of reading it from "
                          "mapped host memory",
    "HPC_SEG_WRITE_PROGRAMS": "N runs a write-through's segment-copy launches on at most N programs, each "
                              "copying every N-th row (unset: a program a row)",
    "HPC_KV_KERNELS": "torch runs the KV formats' torch reference instead of their Triton kernels (debugging)",
    "HPC_BENCH_API_KEY": "`hpc-cli bench --base`: the server's API key",
}


def env_var(key: str) -> str:
    """The environment variable that sets a dotted key: cache.host_cache_mib -> HPC_CACHE__HOST_CACHE_MIB."""
    return ENV_PREFIX + key.replace(".", "__").upper()


@dataclass
class ResolvedSettings:
    settings: HpcSettings
    sources: dict[str, str]  # dotted key -> layer
    effective: dict[str, Any]  # dotted key -> value, derived values included
    profile_path: Path | None = None
    mode_options: Any = None  # the cache mode's validated options model
    raw_layers: dict[str, dict] = field(default_factory=dict)

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")

