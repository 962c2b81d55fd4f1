"""The runner layer: turns a step message into tensors, runs the model and samples
(`model_runner.py`); the execution plan that alone decides which kernels a step runs
(`plan.py`), measured per machine (`tune.py`); thread choice (`threads.py`); and building
one rank of an engine (`worker.py`).

May import: `model/`, `attention/`, `quantization/`, `parallel/`, `kernels/`, `engine/`
(the step contract only) and the ground floor. Never `builder.py` or anything above it.
"""
