"""Compiling constraints into grammars with xgrammar, once per constraint (LRU cache)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from typing import Any

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

BACKENDS = ("xgrammar",)
# A constraint's text is refused past this size: compile time and grammar memory grow
# with it, and no sensible schema is this large.
MAX_CONSTRAINT_CHARS = 256 * 1024
# JSON may put at most this many whitespace characters between two tokens: enough for
# pretty-printed output, and a small model cannot loop on spaces until max_tokens.
MAX_JSON_WHITESPACE = 8
DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong."""


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, with an LRU cache of compiled grammars keyed
    by the constraint (kind, canonical text, whitespace mode). Thread-safe: the server
    compiles on a thread pool while the runner reads the cache."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = "xgrammar",
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend {backend!r} is not supported; choose one of {BACKENDS}")
        import xgrammar as xgr

        self.backend = backend
        self.vocab_size = vocab_size
        # Byte-level BPE or sentencepiece, read from the tokenizer's own description.
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        self.tokenizer_info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer), vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=bool(metadata["add_prefix_space"]))
        # xgrammar's own cache is off: ours is bounded by entries and keyed as we choose.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self.num_compiled = 0  # compilations actually run (cache misses)

    # ----- compiling -------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of `params` (cached); raises StructuredOutputError."""
        key = params.key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(params)
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return grammar

    def compile_with_timeout(self, params: StructuredOutputsParams,
                             timeout: float = DEFAULT_COMPILE_TIMEOUT_S) -> Any:
        """`compile` on the compiler's own thread, waiting at most `timeout` seconds. A
        constraint that takes longer is refused (StructuredOutputError); its compilation
        cannot be interrupted, so it finishes in the background and is cached, while the
        same constraint sent again waits on it rather than starting another."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            future = self._pending.get(key)
            if future is None:
                future = self._pool.submit(self.compile, params)
                self._pending[key] = future
                future.add_done_callback(lambda _: self._forget_pending(key))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise StructuredOutputError(
                f"the {params.kind} constraint took more than {timeout:g} s to compile; simplify it") from None

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        with self._lock:
            return params.key() in self._cache

    def _forget_pending(self, key: tuple) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind, text, compact = params.key()
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise StructuredOutputError(
                f"the {kind} constraint is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS} are accepted")
        compiler = self._compiler
        try:
            if kind == "json":
                _check_json_schema(params.json)
                whitespace = {"any_whitespace": False} if compact else {"max_whitespace_cnt": MAX_JSON_WHITESPACE}
                return compiler.compile_json_schema(text, strict_mode=True, **whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    **({"any_whitespace": False} if compact else
                                                       {"max_whitespace_cnt": MAX_JSON_WHITESPACE}))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            if kind == "grammar":
                return compiler.compile_grammar(text)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
        except StructuredOutputError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError/ValueError with a C++ location prefix
            raise StructuredOutputError(f"invalid {_NAMES[kind]}: {clean_error(error)}") from None
        raise StructuredOutputError(f"unknown constraint kind {kind!r}")


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are also
    EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def clean_error(error: BaseException) -> str:
    """xgrammar's message without its '[time] /project/cpp/file.cc:123: ' prefix."""
    text = str(error).strip()
    text = re.sub(r"^\[[0-9:]+\]\s*\S+?:\d+:\s*", "", text)
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    return text.splitlines()[0] if text else type(error).__name__


def _check_json_schema(schema: str | dict[str, Any]) -> None:
    """The schema must be a JSON object (or boolean) that is itself a valid schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise StructuredOutputError(f"invalid JSON schema: not JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError("invalid JSON schema: a schema must be a JSON object")
    try:
        import jsonschema
    except ImportError:  # validation of the schema itself is a bonus, not a requirement
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise StructuredOutputError(f"invalid JSON schema at {where}: {error.message}") from None


# ----- the tokenizer as xgrammar sees it ---------------------------------------------------


def _encoded_vocab(tokenizer: Tokenizer) -> list[str]:
    backend = tokenizer.backend
    return [backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]


_COMPILERS: dict[tuple[int, int, str], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int, backend: str = "xgrammar") -> GrammarCompiler:
    """The process's compiler for this tokenizer, so the server (which compiles before
    admission) and the model runner (which only reads) share one cache."""
    key = (id(tokenizer), vocab_size, backend)
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = GrammarCompiler(tokenizer, vocab_size, backend)
            compiler._tokenizer = tokenizer  # keeps id(tokenizer) from being reused
            _COMPILERS[key] = compiler
        return compiler
