"""`tokenmill` command line: generate, chat, serve, bench, plan, simulate, eval."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.config import add_engine_args, config_from_args


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of the request's sampling")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from tokenmill.sampling.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


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
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    _add_optional_commands(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _add_optional_commands(sub) -> None:
    """`serve`, `bench`, `plan` and `eval` register their own flags."""
    from tokenmill.bench import cli as bench_cli
    from tokenmill.eval import cli as eval_cli
    from tokenmill.planner import cli as plan_cli
    from tokenmill.serve import cli as serve_cli
    from tokenmill.simulator import cli as simulate_cli

    serve_cli.register(sub)
    bench_cli.register(sub)
    plan_cli.register(sub)
    eval_cli.register(sub)
    simulate_cli.register(sub)


if __name__ == "__main__":
    sys.exit(main())
