"""`tokenmill serve [MODEL]`: the OpenAI-compatible HTTP server.

Every flag can also come from a YAML file (`--config server.yaml`, keys spelled
as the flags, with dashes or underscores); a flag given on the command line
wins over the file, and the file wins over the defaults.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("tokenmill.serve")


class _Unset:
    """Default of every serve flag, so that explicit flags can be told apart."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()
_DEFAULTS_KEY = "_serve_defaults"
_SECRET_SETTINGS = {"api_key"}


def register(sub, planner: Callable[[], Any] | None = None) -> None:
    """`planner`: makes the what-if planner of POST /v1/plan (the simulator's; the command
    line above both rooms hands it over)."""
    from tokenmill.config import add_engine_args

    parser = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).",
    )
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="GGUF file or Hugging Face directory (same as --model)")
    add_engine_args(parser)
    add_server_args(parser)
    parser.set_defaults(func=functools.partial(cmd_serve, planner=planner))
    # Remember the real defaults, then replace them with a marker: cmd_serve fills what
    # the command line left unset from the YAML file first, the defaults second.
    defaults = {k: v for k, v in vars(parser.parse_args([])).items() if k != "func"}
    parser.set_defaults(**{key: _UNSET for key in defaults}, **{_DEFAULTS_KEY: defaults})


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.serve.limits import RequestLimits

    group = parser.add_argument_group("server")
    group.add_argument("--config", default=None, help="YAML file of flag values (command-line flags win)")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    group.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY, else none)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use (default: the model's name)")
    group.add_argument("--protect-health-and-metrics", action="store_true",
                       help="with --api-key, require the key on /health and /metrics too (default: open)")
    group.add_argument("--max-queued-requests", type=int, default=1024,
                       help="answer 429 (with Retry-After) when this many sequences already wait (default 1024)")
    group.add_argument("--max-queue-wait-s", type=float, default=None,
                       help="answer 503 (with Retry-After) to a request not scheduled within this many seconds "
                            "(default: no limit)")
    group.add_argument("--max-request-body-bytes", type=int, default=RequestLimits.max_request_body_bytes,
                       help="answer 413 to a larger body, before parsing it (default 4 MiB)")
    group.add_argument("--max-sequences-per-request", type=int, default=RequestLimits.max_sequences_per_request,
                       help="most sequences (prompts in a list times n) one request may ask for (default 256)")
    group.add_argument("--max-stop-sequences", type=int, default=RequestLimits.max_stop_sequences,
                       help="most stop strings one request may give (default 64)")
    group.add_argument("--max-logprobs", type=int, default=RequestLimits.max_logprobs,
                       help="largest logprobs / top_logprobs a request may ask for (default 20, as vLLM)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (rendered in the sandbox, within its limits)")
    group.add_argument("--shutdown-timeout", type=float, default=25.0,
                       help="on SIGTERM/SIGINT, seconds to let admitted requests finish before aborting them; "
                            "a second signal exits at once (default 25: drain and close fit Kubernetes' default "
                            "30 s grace period; raise terminationGracePeriodSeconds with it)")
    group.add_argument("--header-timeout", type=float, default=20.0,
                       help="close a connection whose request headers are not complete this many seconds after it "
                            "opened or its previous response ended (drip-fed headers; default 20)")
    group.add_argument("--stream-send-timeout", type=float, default=60.0,
                       help="abort a streamed request (freeing its KV cache) and drop the connection when one write "
                            "waits this many seconds for the client to read (default 60)")
    group.add_argument("--health-stall-timeout", type=float, default=60.0,
                       help="/health fails when the engine has work but no step ended for this long (default 60)")
    group.add_argument("--keep-alive-on-engine-death", action="store_true",
                       help="keep serving 503s when the engine loop dies, instead of exiting with status 1")
    group.add_argument("--disable-dashboard", action="store_true",
                       help="do not serve the live dashboard at /dashboard (default: served; behind --api-key)")
    group.add_argument("--allow-special-tokens-in-content", action="store_true",
                       help="tokenize special-token text in messages (e.g. <|im_start|>) as control tokens, as vLLM "
                            "does; by default it is text, so a user cannot forge a system turn")
    group.add_argument("--chat-template", default=None,
                       help="the chat template to use instead of the model's: a file, or the template itself (as vLLM)")
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's own log level (default: --log-level)")
    group.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each generation request's id, prompt length and sampling parameters (no text)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="do not log requests (the default; accepted for vLLM's command lines)")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify clients' certificates with")
    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument("--allowed-origins", type=_string_list, default=None,
                      help='origins browsers may call from: a JSON list (\'["https://a.example"]\', as vLLM) or '
                           'comma-separated; "*" for any')
    cors.add_argument("--allowed-methods", type=_string_list, default=["*"], help="default: any")
    cors.add_argument("--allowed-headers", type=_string_list, default=["*"], help="default: any")
    cors.add_argument("--allow-credentials", action="store_true", help="allow cookies and auth headers")
    from tokenmill.serve.tools import add_agent_args

    add_agent_args(parser)
    scale = parser.add_argument_group("scale-out")
    scale.add_argument("--headless", action="store_true",
                       help="serve no HTTP: run this host's ranks of a multi-host split (--nnodes, --node-rank >= 1, "
                            "--master-addr, --master-port) until the engine on node 0 stops")
    scale.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas (processes) behind this API port, each with its own KV cache")
    scale.add_argument("--data-parallel-policy", default="cache_aware", choices=["cache_aware", "kv_aware", "round_robin"],
                       help="how requests are spread over the replicas: cache_aware = to the replica that served "
                            "the longest prefix recently unless the loads are out of balance (default); kv_aware = "
                            "to the replica whose KV events say it holds the longest prefix of the prompt's tokens")


def _string_list(value: str) -> list[str]:
    """A JSON list of strings (vLLM's spelling) or comma-separated strings."""
    import json

    if value.lstrip().startswith("["):
        parsed = json.loads(value)
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
        return parsed
    return [v.strip() for v in value.split(",") if v.strip()]


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (vLLM's rule: a value that
    cannot be opened and has none of `{`, `}`, newline is a missing file); compiled in the
    sandbox now, so that a broken one is refused before the port is bound."""
    from tokenmill.chat_template import compile_chat_template

    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as file:
            source = file.read()
    except OSError as error:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: "
                             f"{error.strerror}") from None
        source = value
    try:
        compile_chat_template(source)
    except ValueError as error:
        raise ValueError(f"--chat-template: {error}") from None
    return source


def cmd_serve(args: argparse.Namespace, planner: Callable[[], Any] | None = None) -> int:
    settings = resolve_settings(args)
    log_settings(settings, getattr(args, _DEFAULTS_KEY))
    if settings.headless:
        from tokenmill.config import config_from_args
        from tokenmill.distributed.worker import run_node

        logging.getLogger().setLevel(settings.log_level.upper())
        return run_node(config_from_args(settings))
    check_model(settings)
    load_chat_template(settings.chat_template)
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(settings, flag)
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"--{flag.replace('_', '-')} {path!r} does not exist")
    if settings.data_parallel_size > 1:
        from tokenmill.serve.data_parallel import serve_data_parallel

        # The replicas get the planner too: the router proxies POST /v1/plan to one of them
        return serve_data_parallel(settings, functools.partial(serve, planner=planner))
    return serve(settings, planner)


def check_model(settings: argparse.Namespace) -> None:
    """Refuse a bad config, a missing model or an unsupported architecture in one line,
    before any port is bound (as `generate` does): the engine thread loads the model only
    once uvicorn is listening, where a failure took a traceback and a bound port. Opening
    the checkpoint reads its header and tokenizer only (~0.5 s for the default model)."""
    from tokenmill.config import config_from_args
    from tokenmill.model.loader import open_checkpoint

    open_checkpoint(config_from_args(settings).model.model)  # FileNotFoundError, ValueError


# ----- settings ----------------------------------------------------------------------------


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """Command line over YAML file over defaults; raises ValueError for a bad file."""
    defaults: dict[str, Any] = getattr(args, _DEFAULTS_KEY)
    config_path = args.config if args.config is not _UNSET else None
    from_file = load_config_file(config_path, defaults) if config_path else {}
    resolved = {}
    for key, default in defaults.items():
        value = getattr(args, key)
        resolved[key] = value if value is not _UNSET else from_file.get(key, default)
    if resolved["model_tag"] is not None:  # the positional MODEL wins over --model
        resolved["model"] = resolved["model_tag"]
    return argparse.Namespace(**resolved)


def load_config_file(path: str, defaults: dict[str, Any]) -> dict[str, Any]:
    import yaml

    with open(path, encoding="utf-8") as file:
        data = yaml.safe_load(file) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values")
    values = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key in ("no_prefix_caching",):  # the flag's own spelling of enable_prefix_caching
            key, value = "enable_prefix_caching", not value
        if key not in defaults or key in ("config", "model_tag"):
            raise ValueError(f"{path}: unknown setting {raw_key!r}")
        values[key] = _check_type(path, key, value, defaults[key])
    return values


def _check_type(path: str, key: str, value: Any, default: Any) -> Any:
    """YAML gives typed values; refuse one whose type differs from the flag's."""
    if key == "served_model_name" and isinstance(value, str):
        return [value]
    if value is None or default is None:
        return value
    expected = float if isinstance(default, float) else type(default)
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ValueError(f"{path}: {key} must be of type {expected.__name__}, got {value!r}")
    return value


def log_settings(settings: argparse.Namespace, defaults: dict[str, Any]) -> None:
    changed = {
        key: ("***" if key in _SECRET_SETTINGS else value)
        for key, value in vars(settings).items()
        if key != "model_tag" and value != defaults.get(key)
    }
    described = ", ".join(f"{key}={value!r}" for key, value in sorted(changed.items())) or "all defaults"
    logger.info("tokenmill serve, non-default settings: %s", described)


# ----- running -----------------------------------------------------------------------------


def serve(settings: argparse.Namespace, planner: Callable[[], Any] | None = None) -> int:
    """Build the engine config, start uvicorn (the model loads in the engine thread
    meanwhile), and return the exit status once it has shut down."""
    import uvicorn

    from tokenmill.builder import build_engine
    from tokenmill.config import config_from_args
    from tokenmill.runner.worker import freeze_startup_heap
    from tokenmill.serve.api_server import ConnectionAbortMiddleware, CORSSettings, ServerSettings, create_server
    from tokenmill.serve.draining import DrainingServer
    from tokenmill.serve.http_protocol import header_timeout_protocol
    from tokenmill.serve.limits import RequestLimits
    from tokenmill.serve.tools import agent_settings_from_args

    logging.getLogger().setLevel(settings.log_level.upper())
    engine_config = config_from_args(settings)
    for name in ("max_queued_requests",):
        if getattr(settings, name) is not None and getattr(settings, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(settings, name)}")
    for name in ("stream_send_timeout", "header_timeout"):
        if getattr(settings, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(settings, name)}")
    if settings.max_queue_wait_s is not None and settings.max_queue_wait_s <= 0:
        raise ValueError(f"max_queue_wait_s must be positive, got {settings.max_queue_wait_s}")
    limits = RequestLimits(
        max_request_body_bytes=settings.max_request_body_bytes,
        max_sequences_per_request=settings.max_sequences_per_request,
        max_stop_sequences=settings.max_stop_sequences, max_logprobs=settings.max_logprobs,
    )
    fatal: list[BaseException] = []
    uvicorn_server: DrainingServer | None = None  # set once built; on_fatal may run before

    def on_fatal(error: BaseException) -> None:  # the engine thread
        fatal.append(error)
        if uvicorn_server is not None and not settings.keep_alive_on_engine_death:
            uvicorn_server.should_exit = True  # read by uvicorn's main loop each tick

    def build_for_life():  # this process serves one engine until it exits
        engine = build_engine(engine_config)
        freeze_startup_heap("server")
        return engine

    server = create_server(
        build_for_life,
        ServerSettings(
            served_model_names=settings.served_model_name, api_key=settings.api_key,
            protect_health_and_metrics=settings.protect_health_and_metrics,
            max_queued_requests=settings.max_queued_requests, max_queue_wait_s=settings.max_queue_wait_s,
            shutdown_timeout=settings.shutdown_timeout, health_stall_timeout=settings.health_stall_timeout,
            limits=limits, trust_request_chat_template=settings.trust_request_chat_template,
            stream_send_timeout=settings.stream_send_timeout, chat_template=load_chat_template(settings.chat_template),
            enable_log_requests=settings.enable_log_requests and not settings.disable_log_requests,
            allow_special_tokens_in_content=settings.allow_special_tokens_in_content,
            cors=CORSSettings(settings.allowed_origins, settings.allowed_methods, settings.allowed_headers,
                              settings.allow_credentials) if settings.allowed_origins else None,
            on_fatal=on_fatal,
            enable_dashboard=not settings.disable_dashboard, agent=agent_settings_from_args(settings),
            planner=planner() if planner is not None else None,
        ),
    )
    config = uvicorn.Config(
        ConnectionAbortMiddleware(server.app), host=settings.host, port=settings.port,
        log_level=settings.uvicorn_log_level or settings.log_level,
        ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile, ssl_ca_certs=settings.ssl_ca_certs,
        access_log=not settings.disable_access_log, lifespan="on",
        http=header_timeout_protocol(settings.header_timeout),
        # The drain has already waited for the requests; this only covers closing.
        timeout_graceful_shutdown=5,
    )
    uvicorn_server = DrainingServer(config, server.drain)
    uvicorn_server.run()
    if fatal:
        logger.error("exiting with status 1: the engine failed (%s)", type(fatal[0]).__name__)
        return 1
    if not uvicorn_server.drained_cleanly:
        logger.error("exiting with status 1: the engine could not finish or abort its requests")
        return 1
    return 0
