"""The grammar libraries behind `--structured-outputs-backend`: xgrammar and llguidance
(vLLM's `guidance`), behind one small interface so the compiler's cache and time bound
and the runner's matchers do not care which one compiled a constraint.

A backend turns a constraint (kind, text, compact JSON or not) into a compiled grammar;
a compiled grammar makes matchers, one per sequence. A matcher has xgrammar's four
calls: `accept_token` (False, and no change, for a token the grammar forbids),
`fill_next_token_bitmask` (one int32 row of the bitmask both libraries share: bit i of
word w allows token 32*w + i), `is_terminated` (a stop token was accepted) and
`rollback(n)`.

Both backends produce the same language for the same constraint: JSON with at most
`MAX_JSON_WHITESPACE` whitespace characters between tokens (none, and `", "` / `": "`
separators, when compact), objects without properties the schema does not name
(xgrammar's strict mode; the schema is made explicit for llguidance), regexes matched
whole, EBNF/GBNF grammars from rule `root`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from tokenmill.tokenizer import Tokenizer

# JSON may put at most this many whitespace characters between two tokens: enough for
# pretty-printed output, and a small model cannot loop on spaces until max_tokens.
MAX_JSON_WHITESPACE = 8


class BackendError(ValueError):
    """The library refused the constraint; the message is the library's (cleaned)."""


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        # Byte-level BPE or sentencepiece, read from the tokenizer's own description.
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        self.tokenizer_info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer), vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=bool(metadata["add_prefix_space"]))
        # xgrammar's own cache is off: the compiler's is bounded by entries and keyed as it chooses.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def token_bytes(self) -> list[bytes]:
        return list(self.tokenizer_info.decoded_vocab)

    def compile(self, kind: str, text: str, compact: bool) -> _XgrammarGrammar:
        compiler = self._compiler
        whitespace = {"any_whitespace": False} if compact else {"max_whitespace_cnt": MAX_JSON_WHITESPACE}
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text, strict_mode=True, **whitespace)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind in ("choice", "grammar"):
                compiled = compiler.compile_grammar(text)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(text)
            else:
                raise BackendError(f"unknown constraint kind {kind!r}")
        except BackendError:
            raise
        except Exception as error:  # RuntimeError/ValueError with a C++ location prefix
            raise BackendError(clean_error(error)) from None
        return _XgrammarGrammar(compiled)


class _XgrammarGrammar:
    backend = "xgrammar"

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    def matcher(self) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)  # has the four calls itself


class GuidanceBackend:
    """llguidance: compiles lazily (the lexer is built as the matcher goes), so a new
    constraint costs little up front; a compiled grammar is a template matcher that each
    sequence deep-copies."""

    name = "guidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import llguidance

        self.stop_token_ids = list(tokenizer.eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                eos_token=self.stop_token_ids)

    def token_bytes(self) -> list[bytes]:
        return [self.tokenizer.decode_bytes([i]) for i in range(self.tokenizer.vocab_size)]

    def compile(self, kind: str, text: str, compact: bool) -> _GuidanceGrammar:
        import llguidance

        whitespace: dict[str, Any] = (
            {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} if compact else
            {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"})
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_schema(json.loads(text)),
                                                                        defaults=whitespace)
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=whitespace)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            elif kind in ("choice", "grammar"):
                grammar = llguidance.grammar_from("grammar", text)  # GBNF/EBNF (root ::=) or Lark
            elif kind == "structural_tag":
                grammar = _guidance_structural_tag(text)
            else:
                raise BackendError(f"unknown constraint kind {kind!r}")
        except BackendError:
            raise
        except Exception as error:
            raise BackendError(clean_error(error)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise BackendError(clean_error(error))
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise BackendError(clean_error(template.get_error()))
        return _GuidanceGrammar(template, self.stop_token_ids)


class _GuidanceGrammar:
    backend = "guidance"

    def __init__(self, template: Any, stop_token_ids: list[int]) -> None:
        self.template = template
        self.stop_token_ids = frozenset(stop_token_ids)

    def matcher(self) -> _GuidanceMatcher:
        return _GuidanceMatcher(self.template.deep_copy(), self.stop_token_ids)


class _GuidanceMatcher:
    """An llguidance matcher with xgrammar's calls. llguidance's matcher enters a
    permanent error state on a forbidden token, so a token is checked before it is
    consumed (a rejected speculative proposal must leave the matcher usable). It stops
    as soon as nothing but EOS can follow, so "terminated" is tracked as xgrammar means
    it (a stop token was accepted), and an EOS taken by an already stopped matcher is
    not one of its tokens: a rollback over it undoes nothing there."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self._taken: list[tuple[bool, int]] = []  # per accepted token: (a stop token, tokens llguidance kept)

    def accept_token(self, token_id: int) -> bool:
        stop = token_id in self.stop_token_ids
        # validate_tokens does not count a stop token; one is allowed where the grammar may end.
        allowed = self.matcher.is_accepting() if stop else self.matcher.validate_tokens([token_id]) == 1
        already_stopped = self.matcher.is_stopped()
        if not allowed or not self.matcher.consume_token(token_id):
            return False
        self._taken.append((stop, 0 if stop and already_stopped else 1))
        return True

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> None:
        row = bitmask[index]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def is_terminated(self) -> bool:
        return bool(self._taken) and self._taken[-1][0]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            kept = sum(count for _, count in self._taken[-num_tokens:])
            del self._taken[-num_tokens:]
            if kept:
                self.matcher.rollback(kept)


def strict_schema(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object schema lists
    `properties` and says nothing of others (xgrammar's strict mode, made explicit)."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key in ("enum", "const", "default", "examples") else strict_schema(value))
           for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _guidance_structural_tag(text: str) -> str:
    """xgrammar's structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers"}`,
    as vLLM accepts it) as an llguidance grammar: free text, and after a trigger a tag
    whose body is JSON valid for its schema (vLLM's translation)."""
    import llguidance

    spec = json.loads(text)
    if not isinstance(spec, dict) or "structures" not in spec or "triggers" not in spec:
        raise BackendError("the guidance backend takes a structural tag with 'structures' and 'triggers'")
    tags = []
    for structure in spec["structures"]:
        begin = structure["begin"]
        trigger = next((t for t in spec["triggers"] if begin.startswith(t)), None)
        if trigger is None:
            raise BackendError(f"structural tag begin {begin!r} starts with none of the triggers {spec['triggers']}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=copy.deepcopy(structure["schema"]),
                                         end=structure["end"]))
    if not tags:
        raise BackendError("the structural tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


def clean_error(error: BaseException | str) -> str:
    """A library's message, first line, without xgrammar's '[time] /project/cpp/file.cc:123: '
    prefix or llguidance's position prefix."""
    import re

    text = str(error).strip()
    text = re.sub(r"^\[[0-9:]+\]\s*\S+?:\d+:\s*", "", text)
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    return text.splitlines()[0] if text else type(error).__name__


def _encoded_vocab(tokenizer: Tokenizer) -> list[str]:
    backend = tokenizer.backend
    return [backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]


BACKEND_CLASSES = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
