"""`tokenmill serve`: the OpenAI-compatible HTTP server (`cli.py`, `api_server.py`,
`serving.py`, `async_engine.py`, metrics, limits, draining) and the data-parallel
router in front of replica servers (`data_parallel.py`, `routing.py`), which receives
the single server's `serve` as a callable.

A front door: may import builder.py, llm.py, distributed/ (for `--headless`) and
everything below; only cli.py (the floor above) imports it.
"""
