"""A model named on the command line: a preset, a GGUF file, or a Hugging Face config.json.

Kept apart from `shape.py` because it looks names up in `presets.py`, which builds its
shapes with `shape.ModelShape`: shape <- presets <- model_spec, no circle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.dtypes import DTYPES
from tokenmill.planner.presets import PRESETS, preset
from tokenmill.planner.shape import ModelShape, StoredWeights, read_gguf, shape_from_hf_config


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan for: its shape, and what its checkpoint stores when that is known."""

    shape: ModelShape
    source: str  # "preset", a GGUF path, a config.json path
    stored: StoredWeights | None = None  # GGUF only
    checkpoint_format: str | None = None  # the weight format a checkpoint names (HF torch_dtype, GPTQ bits)


def read_model(model: str) -> ModelSpec:
    """A preset name, a GGUF file, a Hugging Face directory or its config.json."""
    key = model.strip().lower()
    if key in PRESETS:
        return ModelSpec(preset(key), "preset")
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: neither a preset ({', '.join(PRESETS)}) "
                         "nor a path to a .gguf file, a Hugging Face directory or a config.json")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file():
            path = path / "config.json"
        elif len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ValueError(f"{model!r} is a directory without config.json (nor exactly one .gguf file)")
    if path.suffix == ".gguf":
        shape, stored = read_gguf(path)
        return ModelSpec(shape, str(path), stored)
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{model!r} is neither a GGUF file nor a readable config.json: {exc}") from None
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelSpec(shape_from_hf_config(cfg, name), str(path), checkpoint_format=_hf_weight_format(cfg))


def _hf_weight_format(cfg: dict[str, Any]) -> str | None:
    """The weight format a config.json declares: GPTQ/AWQ int4 with its group size, fp8, or its dtype."""
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method in ("gptq", "awq") and quant.get("bits") in (4, 8):
        group = quant.get("group_size") or 128
        return "int8" if quant["bits"] == 8 else f"int4-g{group if group > 0 else 128}"
    if method == "fp8":
        return "fp8"
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return dtype if dtype in DTYPES else None
