"""Request bodies of the OpenAI-compatible and SGLang-native routes (pydantic; unknown fields are refused).

Only fields the server honours (or accepts with their default value, for clients that always send them) are
declared: anything else is a 400 that names the field, never silently ignored.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class _SamplingFields(_Strict):
    """Sampling fields shared by both OpenAI routes, including SGLang's and vLLM's extras."""

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
    rid: Optional[str] = None
    # SGLang's gateway (sglang-router) re-serializes each request with these, at these values
    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False


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


class GenerateRequest(_Strict):
    """SGLang's GenerateReqInput: the fields lmc serves, plus those SGLang clients send with default values."""

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
    image_data: Optional[Any] = None
    modalities: Optional[Any] = None
    lora_path: Optional[Any] = None
    session_params: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    return_hidden_states: bool = False
    log_metrics: bool = True
    # sent by SGLang's gateway on every forwarded /generate, at these values (`model` is not checked: one model)
    model: Optional[str] = None
    background: Literal[False] = False
    no_logs: bool = False
    return_bytes: Literal[False] = False
    return_entropy: Literal[False] = False
