"""Compiling constraints into grammars, once per constraint (LRU cache), with the
backend `--structured-outputs-backend` names (vLLM's names: `xgrammar`, `guidance`
(llguidance), or `auto`, the default: llguidance, and xgrammar for a constraint
llguidance refuses).

Why llguidance first (docs/agent-apis.md, "What it costs"): it compiles a new schema in
about 1-10 ms where xgrammar takes up to ~400 ms (any schema with a length-bounded
string), which is the whole first-token latency of a new schema; its tokenizer set-up
at start-up is 0.3 s against xgrammar's 2.7 s; decode with either stays within the 95%
target. xgrammar is kept for what llguidance refuses (e.g. xgrammar's own structural
tag format) and as an explicit choice."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from typing import Any

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.structured_output.backends import (
    BACKEND_CLASSES,
    MAX_JSON_WHITESPACE,
    BackendError,
    clean_error,
)
from tokenmill.tokenizer import Tokenizer

try:  # imported here, not on a request's first schema (it takes ~40 ms)
    import jsonschema_rs
except ImportError:  # jsonschema alone checks schemas, 1-7 ms each
    jsonschema_rs = None

BACKENDS = ("auto", "xgrammar", "guidance")
# A constraint's text is refused past this size: compile time and grammar memory grow
# with it, and no sensible schema is this large.
MAX_CONSTRAINT_CHARS = 256 * 1024
DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0

__all__ = ["BACKENDS", "MAX_JSON_WHITESPACE", "GrammarCompiler", "StructuredOutputError", "choice_grammar",
           "clean_error", "compiler_for"]


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong."""


class GrammarCompiler:
    """The grammar compiler for one tokenizer, with an LRU cache of compiled grammars keyed
    by the constraint (kind, canonical text, whitespace mode). Thread-safe: the server
    compiles on a thread pool while the runner reads the cache. A compiled grammar makes
    the matchers (`grammar.matcher()`) of the backend that compiled it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, backend: str = "auto",
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend {backend!r} is not supported; choose one of {BACKENDS}")
        self.backend = backend
        self.vocab_size = vocab_size
        self.stop_token_ids = list(tokenizer.eos_token_ids)
        self._tokenizer = tokenizer  # also keeps id(tokenizer) from being reused (compiler_for's key)
        # The backends, built when first needed (xgrammar's, under auto, by the first
        # constraint llguidance refuses).
        self._backends: dict[str, Any] = {}
        self._backends_lock = threading.Lock()
        self._unusable: set[str] = set()
        try:
            self._backend(self._order()[0])  # the tokenizer set-up is paid at start-up, not by a request
        except ValueError:
            # llguidance cannot read some tokenizers (e.g. a tokenizer.json without a decoder:
            # "can't determine decoder type"): auto then uses xgrammar alone; asked by name, it fails.
            if self.backend != "auto":
                raise
            self._unusable.add(self._order()[0])
            self._backend(self._order()[0])
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._pending: dict[tuple, concurrent.futures.Future] = {}
        self.num_compiled = 0  # compilations actually run (cache misses)
        self._token_bytes: list[bytes] | None = None

    def _order(self) -> tuple[str, ...]:
        order = ("guidance", "xgrammar") if self.backend == "auto" else (self.backend,)
        return tuple(name for name in order if name not in self._unusable)

    def _backend(self, name: str) -> Any:
        with self._backends_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = BACKEND_CLASSES[name](self._tokenizer, self.vocab_size)
            return backend

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes, as the (first) backend decodes them."""
        if self._token_bytes is None:
            self._token_bytes = self._backend(self._order()[0]).token_bytes()
        return self._token_bytes

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
        if kind == "json":
            _check_json_schema(params.json)
        elif kind == "choice":
            kind, text = "grammar", choice_grammar(params.choice)
        first_error: BackendError | None = None
        for name in self._order():  # auto: xgrammar only for what llguidance refuses
            try:
                return self._backend(name).compile(kind, text, compact)
            except BackendError as error:
                first_error = first_error or error
        raise StructuredOutputError(f"invalid {_NAMES[params.kind]}: {first_error}") from None


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are also
    EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


_KNOWN_DRAFTS = tuple(f"{base}{end}" for base in (
    "https://json-schema.org/draft/2020-12/schema", "https://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft-07/schema", "http://json-schema.org/draft-06/schema",
    "http://json-schema.org/draft-04/schema") for end in ("", "#"))


def _check_json_schema(schema: str | dict[str, Any]) -> None:
    """The schema must be a JSON object (or boolean) that is itself a valid schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise StructuredOutputError(f"invalid JSON schema: not JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError("invalid JSON schema: a schema must be a JSON object")
    # The Rust validator answers in microseconds where jsonschema takes 1-7 ms, on every new
    # schema; only for the drafts it ships (another `$schema` would make it fetch a URL).
    if isinstance(schema, bool) or schema.get("$schema", _KNOWN_DRAFTS[0]) in _KNOWN_DRAFTS:
        try:
            if jsonschema_rs is not None and jsonschema_rs.meta.is_valid(schema):
                return
        except Exception:  # it failed: jsonschema decides
            pass
    try:  # only jsonschema's message says where and what is wrong
        import jsonschema
    except ImportError:  # validation of the schema itself is a bonus, not a requirement
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        raise StructuredOutputError(f"invalid JSON schema at {where}: {error.message}") from None


_COMPILERS: dict[tuple[int, int, str], GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int, backend: str = "auto") -> GrammarCompiler:
    """The process's compiler for this tokenizer, so the server (which compiles before
    admission) and the model runner (which only reads) share one cache."""
    key = (id(tokenizer), vocab_size, backend)
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = GrammarCompiler(tokenizer, vocab_size, backend)
            _COMPILERS[key] = compiler
        return compiler
