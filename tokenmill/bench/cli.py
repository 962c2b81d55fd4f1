"""`tokenmill bench` subcommands (placeholder until they land)."""


def register(sub, add_engine_args) -> None:
    pass
