"""The serving simulator (`tokenmill simulate`): the engine's own scheduler and KV block
manager on virtual time, with a step cost model in place of the model.

- `executor`: `StepMeter` (a step's cost-model features), `SimulatedExecutor`, `VirtualClock`;
- `simulate`: the run (an `LLMEngine` on a simulated executor) and its bench-serve result;
- `profile`: calibration on the real runner, the stored profiles;
- `setup`: a simulation's setup from a profile or the roofline of a catalog device;
- `sweep`, `validate`: request-rate and config sweeps; predicted against measured;
- `cli`: `tokenmill simulate [calibrate|sweep|validate]`.

It replays the requests of `workloads.trace` (synthetic, a recorded `bench serve` result,
JSONL) and reports with `workloads.metrics`, so a simulated run and a measured one count
alike. Everything but calibration and validation (which load the model or start a server)
is torch-free.

May import: `workloads/`, `engine/`, `planner/` and the ground floor; `builder.py` only to
calibrate (inside the function); never `bench/` (a peer front door).
"""
