"""`tokenmill bench kernels`: the dense CPU matmul kernels measured on this machine for a
model's shapes, and the choice the engine makes from them (runner/tune.py). It measures
afresh and updates the cache the engine reads at load."""

from __future__ import annotations

import argparse


def add_kernels_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="GGUF file, Hugging Face directory or planner preset (default: the default model)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="how the weights are stored (default bfloat16, what --dtype auto does on CPU)")
    parser.add_argument("--num-threads", type=int, default=None, help="threads (default: all cores this process may use)")


def cmd_kernels(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.runner.worker import layer_shapes
    from tokenmill.hardware import cpu_info
    from tokenmill.kernels import cpu_kernels_available
    from tokenmill.model.loader import resolve_model_path
    from tokenmill.planner.model_spec import read_model
    from tokenmill.runner import tune

    torch.set_num_threads(args.num_threads or cpu_info().num_cores)
    if not cpu_kernels_available():
        raise ValueError("the native CPU kernels did not build; `python -m tokenmill.kernels -v` shows why")
    shape = read_model(args.model or resolve_model_path(None)).shape
    shapes = layer_shapes(shape)  # the planner's shape has the architecture's field names
    dtype = getattr(torch, args.dtype)
    choice, timings, source = tune.choose(shapes, dtype, refresh=True)
    print(f"{cpu_info().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{shape.name}: layer shapes {shapes}, {args.dtype} weights")
    print("ms per pass over 8 layers' weights (fastest of 5):")
    print(tune.describe(timings, choice))
    print(source)
    return 0
