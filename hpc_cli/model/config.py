"""The text-stack configuration of a Qwen3.5 model (dense ``qwen3_5`` or MoE ``qwen3_5_moe``).

Read from a HF checkpoint's ``config.json`` (``text_config`` nested as in the released
multimodal checkpoints, or flat as ``Qwen3_5ForCausalLM.save_pretrained`` writes it with
``model_type`` ``qwen3_5_text``) or built in code for the ``builtin:*`` models.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_cli.errors import ModelError
from hpc_cli.shapes import HybridShape

DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
KNOWN_TYPES = DENSE_TYPES + MOE_TYPES


@dataclass(slots=True)
class ModelConfig:
    name: str
    model_type: str  # "qwen3_5" or "qwen3_5_moe" (the *_text variants are normalised)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    layer_types: list[str] = field(default_factory=list)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE (qwen3_5_moe only)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # MTP module (the speculative backends read it)
    mtp_num_hidden_layers: int = 1
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    #: the drafts a round the checkpoint recommends (``generation_config.json``'s
    #: ``num_assistant_tokens``, HF's speculative k), None where it names none in 1..16; the
    #: engine's k when ``speculative.num_draft_tokens`` is not set
    num_assistant_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        self.validate()

    # -- derived -----------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def full_attention_interval(self) -> int:
        att = self.attention_layers
        return att[0] + 1 if att else self.num_hidden_layers + 1

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def shape(self, state_dtype_bytes: int = 2) -> HybridShape:
        """The cache-relevant shape (spec §3): what sizes pages, slabs and state images."""
        return HybridShape(
            name=self.name, num_layers=self.num_hidden_layers,
            full_attention_interval=self.full_attention_interval,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim, hidden_size=self.hidden_size,
            state_dtype_bytes=state_dtype_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        where = f"model {self.name!r}"
        if self.model_type not in KNOWN_TYPES:
            raise ModelError(f"{where}: unknown model_type {self.model_type!r}",
                             hint=f"hpc-cli runs Qwen3.5 checkpoints: model_type one of {', '.join(KNOWN_TYPES)}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ModelError(f"{where}: layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers", hint="fix config.json")
        bad = sorted(set(self.layer_types) - {"full_attention", "linear_attention"})
        if bad:
            raise ModelError(f"{where}: unsupported layer types {bad}",
                             hint="layer_types may hold only 'full_attention' and 'linear_attention'")
        interval = self.full_attention_interval
        expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                    for i in range(self.num_hidden_layers)]
        if self.layer_types != expected:
            raise ModelError(f"{where}: layer_types is not a regular pattern (full attention every "
                             f"{interval}th layer)", hint="the hybrid prefix cache needs a periodic layer pattern")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"{where}: {self.num_attention_heads} attention heads are not a multiple of "
                             f"{self.num_key_value_heads} KV heads", hint="fix config.json")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelError(f"{where}: linear_num_value_heads {self.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads {self.linear_num_key_heads}", hint="fix config.json")
        if self.hidden_act != "silu":
            raise ModelError(f"{where}: hidden_act {self.hidden_act!r} is not supported",
                             hint="Qwen3.5 uses silu")
        if self.is_moe and not (self.num_experts and self.num_experts_per_tok and self.moe_intermediate_size):
            raise ModelError(f"{where}: a qwen3_5_moe config needs num_experts, num_experts_per_tok and "
                             "moe_intermediate_size", hint="fix config.json")
        if not self.is_moe and not self.intermediate_size:
            raise ModelError(f"{where}: a dense config needs intermediate_size", hint="fix config.json")

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "checkpoint") -> "ModelConfig":
        """Build from a HF ``config.json`` dict (text_config nested or flat)."""
        model_type = raw.get("model_type")
        if model_type not in KNOWN_TYPES:
            raise ModelError(f"{name}: unknown model_type {model_type!r} in config.json",
                             hint=f"hpc-cli runs Qwen3.5 checkpoints: model_type one of {', '.join(KNOWN_TYPES)}")
        text = raw.get("text_config")
        if isinstance(text, dict):
            merged = dict(text)
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key not in merged and key in raw:
                    merged[key] = raw[key]
        else:
            merged = dict(raw)
        moe = model_type in MOE_TYPES or merged.get("model_type") in MOE_TYPES
        norm_type = "qwen3_5_moe" if moe else "qwen3_5"

        def need(key: str) -> Any:
            if key not in merged:
                raise ModelError(f"{name}: config.json lacks {key!r}",
                                 hint="is this a complete Qwen3.5 config.json?")
            return merged[key]

        rope = merged.get("rope_parameters") or merged.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ModelError(f"{name}: rope type {rope_type!r} is not supported",
                             hint="hpc-cli implements the default (text-only mRoPE = 1-D) rotary embedding")
        rope_theta = rope.get("rope_theta", merged.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", merged.get("partial_rotary_factor", 0.25))
        eos = merged.get("eos_token_id")
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        n_layers = int(need("num_hidden_layers"))
        layer_types = merged.get("layer_types")
        if not layer_types:
            interval = int(merged.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        return cls(
            name=name, model_type=norm_type, vocab_size=int(need("vocab_size")), hidden_size=hidden,
            num_hidden_layers=n_layers, num_attention_heads=heads,
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(merged.get("head_dim") or hidden // heads),
            intermediate_size=int(merged.get("intermediate_size") or 0),
            rms_norm_eps=float(merged.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial), attention_bias=bool(merged.get("attention_bias", False)),
            hidden_act=str(merged.get("hidden_act", "silu")),
            tie_word_embeddings=bool(merged.get("tie_word_embeddings", False)),
            max_position_embeddings=int(merged.get("max_position_embeddings", 262_144)),
            layer_types=list(layer_types),
            linear_conv_kernel_dim=int(merged.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(merged.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(merged.get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(merged.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(merged.get("linear_num_value_heads", 32)),
            num_experts=int(merged.get("num_experts", 0) or 0) if moe else 0,
            num_experts_per_tok=int(merged.get("num_experts_per_tok", 0) or 0) if moe else 0,
            moe_intermediate_size=int(merged.get("moe_intermediate_size", 0) or 0) if moe else 0,
            shared_expert_intermediate_size=int(merged.get("shared_expert_intermediate_size", 0) or 0) if moe else 0,
            mtp_num_hidden_layers=int(merged.get("mtp_num_hidden_layers", 1) or 0),
            eos_token_id=eos_list, bos_token_id=merged.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise ModelError(f"model path {str(path)!r} is not a directory",
                             hint="pass a checkpoint directory with config.json and *.safetensors, or builtin:tiny")
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelError(f"{path}: no config.json", hint="a checkpoint directory needs config.json")
        raw = _json_object(cfg_file, "fix or replace config.json")
        cfg = cls.from_hf_dict(raw, name=path.name or str(path))
        cfg.num_assistant_tokens = recommended_draft_tokens(path)
        return cfg


#: the largest k: ``speculative.num_draft_tokens``' bound, and a checkpoint's recommendation's
MAX_DRAFT_TOKENS = 16


def recommended_draft_tokens(path: Path) -> int | None:
    """``num_assistant_tokens`` of the checkpoint's ``generation_config.json`` (HF's k for
    speculative decoding), where the file names one in 1..:data:`MAX_DRAFT_TOKENS`; None where
    there is no such file or value (HF's own default, 20, is the starting k of its adaptive
    schedule for a separate assistant model, not a per-round k). A file that is not a JSON object
    is an error."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return None
    k = _json_object(f, "fix or remove generation_config.json").get("num_assistant_tokens")
    return k if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_DRAFT_TOKENS else None


def _json_object(f: Path, hint: str) -> dict[str, Any]:
    """The JSON object in ``f``; a file that cannot be read, or holds no object, is a
    :class:`ModelError` naming it, with ``hint``."""
    try:
        raw = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{f}: cannot read JSON: {exc}", hint=hint) from exc
    if not isinstance(raw, dict):
        raise ModelError(f"{f}: not a JSON object", hint=hint)
    return raw
