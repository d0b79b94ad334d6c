"""OpenAI-compatible serving of a dosa model: `python -m serving` (docs/serving.md).

config (validated YAML) -> loading (which model) -> engine (jitted chunked prefill, batched
decode over slots, prefix cache copies) <- scheduler (worker thread: admission order,
interleaving, cancellation, timeouts) <- api (FastAPI handlers, protocol parsing) under
server (uvicorn with a graceful drain); metrics (Prometheus); bench (load client).
Dependency direction: model <- serving.
"""
