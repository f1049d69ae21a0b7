"""The executor actor and the whole device half of a step (docs/architecture.md, "Executor and
its two threads"): `Executor` (executor.py) and its two threads, `DeviceState` (device_state.py:
the device tables and a step's launch), `PendingStep` (pending_step.py), pipeline stages
(stages.py), CUDA streams (streams.py) and decode graphs (cuda_graphs.py)."""
