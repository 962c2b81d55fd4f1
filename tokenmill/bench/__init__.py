"""`tokenmill bench`: offline (W1-W6), serving, kernel and sweep benchmarks. A front door
beside `serve/` and `simulator/`: it drives an engine or a server and reports; the shared
pieces (datasets, arrivals, metrics, reports, plots, load client) live in `workloads/`.

May import: `workloads/`, `llm.py`, `builder.py` and everything below them.
"""
