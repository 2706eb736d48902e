"""One log line per finished request (logger ``hpc_cli.server.requests``, INFO): the route, the
outcome, prompt and cached tokens, time to first token, output tokens and their rate, the total.

    hpc-cli: POST /v1/chat/completions ok | prompt 1204 tok, cached 1152 | ttft 0.083 s | output 16 tok, 41.2 tok/s | 0.47 s
"""

from __future__ import annotations

import logging

from hpc_cli.engine.api import Usage

log = logging.getLogger("hpc_cli.server.requests")

ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages"}


def request_line(endpoint: str, outcome: str, usage: Usage | None, seconds: float) -> str:
    route = ROUTES.get(endpoint, endpoint)
    parts = [f"POST {route} {outcome}"]
    if usage is not None:
        parts.append(f"prompt {usage.prompt_tokens} tok, cached {usage.reuse_tokens}")
        ttft = usage.time_to_first_token
        parts.append("ttft -" if ttft is None else f"ttft {ttft:.3f} s")
        out = f"output {usage.completion_tokens} tok"
        decode_s = seconds - (ttft or 0.0)
        if usage.completion_tokens > 1 and decode_s > 0:
            out += f", {(usage.completion_tokens - 1) / decode_s:.1f} tok/s"
        parts.append(out)
    parts.append(f"{seconds:.2f} s")
    return " | ".join(parts)


def log_request(endpoint: str, outcome: str, usage: Usage | None, seconds: float) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("%s", request_line(endpoint, outcome, usage, seconds))
