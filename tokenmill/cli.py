"""`tokenmill` command line: generate, chat, serve, bench, plan, simulate, tune, eval."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.config import add_engine_args, config_from_args


# The request parameters `generate` and `chat` take as flags; each flag's type, default
# and help come from its SamplingParams field (tokenmill/sampling/params.py).
CLI_SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                       "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                       "skip_special_tokens", "include_stop_str_in_output")


def add_sampling_args(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """One flag per SamplingParams field of CLI_SAMPLING_FIELDS, with the field's default
    unless `defaults` overrides it (a command that means another default says why)."""
    from tokenmill.sampling.params import sampling_fields

    group = parser.add_argument_group("sampling", "the request's parameters (as SamplingParams and the server's)")
    for f in sampling_fields():
        if f.name not in CLI_SAMPLING_FIELDS:
            continue
        flag = _sampling_flag(f)
        kwargs: dict = {"dest": _dest(flag), "default": defaults.get(f.name, f.default), "help": f.metadata["help"]}
        kind = str(f.type)
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("list["):  # a list field: repeat the flag
            kwargs.update(action="append", type=int if kind.startswith("list[int]") else str,
                          help=kwargs["help"] + " (repeatable)")
        else:
            kwargs["type"] = int if kind.startswith("int") else float if kind.startswith("float") else str
        if not kind == "bool" and kwargs["default"] is not None and "action" not in kwargs:
            kwargs["help"] += f" (default {kwargs['default']})"
        group.add_argument(flag, **kwargs)


def sampling_params(args: argparse.Namespace):
    from tokenmill.sampling.params import SamplingParams, sampling_fields

    values = vars(args)
    return SamplingParams(**{f.name: values[_dest(_sampling_flag(f))] for f in sampling_fields()
                             if f.name in CLI_SAMPLING_FIELDS})


def _sampling_flag(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM

    llm = LLM(**config_from_args(args).flat())
    params = sampling_params(args)
    prompt = args.prompt
    ids = llm.encode_chat([{"role": "user", "content": prompt}]) if args.chat_template else prompt
    (output,) = llm.generate([ids], params)
    print(output.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat that streams tokens as the engine produces them."""
    from tokenmill.llm import LLM

    llm = LLM(**config_from_args(args).flat())
    params = sampling_params(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        reply = _stream_reply(llm, llm.encode_chat(messages), params)
        messages.append({"role": "assistant", "content": reply})
    return 0


def _stream_reply(llm, prompt_ids: list[int], params) -> str:
    engine = llm.engine
    request_id = engine.new_request_id()
    engine.add_request(request_id, prompt_ids, params)
    shown = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                print(text[len(shown):], end="", flush=True)
                shown = text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    print()
    return shown


# Libraries that log every HTTP request at INFO (the DP router's health polls, twice a
# second; `bench serve`'s requests among its progress bar): WARNING unless debugging.
QUIET_LIBRARIES = ("httpx", "httpcore", "urllib3", "filelock")


def configure_logging(level: str = "info") -> None:
    """The root logger at `level` (tokenmill's own lines); chatty libraries at WARNING
    unless `level` is debug."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level.upper())
    quiet = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    # The one default chat changes: a reply runs until it ends (EOS) or the context does,
    # as the server's /v1/chat/completions does when max_tokens is left out (vLLM's too).
    add_sampling_args(chat, max_tokens=None)
    chat.set_defaults(func=cmd_chat)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub) -> None:
    """`serve`, `bench`, `plan` and `eval` register their own flags."""
    from tokenmill.bench import cli as bench_cli
    from tokenmill.eval import cli as eval_cli
    from tokenmill.planner import cli as plan_cli
    from tokenmill.serve import cli as serve_cli
    from tokenmill.simulator import cli as simulate_cli

    serve_cli.register(sub, planner=_what_if_planner)
    bench_cli.register(sub)
    plan_cli.register(sub)
    eval_cli.register(sub)
    simulate_cli.register(sub)


def _what_if_planner():
    """The simulator, for the server's POST /v1/plan (the serve room cannot import it)."""
    from tokenmill.simulator.what_if import SimulatorPlanner

    return SimulatorPlanner()


if __name__ == "__main__":
    sys.exit(main())
