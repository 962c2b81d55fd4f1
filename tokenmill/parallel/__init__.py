"""What a model split over ranks uses at run time: the shard layout (`layout.py`,
torch-free), `ModelParallel` (a model's view of its split), a rank's membership of the
split (`group.py`: rendezvous, process groups, stage links), the shared-memory
all-reduce (`shm.py`) and the step channel (`channel.py`).

Sits below model/: imports config, model_arch, hardware, kernels and torch; never model/,
runner/ or anything above.
"""
