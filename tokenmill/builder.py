"""The composition root: an EngineConfig in, a running engine out.

`build_executor` chooses the executor (the model in this process, built by
`runner.worker.build_rank`, or a tensor/pipeline-parallel `distributed.executor.
ParallelExecutor` whose ranks build themselves with the same function) and the proposer
for speculative decoding; `build_engine` wraps them in an `LLMEngine`. `LLM`,
`tokenmill serve` and the bench all start here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import EngineConfig, EngineFacts
from tokenmill.engine.engine import LLMEngine, Proposer
from tokenmill.kv_events.publisher import make_publisher
from tokenmill.kv_transfer import ZmqKVConnector, kv_layout_facts
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.worker import build_rank
from tokenmill.spec_decode.draft import DraftModelProposer
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.tokenizer import Tokenizer


@dataclass
class BuiltExecutor:
    executor: ModelRunner  # or anything with execute(SchedulerOutput) -> RunnerOutput
    tokenizer: Tokenizer
    facts: EngineFacts
    proposer: Proposer | None = None  # speculative decoding's


def build_engine(config: EngineConfig) -> LLMEngine:
    built = build_executor(config)
    engine = LLMEngine(config, built.executor, built.tokenizer, built.facts, proposer=built.proposer)
    publisher = make_publisher(config.cache.kv_events_config)
    if publisher is not None:  # vLLM's KV events for a KV-aware router
        engine.kv_event_sink = publisher.publish_events
        engine.kv_event_publisher = publisher
    transfer = config.cache.kv_transfer_config
    if transfer is not None:  # prefill-decode disaggregation (docs/disaggregation.md)
        if config.parallel.world_size > 1:
            raise ValueError("kv_transfer_config: disaggregation with tensor/pipeline parallelism is not built yet")
        facts = built.facts
        runner = built.executor
        engine.set_kv_connector(ZmqKVConnector(transfer, kv_layout_facts(facts),
                                               facts.kv_bytes_per_token * facts.block_size,
                                               runner.kv_block_bytes, write_blocks=runner.write_kv_blocks,
                                               shared_pool=runner.shared_kv_pool(),
                                               copy_shared=runner.copy_shared_kv_blocks))
    return engine


def build_executor(config: EngineConfig) -> BuiltExecutor:
    """The model in this process, or split over worker processes (and hosts) when the
    config asks for tensor or pipeline parallelism."""
    if config.parallel.world_size > 1:
        from tokenmill.distributed.executor import ParallelExecutor

        executor = ParallelExecutor(config)
        return BuiltExecutor(executor, executor.tokenizer, executor.facts)
    rank = build_rank(config)
    proposer = None
    if config.speculative.speculative_config is not None:
        proposer = build_proposer(config, rank.runner, rank.draft_runner)
    return BuiltExecutor(rank.runner, rank.tokenizer, rank.facts, proposer)


def build_proposer(config: EngineConfig, runner: ModelRunner, draft_runner: ModelRunner | None) -> Proposer:
    """n-gram: model-free. Draft model: the draft's runner (built with the rank, beside the
    target's KV cache) in a proposer; the target runner asks it for the distributions its
    proposals were drawn from."""
    speculative = config.speculative.speculative_config
    k = speculative.num_speculative_tokens
    if speculative.method == "ngram":
        return NgramProposer(k, speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    proposer = DraftModelProposer(draft_runner, k, config.scheduler.max_num_batched_tokens,
                                  config.cache.enable_prefix_caching, seed=config.model.seed)
    runner.draft_probs = proposer.draft_probs
    return proposer
