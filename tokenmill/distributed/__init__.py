"""The tensor/pipeline-parallel executor: rank 0's `ParallelExecutor` (`executor.py`)
drives the other ranks through the step channel and watches them; `worker.py` is the
body of a worker rank's process and of `serve --headless` hosts. Every rank builds
itself with `runner.worker.build_rank`.

May import runner/, parallel/, engine's step types and the ground floor; never
builder.py or anything above it.
"""
