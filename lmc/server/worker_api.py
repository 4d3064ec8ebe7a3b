"""The routes a gateway calls on a worker beyond the serving API: SGLang's load report (`/get_load`).

`sglang-router` (the Rust gateway, `python -m sglang_router.launch_router`) treats an HTTP worker as a black box
that speaks SGLang's worker API. What it calls, read from its worker-management code (sgl-model-gateway
src/core/steps/worker/local/*.rs, src/core/worker_manager.rs) and checked against the real gateway in
tests/test_scale.py:
- registration: `GET /health` (the health-check endpoint; 200 = up), then `GET /server_info` (model_path,
  served_model_name, max_total_tokens, max_running_requests: optional, typed) and `GET /model_info`
  (model_path, is_generation, model_type, architectures). Both are served by app.py under SGLang's two names.
- periodic health checks: `GET /health`;
- load: `GET /get_load`, SGLang's shape: a list with one object per data-parallel rank,
  `{dp_rank, num_reqs, num_waiting_reqs, num_tokens, ts_tic}`; the gateway sums `num_tokens` (its `/get_loads`
  shows the result);
- traffic: `/generate`, `/v1/completions`, `/v1/chat/completions`, `/v1/models` passed through; the API key the
  gateway was given (`--api-key`) is sent as `Authorization: Bearer` on each of them;
- `/flush_cache` fanned out by the gateway's own `POST /flush_cache`.
"""
from __future__ import annotations

import time
from typing import Any


def load_report(engine) -> dict[str, Any]:
    """One rank's load, SGLang's fields: requests running + waiting, tokens held (KV slots owned by requests or
    pinned by them in the cache) plus the prompt tokens still waiting for admission. From the snapshot the
    engine's scheduler thread publishes after each step (Engine.load): consistent, never read across threads."""
    load = engine.load()
    held = load["request_owned_slots"] + load["protected_slots"]
    return {"dp_rank": 0, "num_reqs": load["running_requests"] + load["waiting_requests"],
            "num_waiting_reqs": load["waiting_requests"], "num_tokens": held + load["waiting_prompt_tokens"],
            "ts_tic": time.perf_counter()}


def add_worker_routes(app, svc) -> None:
    """Add the gateway-facing routes to `app` (a FastAPI app built by create_app around the service `svc`)."""

    @app.get("/get_load")
    async def get_load():
        return [load_report(svc.engine)]
