"""The engine's k where the settings name none: the checkpoint's recommendation
(``generation_config.json``'s ``num_assistant_tokens``, read by :mod:`hpc_cli.model.config`), else
3; ``speculative.num_draft_tokens`` wins over both."""

from __future__ import annotations

import json
import shutil

import pytest

from hpc_cli.engine.config import DEFAULT_DRAFT_TOKENS, draft_tokens
from hpc_cli.errors import ModelError
from hpc_cli.model.builtin import TINY_DIR, builtin_config
from hpc_cli.model.config import ModelConfig, recommended_draft_tokens


def _checkpoint(tmp_path, generation: object | None):
    """A copy of the embedded model's config.json, with ``generation`` as its generation_config.json
    (a dict as JSON, a str as the file's text, None for no file)."""
    shutil.copy(TINY_DIR / "config.json", tmp_path / "config.json")
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def test_the_embedded_model_recommends_one_draft():
    assert json.loads((TINY_DIR / "generation_config.json").read_text())["num_assistant_tokens"] == 1
    assert builtin_config("builtin:tiny").num_assistant_tokens == 1
    assert builtin_config("builtin:random").num_assistant_tokens is None


@pytest.mark.parametrize("generation,want", [
    (None, None), ({"eos_token_id": 2}, None), ({"num_assistant_tokens": 2}, 2), ({"num_assistant_tokens": 16}, 16),
    # HF's default (20, the start of its adaptive schedule for an assistant model) and nonsense: no recommendation
    ({"num_assistant_tokens": 20}, None), ({"num_assistant_tokens": 0}, None),
    ({"num_assistant_tokens": "2"}, None), ({"num_assistant_tokens": True}, None),
])
def test_a_checkpoint_recommends_k_in_its_generation_config(tmp_path, generation, want):
    path = _checkpoint(tmp_path, generation)
    assert recommended_draft_tokens(path) == want
    assert ModelConfig.from_dir(path).num_assistant_tokens == want


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_damaged_generation_config_is_an_error_with_a_hint(tmp_path, text):
    with pytest.raises(ModelError) as e:
        ModelConfig.from_dir(_checkpoint(tmp_path, text))
    assert "generation_config.json" in str(e.value) and e.value.hint


def test_the_settings_win_then_the_checkpoint_then_three():
    tiny, random = builtin_config("builtin:tiny"), builtin_config("builtin:random")
    assert draft_tokens(None, tiny) == 1
    assert draft_tokens(None, random) == DEFAULT_DRAFT_TOKENS == 3
    assert draft_tokens(4, tiny) == 4 and draft_tokens(2, random) == 2


def test_a_served_profile_without_k_takes_the_checkpoints(tmp_path):
    """Through the settings as `hpc-cli serve --profile int8-mtp.toml` resolves them: the shipped
    profile names no k, so builtin:tiny's engine drafts one token a round, and a flag still wins."""
    from hpc_cli.engine.engine import Engine
    from hpc_cli.settings import load_settings

    base = {"engine.kv_capacity": 32, "engine.max_concurrency": 1, "model.name": "builtin:tiny",
            "cache.host_cache_mib": 0}
    profile = TINY_DIR.parents[2] / "profiles" / "int8-mtp.toml"
    for extra, want in [({}, 1), ({"speculative.num_draft_tokens": 3}, 3)]:
        r = load_settings(str(profile), {**base, **extra}, environ={})
        assert r.settings.speculative.backend == "mtp"
        e = Engine.from_settings(r)
        try:
            assert e.spec is not None and e.spec.k == want
        finally:
            e.stop()


@pytest.mark.parametrize("model,backend,want", [
    ("builtin:tiny", "mtp", (1, "derived")), ("builtin:random", "dflash2", (3, "derived")),
    ("builtin:tiny", "none", (None, "default")),  # no backend, no k
    ("/no/such/checkpoint", "mtp", (None, "default")),  # the model's load reports it
])
def test_settings_show_the_k_they_derive(model, backend, want):
    """`hpc-cli config show` lists the k an engine would draft, as a derived value."""
    from hpc_cli.settings import load_settings

    r = load_settings(None, {"model.name": model, "speculative.backend": backend}, environ={})
    key = "speculative.num_draft_tokens"
    assert (r.effective[key], r.sources[key]) == want
    assert r.settings.speculative.num_draft_tokens is None


def test_a_checkpoint_directorys_k_is_derived_from_its_files(tmp_path):
    """config_for reads a directory's configuration without its weights, as the settings do."""
    from hpc_cli.model.builtin import config_for
    from hpc_cli.settings import load_settings

    path = _checkpoint(tmp_path, {"num_assistant_tokens": 5})
    assert config_for(str(path)).num_assistant_tokens == 5
    assert config_for("builtin:tiny").num_assistant_tokens == 1
    r = load_settings(None, {"model.name": str(path), "speculative.backend": "mtp"}, environ={})
    assert (r.effective["speculative.num_draft_tokens"], r.sources["speculative.num_draft_tokens"]) == (5, "derived")
