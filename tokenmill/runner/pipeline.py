"""Pipeline stages overlapping within a step: the step's requests are cut into
micro-batches that flow stage to stage, so stage 1 computes micro-batch 1 while stage 0
computes micro-batch 2 (GPipe-style; a step of m micro-batches over p stages keeps the
stages busy m / (m + p - 1) of the time, where one batch would keep them 1 / p).

Every rank cuts the step the same way (a function of the step message alone), runs the
same runner code on each micro-batch and, on a stage before the last, sends each
micro-batch's hidden states on without waiting for the next stage to take them.
"""

from __future__ import annotations

import dataclasses

from tokenmill.engine.batch import RunnerOutput, StepRequest
from tokenmill.runner.model_runner import ModelRunner


def split_microbatches(items: list[StepRequest], count: int) -> list[list[StepRequest]]:
    """Up to `count` contiguous groups of about as many tokens each, none empty."""
    count = min(count, len(items))
    if count <= 1:
        return [items] if items else []
    target = sum(r.num_tokens for r in items) / count
    groups: list[list[StepRequest]] = []
    current: list[StepRequest] = []
    tokens = 0
    for i, item in enumerate(items):
        current.append(item)
        tokens += item.num_tokens
        items_left, groups_left = len(items) - i - 1, count - len(groups) - 1
        if len(groups) < count - 1 and (tokens >= target * (len(groups) + 1) or items_left == groups_left):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


def merge_outputs(into: RunnerOutput, part: RunnerOutput) -> None:
    for f in dataclasses.fields(RunnerOutput):
        merged, more = getattr(into, f.name), getattr(part, f.name)
        if isinstance(merged, dict):  # per request
            merged.update(more)
        else:  # per step (the disk tier's write report)
            merged.extend(more)


class PipelineRunner(ModelRunner):
    """A ModelRunner that runs each step as micro-batches (pipeline parallelism)."""

    microbatches = 2

    def run(self, items: list[StepRequest]) -> RunnerOutput:
        output = RunnerOutput()
        link = self.model.parallel.next_stage
        try:
            for group in split_microbatches(items, self.microbatches):
                merge_outputs(output, super().run(group))
        finally:
            if link is not None:
                link.flush()
        return output
