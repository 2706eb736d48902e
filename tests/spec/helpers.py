from __future__ import annotations

import random

from hpc_cli.engine.api import GenerationRequest, SamplingParams, to_json
from hpc_cli.engine.engine import Engine

BACKENDS = ["mtp", "dflash", "dflash2", "oracle"]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(engine: Engine, prompt, max_tokens: int = 8, *, sampling=None, **kw):
    toks, fin = engine.generate(GenerationRequest(list(prompt), sampling or greedy(max_tokens), **kw), timeout=300)
    assert fin.reason in ("length", "stop"), (fin.reason, fin.error)
    return toks, fin


class References(dict):
    """prompt tuple -> greedy output, filled from runs without speculation (the oracle's source)."""


def backend(name: str, refs: dict | None = None):
    if name == "oracle":
        from hpc_cli.speculative.oracle import OracleBackend

        return OracleBackend(refs or {})
    return name


def anchor_drafter(model, kind: str, directory, seed: int = 4) -> str:
    """A seeded one-layer anchor-drafting DFlash or DFlash2 drafter for ``model``, saved as a
    checkpoint directory under ``directory``; returns its path (``make(..., drafter=path)``)."""
    import torch

    from hpc_cli.speculative.dflash import DFlashNet, default_config, save_drafter, seed_weights

    cfg = default_config(kind, model, 1)
    cfg.anchor_drafts = True
    net = DFlashNet(cfg, dtype=torch.float32)
    seed_weights(net, seed)
    path = str(directory / f"{kind}-anchor")
    save_drafter(net, path)
    return path


def make(model, spec=None, **kw) -> Engine:
    kw.setdefault("kv_pages", 64)
    kw.setdefault("prefill_chunk", 128)
    kw.setdefault("max_concurrency", 2)
    return Engine(model, speculative=spec, **kw).start()


def tap_engine(model, spec, *, split: bool) -> Engine:
    """A started engine of one lane, passes of 256 tokens and a 16 MiB host tier; ``split``: no
    tap slot, so a pass splits at each tap (else the pass takes its taps itself)."""
    e = Engine(model, speculative=spec, kv_pages=64, prefill_chunk=256, max_concurrency=1, host_cache_mib=16)
    if split:
        e.cache.tap_scratch = []
    return e.start()


def settle(engine: Engine) -> dict:
    engine.stop()
    engine.check_invariants()
    assert engine.fatal is None, engine.fatal
    cache = engine.cache
    held = {k: v for k, v in cache.leftovers().items() if v}  # pins, sequences, pages, lanes, transfers
    assert not held, held
    return to_json(cache.index.stats() if cache.mode == "hybrid" else cache.stats())


def record_proposals(drafter) -> list[tuple[int, list[list[int]]]]:
    """Wrap the drafter's proposal (``propose_device`` where it has one, which the runtime calls
    then, else ``propose``) so that each round's ``(k, drafts)`` is appended to the list returned;
    a proposal made ahead (``propose_ahead``) is appended when a round takes it (``took_ahead``)."""
    seen: list[tuple[int, list[list[int]]]] = []
    name = "propose_device" if hasattr(drafter, "propose_device") else "propose"
    inner = getattr(drafter, name)

    def propose(lanes, k, states):
        out = inner(lanes, k, states)
        seen.append((k, out.tolist() if name == "propose_device" else out))
        return out

    setattr(drafter, name, propose)
    if hasattr(drafter, "propose_ahead"):
        made: list = []
        ahead, took = drafter.propose_ahead, drafter.took_ahead

        def propose_ahead(lanes, k, verdict, states=None):
            out = ahead(lanes, k, verdict, states)
            made[:] = [] if out is None else [(k, out.clone())]
            return out

        def took_ahead(lanes):
            k, out = made.pop()
            seen.append((k, out.tolist()))
            took(lanes)

        drafter.propose_ahead, drafter.took_ahead = propose_ahead, took_ahead
    return seen


def record_end_images(engine, key=lambda lane: tuple(lane.request.prompt_tokens)) -> dict:
    """Wrap the engine's cache finish so that each lane's state image at its end (conv, recurrent,
    hidden and the backend's extra parts, cloned) is recorded under ``key(lane)``; returns the
    dict they go into."""
    images: dict = {}
    inner, st = engine.cache.finish, engine.states

    def finish(lane, *, publish=True):
        s = lane.state_slot
        images[key(lane)] = [st.conv_all[:, s].clone(), st.recurrent_all[:, s].clone(), st.hidden[s].clone(),
                             *(x[s].clone() for x in st.extra.values())]
        inner(lane, publish=publish)

    engine.cache.finish = finish
    return images


#: chat questions builtin:tiny answers (its drafters accept drafts on them)
CHAT_QUESTIONS = ("What does json.dumps do?", "What is functools.partial?", "Explain datetime.timedelta.",
                  "How do I read a file line by line?")


def chat_prompts(model, questions=CHAT_QUESTIONS) -> list[list[int]]:
    """``questions`` rendered with the model's chat template (thinking off), tokenized."""
    tok = model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               enable_thinking=False)) for q in questions]


def stopping_cases(prompts, answers) -> tuple[list, list, list]:
    """Requests that stop on their greedy answer's 3rd, 5th, ... 11th token (some of them inside
    accepted drafts): the prompts, the answers and the stop tokens, one entry a case."""
    cases = [(p, a, a[j]) for p, a in zip(prompts, answers) for j in (2, 4, 6, 8, 10) if j < len(a)]
    return tuple(list(x) for x in zip(*cases))
