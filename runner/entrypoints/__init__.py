"""Front ends: the offline ``LLM``, the CLI, and the OpenAI-compatible HTTP server."""
