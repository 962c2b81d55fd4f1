"""The dense CPU kernels are chosen by measuring them (runner/tune.py): the choice logic on
injected timings, the cache, and that every candidate computes the same product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.quantization.dense import CPUMatmulChoice, DenseFormat
from tokenmill.runner import tune


@pytest.fixture(autouse=True, scope="module")
def native_kernels() -> None:
    from tokenmill.kernels import cpu_kernels_available

    if not cpu_kernels_available():
        pytest.fail("the native CPU kernels did not build (python -m tokenmill.kernels -v shows why)")


def timings(skinny: dict[int, float], **gemm: dict[int, float]) -> tune.Timings:
    return tune.Timings(skinny, gemm)


def test_the_gemm_fastest_for_prefill_wins_and_skinny_keeps_the_rows_it_does_not_lose() -> None:
    t = timings({1: 1.0, 2: 1.1, 4: 1.4, 8: 2.0, 16: 4.0},
                onednn_f32={1: 2.0, 2: 2.0, 4: 2.1, 8: 2.5, 16: 3.1, 128: 14.0},
                onednn_bf16={1: 1.2, 2: 1.2, 4: 1.2, 8: 1.3, 16: 1.4, 128: 4.0})
    # bf16 wins prefill; skinny keeps 1, 2 (within the fused margin), loses at 4 (1.4 > 1.15 * 1.2).
    assert tune.decide(t) == CPUMatmulChoice(skinny_max_rows=2, gemm="onednn_bf16")
    f32_only = timings(t.skinny, onednn_f32=t.gemm["onednn_f32"])
    assert tune.decide(f32_only) == CPUMatmulChoice(skinny_max_rows=8, gemm="onednn_f32")
    never = timings({1: 3.0, 2: 3.0}, onednn_bf16={1: 1.0, 2: 1.0, 128: 4.0})
    assert tune.decide(never) == CPUMatmulChoice(skinny_max_rows=0, gemm="onednn_bf16")
    # The first loss ends the skinny range even if a larger row count happens to time well.
    ragged = timings({1: 1.0, 2: 5.0, 4: 1.0}, onednn_f32={1: 2.0, 2: 2.0, 4: 2.0, 128: 9.0})
    assert tune.decide(ragged).skinny_max_rows == 1


def test_float32_weights_never_get_bf16_inputs() -> None:
    from tokenmill import kernels

    panels = {"panels"} if kernels.panel_linear_built(torch.float32) else set()
    assert set(tune.candidate_gemms(torch.float32)) == {"onednn_f32", *panels}
    panels = {"panels"} if kernels.panel_linear_built(torch.bfloat16) else set()
    assert set(tune.candidate_gemms(torch.bfloat16)) == {"onednn_f32", "onednn_bf16", *panels}


def test_the_panel_kernel_is_taken_unless_the_split_is_faster_by_the_margin_at_some_row_count() -> None:
    """One arithmetic at every row count (a row's bits independent of its step) is worth up
    to PANELS_MARGIN of time at any measured row count, against the split the timings decide
    (skinny up to its rows, the GEMM beyond)."""
    from tokenmill.runner.plan import ROWS

    skinny = {1: 1.0, 2: 1.1, 4: 1.4, 8: 2.0, 16: 4.0}
    gemm = {1: 2.0, 2: 2.0, 4: 2.1, 8: 2.5, 16: 3.1, 128: 14.0}  # the split: skinny up to 8 rows
    close = tune.Timings(skinny, {"onednn_f32": gemm}, panels={1: 1.4, 2: 1.0, 4: 1.5, 8: 2.1, 16: 3.3, 128: 20.0})
    assert tune.decide(close) == CPUMatmulChoice(ROWS.skinny_max_rows, "panels")
    slow_prefill = tune.Timings(skinny, {"onednn_f32": gemm}, panels={**close.panels, 128: 21.5})  # > 1.5 x 14
    assert tune.decide(slow_prefill) == CPUMatmulChoice(8, "onednn_f32")
    slow_decode = tune.Timings(skinny, {"onednn_f32": gemm}, panels={**close.panels, 1: 1.6})  # > 1.5 x 1.0
    assert tune.decide(slow_decode) == CPUMatmulChoice(8, "onednn_f32")
    assert tune.decide(tune.Timings(skinny, {"onednn_f32": gemm})) == CPUMatmulChoice(8, "onednn_f32")  # not built
    assert "panel kernel 2000000.00 ms at 1 rows vs 1000.00 ms at 2" == tune.disturbed(
        tune.Timings(skinny, {"onednn_f32": gemm}, panels={**close.panels, 1: 2000.0}))


def test_measure_times_the_panel_kernel_where_the_build_has_it() -> None:
    from tokenmill import kernels

    t = tune.measure([(64, 32), (32, 64)], torch.bfloat16, layers=1, reps=1)
    if kernels.panel_linear_built(torch.bfloat16):
        assert set(t.panels) == {*tune.DECODE_ROWS, tune.PREFILL_ROWS} and all(v > 0 for v in t.panels.values())
        assert "panels" in tune.describe(t, tune.decide(t)).splitlines()[0]
    else:
        assert t.panels == {}


def test_a_measured_pass_streams_few_layers_of_a_big_model_and_many_of_a_small_one(monkeypatch) -> None:
    """Layers' copies within MEASURE_WEIGHT_BYTES of float32: the first start of an 8B model
    took 18 GB to choose its kernels over 8 copies of its layer shapes."""
    def llama(hidden: int, kv: int, ffn: int) -> list[tuple[int, int]]:
        return [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * ffn, hidden), (hidden, ffn)]

    assert tune.measured_layers(llama(576, 192, 1536), 8) == 8  # SmolLM2-135M: 14 MB a layer
    assert tune.measured_layers(llama(2048, 512, 8192), 8) == 2  # Llama-3.2-1B: 243 MB
    assert tune.measured_layers(llama(4096, 1024, 14336), 8) == 1  # Llama-3.1-8B: 872 MB, still one
    assert tune.measured_layers(llama(4096, 1024, 14336), 4) == 1
    shapes = [(64, 32), (32, 64)]
    monkeypatch.setattr(tune, "MEASURE_WEIGHT_BYTES", 3 * 4 * 2 * 64 * 32)  # room for 3 layers
    t = tune.measure(shapes, torch.float32, ("onednn_f32",), layers=8, reps=1)
    assert t.weight_elements == 3 * 2 * 64 * 32


def test_the_choice_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch) -> None:
    calls = []

    def fake_measure(shapes, tile_dtype, gemms):
        calls.append((tuple(shapes), tile_dtype, tuple(gemms)))
        return timings({1: 1.0}, **{g: {1: 2.0, 128: 3.0} for g in gemms if g != "panels"})

    monkeypatch.setattr(tune, "measure", fake_measure)
    shapes = [(96, 32), (32, 32)]
    first, measured, source = tune.choose(shapes, torch.bfloat16, cache_dir=tmp_path)
    assert measured is not None and "measured" in source and len(calls) == 1
    again, measured, source = tune.choose(shapes, torch.bfloat16, cache_dir=tmp_path)
    assert again == first and measured is None and "cached" in source and len(calls) == 1
    # Another dtype, another shape set or other allowed GEMMs is another key.
    tune.choose(shapes, torch.float32, cache_dir=tmp_path)
    tune.choose(shapes, torch.bfloat16, allowed=["onednn_f32"], cache_dir=tmp_path)
    assert len(calls) == 3 and len(list(tmp_path.glob("dense-*.json"))) == 3
    # A damaged cache file is measured over, not trusted.
    for path in tmp_path.glob("dense-*.json"):
        path.write_text("{not json")
    tune.choose(shapes, torch.bfloat16, cache_dir=tmp_path)
    assert len(calls) == 4


@pytest.mark.parametrize("tile_dtype,gemm", [(torch.float32, "onednn_f32"), (torch.bfloat16, "onednn_f32"),
                                             (torch.bfloat16, "onednn_bf16")])
def test_every_candidate_computes_the_same_product(tile_dtype, gemm) -> None:
    from tokenmill.model.layers import Linear

    torch.manual_seed(0)
    layer = Linear(64, 40, bias=True)
    reference = layer.weight.detach().to(tile_dtype).float()
    bias = layer.bias.detach().clone()
    layer.set_format(DenseFormat(tile_dtype, cpu_layout=True, onednn=True,
                                 choice=CPUMatmulChoice(skinny_max_rows=4, gemm=gemm)))
    with torch.inference_mode():
        for rows in (1, 4, 5, 33):
            x = torch.randn(rows, 64)
            bf16_inputs = gemm == "onednn_bf16" and rows > 4
            tol = 3e-2 if bf16_inputs else 1e-4  # bf16 inputs round x: the product differs by that rounding
            torch.testing.assert_close(layer(x), F.linear(x, reference, bias), atol=tol, rtol=tol)


def test_measure_times_every_candidate_for_every_row_count() -> None:
    t = tune.measure([(64, 32), (32, 64)], torch.bfloat16, layers=1, reps=1)
    assert set(t.skinny) == set(tune.DECODE_ROWS)
    assert set(t.gemm) == {"onednn_f32", "onednn_bf16"}
    assert all(set(g) == {*tune.DECODE_ROWS, tune.PREFILL_ROWS} for g in t.gemm.values())
    assert all(v > 0 for v in t.skinny.values())
    assert "choice:" in tune.describe(t, tune.decide(t))


def test_on_a_cpu_with_the_kernels_activations_stay_float32_and_dtype_is_storage() -> None:
    from tokenmill.runner.worker import DtypePlan, resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, native_kernels=True) == DtypePlan("float32", "bfloat16", "bfloat16")
    assert resolve_dtype("bfloat16", cpu, native_kernels=True) == DtypePlan("float32", "bfloat16", "bfloat16")
    assert resolve_dtype("float32", cpu, native_kernels=True) == DtypePlan("float32", "float32", "float32")
    with pytest.raises(ValueError, match="float16 is for GPUs"):
        resolve_dtype("float16", cpu, native_kernels=True)


def test_a_disturbed_measurement_is_not_cached_and_falls_back_to_the_default_split(tmp_path, monkeypatch) -> None:
    """A kernel that times slower at fewer rows (by > 2x) was robbed by other work: the
    measurement is retried, and if every attempt is disturbed the default row split is used
    with the GEMM the CPU's features name (fallback_gemm), and nothing is cached (the next
    start measures again)."""
    from tokenmill.runner.plan import ROWS

    clean = timings({1: 1.0, 2: 1.1, 4: 1.4, 8: 2.0, 16: 4.0}, onednn_f32={1: 2.0, 2: 2.0, 4: 2.1, 8: 2.5, 16: 3.1,
                                                                          128: 14.0})
    spoiled = timings({1: 100.0, 2: 102.0, 4: 103.0, 8: 17.0, 16: 40.0}, onednn_f32=clean.gemm["onednn_f32"])
    assert tune.disturbed(clean) is None
    assert "skinny kernel 100000.00 ms at 1 rows vs 17000.00 ms at 8" in tune.disturbed(spoiled)
    results = [spoiled, spoiled, spoiled, spoiled, clean]
    monkeypatch.setattr(tune, "measure", lambda shapes, tile_dtype, gemms: results.pop(0))
    choice, _, source = tune.choose([(96, 32)], torch.float32, cache_dir=tmp_path)
    assert choice == tune.fallback_choice(tune.candidate_gemms(torch.float32), torch.float32) and "not cached" in source
    assert choice in (CPUMatmulChoice(ROWS.skinny_max_rows, "onednn_f32"), CPUMatmulChoice(ROWS.skinny_max_rows, "panels"))
    assert not list(tmp_path.glob("dense-*.json")) and len(results) == 2  # three attempts
    # The next start measures again; a clean second attempt is decided and cached.
    choice, _, source = tune.choose([(96, 32)], torch.float32, cache_dir=tmp_path)
    assert choice == tune.decide(clean) and "cached in" in source and len(list(tmp_path.glob("dense-*.json"))) == 1


def test_a_uniformly_slow_measurement_is_disturbed_too() -> None:
    """Every pass of every kernel stalled alike (2 threads on a box of busy cores: ~100-250
    ms each, each OpenMP region waiting for a descheduled thread) looks slower at no row
    count; reading the weights at well under the machine's bandwidth gives it away."""
    elements = 8 * 3_000_000  # 8 layers of a 135M model's linears: 48 MB in bf16
    stalled = timings({m: 0.1 for m in (1, 2, 4, 8, 16)}, onednn_f32={m: 0.1 for m in (1, 2, 4, 8, 16, 128)},
                      onednn_bf16={m: 0.12 for m in (1, 2, 4, 8, 16, 128)})
    stalled = tune.Timings(stalled.skinny, stalled.gemm, elements)
    assert "skinny kernel 100.00 ms at 1 rows over 48 MB of weights (0.48 GB/s)" == tune.disturbed(stalled)
    clean = tune.Timings({1: 2.1e-3, 2: 2.6e-3, 4: 4.2e-3, 8: 9e-3, 16: 14e-3},
                         {"onednn_f32": {1: 8e-3, 2: 9e-3, 4: 7e-3, 8: 9e-3, 16: 12e-3, 128: 70e-3},
                          "onednn_bf16": {1: 4e-3, 2: 5e-3, 4: 4e-3, 8: 5e-3, 16: 7e-3, 128: 37e-3}}, elements)
    assert tune.disturbed(clean) is None  # measured on a Zen 4 EPYC, 1 thread


@pytest.mark.parametrize("native_bf16", [True, False])
def test_an_untrusted_measurement_falls_back_to_the_gemm_the_cpu_features_name(monkeypatch, native_bf16) -> None:
    class CPU:
        pass

    cpu = CPU()
    cpu.native_bf16 = native_bf16
    monkeypatch.setattr(tune, "cpu_info", lambda: cpu)
    assert tune.fallback_gemm(("onednn_f32", "onednn_bf16")) == ("onednn_bf16" if native_bf16 else "onednn_f32")
    assert tune.fallback_gemm(("onednn_f32",)) == "onednn_f32"  # float32 weights: never bf16 inputs
    assert tune.fallback_gemm(("onednn_bf16",)) == "onednn_bf16"  # fixed by --cpu-gemm


@pytest.mark.parametrize("amx", [True, False])
def test_an_untrusted_measurement_takes_the_panel_kernel_where_built_and_no_amx(monkeypatch, amx) -> None:
    from tokenmill import kernels
    from tokenmill.runner.plan import ROWS

    class CPU:
        native_bf16 = True

        def has(self, flag: str) -> bool:
            return amx and flag == "amx_bf16"

    monkeypatch.setattr(tune, "cpu_info", lambda: CPU())
    gemms = ("onednn_f32", "onednn_bf16", "panels")
    monkeypatch.setattr(kernels, "panel_linear_built", lambda dtype: True)
    expected = "onednn_bf16" if amx else "panels"
    assert tune.fallback_choice(gemms, torch.bfloat16) == CPUMatmulChoice(ROWS.skinny_max_rows, expected)
    monkeypatch.setattr(kernels, "panel_linear_built", lambda dtype: False)
    assert tune.fallback_choice(gemms, torch.bfloat16) == CPUMatmulChoice(ROWS.skinny_max_rows, "onednn_bf16")


# ----- quantized weights: integer GEMM or bf16 GEMM past the integer rows ---------------------


def test_the_integer_gemm_is_chosen_only_where_it_was_faster_at_every_row_count() -> None:
    fast = {"integer": {32: 1.0, 128: 3.0}, "bf16 gemm": {32: 2.0, 128: 4.0}}
    assert tune.decide_quant_gemm(fast)
    assert not tune.decide_quant_gemm({"integer": {32: 1.0, 128: 5.0}, "bf16 gemm": {32: 2.0, 128: 4.0}})
    assert not tune.decide_quant_gemm({"integer": {32: 2.0, 128: 3.0}, "bf16 gemm": {32: 2.0, 128: 4.0}})


def test_the_quantized_gemm_choice_is_measured_once_then_cached(tmp_path, monkeypatch) -> None:
    calls = []

    def fake_measure(shapes):
        calls.append(tuple(shapes))
        return {"integer": {32: 1e-6, 128: 1.5e-6}, "bf16 gemm": {32: 2e-6, 128: 3e-6}}

    monkeypatch.setattr(tune, "measure_quant_gemm", fake_measure)
    monkeypatch.setattr(tune.kernels, "quant_integer_gemm_built", lambda: True)
    shapes = [(96, 64), (64, 64)]
    integer, measured, source = tune.choose_quant_gemm(shapes, cache_dir=tmp_path)
    assert integer and measured is not None and "measured" in source and len(calls) == 1, source
    again, measured, source = tune.choose_quant_gemm(shapes, cache_dir=tmp_path)
    assert again and measured is None and "cached" in source and len(calls) == 1
    assert len(list(tmp_path.glob("quant-*.json"))) == 1 and not list(tmp_path.glob("dense-*.json"))
    # A build without the kernel never measures and keeps the bf16 GEMM.
    monkeypatch.setattr(tune.kernels, "quant_integer_gemm_built", lambda: False)
    integer, measured, source = tune.choose_quant_gemm(shapes, cache_dir=tmp_path, refresh=True)
    assert not integer and measured is None and "AVX512-VNNI" in source and len(calls) == 1


def test_a_disturbed_quantized_gemm_measurement_keeps_the_bf16_gemm_uncached(tmp_path, monkeypatch) -> None:
    # 32 rows 3x slower than 128: another job stole the thread, not the kernel.
    monkeypatch.setattr(tune, "measure_quant_gemm",
                        lambda shapes: {"integer": {32: 3e-3, 128: 1e-3}, "bf16 gemm": {32: 2e-3, 128: 4e-3}})
    monkeypatch.setattr(tune.kernels, "quant_integer_gemm_built", lambda: True)
    integer, measured, source = tune.choose_quant_gemm([(64, 64)], cache_dir=tmp_path)
    assert not integer and "disturbed" in source and not list(tmp_path.glob("quant-*.json"))


def test_measuring_the_quantized_gemms_times_both_at_every_row_count() -> None:
    timings = tune.measure_quant_gemm([(64, 64), (32, 64)], reps=1)
    assert set(timings) == set(tune.QUANT_CANDIDATES)
    assert all(set(t) == set(tune.QUANT_ROWS) and min(t.values()) > 0 for t in timings.values())


def test_the_plan_carries_the_integer_gemm_and_deterministic_inference_keeps_it() -> None:
    """The integer GEMM gives a row the row kernel's bits at any row count, so deterministic
    inference keeps the default's pair (same speed); without it, the integer kernel at every row."""
    from tokenmill.runner.plan import EVERY_ROW, batch_invariant_plan, cpu_native_plan, quantized_plan

    dense = cpu_native_plan(torch.bfloat16, onednn=True, choice=CPUMatmulChoice(2, "onednn_bf16"), fused_decode=True)
    assert dense.bf16_activation_rows == 2  # bf16 float tensors: their GEMM takes bf16 rows
    plan = quantized_plan(dense, "int4", native_bf16=True, integer_gemm=True)
    assert plan.weight_format.integer_gemm and "integer GEMM" in plan.describe()
    # float32 activations into the integer GEMM; bf16 prefill attention still
    assert plan.bf16_activation_rows is None and plan.prefill_attention_dtype == torch.bfloat16
    assert not quantized_plan(dense, "int4", native_bf16=True).weight_format.integer_gemm
    assert quantized_plan(dense, "int4", native_bf16=True).bf16_activation_rows is not None
    invariant = batch_invariant_plan(plan).weight_format
    assert invariant.integer_gemm and invariant.integer_rows == plan.weight_format.integer_rows
    without = batch_invariant_plan(quantized_plan(dense, "int4", native_bf16=True)).weight_format
    assert not without.integer_gemm and set(without.integer_rows.values()) == {EVERY_ROW}


def test_a_mixture_of_experts_keeps_the_split_and_panels_can_be_forced_or_refused(monkeypatch) -> None:
    """An MoE model's experts run as one grouped call on skinny tiles, so its dense kernels are
    chosen among the split's GEMMs only; `cpu_gemm panels` takes the panel kernel without a
    measurement where the build has it, and is refused, naming the fix, where it has not."""
    import dataclasses

    from tokenmill import kernels
    from tokenmill.config import EngineConfig
    from tokenmill.model_arch import ModelArchConfig
    from tokenmill.runner import worker

    seen = []

    def fake_choose(shapes, tile_dtype, *, allowed=None, **_):
        seen.append(allowed)
        return CPUMatmulChoice(4, "onednn_bf16"), None, "fake"

    monkeypatch.setattr(tune, "choose", fake_choose)
    dense = ModelArchConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                            max_position_embeddings=128)
    moe = dataclasses.replace(dense, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    worker.cpu_matmul_choice(EngineConfig(), torch.bfloat16, dense)
    worker.cpu_matmul_choice(EngineConfig(), torch.bfloat16, moe)
    assert seen[0] is None and "panels" not in seen[1] and "onednn_bf16" in seen[1]
    forced = EngineConfig.from_kwargs(cpu_gemm="panels")
    if kernels.panel_linear_built(torch.bfloat16):
        assert worker.cpu_matmul_choice(forced, torch.bfloat16, dense) == CPUMatmulChoice(16, "panels")
        assert len(seen) == 2  # nothing measured
    else:
        with pytest.raises(ValueError, match="cpu_gemm panels needs the native kernels built for AVX-512"):
            worker.cpu_matmul_choice(forced, torch.bfloat16, dense)
