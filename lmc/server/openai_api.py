"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE streaming, usage with cached tokens,
logprobs, response_format, n, stop, seed, logit_bias; extras regex / ebnf / json_schema / structured_outputs /
top_k / min_p ...), /v1/models. An extra body field `program` carries the request's program hints
(lmc.protocol.ProgramHints): a bad one is a 400 naming the field."""
from __future__ import annotations

import re
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .service import Service, check_token_ids, n_params, program_hints, validate_params
from .sse import EventStream, sse, start_streams, unless_disconnected

_NO_VALUE = object()


def router(svc: Service) -> APIRouter:
    r = APIRouter()

    # ---- completions -----------------------------------------------------------------------------
    @r.post("/v1/completions")
    async def completions(request: Request):
        req = await svc.parse(request, CompletionRequest)
        program = program_hints(req.program)
        texts, id_lists, items, prompt_index = await svc.offload(_completion_items, svc, req)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice_logprobs(meta, k):
            if req.logprobs is None:
                return None
            return _completion_logprobs(svc, meta, req.logprobs, req.echo, 0)

        if req.stream:
            async def events(merged):
                results: dict[int, dict] = {}
                texts_out = {i: "" for i in range(len(items))}
                async for i, c in merged:
                    k = prompt_index[i]
                    delta = (texts[k] if req.echo and not texts_out[i] and c["text"] is not None else "") + c["text"]
                    texts_out[i] += c["text"]
                    fin = "meta_info" in c
                    if fin:
                        svc.check_meta(c["meta_info"])
                        results[i] = {**c, "_prompt_index": k}
                    if delta or fin:
                        yield sse({"id": cid, "object": "text_completion", "created": created,
                                    "model": svc.model, "choices": [{
                                        "index": i, "text": delta,
                                        "logprobs": choice_logprobs(c["meta_info"], k) if fin else None,
                                        "finish_reason": _finish(c["meta_info"]) if fin else None}]})
                if req.stream_options is not None and req.stream_options.include_usage:
                    ordered = [results[i] for i in sorted(results)]
                    yield sse({"id": cid, "object": "text_completion", "created": created,
                                "model": svc.model, "choices": [],
                                "usage": _usage(ordered, [len(x) for x in id_lists])})

            return EventStream(await start_streams(svc, items, program), events)

        results = await unless_disconnected(request, svc.run_all(items, program=program))
        choices = []
        for i, (r, k) in enumerate(zip(results, prompt_index)):
            svc.check_meta(r["meta_info"])
            r["_prompt_index"] = k
            choices.append({"index": i, "text": (texts[k] if req.echo else "") + r["text"],
                            "logprobs": choice_logprobs(r["meta_info"], k), "finish_reason": _finish(r["meta_info"]),
                            "matched_stop": (r["meta_info"].get("finish_reason") or {}).get("matched")})
        return _response(req, {"id": cid, "object": "text_completion", "created": created, "model": svc.model,
                               "choices": choices, "usage": _usage(results, [len(x) for x in id_lists])})

    # ---- OpenAI: chat completions ------------------------------------------------------------------------
    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await svc.parse(request, ChatCompletionRequest)
        program = program_hints(req.program)
        _check_model(svc, req.model)
        if req.tools:
            raise ApiError(400, "tools are not supported by this server", "tools")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ApiError(400, "top_logprobs must be in [0, 20]", "top_logprobs")
        ids = await svc.offload(lambda: svc.encode(_render_chat(svc, req), "messages"))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        constraint = _constraint(req, req.response_format)
        p = {**_openai_params(svc, req, len(ids), max_tokens, None), **constraint}
        if svc.template.stop_token_ids:
            p["stop_token_ids"] = list(p.get("stop_token_ids") or []) + list(svc.template.stop_token_ids)
        top = req.top_logprobs or 0
        if req.logprobs:
            p.update(return_logprob=True, top_logprobs_num=top)
        validate_params(svc, p)
        items = [(ids, q) for q in n_params(svc, p, req.n)]
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if req.stream:
            def chunk(choices, usage=_NO_VALUE):
                out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": svc.model,
                       "choices": choices}
                if usage is not _NO_VALUE:
                    out["usage"] = usage
                return sse(out)

            async def events(merged):
                results: dict[int, dict] = {}
                for i in range(len(items)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                async for i, c in merged:
                    fin = "meta_info" in c
                    if c["text"]:
                        yield chunk([{"index": i, "delta": {"content": c["text"]}, "logprobs": None,
                                      "finish_reason": None}])
                    if fin:
                        svc.check_meta(c["meta_info"])
                        results[i] = {**c, "_prompt_index": 0}
                        yield chunk([{"index": i, "delta": {},
                                      "logprobs": _chat_logprobs(svc, c["meta_info"], top) if req.logprobs
                                      else None, "finish_reason": _finish(c["meta_info"])}])
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield chunk([], _usage([results[i] for i in sorted(results)], [len(ids)]))

            return EventStream(await start_streams(svc, items, program), events)

        results = await unless_disconnected(request, svc.run_all(items, program=program))
        choices = []
        for i, r in enumerate(results):
            svc.check_meta(r["meta_info"])
            r["_prompt_index"] = 0
            choices.append({"index": i, "message": {"role": "assistant", "content": r["text"]},
                            "logprobs": _chat_logprobs(svc, r["meta_info"], top) if req.logprobs else None,
                            "finish_reason": _finish(r["meta_info"]),
                            "matched_stop": (r["meta_info"].get("finish_reason") or {}).get("matched")})
        return _response(req, {"id": cid, "object": "chat.completion", "created": created, "model": svc.model,
                               "choices": choices, "usage": _usage(results, [len(ids)])})

    @r.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model, "object": "model", "created": int(svc.started),
                                            "owned_by": "lmc", "root": svc.engine.model_name,
                                            "max_model_len": svc.engine.context_length}]}

    @r.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.model:
            raise ApiError(404, f"model {model_id!r} not found; this server serves {svc.model!r}", "model")
        return {"id": svc.model, "object": "model", "created": int(svc.started), "owned_by": "lmc"}

    return r


# ---- OpenAI sampling translation -------------------------------------------------------------------------------
def _constraint(req, response_format) -> dict:
    """Engine constraint fields from the request's extras / response_format / structured_outputs."""
    out: dict[str, Any] = {}
    if req.regex is not None:
        out["regex"] = req.regex
    if req.ebnf is not None:
        out["ebnf"] = req.ebnf
    if req.json_schema is not None:
        out["json_schema"] = req.json_schema
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_schema":
            if response_format.json_schema is None or response_format.json_schema.schema_ is None:
                raise ApiError(400, "response_format json_schema needs json_schema.schema", "response_format")
            out.setdefault("json_schema", response_format.json_schema.schema_)
        else:
            out.setdefault("json_schema", {"type": "object"})
    so = req.structured_outputs
    if so is not None:
        given = [k for k in ("choice", "regex", "json_", "grammar") if getattr(so, k) is not None]
        if len(given) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of choice, regex, json, grammar",
                           "structured_outputs")
        k = given[0]
        if k == "choice":
            if not so.choice:
                raise ApiError(400, "structured_outputs.choice must be a non-empty list", "structured_outputs")
            out["regex"] = "(" + "|".join(re.escape(c) for c in so.choice) + ")"
        else:
            out[{"regex": "regex", "json_": "json_schema", "grammar": "ebnf"}[k]] = getattr(so, k)
    if len(out) > 1:
        raise ApiError(400, f"at most one constraint may be given: got {', '.join(sorted(out))}")
    return out


def _openai_params(svc: Service, req, prompt_len: int, max_tokens: int | None, default_max: int | None) -> dict:
    ctx = svc.engine.context_length
    if prompt_len >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the prompt has {prompt_len} "
                            "tokens. Shorten the prompt.", "messages" if hasattr(req, "messages") else "prompt")
    if max_tokens is None:
        max_tokens = ctx - prompt_len if default_max is None else min(default_max, ctx - prompt_len)
    elif not isinstance(max_tokens, int) or max_tokens < 0:
        raise ApiError(400, f"max_tokens must be a non-negative integer, got {max_tokens!r}", "max_tokens")
    elif prompt_len + max_tokens > ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                            "completion). Reduce the prompt or max_tokens.", "max_tokens")
    if not req.skip_special_tokens:
        raise ApiError(400, "skip_special_tokens=false is not supported by this server", "skip_special_tokens")
    p: dict[str, Any] = {"max_new_tokens": max_tokens}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                     ("repetition_penalty", "repetition_penalty"), ("seed", "seed"), ("stop", "stop"),
                     ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                     ("min_tokens", "min_new_tokens"), ("logit_bias", "logit_bias")):
        v = getattr(req, src)
        if v is not None:
            p[dst] = v
    if isinstance(p.get("stop"), list) and not p["stop"]:
        del p["stop"]
    return p



def _finish(meta: dict) -> str:
    t = (meta.get("finish_reason") or {}).get("type")
    return "length" if t == "length" else "stop"


def _usage(results: list[dict], prompts: list[int]) -> dict:
    """Prompt tokens counted once per prompt (as OpenAI bills n>1), completion tokens summed."""
    metas = [r["meta_info"] for r in results]
    prompt = sum(prompts)
    completion = sum(m["completion_tokens"] for m in metas)
    per_prompt: dict[int, int] = {}
    for r in results:
        per_prompt.setdefault(r["_prompt_index"], r["meta_info"].get("cached_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}


def _response(req, response: dict) -> JSONResponse:
    """The response, plain JSON data sent as is (FastAPI's encoder would walk every logprob), with SGLang's
    extension where asked: with return_cached_tokens_details, where the cached prompt tokens came from (lmc's
    prefix cache is all in device memory: no host tier)."""
    if req.return_cached_tokens_details:
        cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
        response["sglext"] = {"cached_tokens_details": {"device": cached, "host": 0}}
    return JSONResponse(response)


def _chat_logprobs(svc: Service, meta: dict, top: int) -> dict:
    content = []
    tops = meta.get("output_top_logprobs") or []
    for i, (lp, tid, _) in enumerate(meta.get("output_token_logprobs") or []):
        tok = svc.token_text(tid)
        entry = {"token": tok, "logprob": 0.0 if lp is None else lp, "bytes": list(tok.encode()),
                 "top_logprobs": []}
        if top and i < len(tops) and tops[i]:
            entry["top_logprobs"] = [{"token": svc.token_text(t), "logprob": v,
                                      "bytes": list(svc.token_text(t).encode())} for v, t, _ in tops[i][:top]]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(svc: Service, meta: dict, top: int, echo: bool, offset0: int) -> dict:
    entries = list(meta.get("output_token_logprobs") or [])
    tops = list(meta.get("output_top_logprobs") or [])
    if echo:
        entries = list(meta.get("input_token_logprobs") or []) + entries
        tops = list(meta.get("input_top_logprobs") or [None] * len(meta.get("input_token_logprobs") or [])) + tops
    tokens, lps, top_out, offsets = [], [], [], []
    pos = offset0
    for i, (lp, tid, _) in enumerate(entries):
        t = svc.token_text(tid)
        tokens.append(t)
        lps.append(lp)
        offsets.append(pos)
        pos += len(t)
        row = tops[i] if i < len(tops) else None
        top_out.append({svc.token_text(x): v for v, x, _ in (row or [])[:top]} if top else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_out, "text_offset": offsets}



def _completion_items(svc: Service, req: CompletionRequest):
    """(prompt texts, prompt ids, engine items, prompt index of each item) of a /v1/completions request (in the
    worker pool: it tokenizes)."""
    _check_model(svc, req.model)
    if req.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.best_of not in (None, 1, req.n):
        raise ApiError(400, "best_of is not supported (use n)", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise ApiError(400, "logprobs must be in [0, 20]", "logprobs")
    prompts = req.prompt
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ApiError(400, "prompt must not be empty", "prompt")
    texts, id_lists = [], []
    for p in prompts:
        if isinstance(p, str):
            texts.append(p)
            id_lists.append(svc.encode(p))
        else:
            check_token_ids(svc, p, "prompt")
            texts.append(svc.tok.decode(p) if svc.tok is not None else "")
            id_lists.append(list(p))
    constraint = _constraint(req, req.response_format)
    items, prompt_index = [], []
    for k, ids in enumerate(id_lists):
        p = {**_openai_params(svc, req, len(ids), req.max_tokens, 16), **constraint}
        if req.logprobs is not None:
            p.update(return_logprob=True, top_logprobs_num=req.logprobs)
            if req.echo:
                p["logprob_start_len"] = 0
        validate_params(svc, p)
        for q in n_params(svc, p, req.n):
            items.append((ids, q))
            prompt_index.append(k)
    return texts, id_lists, items, prompt_index


def _check_model(svc: Service, model: str | None) -> None:
    # Any name is accepted (clients often send a placeholder); it is echoed back as the served name.
    return None


def _render_chat(svc: Service, req: ChatCompletionRequest) -> str:
    msgs = []
    for k, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if getattr(part, "type", None) != "text":
                    raise ApiError(400, f"messages[{k}]: {part.type} content is not supported: the model "
                                        f"{svc.model!r} is text-only", "messages")
                parts.append(part.text)
            content = "".join(parts)
        if m.role in ("tool", "function"):
            raise ApiError(400, f"messages[{k}]: role {m.role!r} is not supported (no tool calling)", "messages")
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    if not msgs:
        raise ApiError(400, "messages must not be empty", "messages")
    cont = req.continue_final_message
    if cont and msgs[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs a final assistant message", "messages")
    head, tail = (msgs[:-1], msgs[-1]["content"]) if cont else (msgs, "")
    gen_prompt = cont or req.add_generation_prompt
    tok = svc.tok
    if tok is not None and getattr(tok, "chat_template", None):
        if not head:
            text = svc.template.default_system + svc.template.prefix["assistant"] if gen_prompt else ""
        else:
            try:
                text = tok.apply_chat_template(head, tokenize=False, add_generation_prompt=gen_prompt)
            except Exception as e:
                raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from None
    else:
        t = svc.template
        text = "" if head and head[0]["role"] == "system" else t.default_system
        text += "".join(t.prefix[m["role"]] + m["content"] + t.suffix[m["role"]] for m in head)
        if gen_prompt:
            text += t.prefix["assistant"]
    return text + tail

