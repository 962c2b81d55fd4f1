"""Capacity planning: what a model needs and what a device gives, by the roofline.

- `shape`: a model's shape (`ModelShape`), read from a GGUF's metadata, a Hugging Face
  config.json, or a preset, without loading any weight;
- `roofline`: the formulas (parameter counts, weight and KV bytes, step times), pure functions;
- `catalog` and `machine`: devices, from datasheets or measured here;
- `presets`: popular architectures;
- `costmodel`: a step-time model fitted to measured steps (for the simulator);
- `cli`: `tokenmill plan`.

Nothing here imports torch except `machine`'s measurements, inside the functions.
"""
