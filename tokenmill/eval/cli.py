"""`tokenmill eval perplexity [MODEL] --text FILE`: perplexity through the engine's paged path."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Perplexity of a text under a model, computed by the engine itself: the text's tokens are cut
into windows of --context-len tokens starting every --stride tokens, each window is one
request whose prompt log-probabilities the engine computes through its scheduler, paged
attention and KV cache (so --kv-cache-dtype, --dtype and the other engine flags are what is
measured), and every token after the first is scored once, with at least
context-len - stride tokens of context outside the first window.

MODEL: a GGUF file or Hugging Face directory (default: the default model). --text: a UTF-8
file (default: the shipped public-domain text, Newton's Opticks, Queries; 25,900 tokens).
"""

EPILOG = """\
examples:
  tokenmill eval perplexity                                   # default model and text
  tokenmill eval perplexity --kv-cache-dtype int8 --output-json int8.json
  tokenmill eval perplexity --cached-prefix --kv-offloading-size 2 --kv-offloading-cache-dtype int8
  tokenmill eval perplexity model.gguf --text book.txt --context-len 2048 --stride 1024
"""


def register(sub) -> None:
    evaluate = sub.add_parser("eval", help="evaluate a model through the engine (perplexity)",
                              description=__doc__.splitlines()[0])
    kinds = evaluate.add_subparsers(dest="eval_command", required=True)
    parser = kinds.add_parser("perplexity", help="perplexity of a text with a sliding window",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_perplexity_args(parser)
    parser.set_defaults(func=cmd_perplexity)


def add_perplexity_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.config import add_engine_args

    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="GGUF file or Hugging Face directory (same as --model)")
    parser.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text (default: the shipped text)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--context-len", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens between window starts (default: half the context length)")
    parser.add_argument("--cached-prefix", action="store_true",
                        help="score each window with its context read back from the prefix cache: prefilled "
                             "first, pushed out of the pool into the host tier when --kv-offloading-size is set, "
                             "so the tier's storage (--kv-offloading-cache-dtype) is what is measured")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="write the result as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(parser)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from tokenmill.config import config_from_args
    from tokenmill.eval.perplexity import default_text_path, format_table, perplexity

    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise ValueError(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model_path
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    stride = args.stride if args.stride is not None else max(1, args.context_len // 2)
    text_path = args.text or str(default_text_path())
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    config = config_from_args(args)
    if config.model.max_model_len is None:  # the windows are all the engine must hold
        config = config.replace(max_model_len=args.context_len + 1)

    from tokenmill.llm import LLM

    llm = LLM(**config.flat())
    token_ids = llm.tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
    result = perplexity(llm, token_ids, args.context_len, stride, show_progress=not args.no_progress,
                        cached_prefix=args.cached_prefix)
    result.settings["text"] = text_path
    print(f"perplexity of {text_path} ({len(token_ids):,} tokens), {result.num_windows} windows, "
          f"{result.tokens_per_second:,.0f} tokens/s computed")
    print(format_table([result]))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=2)
        print(f"wrote {args.output_json}", file=sys.stderr)
    return 0

