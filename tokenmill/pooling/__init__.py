"""Pooling: a prompt's final hidden states -> one vector (an embedding).

The pooling runner's own room, below the runner and beside attention/quantization: the
model returns the hidden states of the step's tokens and knows no requests; the runner
hands each pooling request's rows to the `Pooler`, which keeps what a prompt split into
chunks needs between steps (a running sum for MEAN, the first row for CLS) and returns
the vector when the last chunk has run. `model_pooling` reads how a checkpoint says it
pools (its sentence-transformers files) and whether it is a Matryoshka model; no torch
there. Imports torch and the ground floor only."""

from tokenmill.pooling.model_config import ModelPooling, model_pooling
from tokenmill.pooling.pooler import Pooler

__all__ = ["ModelPooling", "Pooler", "model_pooling"]
