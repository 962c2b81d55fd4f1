"""How a checkpoint says it pools: sentence-transformers' `modules.json` and its Pooling
module's `config.json` (what vLLM reads too), and config.json's Matryoshka fields."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' Pooling config keys -> tokenmill's (vLLM's) pooling types.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass(frozen=True)
class ModelPooling:
    pooling_type: str | None = None  # None: the checkpoint does not say
    normalize: bool | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: not Matryoshka; (): any prefix
    # The checkpoint is an embedding model: it ships a sentence-transformers pooling config,
    # or its architecture is a bare decoder (LlamaModel, Qwen3Model, ...: no LM head). What
    # `--runner auto` resolves to pooling, as vLLM's auto does.
    is_embedding_model: bool = False


def model_pooling(path: str) -> ModelPooling:
    """What a Hugging Face directory says (a GGUF file says nothing: all None)."""
    root = Path(path)
    if not root.is_dir():
        return ModelPooling()
    pooling_type, normalize = _sentence_transformers(root)
    return ModelPooling(pooling_type, normalize, _matryoshka(root), _is_embedding_model(root))


def _sentence_transformers(root: Path) -> tuple[str | None, bool | None]:
    modules_file = root / "modules.json"
    pooling_dir, normalize = root / "1_Pooling", None
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        types = [m.get("type", "") for m in modules]
        normalize = any(t.endswith("models.Normalize") for t in types)
        pooling = next((m for m in modules if m.get("type", "").endswith("models.Pooling")), None)
        pooling_dir = root / pooling["path"] if pooling is not None else None
    config_file = pooling_dir / "config.json" if pooling_dir is not None else None
    if config_file is None or not config_file.is_file():
        return None, normalize
    config = json.loads(config_file.read_text())
    modes = [name for key, name in _ST_MODES.items() if config.get(key)]
    other = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES)
    if other or len(modes) > 1:
        raise ValueError(f"{config_file}: pooling {other or modes} is not supported; tokenmill pools with one of "
                         f"{', '.join(_ST_MODES.values())} (override with --pooler-config)")
    return (modes[0] if modes else None), normalize


def _is_embedding_model(root: Path) -> bool:
    if (root / "modules.json").is_file() or (root / "1_Pooling" / "config.json").is_file():
        return True
    config_file = root / "config.json"
    if not config_file.is_file():
        return False
    names = json.loads(config_file.read_text()).get("architectures") or []
    return bool(names) and all(name.endswith("Model") for name in names)


def _matryoshka(root: Path) -> tuple[int, ...] | None:
    config_file = root / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    dims = config.get("matryoshka_dimensions")
    if dims is not None:
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None
