"""`tokenmill eval perplexity`: the windows, the engine's numbers against a direct
computation of the same windows, the command line and its errors, the shipped text."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenmill.cli import main
from tokenmill.eval.perplexity import default_text_path, perplexity, sliding_windows
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams


@pytest.mark.parametrize("n,context,stride", [(10, 4, 4), (10, 4, 1), (11, 4, 3), (3, 8, 4), (100, 16, 16)])
def test_windows_score_every_token_once_with_enough_context(n, context, stride) -> None:
    windows = sliding_windows(n, context, stride)
    scored = [w.end - k for w in windows for k in range(w.num_scored, 0, -1)]
    assert scored == list(range(1, n))  # each token after the first, in order, once
    for i, w in enumerate(windows):
        assert w.start == i * stride and w.length <= context
        if i > 0:  # its first scored token sees context - stride tokens before it
            assert w.length - w.num_scored == context - stride
    assert windows[-1].end == n


def test_window_errors_are_named() -> None:
    with pytest.raises(ValueError, match="context_len must be at least 2"):
        sliding_windows(100, 1, 1)
    with pytest.raises(ValueError, match="stride must be between 1 and context_len"):
        sliding_windows(100, 8, 9)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sliding_windows(1, 8, 4)


def _direct_nlls(llm, ids: list[int], context: int, stride: int) -> list[float]:
    """The same windows through the model directly (dense causal attention, no engine, no
    cache), scored the same way: log_softmax of the logits, the target's entry."""
    model = llm.engine.executor.model
    nlls = []
    with torch.inference_mode():
        for w in sliding_windows(len(ids), context, stride):
            window = ids[w.start : w.end]
            hidden = model(torch.tensor(window), torch.arange(len(window)))
            logprobs = torch.log_softmax(model.compute_logits(hidden[:-1]), dim=-1)
            targets = torch.tensor(window[1:]).unsqueeze(1)
            nlls.extend((-logprobs.gather(1, targets).squeeze(1)).tolist()[-w.num_scored :])
    return nlls


def test_perplexity_through_the_engine_equals_a_direct_computation(llm_f32) -> None:
    """Float32 weights and cache: the engine's paged path (a window is one request, its
    prompt tokens attending as rows of the paged kernel: docs/determinism.md) computes what
    the model computes densely (SDPA over the window) to float32 rounding: 2e-8 apart
    relative, where a window scored with one token of context more or less, or one target
    off, moves the mean by orders of magnitude more. (While prompt chunks attended through
    SDPA too the two were equal to the last bit.)"""
    ids = llm_f32.tokenizer.encode(default_text_path().read_text(encoding="utf-8"))[:300]
    result = perplexity(llm_f32, ids, context_len=128, stride=64, show_progress=False)
    direct = _direct_nlls(llm_f32, ids, 128, 64)
    assert result.num_scored == len(direct) == 299 and result.num_windows == 4
    assert math.isclose(result.nll_per_token, math.fsum(direct) / len(direct), rel_tol=1e-6, abs_tol=0)
    assert result.perplexity == math.exp(result.nll_per_token)
    assert result.settings["kv_cache_dtype"] == "float32"


def test_the_command_prints_a_table_and_writes_json(tmp_path, capsys, llm_f32) -> None:
    """A second engine, built by the command from flags, on a short slice: the same number
    as the library function on the session's float32 engine; an int8 cache moves it a little."""
    out = tmp_path / "ppl.json"
    args = ["eval", "perplexity", "--max-tokens", "200", "--context-len", "96", "--stride", "48", "--dtype",
            "float32", "--kv-cache-memory", "64MiB", "--no-progress"]
    assert main([*args, "--output-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| model" in table and "| perplexity |" in table
    written = json.loads(out.read_text())
    ids = llm_f32.tokenizer.encode(default_text_path().read_text(encoding="utf-8"))[:200]
    expected = perplexity(llm_f32, ids, context_len=96, stride=48, show_progress=False)
    assert written["num_scored"] == 199 and written["num_windows"] == 4
    assert written["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert f"{expected.perplexity:.4f}" in table

    assert main([*args, "--kv-cache-dtype", "int8", "--output-json", str(out)]) == 0
    int8 = json.loads(out.read_text())
    assert int8["settings"]["kv_cache_dtype"] == "int8"
    assert int8["perplexity"] != written["perplexity"]
    assert abs(int8["perplexity"] / written["perplexity"] - 1) < 0.02


def test_cached_prefix_reads_each_windows_context_back_from_the_host_tier(tmp_path, capsys, llm_f32) -> None:
    """--cached-prefix: every window after the first reads its context (whole blocks before the
    position that scores its first token) from the host tier the pool pushed it into. Kept as
    the pool holds it, the perplexity is the computed one's; in the tier's int8 format it moves a
    little. A prompt-logprobs request without the eval's mark still skips the cache."""
    out = tmp_path / "ppl.json"
    args = ["eval", "perplexity", "--max-tokens", "300", "--context-len", "128", "--stride", "64", "--dtype",
            "float32", "--kv-cache-memory", "16MiB", "--cached-prefix", "--kv-offloading-size", "0.25",
            "--no-progress", "--output-json", str(out)]
    ids = llm_f32.tokenizer.encode(default_text_path().read_text(encoding="utf-8"))[:300]
    computed = perplexity(llm_f32, ids, context_len=128, stride=64, show_progress=False)
    results = {}
    for dtype in ("auto", "int8"):
        assert main([*args, "--kv-offloading-cache-dtype", dtype]) == 0
        results[dtype] = json.loads(out.read_text())
        used = results[dtype]["settings"]["cached_prefix"]
        # windows 2-4 each read 48 tokens (3 blocks of 16: the 64-token overlap less the last block)
        assert used == {"cached_tokens": 3 * 48, "from_pool": 0, "from_host_tier": 3 * 48, "from_disk_tier": 0}
        assert results[dtype]["num_scored"] == computed.num_scored == 299
    capsys.readouterr()
    assert results["auto"]["perplexity"] == pytest.approx(computed.perplexity, rel=1e-5)
    assert results["int8"]["perplexity"] != results["auto"]["perplexity"]
    assert abs(results["int8"]["perplexity"] / results["auto"]["perplexity"] - 1) < 0.02

    caching = LLM.from_engine(llm_f32.engine.sibling(enable_prefix_caching=True))
    prompt = ids[:100]
    caching.generate([prompt], SamplingParams(max_tokens=1))
    again = caching.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0 and all(p is not None for p in again.prompt_logprobs[1:])
    caching.engine.reset_prefix_cache()


def test_command_errors(tmp_path, capsys) -> None:
    assert main(["eval", "perplexity", "--quantization", "int8"]) == 2
    assert "quantized already (gguf)" in capsys.readouterr().err  # the default model is Q4_1: names the fix
    assert main(["eval", "perplexity", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert main(["eval", "perplexity", "a.gguf", "--model", "b.gguf"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_the_shipped_text_is_long_enough() -> None:
    from tokenmill.model.loader import default_model_path
    from tokenmill.tokenizer import Tokenizer

    text = default_text_path().read_text(encoding="utf-8")
    assert text.startswith("_Query_ 1. Do not Bodies act upon Light at a distance")
    assert len(Tokenizer.from_gguf(default_model_path()).encode(text)) >= 20_000
