"""`ModelArchConfig` lives on the ground floor (`tokenmill/model_arch.py`) so that the
planner and the parallel layout can read it without importing `model/`; this name stays
for the model code's importers."""

from tokenmill.model_arch import SUPPORTED_ARCHITECTURES, ModelArchConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArchConfig"]
