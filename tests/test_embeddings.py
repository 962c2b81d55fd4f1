"""The pooling runner (`runner="pooling"`, `LLM.embed`): a decoder used as embedder, its
final hidden states pooled LAST / MEAN / CLS, against Hugging Face transformers on the same
weights (the last layer's states after the final norm, pooled the same way)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import assert_engine_idle
from tests.tiny_checkpoint import VOCAB, write_tiny_llama
from tokenmill.config import PoolerConfig, default_model_path, parse_pooler_config
from tokenmill.llm import LLM
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling.params import SamplingParams

# Prompts of several lengths; with max_num_batched_tokens 16 the long ones are prefilled
# in chunks over several steps, batched with the short ones.
PROMPTS = [[1, *range(5, 5 + n)] for n in (3, 17, 40, 9, 64)]


def hf_hidden(path: str, ids: list[int], gguf_file: str | None = None) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) of one sequence."""
    return hf_hiddens(path, [ids], gguf_file)[0]


def hf_hiddens(path: str, sequences: list[list[int]], gguf_file: str | None = None) -> list[torch.Tensor]:
    """The same for several sequences, one model load (a GGUF's takes seconds to dequantize)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, gguf_file=gguf_file, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in sequences]


def pool(hidden: torch.Tensor, pooling_type: str, normalize: bool = True) -> torch.Tensor:
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return F.normalize(vector, dim=-1) if normalize else vector


def write_sentence_transformers(directory, mode: str, normalize: bool) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json, as Qwen3-Embedding ships them."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 96, "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_lasttoken": mode == "lasttoken"}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = write_tiny_llama(tmp_path_factory.mktemp("tiny-embed"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return directory


@pytest.fixture(scope="module")
def reference(tiny):
    return hf_hiddens(str(tiny), PROMPTS)


def tiny_llm(path, **settings) -> LLM:
    return LLM(str(path), runner="pooling", dtype="float32", max_num_batched_tokens=16, block_size=4,
               kv_cache_memory="4MiB", **settings)


def assert_close(ours: list[float], expected: torch.Tensor) -> None:
    ours = torch.tensor(ours)
    assert ours.shape == expected.shape
    assert F.cosine_similarity(ours, expected, dim=0) >= 0.99999
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pooled_states_equal_transformers_batched_and_chunked(tiny, reference, pooling_type) -> None:
    llm = tiny_llm(tiny, pooler_config={"pooling_type": pooling_type})
    outputs = llm.embed(PROMPTS)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for output, hidden in zip(outputs, reference):
        assert output.finished
        assert_close(output.outputs.embedding, pool(hidden, pooling_type))
    stats = llm.engine.stats()
    assert stats.num_generation_tokens == 0  # prefill only: nothing sampled
    # The prompts share a beginning: LAST pooling serves it from the prefix cache, MEAN and
    # CLS need every position's state and compute all of it.
    assert stats.num_prompt_tokens + stats.prefix_cache_hits == sum(map(len, PROMPTS))
    assert (stats.prefix_cache_hits > 0) == (pooling_type == "LAST")
    assert_engine_idle(llm)  # KV freed when each prompt was pooled


def test_normalize_off_and_the_checkpoints_own_pooling_config(tiny, reference, tmp_path) -> None:
    llm = tiny_llm(tiny, pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    assert_close(llm.embed(PROMPTS[1])[0].outputs.embedding, pool(reference[1], "MEAN", normalize=False))
    # No pooler config: the checkpoint's sentence-transformers files say MEAN, no Normalize module.
    directory = write_tiny_llama(tmp_path / "st")
    write_sentence_transformers(directory, "mean", normalize=False)
    llm = LLM(str(directory), dtype="float32", max_num_batched_tokens=16, block_size=4, kv_cache_memory="4MiB")
    # --runner auto: a sentence-transformers checkpoint is served as an embedding model.
    assert llm.engine.facts.runner == "pooling"
    assert (llm.engine.facts.pooling.pooling_type, llm.engine.facts.pooling.normalize) == ("MEAN", False)
    assert_close(llm.embed(PROMPTS[2])[0].outputs.embedding, pool(reference[2], "MEAN", normalize=False))


def test_last_pooling_uses_the_prefix_cache(tiny, reference) -> None:
    llm = tiny_llm(tiny)  # no config anywhere: LAST, normalized
    facts = llm.engine.facts.pooling
    assert (facts.pooling_type, facts.normalize, facts.hidden_size) == ("LAST", True, 96)
    first = llm.embed(PROMPTS[4])[0]
    again = llm.embed([PROMPTS[4], PROMPTS[4][:30]])
    assert first.num_cached_tokens == 0 and again[0].num_cached_tokens == 64  # 65 tokens: every full block (never the last token)
    assert again[1].num_cached_tokens == 28
    assert_close(again[0].outputs.embedding, pool(reference[4], "LAST"))
    assert_close(again[1].outputs.embedding, pool(hf_hidden(str(tiny), PROMPTS[4][:30]), "LAST"))
    assert_engine_idle(llm)


def test_mean_pooling_turns_prefix_hits_off(tiny, reference) -> None:
    llm = tiny_llm(tiny, pooler_config={"pooling_type": "MEAN"})
    llm.embed(PROMPTS[4])
    again = llm.embed(PROMPTS[4])[0]
    assert again.num_cached_tokens == 0  # every position's state is needed
    assert_close(again.outputs.embedding, pool(reference[4], "MEAN"))


def test_matryoshka_dimensions_cut_then_normalize(tiny, reference) -> None:
    llm = tiny_llm(tiny)
    out = llm.embed(PROMPTS[:2], PoolingParams(dimensions=32))
    for output, hidden in zip(out, reference):
        assert_close(output.outputs.embedding, F.normalize(hidden[-1][:32], dim=-1))
    with pytest.raises(ValueError, match="exceeds the model's embedding size"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=97))
    with pytest.raises(ValueError, match="positive integer"):
        PoolingParams(dimensions=0)


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny, reference) -> None:
    llm = tiny_llm(tiny, max_model_len=32)
    long = PROMPTS[4]  # 65 tokens, over max_model_len
    out = llm.embed([long, long], [PoolingParams(truncate_prompt_tokens=10), PoolingParams(truncate_prompt_tokens=-1)])
    assert out[0].prompt_token_ids == long[-10:] and out[1].prompt_token_ids == long[-32:]
    assert_close(out[0].outputs.embedding, pool(hf_hidden(str(tiny), long[-10:]), "LAST"))
    again = llm.embed(long, truncate_prompt_tokens=10)[0]  # the keyword (the prefix cache serves 8 tokens)
    assert again.prompt_token_ids == long[-10:] and again.num_cached_tokens == 8
    assert_close(again.outputs.embedding, torch.tensor(out[0].outputs.embedding))
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(33\) is greater than max_model_len \(32\)"):
        llm.embed(long, truncate_prompt_tokens=33)
    with pytest.raises(ValueError, match="-1 or a positive integer"):
        PoolingParams(truncate_prompt_tokens=0)


def test_refusals_are_clear_and_leave_nothing_behind(tiny, tmp_path) -> None:
    llm = tiny_llm(tiny, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, you requested 65 tokens"):
        llm.embed([PROMPTS[0], [1] * 65])  # the good prompt is not queued either
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.embed([[VOCAB]])
    with pytest.raises(ValueError, match="generation needs the generate runner"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert len(llm.embed([[1] * 64])[0].outputs.embedding) == 96  # a prompt may fill the whole context
    assert_engine_idle(llm)
    plain = write_tiny_llama(tmp_path / "plain")  # not Matryoshka
    with pytest.raises(ValueError, match="does not support matryoshka"):
        tiny_llm(plain).embed(PROMPTS[0], PoolingParams(dimensions=8))


def test_config_refusals(tiny) -> None:
    with pytest.raises(ValueError, match="pooling_type 'ALL' is not supported"):
        parse_pooler_config({"pooling_type": "ALL"})
    with pytest.raises(ValueError, match=r"unsupported key\(s\) \['softmax'\]"):
        parse_pooler_config('{"softmax": true}')
    assert parse_pooler_config('{"pooling_type": "mean"}') == PoolerConfig("MEAN")
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(str(tiny), runner="embed")
    with pytest.raises(ValueError, match="add --runner pooling"):
        LLM(str(tiny), pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="speculative_config does not apply"):
        LLM(str(tiny), runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_generate_runner_refuses_embed(tiny) -> None:
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="embeddings need the pooling runner"):
        llm.embed("w1 w2")


def test_default_model_as_embedder_equals_transformers() -> None:
    """SmolLM2-135M (the default GGUF, dequantized to float32) as a last-token embedder."""
    path = default_model_path()
    llm = LLM(runner="pooling", dtype="float32", max_model_len=512, kv_cache_memory="64MiB",
              max_num_batched_tokens=64)
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors " * 12, "hi"]
    outputs = llm.embed(texts)
    sequences = [llm.tokenizer.encode(text) for text in texts]
    hiddens = hf_hiddens(os.path.dirname(path), sequences, gguf_file=os.path.basename(path))
    for ids, hidden, output in zip(sequences, hiddens, outputs):
        assert output.prompt_token_ids == ids
        ours, expected = torch.tensor(output.outputs.embedding), pool(hidden, "LAST")
        assert F.cosine_similarity(ours, expected, dim=0) >= 0.999
        torch.testing.assert_close(ours, expected, atol=2e-3, rtol=0)
    assert_engine_idle(llm)


def test_a_checkpoint_without_lm_head_loads_for_pooling(tmp_path) -> None:
    """An embedding checkpoint saved as the bare decoder (Qwen3Model: q/k norms, no LM head,
    tensors without the `model.` prefix), as Qwen3-Embedding's shape; LAST pooling."""
    from transformers import Qwen3Config, Qwen3Model

    from tests.tiny_checkpoint import _write_tokenizer

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    Qwen3Model(config).eval().save_pretrained(tmp_path, safe_serialization=True)
    _write_tokenizer(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    llm = tiny_llm(tmp_path)
    assert llm.engine.executor.model.lm_head is None  # never built: hidden states only
    outputs = llm.embed(PROMPTS[:3])
    for ids, output in zip(PROMPTS, outputs):
        assert_close(output.outputs.embedding, pool(hf_hidden(str(tmp_path), ids), "LAST"))
    with pytest.raises(ValueError, match="lacks weights for: lm_head"):
        LLM(str(tmp_path), runner="generate", dtype="float32", kv_cache_memory="4MiB")  # generation needs the head
    # --runner auto: a bare decoder is an embedding model (vLLM's auto detection).
    assert LLM(str(tmp_path), dtype="float32", kv_cache_memory="4MiB").engine.facts.runner == "pooling"


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_embeddings_equal_one_process(tiny, reference, tp, pp) -> None:
    """Each rank builds its pooler; the output rank (rank 0, the last stage) pools."""
    llm = LLM(str(tiny), runner="pooling", dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_num_batched_tokens=16, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=1,
              pooler_config={"pooling_type": "MEAN"}, distributed_timeout=60.0)
    try:
        for output, hidden in zip(llm.embed(PROMPTS), reference):
            assert_close(output.outputs.embedding, pool(hidden, "MEAN"))
        assert_engine_idle(llm)
    finally:
        llm.engine.executor.close()
