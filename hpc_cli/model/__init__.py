"""Qwen3.5 runtime: dense and MoE hybrid models (Gated DeltaNet + gated full attention).

Execution API (what the engine calls; stable)::

    model = HybridModel.from_name_or_path(name_or_path, dtype=None, device="cpu", progress=True)
        # "builtin:tiny" (embedded default, trained, BPE tokenizer), "builtin:random[@N]" (seeded,
        # byte tokenizer), "builtin:qwen3.5-27b-shape[@N]",
        # "builtin:qwen3.5-35b-a3b-shape[@N]", or a HF checkpoint directory. dtype None: bf16 on
        # CUDA, fp32 on CPU.
    model.config        # ModelConfig
    model.shape()       # hpc_cli.shapes.HybridShape (sizes pages, slabs, state images)
    model.tokenizer     # ByteTokenizer | HFTokenizer: encode, decode, apply_chat_template, eos_token_ids
    model.mtp           # MTPModule | None (weights of the checkpoint's mtp.* head)
    model.new_kv_storage(profile, num_pages) -> PagedKVStorage   # pools shaped for this model
    model.new_state_slots(num_slots) -> StateSlots

    model.prefill(tokens: LongTensor[T], start: int, block_table: list[int], state_slot: int,
                  kv: PagedKVStorage, states: StateSlots, *,
                  layer_ready: Callable[[int], None] | None = None,
                  all_logits: bool = False) -> PrefillOut(logits, hidden_last)
    model.decode(tokens: LongTensor[B], positions: list[int], block_tables: list[list[int]],
                 state_slots: list[int], kv: PagedKVStorage, states: StateSlots) -> logits [B, vocab]

Contract:
- ``prefill`` runs positions ``[start, start+T)`` of one lane. ``block_table`` lists page ids
  covering ``[0, start+T)`` (position p lives in page ``block_table[p // 64]`` at offset
  ``p % 64``). Prior K/V are read from those pages, new K/V are written there in the KV
  profile's format (the attention reads back every K/V, old and new, dequantised). The lane's
  state is read from ``state_slot`` and written back there: per GDN layer the conv window
  (the last ``kernel-1`` pre-conv columns) and the fp32 recurrent state, plus the continuation
  hidden of the last column (after the final norm). A chunk may start anywhere and have any
  length; a split run equals an unsplit one within fp32 rounding. ``layer_ready(i)`` is called
  just before model layer ``i`` runs (the engine waits for a restore there, spec §6.5).
  Logits are ``[vocab]`` for the last position, ``[T, vocab]`` with ``all_logits``.
- ``decode`` runs one token per lane at ``positions[b]`` (the token's own position; pages must
  cover it) with the lane's state slot; lanes must use distinct state slots.
- Images (docs/vision.md): a multimodal checkpoint's ``model.vision`` (VisionTower, None for a
  text-only model) encodes images; ``prefill(..., media=PrefillMedia)`` takes a pass's mRoPE
  positions and the image embeddings of its placeholder rows, and ``decode(...,
  rope_offsets=[delta_b])`` turns each lane's rotary by its position plus its mRoPE delta.
- A state slot with all zeros is the empty state (a fresh sequence): ``StateSlots.reset(slot)``.
- Errors a user can cause (bad checkpoint, unknown model_type, missing/mis-shaped tensor) raise
  :class:`hpc_cli.errors.ModelError` naming the thing.
- CUDA: fla's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` when ``fla`` is
  importable, else the torch path; attention is SDPA over dequantised pages.
"""

from typing import TYPE_CHECKING

__all__ = ["HybridModel", "ModelConfig", "PrefillOut"]

if TYPE_CHECKING:
    from hpc_cli.model.config import ModelConfig
    from hpc_cli.model.model import HybridModel, PrefillOut


def __getattr__(name: str):
    # Lazily, so that tools reading only files (profiles, traces) never import torch.
    if name == "ModelConfig":
        from hpc_cli.model.config import ModelConfig

        return ModelConfig
    if name in ("HybridModel", "PrefillOut"):
        from hpc_cli.model import model

        return getattr(model, name)
    raise AttributeError(f"module 'hpc_cli.model' has no attribute {name!r}")
