"""Speculative decoding: decode tokens/s with each backend against none, in the same run.

Prints one JSON document (and writes it to --out). For each backend (none, mtp, dflash,
dflash2 with seeded drafters, and the oracle drafter that proposes the target's own greedy
continuation) it runs the same greedy requests (--prompts prompts of --prompt-len tokens,
--max-tokens each, --concurrency lanes) and reports decode tokens/s (generated tokens after the
first over the time after the first token), the speedup over none, the mean acceptance length
(tokens committed per lane per verify pass, 1.0 = no draft accepted), the acceptance rate and
whether the output equals none's token for token. With --rollback both, mtp and the oracle also
run with the ``recompute`` rollback (snapshot before verify, recompute the accepted prefix) next
to the default ``per_token`` one.

``--traffic chat`` sends the model's own kind of traffic instead: chat questions about the
Python standard library rendered with the model's chat template (``builtin:tiny`` answers them),
each answered until its end-of-turn token or --max-tokens. The fixed questions are 12, their
answers short (about 300 tokens in all); ``--chat-data DIR`` takes --prompts first-turn prompts of
the tiny corpus's validation split instead (``python scripts/tiny_corpus.py --out DIR``: objects
neither the model nor its drafters were trained on; 64 prompts give about 1,100 answer tokens).

Every backend's engine is built and warmed up first; then ``--repeat`` timed passes run
interleaved over the backends (none, mtp, ..., none, mtp, ...) and each backend reports its
fastest pass, so the ratios to none come from the same run and the same spells of a shared
machine. ``--k-for mtp=2,dflash=1`` gives a backend its own k. ``--tail both`` runs each backend a second
time with the round's catch-up lane by lane instead of in one call for every lane (the tail of
``hpc_cli.speculative.round_tail``), reported as ``BACKEND/lane-catch-up``. ``--drafters new=DIR`` runs dflash
and dflash2 a second time with the drafters in ``DIR/dflash`` and ``DIR/dflash2`` (keys
``dflash@new``, ``dflash2@new``), to compare drafters in one run.

    python benchmarks/spec_decode.py                                   # CPU, builtin:tiny, random prompts
    python benchmarks/spec_decode.py --model builtin:tiny --traffic chat --rollback per_token
    python benchmarks/spec_decode.py --model builtin:qwen3.5-27b-shape@8 --prompt-len 512
"""

from __future__ import annotations

import argparse
import collections
import platform
import random
import sys
import time
from pathlib import Path

import torch

from hpc_cli.bench.document import emit
from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.config import draft_tokens
from hpc_cli.engine.engine import Engine
from hpc_cli.model import HybridModel
from hpc_cli.speculative.oracle import OracleBackend


CHAT_QUESTIONS = (
    "What does json.dumps do?", "What is the signature of textwrap.wrap?", "Explain collections.OrderedDict.",
    "What does shutil.copyfile do?", "Summarize the documentation of heapq.heappush.",
    "What is the base64 module for?", "What does zlib.compress do?", "Which module provides Fraction?",
    "What does string.capwords do?", "What is functools.partial?", "What does os.makedirs do?",
    "Explain datetime.timedelta.",
)


def chat_prompts(model, n: int) -> list[list[int]]:
    """``n`` chat questions rendered with the model's chat template (thinking disabled: the answer
    starts at once), tokenized."""
    tok = model.tokenizer
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}]
        out.append(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)))
    return out


def held_out_prompts(model, data_dir: str, n: int) -> list[list[int]]:
    """``n`` first-turn chat prompts of the tiny corpus's validation split (``scripts/tiny_corpus.py
    --out DIR``): questions about objects that neither the model nor its drafters were trained on,
    drawn as ``scripts/train_tiny.py`` draws its validation answers (the same seed, so the same
    prompts as its ``--val-answers``), tokenized by the model's tokenizer."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", path)
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    texts = train_tiny.chat_prompts(train_tiny.records_all(Path(data_dir)), "val", n, train_tiny.CHAT_PROMPT_SEED)
    if len(texts) < n:
        raise SystemExit(f"{data_dir}: {len(texts)} validation chat prompts, {n} asked for")
    return [model.tokenizer.encode(t) for t in texts]


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(1, min(250, vocab)) for _ in range(length)] for _ in range(n)]


def warmed_engine(model, spec, prompts, args, rollback="per_token", k=None, drafter=None) -> Engine:
    """A started engine for one backend, warmed up as the server warms it (:meth:`Engine.warmup`:
    on CUDA every prefill length and verify shape compiled and captured); "full" warm-up also runs
    every prompt once first (the drafters' own eager passes meet their shapes there)."""
    kv_pages = args.concurrency * (-(-(args.prompt_len + args.max_tokens + 64) // 64)) + 8
    e = Engine(model, kv_pages=kv_pages, prefill_chunk=args.prefill_chunk, max_concurrency=args.concurrency,
               reuse=False, speculative=spec, num_draft_tokens=args.k if k is None else k,
               spec_rollback=rollback, drafter=drafter).start()
    e.warmup()  # as `hpc-cli serve` does: every prefill length and verify shape on CUDA
    if args.warmup == "full":
        _pass(e, prompts, args)
    return e


def _pass(e: Engine, prompts, args) -> tuple[list[list[int]], int, float]:
    """One timed pass over ``prompts``: (outputs, decode tokens, decode seconds)."""
    chat = args.traffic == "chat"
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=not chat)
    outs, decode_tokens, decode_s = [], 0, 0.0
    for i in range(0, len(prompts), args.concurrency):
        batch = prompts[i:i + args.concurrency]
        handles = [e.submit(GenerationRequest(list(p), sp)) for p in batch]
        first, end = [], 0.0
        for h in handles:
            toks, fin = h.result(timeout=3600)
            assert fin.reason == "length" or (chat and fin.reason == "stop"), (fin.reason, fin.error)
            end = max(end, time.monotonic())
            first.append(h.submitted_at + fin.usage.time_to_first_token)
            outs.append([t.token_id for t in toks])
            decode_tokens += len(toks) - 1
        decode_s += end - max(first)
    return outs, decode_tokens, decode_s


def _timed(engines: dict[str, Engine], prompts, args) -> dict[str, tuple[list[list[int]], float, dict | None]]:
    """``--repeat`` timed passes of every engine, interleaved (engine A, B, ..., A, B, ...), so a
    slow spell of a shared machine hits every backend alike; each keeps its fastest pass. The
    speculative counters cover every timed pass (acceptance does not depend on the timing)."""
    for e in engines.values():
        if e.spec is not None:
            e.spec.counters.clear()
            e.spec.accept_hist.clear()
    best: dict[str, tuple[list[list[int]], float]] = {}
    decode_s: dict[str, float] = collections.Counter()  # every timed pass's, for the time outside rounds
    for _ in range(max(1, args.repeat)):
        for key, e in engines.items():
            outs, n, s = _pass(e, prompts, args)
            decode_s[key] += s
            assert key not in best or outs == best[key][0], f"{key}: greedy output changed between passes"
            if key not in best or n / s > best[key][1]:
                best[key] = (outs, n / s)
    result = {}
    for key, e in engines.items():
        result[key] = (*best[key], e.spec.stats() if e.spec is not None else None, decode_s[key])
        e.stop()
    return result


def round_split(st, decode_s: float, requests: int) -> dict:
    """Where a backend's decode time went over the timed passes: the mean round whose verify pass
    the round before launched (the device ahead of the host) and the mean other round (a request's
    first, rounds after the lanes changed), in ms on the engine thread, and the decode time outside
    rounds a request (its first token's hand-off, its end)."""
    ahead_n = getattr(st, "verify_ahead_used", 0)
    ahead_s = getattr(st, "verify_ahead_round_s", 0.0)
    rounds_s = st.propose_s + st.verify_s + st.rollback_s + st.catch_up_s
    return {"verify_ahead_rounds": ahead_n,
            "round_ms_verified_ahead": round(1e3 * ahead_s / ahead_n, 4) if ahead_n else None,
            "round_ms_other": round(1e3 * (rounds_s - ahead_s) / max(1, st.rounds - ahead_n), 4),
            "outside_rounds_ms_per_request": round(1e3 * (decode_s - rounds_s) / max(1, requests), 4)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: builtin:qwen3.5-27b-shape@8 on CUDA, builtin:tiny on CPU")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("-k", type=int, default=None,
                    help="drafts per round (default: the engine's, the model's recommendation else 3)")
    ap.add_argument("--k-for", default="", help="per-backend k overriding -k, e.g. mtp=2,dflash=1")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed passes per backend, interleaved across backends; each reports its fastest")
    ap.add_argument("--backends", default="none,mtp,dflash,dflash2,oracle")
    ap.add_argument("--rollback", default="both", choices=["per_token", "recompute", "both"])
    ap.add_argument("--traffic", default="random", choices=["random", "chat"],
                    help="random token prompts, or chat questions answered until end of turn")
    ap.add_argument("--chat-data", default=None, metavar="DIR",
                    help="with --traffic chat: the validation split's chat prompts of the tiny corpus in DIR "
                         "(scripts/tiny_corpus.py) instead of the fixed questions, --prompts of them")
    ap.add_argument("--warmup", default=None, choices=["short", "full"],
                    help="short: one 4-token request; full: every prompt once (default for chat traffic)")
    ap.add_argument("--drafters", action="append", default=[], metavar="LABEL=DIR",
                    help="also run dflash / dflash2 with the drafters in DIR/dflash, DIR/dflash2 (reported as "
                         "dflash@LABEL, dflash2@LABEL), next to the default ones; repeatable")
    ap.add_argument("--ahead", default="round", choices=["round", "propose", "off", "all"],
                    help="what a greedy round launches of the next before the host reads it: the proposal and "
                         "the verify pass (round, the default), the proposal, nothing; all: each backend in "
                         "the three ways (reported as BACKEND, BACKEND/propose-ahead, BACKEND/no-ahead)")
    ap.add_argument("--tail", default="batched", choices=["batched", "lanes", "both"],
                    help="a round's tail: one call for every lane (commit, catch-up, greedy counts on the "
                         "device; the default, captured on CUDA), or the catch-up lane by lane; both: each "
                         "backend both ways (the second reported as BACKEND/lane-catch-up)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.chat_data and args.traffic != "chat":
        ap.error("--chat-data gives chat prompts: add --traffic chat")
    others = [tuple(x.split("=", 1)) for x in args.drafters]
    args.warmup = args.warmup or ("full" if args.traffic == "chat" else "short")
    cuda = torch.cuda.is_available()
    name = args.model or ("builtin:qwen3.5-27b-shape@8" if cuda else "builtin:tiny")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    t = time.time()
    model = HybridModel.from_name_or_path(name, dtype=getattr(torch, dtype), device="cuda" if cuda else "cpu")
    load_s = time.time() - t
    if args.traffic == "chat":
        prompts = held_out_prompts(model, args.chat_data, args.prompts) if args.chat_data \
            else chat_prompts(model, args.prompts)
    else:
        prompts = _prompts(args.prompts, args.prompt_len, model.config.vocab_size)
    engines = {"none": warmed_engine(model, None, prompts, args)}
    refs = {tuple(p): r for p, r in zip(prompts, _pass(engines["none"], prompts, args)[0])}
    ks = {b: int(v) for b, v in (x.split("=") for x in args.k_for.split(",") if x)} if args.k_for else {}
    for b in [x for x in args.backends.split(",") if x and x != "none"]:
        modes = ["per_token", "recompute"] if args.rollback == "both" and b in ("mtp", "oracle") else \
            [args.rollback if args.rollback != "both" else "per_token"]
        for mode in modes:
            spec = OracleBackend(refs) if b == "oracle" else b
            key = b if mode == "per_token" else f"{b}+recompute"
            engines[key] = warmed_engine(model, spec, prompts, args, rollback=mode, k=ks.get(b, args.k))
            engines[key].spec.look_ahead = "round" if args.ahead == "all" else args.ahead
            if args.ahead == "all" and mode == "per_token":
                for ahead, label in (("propose", "propose-ahead"), ("off", "no-ahead")):
                    engines[f"{key}/{label}"] = e = warmed_engine(model, spec, prompts, args, rollback=mode,
                                                                  k=ks.get(b, args.k))
                    e.spec.look_ahead = ahead
            if args.tail != "batched":
                tail_engines = [key] if args.tail == "lanes" else []
                if args.tail == "both" and mode == "per_token":
                    tail_engines.append(f"{key}/lane-catch-up")
                    engines[tail_engines[-1]] = e = warmed_engine(model, spec, prompts, args, rollback=mode,
                                                                  k=ks.get(b, args.k))
                    e.spec.look_ahead = engines[key].spec.look_ahead
                for tk in tail_engines:
                    engines[tk].spec.tails.batched = False
        if b in ("dflash", "dflash2"):  # the same backend with other drafters, in the same run
            for label, path in others:
                engines[f"{b}@{label}"] = warmed_engine(model, b, prompts, args, k=ks.get(b, args.k),
                                                 drafter=str(Path(path) / b))
    from hpc_cli.model.compile_watch import watch

    counts = watch()
    compiled = counts.compilations + counts.autotunes
    # which engines should chain their rounds (CUDA graphs, look_ahead "round"): a figure taken
    # without chaining measures another regime than a served engine's
    chaining = {key for key, e in engines.items() if e.spec is not None and e.spec.chains(e.spec.k + 1)
                and e.model.column_graphs(e.storage) is not None}
    timed = _timed(engines, prompts, args)
    compiled = counts.compilations + counts.autotunes - compiled
    ref, none_tps, _, _ = timed.pop("none")
    runs = {"none": {"decode_tok_s": none_tps, "speedup": 1.0, "mean_acceptance_length": 1.0,
                     "generated_tokens": sum(len(o) for o in ref)}}
    for key, (outs, tps, st, spent) in timed.items():
        runs[key] = {"decode_tok_s": tps, "speedup": tps / none_tps, "k": st.k,
                     "mean_acceptance_length": st.mean_acceptance_length,
                     "acceptance_rate": st.acceptance_rate, "rollback": st.rollback,
                     "matches_none": outs == ref, "generated_tokens": sum(len(o) for o in outs),
                     "accepted_histogram": st.accepted_histogram,
                     "propose_s": st.propose_s, "verify_s": st.verify_s,
                     "rollback_s": st.rollback_s, "catch_up_s": st.catch_up_s,
                     "rounds": st.rounds,
                     # the same phases a round (the counters and the rounds cover the same passes)
                     "round_ms": {ph: round(1e3 * getattr(st, f"{ph}_s") / max(1, st.rounds), 4)
                                  for ph in ("propose", "verify", "rollback", "catch_up")},
                     "recomputed_columns": st.recomputed_columns,
                     # (an earlier tree on PYTHONPATH, before and after on one machine, has none)
                     "proposals_ahead": getattr(st, "proposals_ahead", 0),
                     "proposals_ahead_used": getattr(st, "proposals_ahead_used", 0),
                     "verify_chained": getattr(st, "verify_chained", 0),
                     **round_split(st, spent, len(prompts) * max(1, args.repeat))}
    doc = {"benchmark": "spec_decode", "model": name, "dtype": dtype,
           "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "model_load_s": load_s,
           "k": draft_tokens(args.k, model.config), "repeat": args.repeat, "traffic": args.traffic,
           "warmup": args.warmup, "prompts": args.prompts,
           "chat_data": args.chat_data, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
           "concurrency": args.concurrency, "compilations_in_timed_passes": compiled, "runs": runs}
    for key in sorted(chaining):
        if not runs[key]["verify_chained"]:
            print(f"warning: {key} chained no round's verify pass (its second verify graphs are missing)",
                  file=sys.stderr)
    emit(doc, args.out)
    return doc


if __name__ == "__main__":
    main()
