"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) against Hugging Face transformers on
tiny random configs, the experts as grouped GEMMs, quantized experts, and expert
parallelism equal to one process."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_model import _paged_logits
from tests.test_model_families import _check_logits_and_greedy, _ids, ours_from
from tests.test_quantization import _gguf_blocks
from tests.tiny_checkpoint import MOE_FAMILIES, tiny_moe_model, write_tiny_moe
from tokenmill import SamplingParams
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.moe import SparseMoE
from tokenmill.model_arch import ModelArchConfig
from tokenmill.parallel.layout import Span, build_layout

VOCAB = 512


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_matches_transformers(family: str) -> None:
    """Logits within float32 tolerance and greedy tokens identical, loading the experts
    stacked as transformers holds them in memory."""
    hf = tiny_moe_model(family)
    ours = ours_from(hf)
    cfg = ours.cfg
    assert cfg.architecture == family and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (family != "olmoe")  # Mixtral always; OLMoE's config says False
    assert all(isinstance(layer.mlp, SparseMoE) for layer in ours.layers)
    _check_logits_and_greedy(hf, ours, prompt_len=30, new_tokens=8)


def test_qwen3_moe_dense_layers_and_unnormalised_top_k() -> None:
    """mlp_only_layers: that layer keeps a dense MLP of intermediate_size; norm_topk_prob
    False: the top-k weights are the softmax's, not renormalised."""
    hf = tiny_moe_model("qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False)
    ours = ours_from(hf)
    assert ours.cfg.dense_layers == (0,) and not ours.cfg.norm_topk_prob
    assert not isinstance(ours.layers[0].mlp, SparseMoE) and isinstance(ours.layers[1].mlp, SparseMoE)
    _check_logits_and_greedy(hf, ours, prompt_len=20, new_tokens=4)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@torch.inference_mode()
def test_checkpoint_with_per_expert_tensors(tmp_path: Path, family: str) -> None:
    """A saved checkpoint holds one tensor per expert and matrix (Mixtral's w1/w3/w2 under
    block_sparse_moe): the loader stacks them."""
    path = write_tiny_moe(tmp_path / family, family)
    hf = tiny_moe_model(family)
    loaded = load_model(str(path), "float32", torch.device("cpu"))
    ids = _ids(25, 2)
    torch.testing.assert_close(loaded.model.compute_logits(loaded.model(ids, torch.arange(25))),
                               hf(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    hf = tiny_moe_model("mixtral")
    ours = LlamaForCausalLM(ModelArchConfig.from_hf_config(hf.config.to_dict()))
    weights = [(n, t) for n, t in _per_expert_state(hf) if ".experts.5.w3" not in n]
    with pytest.raises(ValueError, match=r"lacks weights for: .*layers\.\d\.mlp\.experts\.gate_up_proj"):
        ours.load_weights(weights)


def _per_expert_state(hf) -> list[tuple[str, torch.Tensor]]:
    """Mixtral's state as its checkpoints name it: block_sparse_moe.experts.E.w1/w3/w2."""
    out = []
    for name, tensor in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name.removesuffix("mlp.experts.gate_up_proj") + "block_sparse_moe.experts"
            for e, w in enumerate(tensor):
                gate, up = w.chunk(2)
                out += [(f"{prefix}.{e}.w1.weight", gate), (f"{prefix}.{e}.w3.weight", up)]
        elif name.endswith("experts.down_proj"):
            prefix = name.removesuffix("mlp.experts.down_proj") + "block_sparse_moe.experts"
            out += [(f"{prefix}.{e}.w2.weight", w) for e, w in enumerate(tensor)]
        else:
            out.append((name.replace("mlp.gate.", "block_sparse_moe.gate."), tensor))
    return out


@torch.inference_mode()
def test_experts_run_as_one_gemm_per_active_expert() -> None:
    """A 40-token step calls each routed expert's matrices once, on all of its tokens."""
    model = ours_from(tiny_moe_model("qwen3_moe"))
    moe = model.layers[0].mlp
    x = torch.randn(40, 64)
    weights, ids = moe.route(x)
    calls: list[tuple[int, int]] = []
    original = moe.experts.gate_up
    moe.experts.gate_up = lambda e, rows: calls.append((e, rows.shape[0])) or original(e, rows)
    got = moe(x)
    active = torch.bincount(ids.flatten(), minlength=8)
    assert calls == [(e, int(n)) for e, n in enumerate(active) if n]
    # The reference: each token's experts one at a time.
    expected = torch.zeros_like(x)
    for t in range(40):
        for w, e in zip(weights[t], ids[t]):
            gu = torch.nn.functional.linear(x[t], moe.experts.gate_up_proj[e])
            gate, up = gu.chunk(2)
            expected[t] += w * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                                          moe.experts.down_proj[e])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_native_grouped_call_equals_expert_by_expert(monkeypatch: pytest.MonkeyPatch,
                                                     weight_dtype: torch.dtype) -> None:
    """Skinny-kernel tiles: a decode batch's experts run as one native call per matrix
    (kernels.grouped_skinny_linear), equal to calling the experts one by one; a group past
    the kernel's rows (prefill) goes expert by expert."""
    from tokenmill import kernels
    from tokenmill.model.layers import Experts
    from tokenmill.runner.plan import apply_plan, cpu_native_plan

    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    model = ours_from(tiny_moe_model("qwen3_moe"))
    plan = apply_plan(model, cpu_native_plan(weight_dtype))
    moe = model.layers[1].mlp
    calls = []
    grouped = kernels.grouped_skinny_linear
    monkeypatch.setattr(kernels, "grouped_skinny_linear", lambda *a: calls.append(len(a[2])) or grouped(*a))
    x = torch.randn(6, 64)
    got = moe(x)
    active = len(torch.unique(moe.route(x)[1]))
    assert calls == [active, active]
    monkeypatch.setattr(Experts, "grouped_mlp", lambda *a: None)
    torch.testing.assert_close(got, moe(x), atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    calls.clear()
    many = torch.randn(4 * plan.weight_format.choice.skinny_max_rows + 8, 64)
    moe(many)
    assert calls == []


@pytest.mark.parametrize("backend_name", ["torch_sdpa", "cpu_native"])
@torch.inference_mode()
def test_paged_batched_steps_equal_dense(backend_name: str) -> None:
    """Three requests in chunked prefill and decode steps (their tokens share the experts'
    groups) through the native plan: every step's logits equal the dense reference."""
    from tokenmill.runner.plan import apply_plan, cpu_native_plan

    model = ours_from(tiny_moe_model("mixtral"))
    gen = torch.Generator().manual_seed(4)
    chunks = [[9, 5, 12], [6, 0, 5], [1, 1, 1], [1, 1, 1]]
    seqs = [torch.randint(0, VOCAB, (sum(step[r] for step in chunks),), generator=gen).tolist() for r in range(3)]
    dense = [model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq)))) for seq in seqs]
    plan = apply_plan(model, cpu_native_plan(torch.float32)) if backend_name == "cpu_native" else None
    if plan is not None:
        assert not plan.fused_decode  # the fused native layer has no experts
        assert model.layers[0].mlp.experts.expert_weights is not None
    for expected, got in zip(dense, _paged_logits(model, seqs, chunks, backend_name, plan=plan)):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["int8", "int4"])
@torch.inference_mode()
def test_quantized_experts(method: str) -> None:
    """Experts go through the plan's weight format like any linear (int8 / int4 weights):
    a layer's output equals the float computation on the quantized weights (dequantized),
    within the error of the integer kernels' int8 activations."""
    from tokenmill.quantization.formats import QuantizedWeights
    from tokenmill.runner.plan import apply_plan, cpu_native_plan, quantized_plan

    hf = tiny_moe_model("olmoe")
    reference, quantized = ours_from(hf), ours_from(hf)
    apply_plan(quantized, quantized_plan(cpu_native_plan(torch.float32, fused_decode=False), method, 32))
    experts = quantized.layers[1].mlp.experts
    assert experts.gate_up_proj is None and len(experts.expert_weights) == 8
    assert all(isinstance(w, QuantizedWeights) for pair in experts.expert_weights for w in pair)
    assert not isinstance(quantized.layers[1].mlp.gate.weights, QuantizedWeights)  # the router stays float
    ref_experts = reference.layers[1].mlp.experts
    for e, (gate_up, down) in enumerate(experts.expert_weights):
        ref_experts.gate_up_proj[e] = gate_up.dequantize()
        ref_experts.down_proj[e] = down.dequantize()
    x = torch.randn(20, 64)
    got, want = quantized.layers[1].mlp(x), reference.layers[1].mlp(x)
    assert ((got - want).norm() / want.norm()) < 0.02
    # And the whole model stays near float32 (int8 only: int4 moves a random tiny model's routing).
    if method == "int8":
        ids = _ids(20, 5)
        got, want = (m.compute_logits(m(ids, torch.arange(20))) for m in (quantized, ours_from(hf)))
        assert ((got - want).norm() / want.norm()) < 0.02


GGUF_NAMES = {"qwen3_moe": ("qwen3moe", "QWEN3MOE"), "mixtral": ("llama", "LLAMA"), "olmoe": ("olmoe", "OLMOE")}


def _write_moe_gguf(hf, path: Path, family: str, expert_types: dict[str, str] | None = None) -> None:
    """The model's tensors as float32 GGUF tensors under llama.cpp's names: experts stacked
    (ffn_gate_exps / ffn_up_exps / ffn_down_exps, ffn_gate_inp the router), Mixtral as a
    `llama` file with experts and its q/k rows permuted as llama.cpp's converter does.
    `expert_types` ("gate" / "up" / "down" -> a GGML type name): those expert stacks in
    quantized blocks (gguf's quantizer of the model's weights where it has one; for K-quants,
    which it lacks, random blocks with sane scales, replacing the model's weights)."""
    import gguf

    def add_experts(name: str, kind: str, stack: torch.Tensor) -> None:
        qtype = (expert_types or {}).get(kind)
        if qtype is None:
            writer.add_tensor(name, stack.contiguous().numpy())
            return
        experts, rows, cols = stack.shape
        # K-quant weights d * sc * q reach 63 * 15 * d (Q4_K), 127 * 32 * d (Q6_K): scales
        # that keep them near the model's own (+-0.1), so the router sees a sane stream.
        max_scale = {"Q4_K": 4e-4, "Q6_K": 1e-4}.get(qtype, 0.0)
        blocks = np.stack([_gguf_blocks(qtype, rows, cols, seed=zlib.crc32(f"{name}.{e}".encode()), max_scale=max_scale)
                           if qtype.endswith("_K")
                           else gguf.quants.quantize(stack[e].numpy(), gguf.GGMLQuantizationType[qtype])
                           for e in range(experts)])
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[qtype])

    cfg = hf.config
    file_arch, enum = GGUF_NAMES[family]
    writer = gguf.GGUFWriter(str(path), file_arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(8)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "qwen3_moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "olmoe":
        writer.add_clamp_kqv(cfg.clip_qkv)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"p{i}" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (len(tokens) - 259)])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, enum), cfg.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        tensor = tensor.float()
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            base = name.removesuffix("gate_up_proj")
            add_experts(name_map.get_name(base + "gate_proj") + ".weight", "gate", gate)
            add_experts(name_map.get_name(base + "up_proj") + ".weight", "up", up)
            continue
        if name.endswith("experts.down_proj"):
            add_experts(name_map.get_name(name) + ".weight", "down", tensor)
            continue
        base, suffix = name.rsplit(".", 1)
        if file_arch == "llama" and base.endswith(("q_proj", "k_proj")):  # llama.cpp's interleaved RoPE rows
            heads = tensor.shape[0] // head_dim
            tensor = tensor.reshape(heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", MOE_FAMILIES)
@torch.inference_mode()
def test_gguf_matches_transformers(tmp_path: Path, family: str) -> None:
    """GGUF files of each family (qwen3moe, Mixtral as llama with experts, olmoe) load with
    their stacked experts and match transformers."""
    hf = tiny_moe_model(family)
    _write_moe_gguf(hf, tmp_path / "moe.gguf", family)
    loaded = load_model(str(tmp_path / "moe.gguf"), "float32", torch.device("cpu"))
    arch = loaded.arch
    assert arch.architecture == family and arch.num_experts == 8 and arch.norm_topk_prob == (family != "olmoe")
    assert arch.qk_norm_whole == (family == "olmoe") and arch.clip_qkv == (2.0 if family == "olmoe" else None)
    ids = _ids(25, 3)
    torch.testing.assert_close(loaded.model.compute_logits(loaded.model(ids, torch.arange(25))),
                               hf(ids.unsqueeze(0)).logits[0], atol=1e-4, rtol=1e-4)


# ----- quantized experts as stored ------------------------------------------------------------------

# Q4_0 experts quantized from the model's weights (gguf's quantizer); a *_K_M mix (gate/up
# Q4_K, down Q6_K, as llama.cpp writes Q4_K_M files' experts) of random blocks, in a model
# wide enough for 256-column super-blocks.
EXPERT_MIXES = {"q4_0": ({"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, {}),
                "q4_k_m": ({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                           dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256))}


def _quantized_moe_gguf(directory: Path, mix: str) -> Path:
    types, overrides = EXPERT_MIXES[mix]
    path = directory / f"moe-{mix}.gguf"
    _write_moe_gguf(tiny_moe_model("qwen3_moe", **overrides), path, "qwen3_moe", types)
    return path


@pytest.fixture(scope="module", params=list(EXPERT_MIXES))
def quantized_moe_gguf(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _quantized_moe_gguf(tmp_path_factory.mktemp("qmoe"), request.param)


def _stored_and_dequantized(path: Path):
    """The file served as stored (quantized plan, experts kept as their blocks) and its
    dequantized float32 model (the reference)."""
    from tokenmill import kernels
    from tokenmill.runner.plan import apply_plan, cpu_native_plan, quantized_plan

    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    plan = quantized_plan(cpu_native_plan(torch.float32, fused_decode=False), "stored", 32)
    stored = load_model(str(path), "float32", torch.device("cpu"), weight_format=plan.weight_format,
                        keep_quantized=True).model
    apply_plan(stored, plan)
    return stored, load_model(str(path), "float32", torch.device("cpu")).model


@torch.inference_mode()
def test_gguf_experts_are_kept_as_stored(quantized_moe_gguf) -> None:
    """A GGUF's ffn_{gate,up,down}_exps stay quantized: one QuantizedTensor per expert and
    matrix (gate and up fused in their blocks), equal to the file's values exactly, the
    float stacks never allocated, and the experts' bytes within the packing's overhead of
    the file's expert tensors."""
    import gguf

    from tokenmill.gguf_file import GGUFFile
    from tokenmill.quantization.formats import QuantizedWeights

    mix, path = quantized_moe_gguf
    stored, dequantized = _stored_and_dequantized(path)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name)
    ours = 0
    for layer, ref in zip(stored.layers, dequantized.layers):
        experts = layer.mlp.experts
        assert experts.gate_up_proj is None and experts.down_proj is None
        assert all(isinstance(w, QuantizedWeights) for pair in experts.expert_weights for w in pair)
        bits = [(gu.qt.bits, down.qt.bits) for gu, down in experts.expert_weights]
        assert set(bits) == ({(4, 4)} if mix == "q4_0" else {(4, 8)})  # Q6_K's 6-bit codes in bytes
        for e, (gate_up, down) in enumerate(experts.expert_weights):
            assert torch.equal(gate_up.dequantize(), ref.mlp.experts.gate_up_proj[e])
            assert torch.equal(down.dequantize(), ref.mlp.experts.down_proj[e])
        ours += experts.nbytes
    assert GGUFFile(str(path)).metadata["general.architecture"] == "qwen3moe"
    # The native kernels' packing (QuantizedTensor) as for dense layers: Q4_0's 18 bytes
    # per 32 weights take 24, Q4_K's and Q6_K's 4.5 and 6.6 bits per weight take their
    # per-32 (16) scales in float32 and Q6_K's codes a byte each.
    assert file_bytes <= ours <= (1.34 if mix == "q4_0" else 1.6) * file_bytes, (ours, file_bytes)


@torch.inference_mode()
def test_gguf_experts_as_stored_match_the_dequantized_model(quantized_moe_gguf) -> None:
    """Logits of a prompt (the quantized kernels' many-row path) and of each greedy step
    (their int8-activation few-row path) within the kernels' error of the dequantized
    float32 model's, and the same greedy tokens."""
    _, path = quantized_moe_gguf
    stored, dequantized = _stored_and_dequantized(path)
    ids = _ids(24, 7)
    got, want = (m.compute_logits(m(ids, torch.arange(24))) for m in (stored, dequantized))
    assert ((got - want).norm() / want.norm()) < 0.02
    seqs = [ids.tolist(), ids.tolist()]
    for _ in range(8):  # greedy, the whole sequence recomputed (no cache): one decode row's logits
        for seq, model in zip(seqs, (stored, dequantized)):
            seq.append(int(model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq))))[-1].argmax()))
    assert seqs[0] == seqs[1]


@pytest.mark.slow
def test_llm_serves_quantized_experts_as_stored(tmp_path: Path) -> None:
    """Through the engine (LLM: a quantized GGUF is served as stored by default) against
    --dtype float32 (dequantized) and against expert parallelism over 2 ranks (each reading
    only its experts' blocks): the same sequences (the prompts and the as-stored greedy
    continuation) scored teacher-forced, every token's log-probability within the kernels'
    noise. (Not greedy identity: the int8 activations of the quantized kernels turn a 1e-7
    difference in the attention's sums, another thread split or rank's, into a 1e-3 one, and
    a tiny random model's top-2 margins are down to 1e-2.)"""
    from tokenmill.llm import LLM

    path = _quantized_moe_gguf(tmp_path, "q4_0")

    def run(prompts, params, **kwargs):
        llm = LLM(model=str(path), max_model_len=256, block_size=4, distributed_timeout=60.0, **{"num_threads": 1, **kwargs})
        try:
            return llm.generate(prompts, params)
        finally:
            executor = llm.engine.executor
            if hasattr(executor, "close"):
                executor.close()

    greedy = run(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    seqs = [prompt + out.outputs[0].token_ids for prompt, out in zip(PROMPTS, greedy)]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(**kwargs) -> torch.Tensor:
        outs = run(seqs, score, **kwargs)
        return torch.tensor([pos[tok].logprob for seq, out in zip(seqs, outs)
                             for tok, pos in zip(seq[1:], out.prompt_logprobs[1:])])

    # Measured: 2 threads instead of 1 mean 0.004 (max 0.014); dequantized 0.005 (0.037);
    # EP 2 0.016 (0.146: a router's near-tie flipped by that noise, in the positions after it).
    stored = logprobs()
    for other in (logprobs(dtype="float32"), logprobs(tensor_parallel_size=2, enable_expert_parallel=True)):
        diff = (stored - other).abs()
        assert diff.median() < 0.01 and diff.mean() < 0.03 and diff.max() < 0.3, (diff.median(), diff.mean(), diff.max())


@torch.inference_mode()
def test_expert_parallel_ranks_hold_their_experts_as_stored(tmp_path: Path) -> None:
    """Each rank of EP 2 loads only its experts' blocks (as stored), and the ranks' MoE
    outputs summed (what the all-reduce does) equal one process's on the same input, up to
    float summation order: the quantized kernels see the same rows either way."""
    from tokenmill.parallel.model_parallel import ModelParallel
    from tokenmill.quantization.formats import QuantizedWeights
    from tokenmill.runner.plan import apply_plan, cpu_native_plan, quantized_plan

    from tokenmill import kernels

    if not kernels.cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")
    path = _quantized_moe_gguf(tmp_path, "q4_0")
    plan = quantized_plan(cpu_native_plan(torch.float32, fused_decode=False), "stored", 32)

    def load(rank: int | None):
        parallel = None if rank is None else \
            (lambda arch, unit: ModelParallel(build_layout(arch, 2, rank, 1, 0, column_unit=unit, expert_parallel=True)))
        model = load_model(str(path), "float32", torch.device("cpu"), weight_format=plan.weight_format,
                           parallel=parallel, keep_quantized=True).model
        apply_plan(model, plan)
        return model

    single, ranks = load(None), [load(r) for r in range(2)]
    for layer in range(2):
        held = [m.layers[layer].mlp.experts for m in ranks]
        assert [e.num_experts for e in held] == [4, 4]
        for r, experts in enumerate(held):
            for e, (gate_up, down) in enumerate(experts.expert_weights):
                assert isinstance(gate_up, QuantizedWeights) and isinstance(down, QuantizedWeights)
                want = single.layers[layer].mlp.experts.expert_weights[4 * r + e]
                assert torch.equal(gate_up.qt.packed, want[0].qt.packed) and torch.equal(down.qt.packed, want[1].qt.packed)
        for rows in (1, 5, 40):  # the integer kernels' rows and the many-row GEMM
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            summed = sum(m.layers[layer].mlp(x) for m in ranks)
            torch.testing.assert_close(summed, single.layers[layer].mlp(x), atol=1e-5, rtol=1e-5)


# ----- parallel splits ------------------------------------------------------------------------

QWEN3_MOE = ModelArchConfig("qwen3_moe", VOCAB, 64, 96, 2, 4, 2, 32, qk_norm=True, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def test_expert_parallel_layout() -> None:
    """Expert parallelism: whole experts per rank (uneven when they do not divide), another
    rank's expert tensors not even read; without it, every expert's columns are split."""
    ep = [build_layout(QWEN3_MOE, 2, r, 1, 0, expert_parallel=True) for r in range(2)]
    assert [l.experts for l in ep] == [Span(0, 4), Span(4, 4)] and ep[1].expert_intermediate == Span(0, 32)
    assert ep[1].local_name("layers.1.mlp.experts.2.up_proj.weight") is None
    assert ep[1].local_name("layers.1.mlp.experts.6.up_proj.weight") == "layers.1.mlp.experts.2.up_proj.weight"
    assert ep[1].local_name("layers.1.block_sparse_moe.experts.5.w2.weight") == \
        "layers.1.block_sparse_moe.experts.1.w2.weight"
    tp = [build_layout(QWEN3_MOE, 2, r, 1, 0) for r in range(2)]
    assert [l.experts for l in tp] == [Span(0, 8)] * 2 and [l.expert_intermediate for l in tp] == [Span(0, 16),
                                                                                                   Span(16, 16)]
    assert tp[1].checkpoint_part("layers.0.mlp.experts.3.gate_proj.weight") == (0, Span(16, 16))
    assert tp[1].checkpoint_part("layers.0.block_sparse_moe.experts.3.w2.weight") == (1, Span(16, 16))
    with pytest.raises(ValueError, match="exceeds the model's 8 experts"):
        build_layout(QWEN3_MOE, 16, 0, 1, 0, expert_parallel=True)
    olmoe = ModelArchConfig.from_hf_config(tiny_moe_model("olmoe").config.to_dict())
    with pytest.raises(ValueError, match="q/k norms span every head"):
        build_layout(olmoe, 2, 0, 1, 0)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], list(range(100, 140)), [300] * 9]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)


def _generate(path: Path, **split) -> tuple[list[list[int]], list]:
    from tokenmill.llm import LLM

    llm = LLM(model=str(path), dtype="float32", max_model_len=256, num_threads=1, block_size=4,
              distributed_timeout=60.0, **split)
    try:
        outputs = llm.generate(PROMPTS, PARAMS)
    finally:
        executor = llm.engine.executor
        if hasattr(executor, "close"):
            executor.close()
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].logprobs for o in outputs]


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> Path:
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def one_process(qwen3_moe_dir: Path):
    return _generate(qwen3_moe_dir)


@torch.inference_mode()
def test_llm_generate_equals_transformers_greedy(qwen3_moe_dir: Path, one_process) -> None:
    """Through LLM.generate (scheduler, paged KV cache, batched decode): each prompt's greedy
    tokens are transformers' own."""
    hf = tiny_moe_model("qwen3_moe")
    tokens, _ = one_process
    for prompt, got in zip(PROMPTS, tokens):
        seq = list(prompt)
        for _ in range(10):  # transformers' greedy argmax, EOS included (ignore_eos)
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert got == seq[len(prompt):]


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                   dict(tensor_parallel_size=2)], ids=["ep2", "tp2-expert-columns"])
def test_parallel_split_equals_one_process(qwen3_moe_dir: Path, one_process, split: dict) -> None:
    """EP 2 (each rank 4 whole experts) and TP 2 (each rank half of every expert's columns):
    greedy tokens identical to one process, logprobs within 1e-4 (the ranks' partial sums
    are added in another order: float tolerance, not bit-identical)."""
    tokens, logprobs = _generate(qwen3_moe_dir, **split)
    ref_tokens, ref_logprobs = one_process
    assert tokens == ref_tokens
    for ours, theirs in zip(logprobs, ref_logprobs):
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys() and max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4
