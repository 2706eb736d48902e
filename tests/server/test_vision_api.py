"""Images through the HTTP APIs on a tiny multimodal checkpoint written by transformers (CPU):
the openai and anthropic clients send an image and get an answer, and the second identical
request reports cached tokens; the prompt's tokens equal transformers' processor's; bad images
are 400s in each API's own error shape; remote URLs only with [server] allow_remote_media."""

from __future__ import annotations

import base64
import contextlib
import http.server
import threading

import httpx
import pytest
import torch

from hpc_cli.engine.engine import Engine
from hpc_cli.server.app import create_app
from hpc_cli.settings import load_settings
from model.vision_checkpoint import make_image, write_vision_checkpoint

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SYSTEM = "You describe pictures briefly and plainly, in one sentence. " * 2
#: long enough that the system block's end and the generation opener are taps of their own
QUESTION = "Here is a photograph from my trip, taken early in the morning near the old harbour. " * 2
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
MODEL = "vision-tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield write_vision_checkpoint(tmp_path_factory.mktemp("vision-ckpt"))
    torch.set_num_threads(before)  # later modules' tests (a CPU engine's thread team) see the machine's


def _flags(path, **extra):
    return {"model.name": str(path), "model.device": "cpu", "model.max_model_len": 1024,
            "engine.max_concurrency": 2, "engine.prefill_chunk": 64, "cache.host_cache_mib": 16,
            "server.max_image_pixels": 1_000_000, "server.served_model_name": MODEL, **extra}


@contextlib.contextmanager
def _server(path, **extra):
    from .conftest import live_server

    settings = load_settings(None, _flags(path, **extra), environ={})
    engine = Engine.from_settings(settings).start()
    handles = []
    submit = engine.submit

    def recording_submit(request):
        handles.append(submit(request))
        return handles[-1]

    engine.submit = recording_submit
    try:
        with live_server(create_app(engine, settings)) as url:
            yield url, handles
    finally:
        engine.stop(timeout=30)


@pytest.fixture(scope="module")
def live(checkpoint):
    with _server(checkpoint.path) as (url, handles):
        yield url, handles


def _data_url(png: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(png).decode()


def _openai_messages(png: bytes) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": _data_url(png)}},
                                         {"type": "text", "text": "What is in it?"}]}]


def test_openai_image_answer_and_cached_tokens(live, checkpoint):
    url, handles = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    png = make_image(60, 44, seed=11)
    usages = []
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=_openai_messages(png), max_tokens=4,
                                           temperature=0, extra_body=NO_THINK)
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
        usages.append(r.usage)
    first, second = usages
    cached = second.prompt_tokens_details.cached_tokens
    req = handles[-1].request
    (image,) = req.media
    assert first.prompt_tokens_details.cached_tokens <= image.begin
    assert cached > image.end, f"the identical request resumed at {cached}, before the image ends at {image.end}"
    assert cached == handles[-1].finished.usage.reuse_tokens

    # the prompt is what transformers' processor makes of the same conversation
    from PIL import Image
    import io

    proc = checkpoint.processor
    text = proc.apply_chat_template([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                                  {"type": "image"},
                                                                  {"type": "text", "text": "What is in it?"}]}],
                                    add_generation_prompt=True, tokenize=False, enable_thinking=False)
    ref = proc(text=[text], images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    assert req.prompt_tokens == ref["input_ids"][0].tolist()
    assert torch.equal(torch.from_numpy(image.pixels), ref["pixel_values"])


def test_anthropic_image_answer_and_cached_tokens(live, checkpoint):
    url, handles = live
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)
    png = make_image(52, 60, seed=12)
    content = [{"type": "text", "text": QUESTION},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(png).decode()}},
               {"type": "text", "text": "Describe it."}]
    reads = []
    for _ in range(2):
        r = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM,
                                   messages=[{"role": "user", "content": content}])
        assert r.content and r.usage.output_tokens >= 1
        reads.append(r.usage.cache_read_input_tokens)
    (image,) = handles[-1].request.media
    assert reads[0] <= image.begin < image.end < reads[1]  # at most the shared system block, then past the image


def test_different_image_misses_at_the_span_start(live, checkpoint):
    url, handles = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    for seed in (21, 22):  # same size: identical prompt tokens, different pixels
        client.chat.completions.create(model=MODEL, messages=_openai_messages(make_image(60, 44, seed)),
                                       max_tokens=2, temperature=0, extra_body=NO_THINK)
    a, b = handles[-2], handles[-1]
    assert a.request.prompt_tokens == b.request.prompt_tokens
    (image,) = b.request.media
    usage = b.finished.usage
    assert 0 < usage.reuse_tokens <= image.begin  # the system block's tap, never past the span start
    assert usage.cached_prefix_tokens <= image.begin


def _solid_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=60)


@pytest.mark.parametrize("case", ["undecodable", "format", "pixels", "base64"])
def test_bad_images_are_400_in_each_shape(live, checkpoint, case):
    url, _ = live
    data = {"undecodable": base64.b64encode(b"not an image at all").decode(),
            "format": base64.b64encode(make_image(20, 20, seed=1, fmt="TIFF")).decode(),
            "pixels": base64.b64encode(_solid_png(1200, 1000)).decode(),
            "base64": "%%%not-base64%%%"}[case]
    oa = _post(url, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image_url",
                                                   "image_url": {"url": f"data:image/png;base64,{data}"}}]}]})
    assert oa.status_code == 400, oa.text
    err = oa.json()["error"]
    assert err["type"] == "invalid_request_error" and "messages.1" not in err["message"]
    assert err["param"].startswith("messages.0.content.0")
    an = _post(url, "/v1/messages", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": data}}]}]})
    assert an.status_code == 400, an.text
    body = an.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in body["error"]["message"]


@pytest.fixture(scope="module")
def image_host():
    """A loopback HTTP server with one image, one slow response and one oversized body."""
    png = make_image(40, 40, seed=5)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/big.png":
                body = b"\0" * (3 << 20)
            elif self.path == "/slow.png":
                threading.Event().wait(3)
                body = png
            else:
                body = png
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server under test gave up on it (the limits at work)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _remote_body(checkpoint, image_url):
    return {"model": MODEL, "max_tokens": 2, **NO_THINK,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                      {"type": "image_url", "image_url": {"url": image_url}}]}]}


def test_remote_urls_are_off_by_default(live, checkpoint, image_host):
    url, _ = live
    r = _post(url, "/v1/chat/completions", _remote_body(checkpoint, image_host + "/cat.png"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "remote_media_disabled"


def test_remote_urls_with_allow_remote_media(checkpoint, image_host):
    with _server(checkpoint.path, **{"server.allow_remote_media": True, "server.max_image_bytes": 1 << 20,
                                     "server.media_fetch_timeout_s": 1.0}) as (url, handles):
        ok = _post(url, "/v1/chat/completions", _remote_body(checkpoint, image_host + "/cat.png"))
        assert ok.status_code == 200, ok.text
        assert len(handles[-1].request.media) == 1
        big = _post(url, "/v1/chat/completions", _remote_body(checkpoint, image_host + "/big.png"))
        assert big.status_code == 400 and big.json()["error"]["code"] == "image_too_large"
        slow = _post(url, "/v1/chat/completions", _remote_body(checkpoint, image_host + "/slow.png"))
        assert slow.status_code == 400 and slow.json()["error"]["code"] == "image_fetch_failed"


def test_images_to_a_text_only_model_are_400(serve):
    settings = load_settings(None, {"model.name": "builtin:random", "model.device": "cpu",
                                    "model.max_model_len": 512, "engine.max_concurrency": 1}, environ={})
    engine = Engine.from_settings(settings).start()
    try:
        url = serve(create_app(engine, settings))
        png = make_image(20, 20, seed=1)
        oa = _post(url, "/v1/chat/completions", {"model": "builtin:random", "max_tokens": 2,
                                                  "messages": _openai_messages(png)})
        assert oa.status_code == 400 and oa.json()["error"]["code"] == "unsupported_content"
        an = _post(url, "/v1/messages", {"model": "builtin:random", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": base64.b64encode(png).decode()}}]}]})
        assert an.status_code == 400 and "does not take images" in an.json()["error"]["message"]
    finally:
        engine.stop(timeout=30)
