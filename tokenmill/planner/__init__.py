"""Capacity planning: what a model needs and what a device gives, by the roofline.

- `shape`: a model's shape (`ModelShape`), read from a GGUF's metadata, a Hugging Face
  config.json, or a preset, without loading any weight;
- `roofline`: the formulas (parameter counts, weight and KV bytes, step times), pure functions;
- `catalog` and `machine`: devices, from datasheets or measured here;
- `presets`: popular architectures;
- `model_spec`: a model named on the command line (a preset, a GGUF, a config.json);
- `costmodel`: a step-time model fitted to measured steps (for the simulator);
- `cli`: `tokenmill plan`.

Nothing here imports torch except `machine`'s measurements, inside the functions.
The room may import the ground floor (`model_arch`, `gguf_file`, `hardware`, `config`) and
`engine/`; never `model/` or anything above (only `cli`, a front door, may).
"""
