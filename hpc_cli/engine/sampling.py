"""Token sampling: greedy, temperature, top-k, top-p, seeded; logprobs of the chosen token."""

from __future__ import annotations

import torch

from hpc_cli.engine.api import SamplingParams, TokenEvent


_MASK64 = (1 << 64) - 1


def make_generator(params: SamplingParams, request_index: int, base_seed: int = 0) -> torch.Generator | None:
    """A CPU generator for a sampled request, else None (greedy). A seeded request draws from its
    seed (the same seed gives the same tokens); the others from ``(base_seed, request_index)``
    (``[engine] seed``: a run's k-th request draws the same tokens for the same base seed)."""
    if params.temperature == 0.0:
        return None
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        seed = params.seed & _MASK64  # torch's own reading of a negative seed, total over any int
    else:
        seed = ((0x9E3779B97F4A7C15 * request_index) + 0xBF58476D1CE4E5B9 * base_seed) % (2**63)
    g.manual_seed(seed)
    return g


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from at ``temperature > 0`` (temperature, top-k, top-p),
    on the CPU: what speculative rejection sampling accepts drafts against."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > params.top_p  # keep the smallest set whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    return torch.softmax(x, dim=-1).cpu()


def event_for(logits: torch.Tensor, token: int, params: SamplingParams) -> TokenEvent:
    """The event of a chosen ``token`` with its logprobs from the unmodified ``logits``."""
    event = TokenEvent(token)
    if params.logprobs is not None:
        lp = torch.log_softmax(logits.float(), dim=-1)
        event.logprob = float(lp[token])
        if params.logprobs > 0:
            vals, ids = torch.topk(lp, params.logprobs)
            event.top_logprobs = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return event


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           token: int | None = None) -> TokenEvent:
    """Choose one token from ``logits`` ``[vocab]`` (any device); logprobs come from the
    unmodified distribution, as the OpenAI API reports them. ``token``: a greedy choice already
    made from these logits (a batched argmax)."""
    if params.temperature == 0.0:
        token = int(torch.argmax(logits)) if token is None else token
    else:
        token = int(torch.multinomial(target_probs(logits, params), 1, generator=generator))
    return event_for(logits, token, params)


def prompt_logprobs(all_logits: torch.Tensor, tokens: list[int], start: int, top: int = 0
                    ) -> tuple[list[float], list[list[tuple[int, float]] | None]]:
    """Logprob of each prompt token ``tokens[start+1 ..]`` given its prefix, from the logits of
    positions ``start .. start+T-1`` (``all_logits`` ``[T, vocab]``), and the ``top`` most likely
    tokens at each of those positions (what lm-evaluation-harness checks for greedy)."""
    lp = torch.log_softmax(all_logits.float(), dim=-1)
    nxt = torch.tensor(tokens[start + 1:start + 1 + all_logits.shape[0]], dtype=torch.long, device=lp.device)
    k = nxt.numel()
    chosen = lp[torch.arange(k, device=lp.device), nxt].tolist()
    if top <= 0:
        return chosen, [None] * k
    vals, ids = torch.topk(lp[:k], top, dim=-1)
    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return chosen, tops
