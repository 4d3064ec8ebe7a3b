"""`lmc.RuntimeEndpoint(url)`: programs on an lmc server (`lmc serve`) or an SGLang server, over the native API.

Each primitive sends what SGLang's RuntimeEndpoint sends (notes/sglang_frontend.md 5.4):
- gen: one `/generate` with the full state text (the server's radix cache reuses the shared prefix); n > 1 is one
  batched `/generate` of n copies (seeds seed+i, as `lmc.Local` does);
- select: a prefill that returns the prompt's token count, then one batched `/generate` of prompt+choice with
  `max_new_tokens: 0` and prompt logprobs from two tokens before the prompt's end (the token-healing window of
  `Local.select`); the unconditional method re-scores the choices' tokens alone (`/tokenize` on an lmc server);
- commit: `/generate` with `max_new_tokens: 0`.
On an lmc server, each /generate also carries the running call's program hints (`program`, from a compiled
plan), and a compiled program's segments run whole on the server: one POST /v1/programs per segment
(`capabilities.server_plans`, lmc.compiler.remote), per call where the server lacks the route.
The chat template comes from the server: lmc's `/get_model_info` returns the role prefixes and suffixes derived
from the model's own template (`chat_template_roles`), or the Jinja template itself. A server that gives neither
(SGLang) gets the plain `ROLE: ` template unless one is passed.
"""
from __future__ import annotations

import asyncio
import functools
import json
import threading
from dataclasses import replace
from typing import Any

from ..protocol import (Capabilities, ChatTemplate, ChoicesDecision, ChoicesSamplingMethod, GenParams, Image,
                        current_hints, decide, instance_id)
from .usage import Usage, current_stream, record_usage, stream_usage

_LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
# SGLang's gateway (sglang-router) sends every request with the same key to the same worker under its `manual`
# policy: one key per program instance (its instance id, kept in the stream's meta table, which forks copy) keeps
# its calls, and so its prefixes, on one replica. Servers that do not know the header ignore it.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def _routing_headers() -> dict[str, str]:
    stream = current_stream()
    if stream is None:
        return {}
    return {ROUTING_KEY_HEADER: instance_id(stream)}


@functools.cache  # a failed import is not cached: each try would search sys.path again, on every request
def _httpx():
    try:
        import httpx
    except ImportError:  # some installs ship httpx under the name httpx2
        import httpx2 as httpx
    return httpx


class EndpointError(ValueError):
    """The server refused a request (4xx) or failed it (5xx); the message is the server's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{message} (HTTP {status})" if status else message)
        self.status = status


def _message(resp) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if isinstance(err, str):
            return err
        return str(body.get("message") or body.get("detail") or body)
    return str(body)


def template_from_model_info(info: dict) -> ChatTemplate | None:
    """The server's chat template: lmc's role table, else its Jinja template rendered with sentinels."""
    roles = info.get("chat_template_roles")
    if isinstance(roles, dict) and "prefix" in roles and "suffix" in roles:
        return ChatTemplate(dict(roles["prefix"]), dict(roles["suffix"]), roles.get("default_system", ""),
                            tuple(roles.get("stop_token_ids") or ()))
    source = info.get("chat_template")
    if isinstance(source, str) and source.strip():
        try:
            return ChatTemplate.from_tokenizer(_JinjaTemplate(source))
        except Exception:  # noqa: BLE001 - a template we cannot render: caller falls back
            return None
    return None


class _JinjaTemplate:
    """Just enough of a tokenizer for ChatTemplate.from_tokenizer: renders a Jinja chat template (no token ids, so
    the template's end-of-turn stop token is not known)."""

    def __init__(self, source: str):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env.globals["raise_exception"] = raise_exception
        self.chat_template = source
        self._t = env.from_string(source)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return self._t.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token="",
                              eos_token="")

    def encode(self, text, add_special_tokens=False):
        return []


class RuntimeEndpoint:
    """`capabilities.server_plans`: an lmc server runs compiled segments whole (POST /v1/programs,
    lmc.compiler.remote); switched off for good the first time the server answers 404 (an older lmc)."""

    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None, *,
                 chat_template: ChatTemplate | None = None, timeout: float = 600.0, max_connections: int = 256):
        httpx = _httpx()
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._sync = httpx.Client(timeout=timeout, headers=self.headers)
        self._clients: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.usage = Usage()  # every call through this backend (per program: lmc.backend.openai.program_usage)
        self._usage_lock = threading.Lock()
        self.model_info = self._get_model_info()
        self.model = self.model_info.get("served_model_name") or self.model_info.get("model_path") or "default"
        self.is_lmc = self.model_info.get("engine") == "lmc"
        self.chat_template = chat_template or template_from_model_info(self.model_info) or ChatTemplate.plain()
        self.capabilities = Capabilities(server_plans=self.is_lmc)

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # ---- transport ---------------------------------------------------------------------------------------
    def _get_model_info(self) -> dict:
        httpx = _httpx()
        last = None
        for path in ("/get_model_info", "/model_info"):
            try:
                r = self._sync.get(self.base_url + path)
            except httpx.TransportError as e:
                raise ConnectionError(f"cannot reach the server at {self.base_url}: {e}") from None
            if r.status_code == 200:
                return r.json()
            last = r
        raise EndpointError(last.status_code, f"{self.base_url}/get_model_info: {_message(last)}")

    def _client(self):
        loop = asyncio.get_running_loop()
        with self._lock:
            c = self._clients.get(id(loop))
            if c is None or getattr(c, "_lmc_loop", None) is not loop:
                c = _httpx().AsyncClient(timeout=self.timeout, headers=self.headers, limits=self._limits)
                c._lmc_loop = loop
                self._clients[id(loop)] = c
            return c

    def _hinted(self, body: dict) -> dict:
        """A /generate body with the running call's program hints, for an lmc server (SGLang refuses unknown
        fields)."""
        hints = current_hints()
        return {**body, "program": hints.as_dict()} if hints is not None and self.is_lmc else body

    async def _post(self, path: str, body: dict) -> Any:
        httpx = _httpx()
        if path == "/generate":
            body = self._hinted(body)
        try:
            r = await self._client().post(self.base_url + path, json=body, headers=_routing_headers())
        except httpx.TransportError as e:
            raise ConnectionError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise EndpointError(r.status_code, _message(r))
        return r.json()

    async def run_programs(self, body: dict) -> dict | None:
        """POST /v1/programs (a compiled segment for its instances, lmc.compiler.remote); None when the server has
        no such route (then server_plans is switched off and the caller runs the segment call by call)."""
        try:
            return await self._post("/v1/programs", body)
        except EndpointError as e:
            if e.status != 404:
                raise
            self.capabilities = replace(self.capabilities, server_plans=False)
            return None

    async def generate_raw(self, body: dict) -> Any:
        """POST /generate as is (the result dict, or a list for a batch)."""
        return await self._post("/generate", body)

    # ---- request bodies ----------------------------------------------------------------------------------
    @staticmethod
    def _body(text, params: GenParams) -> dict:
        sp = params.engine_params()
        body: dict[str, Any] = {"text": text}
        for k in _LOGPROB_KEYS:
            if k in sp:
                body[k] = sp.pop(k)
        if sp.get("seed") is not None:
            sp["sampling_seed"] = sp.pop("seed")  # SGLang's name; lmc accepts both
        else:
            sp.pop("seed", None)
        body["sampling_params"] = sp
        return body

    @staticmethod
    def _check_images(images: list[Image]) -> None:
        if images:
            raise ValueError("image(): RuntimeEndpoint sends text only")

    # ---- Backend protocol --------------------------------------------------------------------------------
    async def generate(self, text: str, params: GenParams, images: list[Image]):
        self._check_images(images)
        n = params.n or 1
        body = self._body(text, params)
        if n == 1:
            r = await self.generate_raw(body)
            record_usage(r["meta_info"], self)
            return r["text"], r["meta_info"]
        sp = body["sampling_params"]
        seed = sp.get("sampling_seed")
        body["text"] = [text] * n
        body["sampling_params"] = [{**sp, **({} if seed is None else {"sampling_seed": seed + i})}
                                   for i in range(n)]
        rs = await self.generate_raw(body)
        for r in rs:
            if "error" in r:
                raise ValueError(r["error"])
        record_usage([r["meta_info"] for r in rs], self)
        return [r["text"] for r in rs], [r["meta_info"] for r in rs]

    async def generate_stream(self, text: str, params: GenParams, images: list[Image]):
        self._check_images(images)
        httpx = _httpx()
        body = self._hinted({**self._body(text, params), "stream": True})
        sent = 0
        try:
            async with self._client().stream("POST", self.base_url + "/generate", json=body,
                                             headers=_routing_headers()) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise EndpointError(r.status_code, _message(r))
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        err = event["error"]
                        raise EndpointError(0, err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    cum = event.get("text", "")
                    meta = event.get("meta_info") or {}
                    done = meta.get("finish_reason") is not None
                    delta, sent = cum[sent:], max(sent, len(cum))
                    if done:
                        record_usage(meta, self)
                        yield delta, meta
                    elif delta:
                        yield delta, None
        except httpx.TransportError as e:
            raise ConnectionError(f"{self.base_url}/generate: {type(e).__name__}: {e}") from None

    async def select(self, text: str, choices: list[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision:
        start = max(await self._prompt_len(text) - 2, 0)
        rs = await self.generate_raw({"text": [text + c for c in choices],
                                      "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                      "return_logprob": True, "logprob_start_len": start,
                                      "return_text_in_logprobs": True})
        for r in rs:
            if "error" in r:
                raise ValueError(r["error"])
        record_usage([r["meta_info"] for r in rs], self)
        input_lps = [[tuple(x) for x in r["meta_info"]["input_token_logprobs"]] for r in rs]
        uncond = None
        if method.requires_unconditional_logprobs:
            ids = await self._choice_ids(choices)
            ur = await self.generate_raw({"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, "logprob_start_len": 0})
            record_usage([r["meta_info"] for r in ur], self)
            uncond = [[tuple(x) for x in r["meta_info"]["input_token_logprobs"]] for r in ur]
        return decide(method, choices, input_lps, uncond)

    async def _prompt_len(self, text: str) -> int:
        """Tokens in `text`: /tokenize on an lmc server (no engine work), else a prefill (SGLang's way)."""
        if self.is_lmc:
            try:
                return int((await self._post("/tokenize", {"prompt": text}))["count"])
            except (EndpointError, KeyError, TypeError, ValueError):
                pass
        pre = await self.generate_raw({"text": text, "sampling_params": {"max_new_tokens": 0}})
        record_usage(pre["meta_info"], self)
        return int(pre["meta_info"]["prompt_tokens"])

    async def _choice_ids(self, choices: list[str]) -> list[list[int]]:
        """Each choice's tokens without special tokens (an empty choice scores the end-of-sequence token)."""
        eos = (self.model_info.get("eos_token_ids") or [0])[0]
        try:
            r = await self._post("/tokenize", {"prompt": choices, "add_special_tokens": False})
            return [t or [eos] for t in r["tokens"]]
        except EndpointError:  # a server without /tokenize: prefill each choice alone and read its ids back
            rs = await self.generate_raw({"text": choices, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, "logprob_start_len": 0})
            return [[t for _, t, _ in r["meta_info"]["input_token_logprobs"]] or [eos] for r in rs]

    async def commit(self, text: str) -> None:
        stream_usage(current_stream())  # before a fork copies the parent: the branches share its usage
        _routing_headers()  # ... and its routing key
        if text:
            r = await self.generate_raw({"text": text, "sampling_params": {"max_new_tokens": 0}})
            record_usage(r["meta_info"], self)

    def flush_cache(self) -> bool:
        r = self._sync.post(self.base_url + "/flush_cache")
        return r.status_code == 200

    def get_server_info(self) -> dict:
        for path in ("/get_server_info", "/server_info"):
            r = self._sync.get(self.base_url + path)
            if r.status_code == 200:
                return r.json()
        raise EndpointError(r.status_code, _message(r))

    def shutdown(self) -> None:
        self._sync.close()
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            loop = c._lmc_loop
            if loop.is_running() and not loop.is_closed():
                try:
                    asyncio.run_coroutine_threadsafe(c.aclose(), loop).result(timeout=5)
                except Exception:  # noqa: BLE001
                    pass

    close = shutdown

