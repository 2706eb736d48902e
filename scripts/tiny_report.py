"""The figures of docs/tiny-model.md: the loss curve picture and sampled answers of ``builtin:tiny``.

    python scripts/tiny_report.py --log train.log [--log train2.log] --png docs/tiny-model-loss.png --samples

``--log``: the output of ``scripts/train_tiny.py`` (one JSON line per logged step). ``--samples``
prints greedy answers of the shipped model to the questions below (on the CPU, through the engine
with the model's chat template, thinking disabled), marking the questions about objects in the
validation split.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

QUESTIONS = (
    "What does json.dumps do?", "What is the base64 module for?", "Explain collections.OrderedDict.",
    "What does shutil.copyfile do?", "What is the signature of textwrap.wrap?",
    "Which module provides Fraction?", "What does zlib.compress do?", "Summarize the documentation of heapq.heappush.",
    "What does string.capwords do?", "What is functools.partial?", "What does os.makedirs do?",
    "Explain datetime.timedelta.",
)


def read_log(paths: list[str]) -> tuple[list[dict], list[dict]]:
    main, drafters = [], []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if not line.startswith('{"step"'):
                continue
            entry = json.loads(line)
            (main if "train_loss" in entry else drafters).append(entry)
    return main, drafters


def plot(main: list[dict], drafters: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([e["tokens"] / 1e6 for e in main], [e["train_loss"] for e in main], label="train (batch)")
    val = [e for e in main if "val_loss" in e]
    a.plot([e["tokens"] / 1e6 for e in val], [e["val_loss"] for e in val], "o-", label="validation")
    a.set_xlabel("training tokens (millions)")
    a.set_ylabel("cross-entropy (nats/token)")
    a.set_title("builtin:tiny: next-token loss")
    a.grid(alpha=0.3)
    a.legend()
    for key in ("mtp", "dflash", "dflash2"):
        b.plot([e["step"] for e in drafters], [e[key] for e in drafters], label=key)
    b.set_xlabel("drafter training step")
    b.set_ylabel("cross-entropy vs the model's greedy token")
    b.set_title("MTP head and block drafters")
    b.grid(alpha=0.3)
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def samples(n: int) -> list[dict]:
    import torch

    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.engine.engine import Engine
    from hpc_cli.model import HybridModel
    from tiny_corpus import is_validation

    m = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32, device="cpu", progress=False)
    e = Engine(m, kv_pages=64, max_concurrency=1).start()
    out = []
    for q in QUESTIONS[:n]:
        text = m.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               enable_thinking=False)
        toks, _ = e.generate(GenerationRequest(m.tokenizer.encode(text), SamplingParams(max_tokens=96,
                                                                                          temperature=0.0)))
        ids = [getattr(t, "token_id", t) for t in toks]
        name = next((w.strip("?.") for w in q.split() if "." in w.strip("?.")), "")
        out.append({"question": q, "answer": m.tokenizer.decode(ids, skip_special=True).strip(),
                    "held_out": bool(name) and is_validation(name)})
    e.stop()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", action="append", default=[])
    ap.add_argument("--png", default=None)
    ap.add_argument("--samples", action="store_true")
    ap.add_argument("-n", type=int, default=10)
    args = ap.parse_args(argv)
    if args.png:
        plot(*read_log(args.log), args.png)
    if args.samples:
        for s in samples(args.n):
            print(json.dumps(s, ensure_ascii=False))


if __name__ == "__main__":
    main()
