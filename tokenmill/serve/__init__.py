"""The OpenAI-compatible HTTP server (`tokenmill serve`): FastAPI app and routes, the
asyncio wrapper around the engine thread, request/response schemas, errors, limits,
draining, Prometheus metrics, and the data-parallel router in front of replicas.

A front door: may import `llm.py`, `builder.py` and everything below them; nothing
imports it but `cli.py`.
"""
