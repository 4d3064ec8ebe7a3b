"""Request bodies of the OpenAI-compatible and SGLang-native routes (pydantic; unknown fields are refused), how a
body is parsed, and the server's limits on what one request may ask for.

Only fields the server honours (or accepts with their default value, for clients that always send them) are
declared: anything else is a 400 that names the field, never silently ignored. `parse_body` turns any body into
a model or an ApiError(400) naming the problem: strict JSON (no NaN / Infinity, finite numbers), valid UTF-8 and
Unicode (no lone surrogates), nested at most MAX_JSON_DEPTH deep.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_JSON_DEPTH = 64  # deeper bodies are refused: no legitimate request nests further, and xgrammar recurses
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only \u escapes can put a lone surrogate in a str


class ApiError(Exception):
    """A refused request: status, message (naming the problem), param (the field, when one is to blame)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, type_: str = "invalid_request_error", param=None) -> dict:
    """OpenAI's error shape, plus SGLang's top-level `message`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}, "object": "error",
            "message": message}


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is out of range (numbers must be finite)")
    return v


def load_json(raw: bytes) -> Any:
    """A request body as JSON, or ApiError(400) saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ApiError(400, f"the JSON body is nested too deeply (the limit is {MAX_JSON_DEPTH})") from None
    except ValueError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    _check_tree(obj, check_text=bool(_SURROGATE_ESCAPE.search(raw)))
    return obj


def _check_tree(obj: Any, check_text: bool) -> None:
    """Depth at most MAX_JSON_DEPTH; with check_text, every string (keys too) is encodable Unicode."""
    stack = [(obj, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if check_text:
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    raise ApiError(400, f"{path or 'the body'}: the string holds a lone UTF-16 surrogate (an "
                                        "unpaired \\ud800-\\udfff escape)", path.split(".")[0] or None) from None
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ApiError(400, f"the JSON body is nested too deeply at {path} (the limit is {MAX_JSON_DEPTH})",
                           path.split(".")[0] or None)
        if isinstance(node, dict):
            for k, v in node.items():
                sub = f"{path}.{k}" if path else str(k)
                if check_text:
                    stack.append((k, sub, depth + 1))
                stack.append((v, sub, depth + 1))
        else:
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(node))


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors as one message naming each field."""
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if not loc and err.get("type") in ("dict_type", "model_type", "model_attributes_type"):
            parts.append("the request body must be a JSON object")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            parts.append(f"{loc}: {err.get('msg')}" if loc else err.get("msg", "invalid request"))
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


M = TypeVar("M", bound=BaseModel)


def parse_body(raw: bytes, model: type[M]) -> M:
    obj = load_json(raw)
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        loc = next((x.get("loc") for x in errors if x.get("loc")), ())
        raise ApiError(400, validation_message(errors), str(loc[0]) if loc else None) from None
    if isinstance(req, _SGLangFields):
        req.refuse_unsupported()
    return req


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (server flags). Beyond them a request is a 400 naming the field: they keep
    any single request from making every step slow (long stop lists are scanned each step) or from reaching
    values the engine's tensors cannot hold."""

    max_top_logprobs: int = 20
    max_stop_strings: int = 64
    max_stop_chars: int = 512
    max_token_list: int = 1024  # stop_token_ids, token_ids_logprob, logit_bias entries
    max_n: int = 128


INT64 = 1 << 63


def check_limits(p: dict, vocab_size: int, limits: Limits) -> None:
    """Server limits on an engine sampling-params dict (already validated by SamplingParams): ApiError(400)."""
    def bad(name: str, rule: str):
        return ApiError(400, f"invalid sampling parameter {name}={_short(p[name])}: {rule}", name)

    for name, v in p.items():
        if isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64:
            raise bad(name, "must be within a signed 64-bit integer's range")
    top = p.get("top_logprobs_num")
    if isinstance(top, int) and top > min(limits.max_top_logprobs, vocab_size):
        raise bad("top_logprobs_num", f"this server returns at most {min(limits.max_top_logprobs, vocab_size)} "
                                      "top logprobs per token")
    stop = p.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > limits.max_stop_strings:
            raise bad("stop", f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}")
        if any(len(s) > limits.max_stop_chars for s in stops):
            raise bad("stop", f"a stop string may have at most {limits.max_stop_chars} characters")
    for name in ("stop_token_ids", "token_ids_logprob", "logit_bias"):
        v = p.get(name)
        if v is not None and len(v) > limits.max_token_list:
            raise bad(name, f"at most {limits.max_token_list} entries are allowed, got {len(v)}")
    for name in ("stop_token_ids", "token_ids_logprob"):
        ids = p.get(name) or []
        out = [t for t in ids if not 0 <= t < vocab_size]
        if out:
            raise bad(name, f"token id {out[0]} is outside the model's vocabulary [0, {vocab_size})")


def _short(v: Any, n: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _is_default(value: Any, default: Any) -> bool:
    """`value` asks for nothing beyond `default` (a per-prompt list of defaults too, or null for a falsy one)."""
    if value == default or (value is None and not default):
        return True
    return isinstance(value, list) and all(_is_default(v, default) for v in value) and not isinstance(default, list)


class _SGLangFields(BaseModel):
    """A request body that also takes the fields of SGLang's schema lmc does not implement, at their default
    values (SGLang's clients send them always): `UNSUPPORTED` maps each to (default, why another value is
    refused); `INFORMATIONAL` fields ask nothing of the server (routing hints, labels, tracing) and are ignored
    whatever they hold. Any other field is a 400 naming it: `refuse_unsupported()`, called by parse_body."""

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {}
    INFORMATIONAL: ClassVar[frozenset[str]] = frozenset()

    def refuse_unsupported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self.INFORMATIONAL:
                continue
            if name not in self.UNSUPPORTED:
                raise ApiError(400, f"unknown field {name!r}", name)
            default, why = self.UNSUPPORTED[name]
            if not _is_default(value, default):
                raise ApiError(400, f"{name}={_short(value)} is not supported by this server ({why}); it takes "
                                    f"only SGLang's default, {default!r}", name)


_NO_MM = "the model is text-only"
_NOT_HERE = "not implemented by lmc"


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_Strict):
    """vLLM's spelling of constrained decoding (exactly one field)."""

    choice: Optional[list[str]] = None
    regex: Optional[str] = None
    json_: Optional[Union[dict, str]] = Field(default=None, alias="json")
    grammar: Optional[str] = None


class _SamplingFields(_SGLangFields):
    """Sampling fields shared by both OpenAI routes, including SGLang's and vLLM's extras."""

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        "return_hidden_states": (False, _NOT_HERE), "return_routed_experts": (False, "the model has no experts"),
        "stop_regex": (None, _NOT_HERE), "no_stop_trim": (False, _NOT_HERE), "lora_path": (None, "no LoRA adapters"),
        "custom_logit_processor": (None, _NOT_HERE)}
    INFORMATIONAL: ClassVar[frozenset[str]] = frozenset({"rid", "routing_key", "nvext"})  # nvext: Dynamo's hints

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # extras (SGLang / vLLM)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[Union[dict, str]] = None
    structured_outputs: Optional[StructuredOutputs] = None
    return_cached_tokens_details: bool = False  # SGLang's: the response's sglext.cached_tokens_details
    program: Any = None  # lmc's program hints (lmc.protocol.ProgramHints as an object), checked by the route


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url", "input_image", "image"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients echo back assistant fields (refusal, annotations, ...)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[Union[TextPart, ImagePart]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict] = None
    store: Optional[bool] = None
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    # sent by SGLang's gateway; no-ops without a reasoning parser (as in SGLang without --reasoning-parser)
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class GenerateRequest(_SGLangFields):
    """SGLang's GenerateReqInput: the fields lmc serves, plus those lmc does not implement at their defaults."""

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        **{k: (None, _NO_MM) for k in ("image_data", "video_data", "audio_data", "input_embeds",
                                       "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
                                       "video_max_dynamic_patch", "num_items_assigned")},
        "need_wait_for_mm_inputs": (None, _NO_MM),
        "return_hidden_states": (False, _NOT_HERE), "return_routed_experts": (False, "the model has no experts"),
        "routed_experts_start_len": (0, "the model has no experts"), "session_params": (None, _NOT_HERE),
        "lora_path": (None, "no LoRA adapters"), "lora_id": (None, "no LoRA adapters"),
        "custom_logit_processor": (None, _NOT_HERE),
        **{k: (None, "no prefill/decode disaggregation") for k in (
            "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
            "disagg_prefill_dp_rank")},
        "routed_dp_rank": (None, "one data-parallel rank"), "data_parallel_rank": (None, "one data-parallel rank"),
        "require_reasoning": (False, _NOT_HERE), "background": (False, _NOT_HERE),
        "priority": (None, "no priority scheduling"), "extra_key": (None, "one prefix-cache namespace"),
        "return_bytes": (False, _NOT_HERE), "return_entropy": (False, _NOT_HERE)}
    INFORMATIONAL: ClassVar[frozenset[str]] = frozenset({
        "modalities", "log_metrics", "routing_key", "conversation_id", "custom_labels", "no_logs",
        "external_trace_header", "received_time", "model"})

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    token_ids_logprob: Optional[Union[list[int], list[list[int]]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: Optional[Union[str, list[str]]] = None
    program: Any = None  # lmc's program hints (lmc.protocol.ProgramHints as an object), checked by the route
