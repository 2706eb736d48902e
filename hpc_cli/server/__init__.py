"""The HTTP server: OpenAI- and Anthropic-compatible routes over an engine
(:class:`hpc_cli.engine.api.Engine`). ``docs/server.md`` walks a request through these modules.

- :mod:`.app` ``create_app``: the application, its error handlers, the routes registered;
  :mod:`.state` what the routes share (:class:`~.state.ServerState`: checks, ``submit``).
- one module per route: :mod:`.chat_completions`, :mod:`.completions` (OpenAI; what the two share
  is :mod:`.openai_common`), :mod:`.messages` (Anthropic; its request's conversion is
  :mod:`.messages_prompt`), :mod:`.info` (health, metrics, cache stats, models).
- :mod:`.schemas` the request bodies of both APIs; :mod:`.streaming` the one SSE loop and the
  whole-response collection; :mod:`.tracking` the per-request accounting.
- prompts: :mod:`.chat` (template, tap hints), :mod:`.vision_prompt` and :mod:`.media` (images),
  :mod:`.tools` (tool calls in generated text); text: :mod:`.common` (errors, the engine's events
  on the event loop, text assembly).
- around it: :mod:`.validate` (bodies), :mod:`.limits` (what a client may make it hold),
  :mod:`.metrics`, :mod:`.timing`, :mod:`.reqlog`, :mod:`.stop` (the orderly stop),
  :mod:`.startup`.
"""
