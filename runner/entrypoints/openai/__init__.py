"""The OpenAI-compatible HTTP server (vLLM's ``vllm/entrypoints/openai/``), written against
``runner.engine.protocol.EngineClient`` only.

``api_server.build_app`` makes the FastAPI app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/version``, ``/metrics``, ``/reset_prefix_cache``); ``api_server.run_server`` runs it under uvicorn
with the drain-on-signal shutdown; ``cli_args.add_server_args`` adds the server's flags to ``python -m runner
serve``.
"""
