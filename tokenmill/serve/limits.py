"""What one request may ask for. Each limit is checked before any work is done for
the request, and each exists so that a small body cannot buy a large amount of the
server's memory or CPU (docs/reliability.md lists them with their sources).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.serve.errors import APIError, bad_request

# OpenAI's ceilings where it publishes one (n 128, logit_bias 300 entries); vLLM's
# --max-logprobs default (20); TGI's --max-stop-sequences flag name (its default is 4,
# OpenAI's too; vLLM has none: 64 keeps vLLM clients working).
MAX_N = 128
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = 4 * 2**20
    max_sequences_per_request: int = 256  # prompts in a list times n
    max_stop_sequences: int = 64
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_sequences_per_request", "max_stop_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    # ----- checks (each raises a 400 naming the field) --------------------------------------

    def check_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences_per_request:
            param = "prompt" if num_prompts > 1 else "n"
            raise bad_request(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}); "
                f"the limit is {self.max_sequences_per_request} per request: split it", param=param)

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.max_logprobs:
            raise bad_request(f"{param} must be at most {self.max_logprobs}, got {value}", param=param)

    def check_stop(self, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_sequences:
            raise bad_request(f"stop may hold at most {self.max_stop_sequences} strings, got {len(stops)}",
                              param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise bad_request(f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters, "
                              f"got one of {longest}", param="stop")
        if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}",
                              param="stop_token_ids")

    @staticmethod
    def check_logit_bias(bias: dict[str, Any] | None) -> None:
        if bias is not None and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
                              param="logit_bias")


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-body-bytes)", code="request_too_large", headers={"Connection": "close"})
