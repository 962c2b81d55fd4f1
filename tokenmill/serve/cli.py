"""`tokenmill serve` flags (placeholder until the server lands)."""


def register(sub, add_engine_args) -> None:
    pass
