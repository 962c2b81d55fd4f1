"""Running the model for the engine: `worker.py` builds one rank (device, threads, dtypes,
checkpoint, plan, load, draft model, KV sizing, facts; one process and every rank of a
split alike), `model_runner.py` turns a step message into tensors and sampled tokens,
`pipeline.py` runs a step as pipeline micro-batches, `plan.py` the execution plan,
`tune.py` the measured kernel choice, `threads.py` the thread governor.

May import model/, attention/, quantization/, parallel/, kernels/, engine's plain step
types, sampling/ and the ground floor; never distributed/, builder.py or anything above.
"""
