"""docs/plugins.md documents every hook with its exact signature and docstring."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from hpc_cli import hookspecs

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def test_every_hook_is_documented_with_its_signature():
    text = DOC.read_text()
    documented = dict(re.findall(r"^### `(hpc_\w+)(\(.*\))`$", text, flags=re.M))
    hooks = {name: fn for name, fn in vars(hookspecs).items() if name.startswith("hpc_") and callable(fn)}
    assert set(documented) == set(hooks), "docs/plugins.md and hookspecs.py list different hooks"
    for name, fn in hooks.items():
        assert documented[name] == str(inspect.signature(fn)), name
        # the hook's one-line docstring is the first paragraph of its section
        section = text.split(f"### `{name}")[1]
        assert inspect.getdoc(fn).splitlines()[0].replace("``", "`") in section, name


def test_configuration_reference_is_in_sync():
    """docs/configuration.md is what `hpc-cli config reference` prints (regenerate it with
    `hpc-cli config reference -o docs/configuration.md`)."""
    from hpc_cli.config_reference import reference_markdown

    text = reference_markdown()
    assert (DOC.parent / "configuration.md").read_text() == text
    from hpc_cli.settings import HpcSettings

    for section, field in HpcSettings.model_fields.items():
        for name in field.annotation.model_fields:
            assert f"`HPC_{section.upper()}__{name.upper()}`" in text, f"{section}.{name} missing"


# ---------------------------------------------------------------------------------------------
# The README: what it says exists, and every command it shows, run
# ---------------------------------------------------------------------------------------------
README = DOC.parents[1] / "README.md"


def readme_blocks() -> list[tuple[str, str]]:
    """The README's fenced blocks: (language, text)."""
    return re.findall(r"^```(\w*)\n(.*?)^```$", README.read_text(), flags=re.M | re.S)


def readme_commands() -> list[str]:
    """Each shell command of the README's plain blocks: continuation lines joined, comments off."""
    out = []
    for lang, text in readme_blocks():
        if lang:
            continue
        for line in text.replace("\\\n", " ").splitlines():
            if " # " in line:
                line = line.split(" # ", 1)[0]
            line = " ".join(line.split())
            if line and not line.startswith("{") and not line.startswith('"'):
                out.append(line)
    return out


def test_readme_lists_every_profile_section_and_command():
    from hpc_cli.cli import cli
    from hpc_cli.settings import SECTIONS

    text = README.read_text()
    listed = re.search(r"TOML with the sections (.*?)\. ", text, re.S).group(1)
    assert set(re.findall(r"\[([\w.]+)\]", listed)) == set(SECTIONS) | {"cache.hybrid"}
    for name in cli.commands:
        assert f"hpc-cli {name}" in text, f"the README never mentions `hpc-cli {name}`"


def test_readme_install_and_test_commands_are_what_ci_runs():
    commands = readme_commands()
    install, test = commands[0], commands[1]
    assert install == "python3 -m pip install torch==2.13.0 -e . && hpc-cli serve"
    ci = (DOC.parents[1] / ".ci" / "run").read_text()
    pip, pytest_cmd = test.split(" && ")
    assert pip.replace("pip install", "pip install -q") in ci and 'python3 -m pytest -q -m "not slow and not gpu"' in ci
    assert pytest_cmd == 'python3 -m pytest -m "not slow and not gpu"'


COVERED = (  # every README command is run by one of the tests below (or is the install line above)
    "python3 -m pip install torch==2.13.0 -e", "hpc-cli serve --profile int8-mtp.toml", "curl -s",
    "hpc-cli top", "hpc-cli cache inspect", "hpc-cli cache verify", "hpc-cli config show",
    "hpc-cli config validate", "hpc-cli kv table", "hpc-cli plugins", "pip install -e examples/hpc-kv-example",
    "hpc-cli expert record", "hpc-cli expert profile", "hpc-cli expert score",
)


def test_every_readme_command_is_covered():
    for command in readme_commands():
        assert command.startswith(COVERED), f"README command without a test: {command}"


def _env(**extra: str) -> dict:
    import os

    return {**{k: v for k, v in os.environ.items() if not k.startswith("HPC_")}, **extra}


def _run(command: str, subs: dict[str, str], **kw):
    """A README command with its placeholders replaced, through bash; ``hpc-cli`` is this checkout."""
    import subprocess
    import sys

    for old, new in subs.items():
        command = command.replace(old, new)
    command = command.replace("hpc-cli ", f"{sys.executable} -m hpc_cli ")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, **kw)


def _command(prefix: str) -> str:
    return next(c for c in readme_commands() if c.startswith(prefix))


def test_readme_serving_examples(tmp_path):
    """The serve command (the embedded model for the checkpoint path), the curl request, the
    openai client loop, `top`, then the orderly stop and `cache inspect --tree` / `cache verify`
    on the file it saved."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cache = tmp_path / "prefix.bin"
    subs = {"/path/to/Qwen3.5-27B": "builtin:tiny", "--port 8000": f"--port {port}",
            "~/.cache/hpc/prefix.bin": str(cache), "http://127.0.0.1:8000": url}
    serve = _command("hpc-cli serve --profile int8-mtp.toml")
    for old, new in subs.items():
        serve = serve.replace(old, new)
    args = serve.split()[1:] + ["--device", "cpu", "--host-cache-mib", "64", "--max-concurrency", "2"]
    err = open(tmp_path / "serve.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hpc_cli", *args], stdout=subprocess.DEVNULL, stderr=err,
                            env=_env())
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, open(tmp_path / "serve.txt").read()[-3000:]
        curl = "\n".join(t for lang, t in readme_blocks() if t.startswith("curl "))
        r = _run(curl.replace("\\\n", " "), subs)
        assert r.returncode == 0, r.stderr
        body = __import__("json").loads(r.stdout)
        assert body["choices"][0]["message"]["content"] is not None
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        code = next(t for lang, t in readme_blocks() if lang == "python")
        r = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8000", url)],
                           capture_output=True, text=True, timeout=300, env=_env())
        assert r.returncode == 0, r.stderr
        turns = [list(map(int, line.split())) for line in r.stdout.splitlines()]
        assert [t[0] for t in turns] == [0, 1, 2] and turns[0][2] == 0 and turns[2][2] > 0, r.stdout
        r = _run(_command("hpc-cli top") + f" --url {url} --once", subs)
        assert r.returncode == 0 and "Device KV pages" in r.stdout, r.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    r = _run(_command("hpc-cli cache inspect"), subs)
    # a tree: the root line, then branches drawn with box characters down to the kept snapshots
    # (its shape depends on which snapshots the conversations kept: each turn's tap supersedes
    # the last, spec §9.3)
    assert r.returncode == 0 and re.search(r"^root ", r.stdout, re.M) and \
        re.search(r"^[│ ]*[├└]── (\+\d+ blocks → )?block \d+ .*(tap|boundary|endpoint)@\d+", r.stdout, re.M), \
        r.stdout + r.stderr
    r = _run(_command("hpc-cli cache verify"), subs)
    assert r.returncode == 0 and r.stdout.startswith("ok: "), r.stderr


def test_readme_configuration_examples(tmp_path):
    mine = tmp_path / "my-profile.toml"
    mine.write_text('[kv]\nprofile = "int8"\n')
    subs = {"my-profile.toml": str(mine)}
    r = _run(_command("hpc-cli config show"), subs)
    assert r.returncode == 0 and "HPC_KV__PROFILE" in r.stdout and "derived" in r.stdout, r.stderr
    r = _run(_command("hpc-cli config validate"), subs)
    assert r.returncode == 0 and r.stdout.startswith(f"ok: {mine}"), r.stderr
    r = _run(_command("hpc-cli kv table"), subs)
    assert r.returncode == 0 and "4.00 MiB" in r.stdout, r.stderr


def test_readme_plugin_examples(tmp_path):
    import sys

    r = _run(_command("hpc-cli plugins"), {})
    assert r.returncode == 0 and "hpc_plugins.kv_profiles" in r.stdout, r.stderr
    site = tmp_path / "site"
    root = str(README.parent)
    command = _command("pip install -e examples/hpc-kv-example").replace(
        "pip install -e examples/hpc-kv-example",  # into a private folder, not this environment
        f"{sys.executable} -m pip install -q --no-deps --no-build-isolation --no-index --target {site} "
        f"{root}/examples/hpc-kv-example")
    r = _run(command, {}, env=_env(PYTHONPATH=str(site)), cwd=root)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^fp16 .* kv_example$", r.stdout, re.M), r.stdout  # the example's profile


def test_readme_expert_examples(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the first prompt\na second, longer prompt about experts\n")
    subs = {"prompts.txt": str(prompts), "trace.bin": str(tmp_path / "trace.bin"),
            "profile.bin": str(tmp_path / "profile.bin")}
    for prefix, want in (("hpc-cli expert record", "wrote "), ("hpc-cli expert profile", "wrote "),
                         ("hpc-cli expert score", "h_expert")):
        r = _run(_command(prefix), subs)
        assert r.returncode == 0 and want in r.stdout, (prefix, r.stdout, r.stderr)
