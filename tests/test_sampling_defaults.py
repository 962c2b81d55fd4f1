"""One set of request defaults: SamplingParams declares each parameter once (default and
help text); the CLI's sampling flags are generated from it and the server's request
fields map onto it, so neither re-declares a default of its own."""

from __future__ import annotations

import pytest

from tokenmill.cli import CLI_SAMPLING_FIELDS, build_parser, sampling_params
from tokenmill.sampling.params import SamplingParams, default, sampling_fields
from tokenmill.serve.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.serve.serving import _sampling_params


def test_every_field_has_help_and_the_defaults_are_openai_and_vllm_ones() -> None:
    for f in sampling_fields():
        assert f.metadata["help"], f.name
    assert (default("temperature"), default("top_p"), default("max_tokens"), default("n")) == (1.0, 1.0, 16, 1)


def test_generate_flags_default_to_sampling_params() -> None:
    args = build_parser().parse_args(["generate", "hello"])
    assert sampling_params(args) == SamplingParams()


def test_chat_only_changes_max_tokens_to_the_rest_of_the_context() -> None:
    args = build_parser().parse_args(["chat"])
    assert sampling_params(args) == SamplingParams(max_tokens=None)


def test_every_cli_flag_reaches_its_field() -> None:
    args = build_parser().parse_args([
        "generate", "x", "--max-tokens", "7", "--min-tokens", "2", "--temperature", "0", "--top-p", "0.5",
        "--top-k", "3", "--min-p", "0.1", "--repetition-penalty", "1.2", "--presence-penalty", "0.3",
        "--frequency-penalty", "0.4", "--sampling-seed", "9", "--stop", "a", "--stop", "b",
        "--stop-token-ids", "5", "--ignore-eos", "--no-skip-special-tokens", "--include-stop-str-in-output",
        "--seed", "4",  # the engine's seed, not the request's
    ])
    params = sampling_params(args)
    assert params == SamplingParams(max_tokens=7, min_tokens=2, temperature=0.0, top_p=0.5, top_k=3, min_p=0.1,
                                    repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.4, seed=9,
                                    stop=["a", "b"], stop_token_ids=[5], ignore_eos=True, skip_special_tokens=False,
                                    include_stop_str_in_output=True)
    assert args.seed == 4
    changed = {f.name for f in sampling_fields() if getattr(params, f.name) != f.default}
    assert changed == set(CLI_SAMPLING_FIELDS)  # the test covers every flag


@pytest.mark.parametrize("body", [CompletionRequest(prompt="a"), ChatCompletionRequest(messages=[{"role": "user",
                                                                                                   "content": "a"}])])
def test_a_request_that_says_nothing_gets_sampling_params_defaults(body) -> None:
    assert _sampling_params(body, 5, None) == SamplingParams(max_tokens=5)
    declared = {f.name: f.default for f in sampling_fields()}
    for name, field in type(body).model_fields.items():
        if name in declared and name not in ("max_tokens", "logprobs"):
            assert field.default in (None, declared[name]), name  # null: SamplingParams's default
            assert field.description == SamplingParams.__dataclass_fields__[name].metadata["help"], name


def test_null_means_the_default_and_a_value_is_passed_by_name() -> None:
    body = CompletionRequest.model_validate({"prompt": "a", "temperature": None, "top_p": None, "top_k": 4,
                                             "stop": "x", "logit_bias": {"3": 1.5}})
    params = _sampling_params(body, 3, 2)
    assert params == SamplingParams(max_tokens=3, logprobs=2, top_k=4, stop="x", logit_bias={3: 1.5})
