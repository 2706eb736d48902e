"""`hpc-cli serve`: the OpenAI- and Anthropic-compatible HTTP server (hpc_cli.server)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

import click

from hpc_cli.errors import ConfigError

# flag -> dotted settings key (each also a profile key and an HPC_* variable)
FLAG_KEYS = {
    "model": "model.name", "dtype": "model.dtype", "device": "model.device", "seed": "engine.seed",
    "max_model_len": "model.max_model_len", "quantized_weights": "model.quantized_weights",
    "host": "server.host", "port": "server.port", "api_key": "server.api_key",
    "served_model_name": "server.served_model_name", "tui": "server.tui",
    "debug_timing": "server.debug_timing",
    "max_concurrency": "engine.max_concurrency", "prefill_chunk": "engine.prefill_chunk",
    "kv_capacity": "engine.kv_capacity", "default_max_tokens": "engine.default_max_tokens",
    "kv_profile": "kv.profile",
    "spec_backend": "speculative.backend", "num_draft_tokens": "speculative.num_draft_tokens",
    "drafter": "speculative.drafter",
    "cache_mode": "cache.mode", "host_cache_mib": "cache.host_cache_mib",
    "prefix_cache_file": "cache.prefix_cache_file", "no_prefix_reuse": "cache.no_prefix_reuse",
    "shared_cache": "cache.shared_cache",
}


def _kv_capacity(value: str | None):
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter("auto or a page count") from None


def _cache_words(s) -> str:
    """The banner's cache part: ``cache off`` when nothing is reused (cache.mode off or
    no_prefix_reuse), else the mode, the host tier and the file."""
    from hpc_cli import plugins

    if s.cache.no_prefix_reuse or not plugins.cache_mode(s.cache.mode).reuses:
        return "cache off (no prefix reuse)"
    return (f"cache {s.cache.mode} (host tier {s.cache.host_cache_mib} MiB"
            + (f", file {s.cache.prefix_cache_file}" if s.cache.prefix_cache_file else "") + ")")


def banner(resolved, url: str, loop: str) -> str:
    s = resolved.settings
    served = s.server.served_model_name or s.model.name
    lines = [f"hpc-cli serving {s.model.name} as '{served}' at {url}",
             f"  {_cache_words(s)} | KV {s.kv.profile} | speculative {s.speculative.backend}"
             f" | lanes {s.engine.max_concurrency} | {loop} event loop",
             f"  OpenAI: {url}/v1/chat/completions, {url}/v1/completions | Anthropic: {url}/v1/messages",
             f"  {url}/health, {url}/metrics, {url}/v1/cache/stats"
             + (" | API key required (Authorization: Bearer ...)" if s.server.api_key else "")]
    if s.model.name == "builtin:tiny":
        lines += ["",
                  "  NOTE: builtin:tiny is the embedded demo model: a small Qwen3.5 (8 layers, hidden 256) trained",
                  "  on the Python standard library's docstrings. Ask it what json.dumps does. To serve a real",
                  "  model, point --model at a Qwen3.5 checkpoint directory (config.json, *.safetensors,",
                  "  tokenizer.json): hpc-cli serve --model /path/to/Qwen3.5-27B"]
    elif s.model.name.startswith("builtin:"):
        lines += ["",
                  f"  NOTE: {s.model.name} has random (seeded) weights, so its text is meaningless. It exercises",
                  "  the server and the prefix cache on any machine. To serve a real model, point --model at a",
                  "  Qwen3.5 checkpoint directory (config.json, *.safetensors, tokenizer.json):",
                  "  hpc-cli serve --model /path/to/Qwen3.5-27B"]
    lines.append("  Stop: Ctrl+C twice within 5 s, or SIGTERM.")
    return "\n".join(lines)


def register(cli: click.Group) -> None:
    @cli.command("serve")
    @click.option("--profile", "profile", default=None, help="profile TOML (a path or a shipped profile name)")
    @click.option("--model", default=None, help="a checkpoint directory or builtin:NAME [model.name]")
    @click.option("--dtype", default=None, type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                  help="[model.dtype]")
    @click.option("--device", default=None, type=click.Choice(["auto", "cpu", "cuda"]), help="[model.device]")
    @click.option("--seed", default=None, type=int,
                  help="base seed of sampling for requests that name no seed [engine.seed]")
    @click.option("--max-model-len", default=None, type=int, help="context limit [model.max_model_len]")
    @click.option("--quantized-weights", default=None, type=click.Choice(["auto", "held", "dequantized"]),
                  help="a FP8/NVFP4 checkpoint's Linear weights on CUDA: held as stored, dequantized, or auto "
                       "= FP8 held, NVFP4 held only when dequantized it would not fit [model.quantized_weights]")
    @click.option("--host", default=None, help="address to bind, default 127.0.0.1 [server.host]")
    @click.option("--port", default=None, type=int, help="port, default 8000 [server.port]")
    @click.option("--api-key", default=None, help="require 'Authorization: Bearer KEY' [server.api_key]")
    @click.option("--served-model-name", default=None, help="the model id clients send [server.served_model_name]")
    @click.option("--tui/--no-tui", default=None, help="live cache view in the terminal [server.tui]")
    @click.option("--debug-timing", default=None, is_flag=True, flag_value=True,
                  help="per-request phase seconds in usage.hpc_timing [server.debug_timing]")
    @click.option("--max-concurrency", default=None, type=int, help="lanes [engine.max_concurrency]")
    @click.option("--prefill-chunk", default=None, type=int, help="tokens per prefill pass [engine.prefill_chunk]")
    @click.option("--kv-capacity", default=None, help="device KV pages or auto [engine.kv_capacity]")
    @click.option("--default-max-tokens", default=None, type=int, help="[engine.default_max_tokens]")
    @click.option("--kv-profile", default=None, help="KV storage profile [kv.profile]")
    @click.option("--spec-backend", default=None, help="none, mtp, dflash, dflash2 [speculative.backend]")
    @click.option("--num-draft-tokens", default=None, type=int, help="[speculative.num_draft_tokens]")
    @click.option("--drafter", default=None, help="drafter checkpoint directory [speculative.drafter]")
    @click.option("--cache-mode", default=None, help="hybrid, legacy, off or a plugin's mode [cache.mode]")
    @click.option("--host-cache-mib", default=None, type=int, help="host slab pool MiB [cache.host_cache_mib]")
    @click.option("--prefix-cache-file", default=None, type=click.Path(dir_okay=True, path_type=Path),
                  help="keep the host tier across restarts [cache.prefix_cache_file]")
    @click.option("--no-prefix-reuse", default=None, is_flag=True, flag_value=True,
                  help="disable the cache [cache.no_prefix_reuse]")
    @click.option("--shared-cache", default=None, metavar="URL",
                  help="shared cache tier for replicas, e.g. redis://127.0.0.1:6379/0 [cache.shared_cache]")
    @click.option("--log-level", default="info", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
                  show_default=True, help="uvicorn log level")
    def serve_command(profile, log_level, **flags) -> None:
        """Serve the model over OpenAI- and Anthropic-compatible HTTP APIs."""
        from hpc_cli.settings import load_settings

        flags["kv_capacity"] = _kv_capacity(flags.get("kv_capacity"))
        cli_flags = {FLAG_KEYS[k]: (str(v) if isinstance(v, Path) else v) for k, v in flags.items()}
        resolved = load_settings(profile, cli_flags, os.environ)
        run_server(resolved, log_level=log_level)


def _log_to_stderr(level: str) -> None:
    """hpc_cli's own log lines (the prefix cache file's read/restore/save lines of spec 5.5, the
    server's warnings) on stderr at the --log-level; once per process."""
    import logging
    import sys

    logger = logging.getLogger("hpc_cli")
    if not any(getattr(h, "_hpc_serve", False) for h in logger.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("hpc-cli: %(message)s"))
        h._hpc_serve = True
        logger.addHandler(h)
    logger.setLevel(level.upper())


def _warmup_progress():
    """A progress callback for the warm-up's shape passes: a line at every tenth on stderr."""
    import time

    t0 = time.monotonic()
    shown = [-1]

    def show(done: int, total: int) -> None:
        tenth = done * 10 // max(1, total)
        if tenth != shown[0]:
            shown[0] = tenth
            click.echo(f"hpc-cli: warm-up {done}/{total} kernel shapes ({time.monotonic() - t0:.1f} s)", err=True)

    return show


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def report_host_tier(host, echo, *, follow: bool = True, every_s: float = 5.0):
    """The host tier's allocation and pinning at startup: one line now and, with ``follow``,
    a line every ``every_s`` seconds while it pins in the background and one when it ends (from
    a daemon thread, which it returns). ``host``: the engine's HostSlabStorage."""
    import threading

    from hpc_cli.memory.host_slabs import HostTierState

    p = host.progress()
    if p.total_slabs == 0:
        return None
    if p.state != HostTierState.PINNING:
        _echo_host_end(p, echo)
        return None
    echo(f"host tier {_gib(p.total_bytes)}: allocating and pinning {p.total_chunks} chunks in the background, "
         f"first chunk first ({_gib(p.ready_bytes)} ready); serving meanwhile")
    if not follow:
        return None

    def watch() -> None:
        while True:
            host.wait_ready(host.num_slabs, timeout=every_s)
            q = host.progress()
            if q.state != HostTierState.PINNING:
                _echo_host_end(q, echo)
                return
            echo(f"host tier {_gib(q.ready_bytes)} of {_gib(q.total_bytes)} ready "
                 f"({q.ready_chunks}/{q.total_chunks} chunks, {q.seconds:.1f} s)")

    th = threading.Thread(target=watch, name="hpc-host-tier-progress", daemon=True)
    th.start()
    return th


def _echo_host_end(p, echo) -> None:
    from hpc_cli.memory.host_slabs import HostTierState

    if p.state == HostTierState.READY:
        echo(f"host tier {_gib(p.total_bytes)} ready ({p.total_chunks} chunks in {p.seconds:.1f} s)")
    elif p.state == HostTierState.FAILED:
        echo(f"warning: host tier stopped at {_gib(p.ready_bytes)} of {_gib(p.total_bytes)}: {p.error}")


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (uvicorn listens on it later), so a port
    in use is one clear error at once instead of after the model load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise _bind_error(where, host, port, exc) from None
    sock.set_inheritable(True)
    return sock


def _bind_error(where: str, host: str, port: int, exc: OSError) -> ConfigError:
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"cannot listen on {where}: port {port} is in use",
                           hint=f"stop what uses it, or choose another port with --port (e.g. --port {port + 1})")
    if exc.errno == errno.EACCES:
        return ConfigError(f"cannot listen on {where}: permission denied",
                           hint="ports below 1024 need privileges: choose another with --port (e.g. --port 8000)")
    return ConfigError(f"cannot listen on {where}: {exc.strerror or exc}",
                       hint="check --host (an address of this machine, e.g. 127.0.0.1 or 0.0.0.0) and --port")


def _tui_chrome(banner_text: str, notices):
    """The server's lines in the live view: where it listens, how to stop it, its notices."""
    from hpc_cli.tui.app import Chrome

    return Chrome(banner=banner_text.splitlines()[:1], notices=notices,
                  keys="keys: Ctrl+C twice within 5 s stops the server (running requests end as unavailable)")


def run_server(resolved, log_level: str = "info") -> None:
    """Build the engine, serve until an orderly stop, then return."""
    import uvicorn

    from hpc_cli.engine.engine import Engine
    from hpc_cli.server.app import create_app
    from hpc_cli.server.limits import event_loop, uvicorn_config
    from hpc_cli.server.startup import check_host_tier, fatal_exit, prepare_cache_file, warm_request_path
    from hpc_cli.server.stop import StopController

    s = resolved.settings
    _log_to_stderr("warning" if s.server.tui and log_level == "info" else log_level)
    if s.cache.prefix_cache_file:
        from hpc_cli.engine.persistence import check_cache_file_path

        check_cache_file_path(s.cache.prefix_cache_file)  # other data there: refuse before the model loads
    loop = event_loop(s.server.event_loop)  # before the model: uvloop asked for and missing fails now
    sock = bind_listen_socket(s.server.host, s.server.port)  # before the model: a port in use fails now
    engine = Engine.from_settings(resolved, progress=True)
    echo = lambda msg: click.echo(f"hpc-cli: {msg}", err=True)  # noqa: E731
    report_host_tier(engine.cache.host, echo, follow=not s.server.tui)
    check_host_tier(engine.cache.host)  # none of it: refuse, rather than serve (and save) without it
    save_control = None
    if s.cache.prefix_cache_file:
        from hpc_cli.engine.persistence import attach_cache_file

        prepare_cache_file(s.cache.prefix_cache_file)  # a regular file or absent; killed saves' leftovers go

        # Loads a matching file now (host-only entries) and saves at the orderly stop (spec §5.5).
        save_control = attach_cache_file(engine, s.cache.prefix_cache_file, progress=True).control
    if s.cache.shared_cache:
        from hpc_cli.engine.shared import attach_shared_cache

        tier = attach_shared_cache(engine, s.cache.shared_cache, timeout_ms=s.cache.shared_cache_timeout_ms,
                                   queue_mib=s.cache.shared_cache_queue_mib)
        echo(tier.describe())
    engine.start()
    seconds = engine.warmup(progress=_warmup_progress())
    warm_request_path(engine.tokenizer)  # the chat template compiled before the first request
    click.echo(f"hpc-cli: warm-up done in {seconds:.1f} s (every kernel shape compiled; nothing cached)", err=True)
    notices, tui_shown = None, [False]
    if s.server.tui:
        from hpc_cli.tui.app import Notices

        notices = Notices()

    def notify(msg: str) -> None:  # in the view while it shows (the terminal there is its screen)
        if notices is not None and tui_shown[0]:
            notices.post(msg)
        else:
            click.echo(f"hpc-cli: {msg}", err=True)

    controller = StopController(engine, prefix_cache_file=s.cache.prefix_cache_file, echo=notify,
                                exit_on_fatal=s.server.exit_on_fatal)
    if save_control is not None:
        controller.abort_save = save_control.abandon  # one more Ctrl+C abandons the save
    app = create_app(engine, resolved, stop_controller=controller)
    controller.state = app.state.hpc

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # our orderly stop instead of uvicorn's
            with controller.installed():
                yield

    if s.server.tui and log_level == "info":
        log_level = "warning"  # keep the log from scrolling over the view
    config = uvicorn_config(app, s.server, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
                            loop=loop)
    server = Server(config)
    controller.server = server
    host = s.server.host if ":" not in s.server.host else f"[{s.server.host}]"
    url = f"http://{host}:{sock.getsockname()[1]}"
    text = banner(resolved, url, loop)
    click.echo(text, err=True)
    tui = None
    if s.server.tui:
        from hpc_cli.tui.app import start_tui_thread

        tui_shown[0] = True  # reads engine.stats() only; never slows the worker; opens once uvicorn listens
        tui = start_tui_thread(engine, resolved, chrome=_tui_chrome(text, notices), source=url,
                               ready=lambda: server.started)
    try:
        server.run(sockets=[sock])
    finally:
        if tui is not None:
            tui[1].set()
            tui[0].join(timeout=2)
            tui_shown[0] = False
            for msg in notices.all():  # what the view showed, kept in the terminal's history
                click.echo(f"hpc-cli: {msg}", err=True)
        if not controller.stopping:  # the server ended some other way (bind failure): still stop the engine
            controller.request_stop("server exit", wait=True)
        else:
            controller.done.wait(60)
        if controller.error is not None:
            click.echo(f"hpc-cli: orderly stop failed: {controller.error}", err=True)
    if engine.fatal and s.server.exit_on_fatal:
        raise fatal_exit(engine.fatal)
