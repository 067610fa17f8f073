"""KVPP inside vLLM's worker process: the worker subclass (`worker`), the model-runner adapters
(`runner_base`, `runner_v1`, `runner_v2`), the runtime's forward around each step (`step`, over the
step's rows in `batch`), the engine's state (`state`) and what a worker reports (`stats`). Imports
nothing: the plugin must stay cheap in every vLLM process."""
