"""POST /v1/embeddings on a real `tokenmill serve --runner pooling` (a tiny random Llama
checkpoint, Matryoshka by its config.json), through the official `openai` client, against
Hugging Face transformers' pooled last hidden states; and the 404s of each runner."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from openai import OpenAI

from tests.server_utils import ServerProcess
from tests.test_embeddings import hf_hidden, hf_hiddens, pool
from tests.tiny_checkpoint import write_tiny_llama

ARGS = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "8MiB", "--num-threads", "1",
        "--block-size", "4", "--max-num-batched-tokens", "32", "--disable-access-log"]
TEXTS = ["w5 w6 w7", " ".join(f"w{i}" for i in range(10, 60)), "w9"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = write_tiny_llama(tmp_path_factory.mktemp("tiny-embed-server"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return directory


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess("--model", str(checkpoint), "--runner", "pooling", base_args=ARGS).start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' LAST-pooled, normalized vector of each text (BOS first, as encoded)."""
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_hf_dir(str(checkpoint))
    ids = [tokenizer.encode(text) for text in TEXTS]
    return ids, [pool(hidden, "LAST") for hidden in hf_hiddens(str(checkpoint), ids)]


def assert_matches(vector, reference: torch.Tensor) -> None:
    ours = torch.tensor(vector, dtype=torch.float32)
    assert F.cosine_similarity(ours, reference, dim=0) >= 0.99999
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_openai_client_embeds_a_batch_of_texts(client, server, expected) -> None:
    ids, references = expected
    # The official client asks for base64 unless told otherwise, and decodes it.
    result = client.embeddings.create(model=server.model, input=TEXTS)
    assert [d.index for d in result.data] == [0, 1, 2]
    for data, reference in zip(result.data, references):
        assert len(data.embedding) == 96
        assert_matches(data.embedding, reference)
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    assert result.model == server.model
    assert server.wait_idle()["tokenmill:kv_cache_usage_perc"] == 0  # KV freed after each prefill


def test_inputs_as_one_text_token_ids_and_float_format(client, server, expected) -> None:
    ids, references = expected
    one = client.embeddings.create(model=server.model, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[1])
    assert_matches(one.data[0].embedding, references[1])
    tokens = client.embeddings.create(model=server.model, input=ids[0], encoding_format="float")
    assert_matches(tokens.data[0].embedding, references[0])
    batch = client.embeddings.create(model=server.model, input=[ids[2], ids[0]], encoding_format="float")
    for data, reference in zip(batch.data, [references[2], references[0]]):
        assert_matches(data.embedding, reference)


def test_base64_is_little_endian_float32(server, expected) -> None:
    """The wire format itself, read without the client's decoding."""
    response = server.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert_matches(vector.tolist(), expected[1][0])


def test_matryoshka_dimensions(client, server, checkpoint, expected) -> None:
    ids, _ = expected
    result = client.embeddings.create(model=server.model, input=TEXTS[2], dimensions=24, encoding_format="float")
    hidden = hf_hidden(str(checkpoint), ids[2])[-1]
    assert_matches(result.data[0].embedding, F.normalize(hidden[:24], dim=-1))
    for bad, message in ((0, "positive integer"), (97, "exceeds the model's embedding size")):
        with pytest.raises(openai.BadRequestError, match=message) as error:
            client.embeddings.create(model=server.model, input="w1", dimensions=bad)
        assert error.value.body["param"] == "dimensions"


def test_truncate_prompt_tokens(client, server, checkpoint, expected) -> None:
    ids, _ = expected
    result = client.embeddings.create(model=server.model, input=TEXTS[1], encoding_format="float",
                                      extra_body={"truncate_prompt_tokens": 8})
    assert result.usage.prompt_tokens == 8
    assert_matches(result.data[0].embedding, pool(hf_hidden(str(checkpoint), ids[1][-8:]), "LAST"))
    assert len(client.embeddings.create(model=server.model, input=[[1] * 300],
                                        extra_body={"truncate_prompt_tokens": -1}).data) == 1
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len") as error:
        client.embeddings.create(model=server.model, input="w1", extra_body={"truncate_prompt_tokens": 129})
    assert error.value.body["param"] == "truncate_prompt_tokens"


def test_bad_inputs_are_openai_400s(client, server) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 128 tokens. However, you "
                                                     "requested 129 tokens") as error:
        client.embeddings.create(model=server.model, input=[[1] * 129, [1, 2]])
    assert error.value.body["param"] == "input"
    assert error.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model=server.model, input="")
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.embeddings.create(model=server.model, input=[])
    with pytest.raises(openai.BadRequestError, match="out of the vocabulary"):
        client.embeddings.create(model=server.model, input=[1, 100000])
    response = server.post("/v1/embeddings", json={"input": "w1", "encoding_format": "int8"})
    assert response.status_code == 400 and "encoding_format" in response.text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="another-model", input="w1")
    # A prompt may fill the whole context, and nothing above was left behind.
    assert len(client.embeddings.create(model=server.model, input=[[1] * 128]).data) == 1
    assert server.wait_idle()["tokenmill:kv_cache_usage_perc"] == 0


def test_pooling_server_refuses_generation_with_404(client, server) -> None:
    with pytest.raises(openai.NotFoundError, match="does not support Completions API.*--runner generate"):
        client.completions.create(model=server.model, prompt="w1 w2", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="does not support Chat Completions API"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "w1"}])


def test_generate_server_refuses_embeddings_with_404(checkpoint) -> None:
    process = ServerProcess("--model", str(checkpoint), base_args=ARGS).start()
    try:
        client = OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError, match="does not support Embeddings API.*--runner pooling") as error:
            client.embeddings.create(model=process.model, input="w1 w2")
        assert error.value.body["type"] == "not_found_error"
        assert client.completions.create(model=process.model, prompt="w1", max_tokens=2).choices[0].text is not None
    finally:
        assert process.stop() == 0, process.log_tail()


def test_data_parallel_router_forwards_embeddings(checkpoint, expected) -> None:
    """`--data-parallel-size 2 --runner pooling`: the router sends /v1/embeddings to a replica."""
    ids, references = expected
    process = ServerProcess("--model", str(checkpoint), "--runner", "pooling", "--data-parallel-size", "2",
                            base_args=ARGS).start()
    try:
        client = OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for _ in range(2):
            result = client.embeddings.create(model=process.model, input=TEXTS)
            for data, reference in zip(result.data, references):
                assert_matches(data.embedding, reference)
        routed = process.metrics()
        assert sum(v for k, v in routed.items() if k.startswith("tokenmill:router_requests_total")) == 2
    finally:
        assert process.stop() == 0, process.log_tail()


def test_chat_messages_are_embedded_with_the_chat_template(client, server, checkpoint) -> None:
    """vLLM's chat embedding request: the conversation rendered by the model's template
    (the tiny one joins the contents), without a generation prompt."""
    from tokenmill.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5"}]
    result = client.embeddings.create(model=server.model, input=[], encoding_format="float",
                                      extra_body={"messages": messages, "input": None})
    ids = Tokenizer.from_hf_dir(str(checkpoint)).encode("w3 w4 w5 ", add_special_tokens=False)
    assert result.usage.prompt_tokens == len(ids)
    assert_matches(result.data[0].embedding, pool(hf_hidden(str(checkpoint), ids), "LAST"))
    both = server.post("/v1/embeddings", json={"input": "w1", "messages": messages})
    assert both.status_code == 400 and "exactly one of 'input' or 'messages'" in both.text
