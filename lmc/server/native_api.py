"""SGLang's native routes: POST /generate (text or input_ids, single or batch, max_new_tokens 0, logprobs with
logprob_start_len, streaming, and lmc's `program` hints field), /tokenize, /detokenize, /get_model_info
(/model_info), /get_server_info (/server_info), POST /flush_cache (state-changing routes are POST only: a GET is a
405), /health, /health_generate, /metrics.

Streaming `/generate` follows SGLang: one prompt streams events whose `text` is the output so far; a batch (a list
of prompts, or n > 1) interleaves the events of all its requests, each marked with its position in the batch
(`index`, prompt-major: prompt k's j-th sample is k * n + j).
"""
from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .protocol import ApiError, GenerateRequest
from .service import (Service, check_token_ids, json_object, jsonable, n_params, program_hints, slot_accounting,
                      validate_params, version)
from .sse import EventStream, sse, start_streams, unless_disconnected

SGLANG_SAMPLING_DEFAULTS = {  # SGLang keys lmc accepts only at their default value (they change nothing here)
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "stop_regex": [], "custom_params": None, "structural_tag": None, "stream_interval": None,
}


def router(svc: Service, enable_metrics: bool) -> APIRouter:
    r = APIRouter()

    @r.post("/generate")
    async def generate(request: Request):
        return await _native_generate(svc, await svc.parse(request, GenerateRequest), request)

    @r.post("/tokenize")
    async def tokenize(request: Request):
        body = await json_object(request, svc)
        unknown = set(body) - {"prompt", "text", "add_special_tokens", "model"}
        if unknown:
            raise ApiError(400, f"unknown field(s) {sorted(unknown)}")
        prompt = body.get("prompt", body.get("text"))
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ApiError(400, "add_special_tokens must be a boolean", "add_special_tokens")
        if isinstance(prompt, str):
            ids = await svc.offload(svc.encode, prompt, add_special_tokens=special)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": svc.engine.context_length})
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            ids = await svc.offload(lambda: [svc.encode(p, add_special_tokens=special) for p in prompt])
            return JSONResponse({"tokens": ids, "count": [len(x) for x in ids],
                                 "max_model_len": svc.engine.context_length})
        raise ApiError(400, "prompt must be a string or a list of strings", "prompt")

    @r.post("/detokenize")
    async def detokenize(request: Request):
        body = await json_object(request, svc)
        tokens = body.get("tokens")
        if svc.tok is None or not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "tokens must be a list of token ids", "tokens")
        check_token_ids(svc, tokens, "tokens")
        return {"text": await svc.offload(svc.tok.decode, tokens)}

    @r.api_route("/get_model_info", methods=["GET"])
    @r.api_route("/model_info", methods=["GET"])
    async def model_info():
        eng, t = svc.engine, svc.template
        cfg = getattr(eng.runner, "cfg", None)
        return {"model_path": eng.model_name, "served_model_name": svc.model, "tokenizer_path": eng.model_name,
                "is_generation": True, "has_image_understanding": False, "has_audio_understanding": False,
                "preferred_sampling_params": None, "weight_version": "default",
                "context_length": eng.context_length, "max_total_num_tokens": eng.max_total_tokens,
                "vocab_size": getattr(cfg, "vocab_size", None),
                "eos_token_ids": list(getattr(cfg, "eos_token_ids", ()) or ()),
                "chat_template": getattr(svc.tok, "chat_template", None) if svc.tok is not None else None,
                "chat_template_roles": {"prefix": t.prefix, "suffix": t.suffix, "default_system": t.default_system,
                                        "stop_token_ids": list(t.stop_token_ids)},
                "engine": "lmc", "version": version()}

    @r.api_route("/get_server_info", methods=["GET"])
    @r.api_route("/server_info", methods=["GET"])
    async def server_info():
        stats, slots = svc.engine.stats(), slot_accounting(svc.engine)
        return {**svc.server_args, "served_model_name": svc.model, "version": version(), "engine": "lmc",
                "context_length": svc.engine.context_length, "max_total_num_tokens": svc.engine.max_total_tokens,
                "in_flight_requests": svc.pending, "internal_states": [{**jsonable(stats), "slots": slots}],
                "slots": slots, "gc_frozen_objects": gc.get_freeze_count()}

    @r.post("/flush_cache")  # POST only (SGLang's clients POST): a page cannot trigger it with a plain GET
    async def flush_cache():
        ok = await asyncio.to_thread(svc.engine.flush_cache)
        if not ok:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be "
                                 "performed.)\n")

    @r.get("/health")
    async def health():
        if not svc.engine._thread.is_alive():
            return Response(status_code=503)
        return Response(status_code=200)

    @r.get("/health_generate")
    async def health_generate():
        if not svc.engine._thread.is_alive():
            return Response(status_code=503)
        ids = svc.encode("ping") if svc.tok is not None else [1]
        try:
            await asyncio.wait_for(asyncio.wrap_future(svc.engine.submit(
                None, {"max_new_tokens": 1, "temperature": 0}, ids)), timeout=60)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @r.get("/metrics")
    async def metrics():
        if not enable_metrics:
            raise ApiError(404, "metrics are disabled: start the server with --enable-metrics")
        text = svc.metrics.render(svc.engine.stats(), slot_accounting(svc.engine), svc.engine.grammars.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return r


def _native_items(svc: Service, req: GenerateRequest) -> tuple[list[tuple[list[int], dict]], bool, list[int]]:
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", "text")
    if req.text is not None:
        single = isinstance(req.text, str)
        prompts = [req.text] if single else list(req.text)
        ids = [svc.encode(t, "text") for t in prompts]
    else:
        single = not (req.input_ids and isinstance(req.input_ids[0], list))
        ids = [list(req.input_ids)] if single else [list(x) for x in req.input_ids]
    if not ids:
        raise ApiError(400, "empty batch", "text")
    b = len(ids)

    def per_item(v, name):
        if isinstance(v, list):
            if len(v) != b:
                raise ApiError(400, f"{name}: {len(v)} values for {b} prompts", name)
            return v
        return [v] * b

    sps = per_item(req.sampling_params or {}, "sampling_params")
    rl = per_item(req.return_logprob, "return_logprob")
    ls = per_item(req.logprob_start_len, "logprob_start_len")
    tn = per_item(req.top_logprobs_num, "top_logprobs_num")
    ti = req.token_ids_logprob  # one id list for every prompt, or one per prompt
    ti = per_item(ti, "token_ids_logprob") if ti and isinstance(ti[0], list) else [ti] * b
    items, index = [], []
    for k in range(b):
        sp = dict(sps[k] or {})
        if not isinstance(sp, dict):
            raise ApiError(400, "sampling_params must be an object", "sampling_params")
        p: dict[str, Any] = {}
        n = sp.pop("n", 1) or 1
        if "sampling_seed" in sp:
            sp.setdefault("seed", sp.pop("sampling_seed"))
        for key, default in SGLANG_SAMPLING_DEFAULTS.items():
            if key in sp:
                v = sp.pop(key)
                if v not in (default, None) and not (isinstance(default, (list, dict)) and not v):
                    raise ApiError(400, f"sampling_params.{key}={v!r} is not supported by this server",
                                   "sampling_params")
        for key, v in sp.items():
            if v is not None:
                p[key] = v
        if rl[k]:
            p["return_logprob"] = True
        if ls[k] is not None:
            p["logprob_start_len"] = ls[k]
        if tn[k] is not None:
            p["top_logprobs_num"] = tn[k]
        if ti[k] is not None:
            p["token_ids_logprob"] = ti[k]
        if not isinstance(n, int) or n < 1:
            raise ApiError(400, f"sampling_params.n must be a positive integer, got {n!r}", "sampling_params")
        if isinstance(p.get("logprob_start_len"), int) and p["logprob_start_len"] > len(ids[k]):
            raise ApiError(400, f"logprob_start_len ({p['logprob_start_len']}) exceeds the prompt length "
                                f"({len(ids[k])})", "logprob_start_len")
        validate_params(svc, p)
        for q in (n_params(svc, p, n) if n > 1 else [p]):
            items.append((ids[k], q))
            index.append(k)
    return items, single and len(items) == 1, index


def _native_result(svc: Service, r: dict, text_in_logprobs: bool, start: float) -> dict:
    meta = r["meta_info"]
    meta["e2e_latency"] = time.perf_counter() - start
    if text_in_logprobs:
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = [(lp, t, svc.token_text(t)) for lp, t, _ in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if key in meta:
                meta[key] = [None if row is None else [(lp, t, svc.token_text(t)) for lp, t, _ in row]
                             for row in meta[key]]
    return {"text": r["text"], "output_ids": r["output_ids"], "meta_info": meta}


async def _native_generate(svc: Service, req: GenerateRequest, request: Request):
    start = time.perf_counter()
    program = program_hints(req.program)
    items, single, _ = await svc.offload(_native_items, svc, req)
    if req.stream:
        async def events(merged):
            texts = [""] * len(items)
            async for i, c in merged:
                texts[i] += c["text"]
                if "meta_info" in c:
                    out = _native_result(svc, {**c, "text": texts[i]}, req.return_text_in_logprobs, start)
                else:
                    out = {"text": texts[i], "output_ids": [],  # SGLang's clients read both counts in every event
                           "meta_info": {"id": None, "finish_reason": None, "prompt_tokens": len(items[i][0]),
                                         "completion_tokens": c["completion_tokens"],
                                         "cached_tokens": c["cached_tokens"]}}
                if not single:
                    out["index"] = i
                yield sse(out)

        return EventStream(await start_streams(svc, items, program), events)

    outs = await unless_disconnected(request, svc.run_all(items, keep_failures=True, program=program))
    if single and isinstance(outs[0], BaseException):
        raise outs[0]
    results = [_native_result(svc, out, req.return_text_in_logprobs, start) if not isinstance(out, BaseException)
               else {"text": "", "output_ids": [], "error": str(out),  # one failure leaves the batch standing
                     "meta_info": {"finish_reason": {"type": "abort", "message": str(out)}}} for out in outs]
    return JSONResponse(results[0] if single else results)  # plain JSON, sent as is: no encoder walk
