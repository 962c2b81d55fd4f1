"""Text <-> token ids, and chat templates, on top of the Rust `tokenizers` library.

A `Tokenizer` is built either from a GGUF file's metadata (`from_gguf`), which has no
`tokenizer.json` but stores the vocabulary, merges and special token ids under llama.cpp's
key names, or from a Hugging Face checkpoint directory (`from_hf_dir`).

transformers is deliberately not used at runtime: it takes ~11 s to build a tokenizer from a
GGUF, where building the `tokenizers` backend directly takes a fraction of a second.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.chat_template import RESERVED_TEMPLATE_VARIABLES, RenderLimits, render_chat_template
from tokenmill.gguf_file import read_gguf_metadata

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType).
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split regexes by `tokenizer.ggml.pre`, as llama.cpp and transformers'
# gguf_tokenizer_mapping.py define them. Each vocabulary's merges were learned on text split
# this way, so using another split gives different (worse) tokenizations.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# llama.cpp splits these into single digits first, then applies the GPT-2 regex; SmolLM2's own
# tokenizer.json says the same with Digits(individual_digits=True) + ByteLevel(use_regex=True).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_PLAIN_GPT2 = {"default", "gpt-2", "gpt2"}

# Chat-template variable -> GGUF key of its token id.
_GGUF_TEMPLATE_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what a checkpoint says around it: BOS/EOS, chat template.

    Attributes:
        backend: the underlying `tokenizers.Tokenizer`.
        vocab_size: number of token ids, added tokens included.
        bos_token_id: the beginning-of-sequence id, or None.
        eos_token_ids: every id that ends generation (EOS, and EOT/EOM where the checkpoint has them).
        chat_template: the Jinja chat template source, or None.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        template_tokens: dict[str, str] | None = None,
    ) -> None:
        """`template_tokens` are the special-token strings a chat template sees (bos_token, ...)."""
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.template_tokens: dict[str, str] = dict(template_tokens or {})
        self._special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        # A tokenizer.json's post-processor may add BOS/EOS itself; then encode() must not add another.
        framing = backend.encode("", add_special_tokens=True).ids
        self._post_processor_adds_bos = bos_token_id is not None and framing[:1] == [bos_token_id]
        after_bos = framing[1:] if self._post_processor_adds_bos else framing
        self._post_processor_adds_eos = bool(after_bos) and after_bos[-1] in self.eos_token_ids
        self._token_text_cache: dict[int, str] = {}
        self._max_token_chars: int | None = None
        self._text_anchor = backend.encode("a", add_special_tokens=False).ids
        self._specials: list[str] | None = None
        self._plain_text_backend: BackendTokenizer | None = None

    # ----- construction ------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: gguf.GGUFReader | dict[str, Any] | str | os.PathLike[str]) -> Tokenizer:
        """Build from a GGUF's `tokenizer.*` metadata.

        Takes the parsed metadata (a dict), an open `gguf.GGUFReader`, or a path: then only
        the metadata is parsed, ~10x faster than opening a GGUFReader (which builds a numpy
        view per vocabulary string).
        """
        if isinstance(source, dict):
            meta = source
        elif hasattr(source, "fields"):
            meta = {key: field.contents() for key, field in source.fields.items() if key.startswith("tokenizer.")}
        else:
            meta = read_gguf_metadata(source, prefix="tokenizer.")
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _byte_level_bpe_from_gguf(meta)
        elif kind == "llama":
            backend = _sentencepiece_bpe_from_gguf(meta)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer type {kind!r} (tokenizer.ggml.model); "
                "supported: 'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE)"
            )
        tokens: list[str] = meta.get("tokenizer.ggml.tokens")
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        # llama.cpp ends generation on EOT/EOM too (llama3's <|eot_id|>, <|eom_id|>).
        eos_ids = [
            token_id
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (token_id := meta.get(f"tokenizer.ggml.{key}")) is not None
        ]
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        template_tokens = {
            name: tokens[token_id]
            for name, key in _GGUF_TEMPLATE_TOKEN_KEYS.items()
            if (token_id := meta.get(key)) is not None and token_id < len(tokens)
        }
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=bool(add_bos),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            template_tokens=template_tokens,
        )

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a model path as `resolve_model_path` gives it: a Hugging Face
        directory or a GGUF file (only its metadata is read)."""
        if Path(path).is_dir():
            return cls.from_hf_dir(path)
        if Path(path).is_file():
            return cls.from_gguf(path)
        raise FileNotFoundError(f"{str(path)!r}: no such GGUF file or Hugging Face directory")

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a Hugging Face checkpoint directory.

        Reads `tokenizer.json` (required), `tokenizer_config.json` (required: EOS and the chat
        template live there), the chat template from `chat_template.jinja` / `chat_template.json`
        when present, and `generation_config.json`'s `eos_token_id` when present.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(directory)!r} does not exist")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found in {str(directory)!r} "
                "(only the fast-tokenizer format is supported, not tokenizer.model alone)"
            )
        config_file = directory / "tokenizer_config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"tokenizer_config.json not found in {str(directory)!r}")

        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(config_file)
        generation_config = _read_json(directory / "generation_config.json", missing_ok=True)

        template_tokens = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_content(config.get(name))) is not None
        }
        bos_id = _token_id(backend, template_tokens.get("bos_token"))
        eos_id = _token_id(backend, template_tokens.get("eos_token"))
        # generation_config.json may name more ids that end generation (llama3: <|eot_id|>).
        generation_eos = generation_config.get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        eos_ids = [*([eos_id] if eos_id is not None else []), *(int(i) for i in generation_eos or [])]
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=_read_hf_chat_template(directory, config),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            template_tokens=template_tokens,
        )

    # ----- encoding and decoding ---------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.

        With `add_special_tokens`, BOS/EOS are added where the checkpoint asks for them and
        the backend's post-processor has not already added them.
        """
        ids = self.encode_plain(text, add_special_tokens)
        if not add_special_tokens:
            return ids
        if self.add_bos_token and self.bos_token_id is not None and not self._post_processor_adds_bos:
            ids.insert(0, self.bos_token_id)
        if self.add_eos_token and self.eos_token_ids and not self._post_processor_adds_eos:
            ids.append(self.eos_token_ids[0])
        return ids

    def encode_plain(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The backend's ids for `text`, without encode()'s BOS/EOS rules.

        Through `encode_batch`, which releases the GIL (the single-text `encode` holds it:
        a 1 MB prompt froze a server's event loop for as long as it took to tokenize).
        A string that is not valid Unicode (a lone surrogate, which JSON can spell as
        "\\ud800") is a ValueError, not the backend's TypeError.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError as error:
            position = first_lone_surrogate(text)
            if position is None:
                raise
            raise ValueError(
                f"the text has a lone surrogate (U+{ord(text[position]):04X} at character {position}), "
                "which is not valid Unicode"
            ) from error

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form whole UTF-8 characters come out as U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        """Decoded text of one token, for logprob display (special tokens shown as written).

        Decoded after an anchor token and then cut, because sentencepiece decoders strip the
        leading space of the first token ("▁Paris" alone decodes to "Paris", not " Paris").
        """
        text = self._token_text_cache.get(token_id)
        if text is None:
            anchor = self.backend.decode(self._text_anchor, skip_special_tokens=False)
            both = self.backend.decode([*self._text_anchor, token_id], skip_special_tokens=False)
            text = both[len(anchor):] if both.startswith(anchor) else self.decode([token_id], False)
            self._token_text_cache[token_id] = text
        return text

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for: the longest
        vocabulary entry (byte-level and sentencepiece spellings are never shorter than
        the text they decode to), times 4 when a normalizer could shrink the input
        (NFKC composes several characters into one). So a text of C characters has at
        least C / max_token_chars tokens."""
        if self._max_token_chars is None:
            longest = max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)), default=1)
            self._max_token_chars = longest * (4 if self.backend.normalizer is not None else 1)
        return self._max_token_chars

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special (control) token, skipped by `skip_special_tokens`."""
        return token_id in self._special_ids

    # ----- chat templates ----------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        limits: RenderLimits | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template (or `chat_template`), as
        transformers does, in a sandbox with time and size limits (see chat_template.py).

        `template_kwargs` and extra keyword arguments become template variables (e.g.
        `enable_thinking=False`); a client's dict goes in `template_kwargs`, where a key
        that names a variable set here is a clear error rather than a TypeError.
        Raises ValueError if there is no template, a message is malformed, a template
        variable is reserved (messages, tools, add_generation_prompt, chat_template), or
        the template fails: raises (`raise_exception`), breaks the sandbox or goes over
        its limits.
        """
        kwargs = {**(template_kwargs or {}), **kwargs}
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        _check_messages(messages)
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
        if reserved:
            raise ValueError(f"template variables {reserved} are set by the server and cannot be passed again")
        variables = {**self.template_tokens, **kwargs,
                     "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        return render_chat_template(source, variables, *([limits] if limits else []))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        limits: RenderLimits | None = None,
        allow_special_tokens_in_content: bool = False,
        check_text: Callable[[str], None] | None = None,
    ) -> tuple[str, list[int]]:
        """(rendered text, token ids) of a conversation. The template writes its own special
        tokens (BOS included); special-token text in what the caller sent (message contents,
        template kwargs) is tokenized as text, so that a user message holding
        `<|im_end|>\\n<|im_start|>system\\n...` cannot forge a system turn (issue 31; OpenAI's
        API does not let a user write roles). `allow_special_tokens_in_content` restores the
        old behaviour (vLLM's): such text becomes control tokens. `check_text` sees the
        rendered text before it is tokenized (a length check).

        How: each special token's text in the caller's strings is replaced by a marker (a
        private-use character found in none of them, then the token's index), the template
        renders that, and each marker is encoded as the token's text while the rest is
        encoded as before. A conversation without special-token text renders and encodes
        exactly as it always did."""
        specials = self._special_texts()
        caller_data = (messages, template_kwargs)
        if allow_special_tokens_in_content or not _contains_any(caller_data, specials):
            text = self.apply_chat_template(messages, add_generation_prompt, chat_template=chat_template,
                                            template_kwargs=template_kwargs, limits=limits)
            if check_text is not None:
                check_text(text)
            return text, self.encode(text, add_special_tokens=False)
        marker = _unused_private_char(caller_data, chat_template or self.chat_template or "")
        marked_messages, marked_kwargs = _replace_strings(caller_data, lambda v: _mark(v, specials, marker))
        marked = self.apply_chat_template(marked_messages, add_generation_prompt, chat_template=chat_template,
                                          template_kwargs=marked_kwargs, limits=limits)
        if check_text is not None:
            check_text(marked)  # markers are shorter than the tokens' text: a close bound
        head, *rest = marked.split(marker)
        ids = self.encode_plain(head)
        text_parts = [head]
        for part in rest:
            index = ord(part[0]) - _MARK_BASE if part else -1
            if not 0 <= index < len(specials):
                raise ValueError("the chat template cut a special token's text written in a message")
            ids += self._text_backend().encode_batch([specials[index]], add_special_tokens=False)[0].ids
            ids += self.encode_plain(part[1:])
            text_parts += [specials[index], part[1:]]
        return "".join(text_parts), ids

    def _special_texts(self) -> list[str]:
        """The special tokens' texts, longest first (a marker replaces a whole token)."""
        if self._specials is None:
            texts = {token.content for token in self.backend.get_added_tokens_decoder().values() if token.special}
            self._specials = sorted((t for t in texts if t), key=len, reverse=True)
        return self._specials

    def _text_backend(self) -> BackendTokenizer:
        """A copy of the backend that encodes special tokens' text as plain text."""
        with _TEXT_BACKEND_LOCK:
            if self._plain_text_backend is None:
                backend = BackendTokenizer.from_str(self.backend.to_str())
                backend.encode_special_tokens = True
                self._plain_text_backend = backend
        return self._plain_text_backend


# ----- GGUF ------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the spelling of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _byte_level_bpe_from_gguf(meta: dict[str, Any]) -> BackendTokenizer:
    """Byte-level BPE (GPT-2 style) from `tokens`, `merges` and `token_type`."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")

    vocab = _byte_level_vocab(tokens, token_types)
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=_split_merges(merges)))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, token_types)
    return backend


def _byte_level_vocab(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """Token -> id, with every normal token spelled in the byte alphabet.

    Some converters store a normal token as its raw text; it is respelled so BPE can reach it.
    Control and user-defined tokens keep their raw text: they are matched whole as added tokens.
    """
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
        if token_type == _TOKEN_TYPE_NORMAL and not set(token) <= alphabet:
            respelled = "".join(spelling[byte] for byte in token.encode("utf-8"))
            token = respelled if respelled not in vocab else token
        vocab.setdefault(token, token_id)
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate tokens", len(tokens) - len(vocab))
    return vocab


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """How text is split into words before BPE, by llama.cpp's `tokenizer.ggml.pre` name."""
    if pre in _PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre is not None and pre not in _PLAIN_GPT2:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text with the GPT-2 regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_bpe_from_gguf(meta: dict[str, Any]) -> BackendTokenizer:
    """Sentencepiece BPE (llama/mistral style): byte fallback, "▁" for spaces."""
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [_TOKEN_TYPE_NORMAL] * len(tokens)
    vocab = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        merge_pairs = _split_merges(merges)
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("GGUF sentencepiece tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
        merge_pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None

    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_added_tokens(backend, tokens, token_types)
    return backend


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    """GGUF stores each merge as "left right"; tokens themselves never contain a raw space."""
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    return pairs


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary: every split of a token into two
    vocabulary tokens is a merge, ranked by the merged token's score (best first).

    Same ordering as transformers' `generate_merges`, so both give the same tokenization.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    for merged, score in scores.items():
        local = []
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        ranked.extend((score, len(left), len(right), left, right) for _, _, left, right in local)
    # Stable sort, descending by (score, len(left), len(right)), as transformers does.
    ranked.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for *_, left, right in ranked]


def _add_gguf_added_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Make control tokens special added tokens and user-defined tokens plain added tokens.

    Either way they are matched whole in text (as llama.cpp does) instead of being cut into
    pieces; their text is already in the vocabulary, so they keep their GGUF ids.
    """
    control = [
        AddedToken(token, special=True, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)


# ----- Hugging Face directories ----------------------------------------------------------


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path.name} is not valid JSON: {error}") from error


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json writes a token as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _token_id(backend: BackendTokenizer, text: str | None) -> int | None:
    return None if text is None else backend.token_to_id(text)


def _read_hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The chat template: a separate file wins over tokenizer_config.json, as in transformers."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = directory / "chat_template.json"
    template = _read_json(json_file)["chat_template"] if json_file.is_file() else config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


# ----- chat templates --------------------------------------------------------------------


def _check_messages(messages: list[dict[str, Any]]) -> None:
    """Each message needs a role, and content unless it is an assistant's tool calls."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be an object with 'role' and 'content'")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {index} has no 'role'")
        if "content" not in message and not message.get("tool_calls"):
            raise ValueError(f"message {index} has no 'content'")


def first_lone_surrogate(text: str) -> int | None:
    """Index of the first UTF-16 surrogate code point in `text` (never valid alone in a
    str), or None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        return error.start


# ----- special tokens in what a chat's caller sent -------------------------------------------

_TEXT_BACKEND_LOCK = threading.Lock()
_MARK_BASE = 0xF0000  # Supplementary Private Use Area-A: a marker is followed by chr(_MARK_BASE + index)


def _replace_strings(data: Any, function: Callable[[str], str]) -> Any:
    """`data` with `function` applied to every string value (dict keys are left alone)."""
    if isinstance(data, str):
        return function(data)
    if isinstance(data, dict):
        return {key: _replace_strings(value, function) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_replace_strings(value, function) for value in data)
    return data


def _contains_any(data: Any, needles: list[str]) -> bool:
    found = []
    _replace_strings(data, lambda value: found.append(any(n in value for n in needles)) or value)
    return any(found)


def _unused_private_char(data: Any, template: str) -> str:
    """A private-use character of the Basic Multilingual Plane in none of the strings."""
    seen = set(template)
    _replace_strings(data, lambda value: seen.update(value) or value)
    for code in range(0xE000, 0xF900):
        if chr(code) not in seen:
            return chr(code)
    raise ValueError("the conversation uses every private-use character")


def _mark(value: str, specials: list[str], marker: str) -> str:
    for index, special in enumerate(specials):
        if special in value:
            value = value.replace(special, marker + chr(_MARK_BASE + index))
    return value
