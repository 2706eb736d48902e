"""The README's multi-turn chat through the openai client: cached_tokens grows every turn, up to
the previous turn's opener (the spec's 64-token tap rules used to leave it stuck every other turn
when the new messages were short), and a repeated completions prompt reuses all but its last block."""

from __future__ import annotations

import openai

from .hostile import MODEL, NO_THINK, served, start_engine


def _opener_tokens(engine) -> int:
    """Tokens of the generation opener the template appends (``<|im_start|>assistant`` ...)."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "x"}]
    with_opener = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    without = tok.apply_chat_template(msgs, add_generation_prompt=False, enable_thinking=False)
    return len(tok.encode(with_opener)) - len(tok.encode(without))


def test_cached_tokens_grow_every_turn_of_a_short_chat():
    engine, resolved = start_engine(**{"model.max_model_len": 4096, "engine.prefill_chunk": 512})
    try:
        with served(engine, resolved) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            messages = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Hi!"}]
            opener = _opener_tokens(engine)
            rows = []
            for _ in range(6):
                r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                   extra_body={"chat_template_kwargs": NO_THINK})
                rows.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "More."}]
    finally:
        engine.stop()
    for (prev_prompt, prev_cached), (prompt, cached) in zip(rows, rows[1:]):
        assert cached >= prev_prompt - opener, f"turns (prompt, cached): {rows}"
        assert cached > prev_cached, f"reuse did not grow: {rows}"


def test_a_repeated_short_completions_prompt_is_reused():
    """A prompt shorter than one prefill chunk (its flexible tail tap used to fall at the chunk's
    start, the base, and reuse stayed 0)."""
    engine, resolved = start_engine(**{"engine.prefill_chunk": 512})
    try:
        with served(engine, resolved) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            prompt = "The same prompt, sent again and again. " * 8
            cached = []
            for _ in range(3):
                r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
                cached.append(r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0)
                n = r.usage.prompt_tokens
    finally:
        engine.stop()
    assert cached[0] == 0 and cached[1] == cached[2] == (n - 1) // 64 * 64 > 0, (n, cached)
