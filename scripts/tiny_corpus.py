"""The training corpus of the embedded default model ``builtin:tiny``: the docstrings of the Python
standard library (PSF licence) and chat-shaped examples made from them.

    python scripts/tiny_corpus.py --out .tiny-data          # corpus.jsonl.gz, tokenizer.json, manifest.json

Every public module, class, function and method of the standard library that this interpreter
imports is read with ``inspect.getdoc`` (sorted, so a given Python build always gives the same
text). Each documented object yields

* a plain document: its qualified name, its signature where ``inspect.signature`` knows one, and
  its docstring;
* chat examples rendered with the Qwen3.5 chat template (``BYTE_CHAT_TEMPLATE``): questions
  ("What does json.dumps do?") answered by the docstring's first paragraph, instructions
  ("Summarize the documentation of json.dumps.") answered by its first paragraphs, signature
  questions, "which module provides ..." questions, and two-turn conversations about two objects of
  one module. Every answer follows the empty reasoning block ``<think>\\n\\n</think>\\n\\n`` (half
  rendered as a thinking prompt ``<think>\\n`` plus ``\\n</think>\\n\\n``, half with thinking
  disabled: the same text), which is why the shipped template always closes that block.

Objects whose name hashes into the last 3% go to the validation split (their document and every
chat example about them). The byte-level BPE tokenizer (Qwen's pre-tokenizer pattern, the ChatML
special tokens as added tokens) is trained on the training split.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import random
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 20260511
VOCAB = 6144  # BPE + added tokens + padding rows; the model's vocab_size (the last row is the drafters' mask)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # special: skipped by decode(skip_special)
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # added, kept in decoded text (as Qwen's)
# Qwen2/3's pre-tokenizer split (GPT-4 style, digits one by one)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
SYSTEM = "You are a helpful assistant who answers questions about the Python standard library."

# modules that act when imported (open a browser, print, need a display) or hold tests
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
        "pydoc_data", "__phello__", "msilib", "winreg", "winsound", "nt", "xxsubtype", "xxlimited",
        "xxlimited_35", "sre_compile", "sre_constants", "sre_parse", "distutils", "imp", "asynchat", "asyncore",
        "smtpd", "crypt", "nis", "spwd", "ossaudiodev", "audioop", "cgi", "cgitb", "chunk", "mailcap", "nntplib",
        "pipes", "sndhdr", "sunau", "telnetlib", "uu", "xdrlib", "aifc", "imghdr", "msvcrt", "_winapi"}


def _modules() -> list[str]:
    names = set()
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIP:
            continue
        mod = _import(top)
        if mod is None:
            continue
        names.add(top)
        path = getattr(mod, "__path__", None)
        if path:
            for info in pkgutil.walk_packages(path, top + "."):
                parts = info.name.split(".")
                if any(p.startswith("_") or p in ("test", "tests", "idle_test") for p in parts[1:]):
                    continue
                if _import(info.name) is not None:
                    names.add(info.name)
    return sorted(names)


def _import(name: str):
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - any failure to import just leaves the module out
        return None


def _clean(doc: str | None) -> str:
    if not doc:
        return ""
    doc = doc.replace("\t", "    ").strip()
    return "\n".join(line.rstrip() for line in doc.splitlines())


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except Exception:  # noqa: BLE001 - objects without a readable signature
        return ""
    return sig if len(sig) <= 160 and " at 0x" not in sig else ""


def _objects(modname: str):
    """(qualified name, kind, signature, docstring) of a module's documented public objects."""
    mod = sys.modules[modname]
    out = []
    doc = _clean(inspect.getdoc(mod))
    if doc:
        out.append((modname, "module", "", doc))
    public = getattr(mod, "__all__", None)
    try:
        names = (sorted(public) if isinstance(public, (list, tuple))
                 else sorted(n for n in vars(mod) if not n.startswith("_")))
    except TypeError:
        return out
    for name in names:
        obj = getattr(mod, name, None)
        if obj is None or inspect.ismodule(obj):
            continue
        if getattr(obj, "__module__", None) not in (modname, None) and not modname.startswith(
                str(getattr(obj, "__module__", "")).lstrip("_") or "\0"):
            continue  # re-exported from elsewhere: documented where it is defined
        if inspect.isclass(obj):
            cdoc = _clean(inspect.getdoc(obj))
            if cdoc and obj.__doc__:
                out.append((f"{modname}.{name}", "class", _signature(obj), cdoc))
            for mname, member in sorted(vars(obj).items()):
                if mname.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if not callable(member) or not getattr(member, "__doc__", None):
                    continue
                mdoc = _clean(inspect.getdoc(member))
                if mdoc:
                    out.append((f"{modname}.{name}.{mname}", "method", _signature(member), mdoc))
        elif callable(obj) and getattr(obj, "__doc__", None):
            fdoc = _clean(inspect.getdoc(obj))
            if fdoc:
                out.append((f"{modname}.{name}", "function", _signature(obj), fdoc))
    return out


_SIG_LINE = re.compile(r"^[\w.]+\(.*\)( -> .*)?$", re.S)


def _paragraphs(doc: str) -> list[str]:
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc) if p.strip()]
    while paras and (_SIG_LINE.match(paras[0]) or paras[0].startswith(("--", "=="))):
        paras = paras[1:]  # old-style C docstrings open with their own signature line
    return paras


def _sentence(text: str) -> str | None:
    """A paragraph as an answer: plain prose, a capital first letter, a full stop at the end."""
    if not text or len(text) < 24 or len(text) > 600:
        return None
    if not re.match(r"^[A-Za-z`'\"(]", text) or text.count("(") != text.count(")"):
        return None
    if re.search(r"[>]{3}|\.\.\.\s*$|:$|\|", text):
        return None
    letters = sum(c.isalpha() or c == " " for c in text)
    if letters < 0.8 * len(text):
        return None  # mostly code or tables
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?" else text + "."


def _render(tpl, messages: list[dict], answer: str, thinking: bool) -> str:
    prompt = tpl.render(messages=messages, tools=None, add_generation_prompt=True,
                        **({} if thinking else {"enable_thinking": False}))
    return prompt + ("\n</think>\n\n" if thinking else "") + answer + "<|im_end|>\n"


def _kind_word(kind: str) -> str:
    return {"module": "module", "class": "class", "function": "function", "method": "method"}[kind]


def _chats(tpl, rng: random.Random, entries: list[tuple], by_module: dict[str, list[tuple]]) -> list[tuple[str, str]]:
    """(entity name, rendered chat text) for every chat example."""
    out = []
    for name, kind, sig, doc in entries:
        paras = _paragraphs(doc)
        summary = _sentence(paras[0]) if paras else None
        if summary is None:
            continue
        short = name.rsplit(".", 1)[-1]
        modname = name.split(".")[0] if kind != "module" else name
        qa = []
        if kind == "module":
            qa += [(f"What is the {name} module for?", summary), (f"What does the {name} module do?", summary),
                   (f"Tell me about the {name} module.", summary)]
        else:
            qa += [(f"What does {name} do?", summary), (f"What is {name}?", summary),
                   (f"Explain {name}.", summary), (f"What is {name} used for?", summary)]
            parent = name.rsplit(".", 1)[0]
            if kind == "method":
                qa.append((f"What does the {short} method of {parent} do?", summary))
            else:
                qa.append((f"Which module provides {short}?",
                           f"The {short} {_kind_word(kind)} is provided by the {parent} module."))
            if sig:
                qa.append((f"What is the signature of {name}?", f"The signature is {short}{sig}."))
                qa.append((f"How do I call {name}?", f"Call it as {short}{sig}. {summary}"))
        more = [s for s in (_sentence(p) for p in paras[1:3]) if s]
        if more:
            qa.append((f"Summarize the documentation of {name}.", " ".join([summary] + more)))
            qa.append((f"Explain {name} in detail.", " ".join([summary] + more)))
        for q, a in qa:
            msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
            msgs.append({"role": "user", "content": q})
            out.append((name, _render(tpl, msgs, a, rng.random() < 0.5)))
        # a two-turn conversation with another object of the same module
        others = [e for e in by_module.get(modname, []) if e[0] != name and e[1] != "module"]
        if others:
            other = rng.choice(others)
            oparas = _paragraphs(other[3])
            osum = _sentence(oparas[0]) if oparas else None
            if osum:
                msgs = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
                msgs += [{"role": "user", "content": qa[0][0]}, {"role": "assistant", "content": qa[0][1]},
                         {"role": "user", "content": rng.choice([f"And what does {other[0]} do?",
                                                                 f"What about {other[0]}?"])}]
                out.append((name, _render(tpl, msgs, osum, rng.random() < 0.5)))
    return out


def is_validation(name: str) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100 >= 97


def build(out: Path) -> dict:
    from hpc_cli.model.tokenizer import BYTE_CHAT_TEMPLATE, _jinja_env

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    entries, seen_docs = [], set()
    modules = _modules()
    for m in modules:
        for e in _objects(m):
            key = e[3]
            if key in seen_docs:  # inherited and shared docstrings once
                continue
            seen_docs.add(key)
            entries.append(e)
    by_module: dict[str, list[tuple]] = {}
    for e in entries:
        by_module.setdefault(e[0].split(".")[0], []).append(e)
    tpl = _jinja_env().from_string(BYTE_CHAT_TEMPLATE)
    records = []
    for name, kind, sig, doc in entries:
        head = f"{name}{sig}" if sig else name
        text = f"{head}\n\n{doc[:6000]}"
        records.append({"name": name, "split": "val" if is_validation(name) else "train", "kind": "doc", "text": text})
    for name, text in _chats(tpl, rng, entries, by_module):
        records.append({"name": name, "split": "val" if is_validation(name) else "train", "kind": "chat", "text": text})
    blob = "\n".join(json.dumps(r, ensure_ascii=False, sort_keys=True) for r in records).encode()
    with gzip.GzipFile(out / "corpus.jsonl.gz", "wb", mtime=0) as f:
        f.write(blob)
    tok = train_tokenizer([r["text"] for r in records if r["split"] == "train"])
    tok.save(str(out / "tokenizer.json"))
    manifest = {
        "python": sys.version.split()[0], "seed": SEED, "modules": len(modules), "objects": len(entries),
        "records": len(records), "docs": sum(r["kind"] == "doc" for r in records),
        "chats": sum(r["kind"] == "chat" for r in records),
        "train_chars": sum(len(r["text"]) for r in records if r["split"] == "train"),
        "val_chars": sum(len(r["text"]) for r in records if r["split"] == "val"),
        "corpus_sha256": hashlib.sha256(blob).hexdigest(),
        "tokenizer_sha256": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest(),
        "vocab_size": VOCAB, "tokenizer_tokens": tok.get_vocab_size(with_added_tokens=True),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def train_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_added = len(SPECIALS) + len(ADDED)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - n_added - 64, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    # chat scaffolding is made of added tokens: keep it out of the merges
    split = re.compile("|".join(re.escape(t) for t in SPECIALS + ADDED))
    tok.train_from_iterator((piece for t in texts for piece in split.split(t)), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".tiny-data")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    print(json.dumps(build(Path(args.out)), indent=1))


if __name__ == "__main__":
    main()
