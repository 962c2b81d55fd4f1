"""A live dashboard served by `tokenmill serve` at /dashboard (off with --disable-dashboard).

`state.py` builds snapshots of the engine on its own thread (a StepObserver);
`routes.py` serves the page (static/: plain HTML, JS and canvas, no external network)
and streams the snapshots to it as server-sent events.
"""

from tokenmill.serve.dashboard.routes import PUBLIC_PATHS, Dashboard

__all__ = ["Dashboard", "PUBLIC_PATHS"]
