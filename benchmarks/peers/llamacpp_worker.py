"""Worker: llama.cpp through llama-cpp-python's low-level API, batched as `llama-server -np N` does.

Runs in the llama.cpp virtual environment (no tokenmill there). The high-level `Llama`
object serves one sequence at a time, so this drives `llama_decode` directly:

- one context with `n_seq_max` sequences, a unified KV cache (`kv_unified`, when the
  version has it) of `n_ctx` cells shared by all sequences, `n_batch = n_ubatch = 512`,
  `n_threads = n_threads_batch = --threads`;
- continuous batching: every step puts one token per sequence that is decoding into the
  batch, then fills the rest of `n_batch` with prompt chunks (first come, first served);
  logits are asked for only where a token is sampled (the last prompt token, decode tokens);
- greedy: numpy argmax over `llama_get_logits_ith`; exactly `max_tokens` new tokens (EOS is
  not looked at); a finished sequence is freed at once with `llama_memory_seq_rm`;
- with prefix caching on (W4), the prompts' longest common prefix is prefilled once on
  sequence 0 and `llama_memory_seq_cp`-ed to the others, whose `cached_tokens` count it;
- the memory is cleared between batches.

`python llamacpp_worker.py quantize IN OUT [--ftype BF16]` rewrites a GGUF with
`llama_model_quantize` instead (used by `compare.py install` for the BF16 GGUF).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from protocol import Clock, Request, claim_stdout, log, record, serve

NAME = "llama.cpp"


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    fed: int = 0  # prompt tokens already in the KV cache
    cached: int = 0  # of which copied from a shared prefix
    out: list[int] = field(default_factory=list)
    ttft: float = 0.0
    e2e: float = 0.0

    @property
    def decoding(self) -> bool:
        return self.fed == len(self.prompt) and 0 < len(self.out) < self.max_tokens

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens


class LlamaCppRunner:
    def __init__(self, model_path: str, threads: int, n_ctx: int, n_seq_max: int, n_batch: int = 512,
                 prefix_caching: bool = False) -> None:
        import llama_cpp as lc

        self.lc = lc
        self.n_batch = n_batch
        self.prefix_caching = prefix_caching
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.kv_unified = "kv_unified" in {name for name, _ in type(cparams)._fields_}
        if self.kv_unified:
            cparams.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context (n_ctx {n_ctx}, n_seq_max {n_seq_max})")
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_ctx = lc.llama_n_ctx(self.ctx)
        self.n_seq_max = lc.llama_n_seq_max(self.ctx)
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def describe(self) -> dict[str, Any]:
        lc = self.lc
        desc = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.model, desc, len(desc))
        return {
            "llama_cpp_python": lc.__version__,
            "model_desc": desc.value.decode(),
            "dtype": desc.value.decode().split()[-1],  # "llama 256M Q4_1" -> Q4_1
            "model_bytes": lc.llama_model_size(self.model),
            "model_params": lc.llama_model_n_params(self.model),
            "n_ctx": self.n_ctx,
            "n_seq_max": self.n_seq_max,
            "n_batch": self.n_batch,
            "kv_unified": self.kv_unified,
            "system_info": lc.llama_print_system_info().decode(errors="replace").strip(),
            "prefix_caching": self.prefix_caching,
            "batching": "continuous: one decode token per running sequence per llama_decode, "
                        "prompt chunks fill the rest of n_batch",
        }

    # ----- one batch of requests --------------------------------------------------------

    def run(self, requests: list[Request]) -> dict[str, Any]:
        if len(requests) > self.n_seq_max:
            raise ValueError(f"{len(requests)} requests but n_seq_max is {self.n_seq_max}")
        self.lc.llama_memory_clear(self.mem, True)
        seqs = [Sequence(i, prompt, n) for i, (prompt, n) in enumerate(requests)]
        clock = Clock()
        if self.prefix_caching and len(seqs) > 1:
            self._share_prefix(seqs)
        while not all(s.done for s in seqs):
            self._step(seqs, clock)
        wall = clock.wall()
        return record(wall, [s.ttft for s in seqs], [s.e2e for s in seqs], requests, [s.out for s in seqs],
                      [s.cached for s in seqs], clock.cpu(), clock.load)

    def _share_prefix(self, seqs: list[Sequence]) -> None:
        """Prefill the common prefix once on sequence 0 and copy it to the others."""
        length = _common_prefix_length([s.prompt for s in seqs])
        length = min(length, min(len(s.prompt) for s in seqs) - 1)  # keep a token to sample from
        if length <= 0:
            return
        first = seqs[0]
        for start in range(0, length, self.n_batch):
            chunk = [(first.prompt[p], p, first.seq_id, False) for p in range(start, min(start + self.n_batch, length))]
            self._decode(chunk)
        for s in seqs:
            if s is not first:
                self.lc.llama_memory_seq_cp(self.mem, first.seq_id, s.seq_id, -1, -1)
                s.cached = length
            s.fed = length

    def _step(self, seqs: list[Sequence], clock: Clock) -> None:
        """One llama_decode: a token per decoding sequence, then prompt chunks."""
        items: list[tuple[int, int, int, bool]] = []  # (token, position, sequence, wants logits)
        sampled: list[tuple[Sequence, int]] = []  # (sequence, batch index of its logits)
        for s in seqs:
            if s.decoding:
                sampled.append((s, len(items)))
                items.append((s.out[-1], len(s.prompt) + len(s.out) - 1, s.seq_id, True))
        for s in seqs:
            room = self.n_batch - len(items)
            if room <= 0:
                break
            if not s.prefilling:
                continue
            end = min(len(s.prompt), s.fed + room)
            for p in range(s.fed, end):
                items.append((s.prompt[p], p, s.seq_id, p == len(s.prompt) - 1))
            if end == len(s.prompt):
                sampled.append((s, len(items) - 1))
            s.fed = end
        self._decode(items)
        tokens = [self._argmax(index) for _, index in sampled]
        now = clock.now()
        for (s, _), token in zip(sampled, tokens):
            s.out.append(token)
            if len(s.out) == 1:
                s.ttft = now
            if s.done:
                s.e2e = now
                self.lc.llama_memory_seq_rm(self.mem, s.seq_id, -1, -1)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq_id, logits) in enumerate(items):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq_id
            b.logits[i] = logits
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            hint = " (no KV slot: raise --n-ctx)" if rc == 1 else ""
            raise RuntimeError(f"llama_decode returned {rc}{hint}")

    def _argmax(self, index: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())


def _common_prefix_length(prompts: list[list[int]]) -> int:
    shortest = min(len(p) for p in prompts)
    for k in range(shortest):
        token = prompts[0][k]
        if any(p[k] != token for p in prompts):
            return k
    return shortest


# ----- entry points ---------------------------------------------------------------------


def quantize(source: str, target: str, ftype: str, threads: int) -> int:
    """Rewrite a GGUF in another type (BF16, F16, ALL_F32...), dequantizing as needed."""
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}", None) or getattr(lc, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = threads
    rc = lc.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


def serve_main(args: argparse.Namespace) -> int:
    channel = claim_stdout()
    if not args.verbose:
        from llama_cpp._logger import set_verbose

        set_verbose(False)  # llama.cpp's info logs off; errors still reach stderr
    log(NAME, f"loading {args.model} ({args.threads} threads, n_ctx {args.n_ctx}, n_seq_max {args.n_seq_max}, "
              f"prefix caching {args.prefix_caching})")
    t0 = time.perf_counter()
    runner = LlamaCppRunner(args.model, args.threads, args.n_ctx, args.n_seq_max, args.n_batch,
                            prefix_caching=args.prefix_caching == "on")
    info = {"load_s": time.perf_counter() - t0, "threads": args.threads, "model": args.model, **runner.describe()}
    return serve(channel, NAME, info, lambda workload, requests, options: runner.run(requests))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "quantize":
        parser = argparse.ArgumentParser(prog="llamacpp_worker.py quantize")
        parser.add_argument("source")
        parser.add_argument("target")
        parser.add_argument("--ftype", default="BF16")
        parser.add_argument("--threads", type=int, default=2)
        args = parser.parse_args(sys.argv[2:])
        return quantize(args.source, args.target, args.ftype, args.threads)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, required=True, help="KV cells shared by all sequences")
    parser.add_argument("--n-seq-max", type=int, required=True)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="off")
    parser.add_argument("--verbose", action="store_true", help="keep llama.cpp's own logs")
    return serve_main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
