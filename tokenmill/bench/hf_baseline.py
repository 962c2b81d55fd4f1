"""The Hugging Face transformers baseline of `tokenmill bench offline`.

The same checkpoint tokenmill serves, loaded with `AutoModelForCausalLM.from_pretrained`.
A GGUF file is dequantized at load time (`GgufConfig(dequantize=True)`), so both systems
multiply the same dense weights in the same dtype. Requests run through `generate`
greedily (`do_sample=False`) with `min_new_tokens = max_new_tokens`, which masks EOS so
every output has exactly the asked-for length.

transformers' `generate` is static batching: a batch starts together, its prompts are
left-padded to the longest one (with an attention mask), and it runs until its longest
output is done. Requests are therefore batched by the caller's rule:

- one request (W1, W2): a single `generate` call of batch size 1;
- many requests (W3): sorted by output length, then cut into batches of `batch_size`, run one
  after the other. Sorting by output length groups requests that need the same number of
  decode steps, which wastes the fewest steps on requests that are already done (decode
  dominates the time); the price is more prompt padding. Each request is counted with the
  tokens it asked for; what its batch generated beyond that is reported separately as
  `generated_tokens`;
- W4 (equal-length prompts): one batch of all requests, so no padding at all.

TTFT is taken inside the same `generate` call through a streamer, whose `put` is called with
the prompt and then once per decode step: the second call marks the batch's first token.
A request's TTFT and end-to-end time are counted from the start of the whole run (its batch
may have waited for earlier ones), as tokenmill's are counted from the submission of all.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from tokenmill.dtypes import torch_dtype
from tokenmill.workloads.offline import Request, RunRecord


class _StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass

    @property
    def first_token_time(self) -> float:
        # times[0]: the prompt; times[1]: the first generated token.
        return self.times[1] if len(self.times) > 1 else self.times[-1]


class HFBaseline:
    def __init__(self, model_path: str, dtype: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.dtype = dtype
        self.device = torch.device(device)
        kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
        if model_path.endswith(".gguf"):
            directory, name = os.path.split(os.path.abspath(model_path))
            kwargs["gguf_file"] = name
            try:  # transformers >= 5 can keep GGUF weights packed; we want them dense
                from transformers import GgufConfig

                kwargs["quantization_config"] = GgufConfig(dequantize=True)
            except ImportError:  # older versions always dequantize
                pass
        else:
            directory = model_path
        self.model = AutoModelForCausalLM.from_pretrained(directory, **kwargs).to(self.device).eval()
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        pad = gen.pad_token_id if gen.pad_token_id is not None else self.eos_token_id
        self.pad_token_id = 0 if pad is None else pad

    def describe(self) -> dict[str, Any]:
        import transformers

        return {
            "transformers": transformers.__version__,
            "model_class": type(self.model).__name__,
            "dtype": str(next(self.model.parameters()).dtype),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "weights": "dequantized from GGUF" if self.model_path.endswith(".gguf") else "safetensors",
            "batching": "W1/W2: one generate call; W3: sorted by output length, padded batches "
                        "(left padding + attention mask) of hf_batch_size run in turn; W4: one batch",
            "greedy": "do_sample=False, min_new_tokens=max_new_tokens",
        }

    def run(self, requests: list[Request], batch_size: int) -> RunRecord:
        order = sorted(range(len(requests)), key=lambda i: (requests[i][1], len(requests[i][0])), reverse=True)
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        n = len(requests)
        ttft, e2e, outputs = [0.0] * n, [0.0] * n, [[] for _ in range(n)]
        generated = 0
        cpu0, t0, m0 = time.process_time(), time.perf_counter(), time.monotonic()
        load = os.getloadavg()[0]
        for batch in batches:
            clock, tokens = self._generate([requests[i] for i in batch])
            done = time.monotonic()
            for row, i in enumerate(batch):
                asked = requests[i][1]
                ttft[i] = clock.first_token_time - m0
                e2e[i] = done - m0
                outputs[i] = tokens[row][:asked]
            generated += len(batch) * len(tokens[0])
        wall = time.perf_counter() - t0
        return RunRecord(
            wall_s=wall,
            ttft_s=ttft,
            e2e_s=e2e,
            prompt_tokens=[len(p) for p, _ in requests],
            output_tokens=[len(o) for o in outputs],
            cached_tokens=[0] * n,
            output_token_ids=outputs,
            generated_tokens=generated,
            cpu_s=time.process_time() - cpu0,
            loadavg_1m=load,
        )

    @torch.inference_mode()
    def _generate(self, batch: list[Request]) -> tuple[_StepClock, list[list[int]]]:
        width = max(len(p) for p, _ in batch)
        new = max(n for _, n in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        clock = _StepClock()
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            streamer=clock,
        )
        tokens = out[:, width:].tolist()
        if any(len(t) != new for t in tokens):
            raise RuntimeError(f"transformers generated {[len(t) for t in tokens]} tokens where {new} were asked for")
        return clock, tokens
