"""`lmc.OpenAI(model, base_url=None, api_key=None)`: programs on any OpenAI-compatible API (chat or completion
models), through the `openai` client.

- Chat models get `messages` (the program's turns; a gen must be in an assistant turn), completion models the
  state text; so does a program without roles on a chat model where the server also offers completions (every
  server but api.openai.com). Against an lmc server (detected from `/get_model_info`) the backend uses the server's exact chat
  template, so the text sent is byte-identical to what `lmc.Local` runs: same results at temperature 0.
- Usage per program: calls, prompt, cached prompt (`usage.prompt_tokens_details.cached_tokens`) and completion
  tokens, retries, response-cache hits and calls saved by speculation, kept on the program state (shared by its
  forks): `program_usage(state)`, summed over a run_batch by `total_usage(states)`. The backend also keeps its
  own running total (`backend.usage`).
- One retry policy: 429, 408, 409, 5xx and connection errors are retried (max_retries, default 4), waiting what
  `Retry-After` / `retry-after-ms` says, else exponential backoff with jitter. Other 4xx raise ValueError with
  the server's message.
- Opt-in response cache (`cache=True`): keyed by the endpoint, model and the full request; bounded (entries);
  in memory, and on disk under `$LMC_CACHE_DIR/openai` when that is set (or `cache_dir`). Only deterministic
  requests (temperature 0 or a seed) are cached unless `cache="always"`.
- Sampling extras (`stop_token_ids`, `top_k`, `min_p`...) go to lmc / SGLang / vLLM servers as extra body fields;
  api.openai.com refuses them with a clear error.
- Constraints (`regex`, `json_schema` and typed gens; `select`) are lowered to the best the endpoint supports, in
  this order (`constraints="auto"`; `constraints="server" | "json_schema" | "logit_bias"` forces one):
  1. server: lmc / SGLang / vLLM servers decode `regex`, `json_schema` and typed gens themselves (extra body
     fields); `select` scores its choices from prompt logprobs (`echo`) with the program's choices method where
     the endpoint returns them (lmc, vLLM, completion models);
  2. json_schema (chat models): `response_format` json_schema for JSON schemas and typed gens (int/float/bool/str
     wrapped in an object, unwrapped here); `select` asks for an object whose value is an `enum` of the choices;
  3. logit_bias (see logit_bias.py): calls of one token each with +100 on the tokens the constraint allows next;
     `select` decides token by token (greedy at temperature 0, not the choices method) and stops once one choice
     is left; typed gens and regexes end when the model ends them (JSON schemas are out of reach). It needs the
     model's tokenizer (`tokenizer=`; tiktoken's for OpenAI models by default) and, past the first token, a
     completion model or a chat API that continues a partial assistant message (lmc, vLLM). Its calls count in
     `calls` and, separately, in `bias_calls`.
  Where nothing fits, UnsupportedOnEndpoint says why and what would work.
- API speculative execution (`@function(num_api_spec_tokens=N)`): the first gen of a run of gens over-generates
  (at least N tokens, no stop); the following gens and constant fills are served from that text while it matches
  the template. The buffer is anchored to the exact state text it continues and lives on the program's own
  stream, so programs of a run_batch and forks never see each other's; a gen whose text does not match runs as a
  normal call (a value is never silently empty). A compiled program runs the groups its plan fixed
  (lmc.passes.api_speculation, lowered into the plan's generate ops): the backend then decides nothing, a gen
  outside every group is a normal call. An interpreted program has no plan: the backend decides as it goes.
"""
from __future__ import annotations

import asyncio
import base64
import email.utils
import hashlib
import json
import os
import random
import threading
import time
from collections import OrderedDict
from dataclasses import fields, replace
from typing import Any

from ..protocol import ROLES, Capabilities, ChatTemplate, ChoicesDecision, ChoicesSamplingMethod, GenParams, Image, decide
from ..protocol.backend import SpecStep
from ..protocol.hints import current_hints
from .endpoint import _httpx, template_from_model_info
from .logit_bias import DTYPE_PATTERNS, Stepper, Vocabulary, load_tokenizer
from .usage import (Usage, current_stream, program_usage, record_usage, stream_usage,  # noqa: F401 (re-exported)
                    total_usage)

COMPLETION_MODELS = {"gpt-3.5-turbo-instruct", "davinci-002", "babbage-002", "text-davinci-003"}
_SPEC_ATTR = "_lmc_spec_buffer"
_RETRY_STATUS = {408, 409, 429}
LOWERINGS = ("auto", "server", "json_schema", "logit_bias")


# ---- chat messages from the state --------------------------------------------------------------------------------
def split_chat(text: str, tmpl: ChatTemplate) -> tuple[list[dict], str | None, str | None]:
    """Split a state text rendered with `tmpl` back into messages. Returns (closed messages, open role or None,
    the open role's text so far). The default system block the template inserts is dropped (the server's
    template inserts it again)."""
    pos, msgs = 0, []
    if tmpl.default_system and text.startswith(tmpl.default_system):
        pos = len(tmpl.default_system)
    while pos < len(text):
        role = next((r for r in ROLES if tmpl.prefix[r] and text.startswith(tmpl.prefix[r], pos)), None)
        if role is None:
            raise ValueError(f"a chat model needs the program's text in role turns; text outside any turn at "
                             f"{text[pos:pos + 40]!r}")
        pos += len(tmpl.prefix[role])
        end = text.find(tmpl.suffix[role], pos) if tmpl.suffix[role] else -1
        if end < 0:
            return msgs, role, text[pos:]
        msgs.append({"role": role, "content": text[pos:end]})
        pos = end + len(tmpl.suffix[role])
    return msgs, None, None


def _retry_after(exc) -> float | None:
    resp = getattr(exc, "response", None)
    headers = getattr(resp, "headers", None) or {}
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if not ra:
        return None
    try:
        return float(ra)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(ra)
            return max(0.0, when.timestamp() - time.time())
        except (TypeError, ValueError):
            return None


class _ResponseCache:
    def __init__(self, directory: str | None, max_entries: int):
        self.mem: OrderedDict[str, dict] = OrderedDict()
        self.max_entries = max(1, max_entries)
        self.dir = os.path.join(directory, "openai") if directory else None
        self.lock = threading.Lock()
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)

    def get(self, key: str) -> dict | None:
        with self.lock:
            if key in self.mem:
                self.mem.move_to_end(key)
                return self.mem[key]
        if self.dir:
            try:
                with open(os.path.join(self.dir, key + ".json"), encoding="utf-8") as f:
                    value = json.load(f)
            except (OSError, ValueError):
                return None
            self._put_mem(key, value)
            return value
        return None

    def _put_mem(self, key: str, value: dict) -> None:
        with self.lock:
            self.mem[key] = value
            self.mem.move_to_end(key)
            while len(self.mem) > self.max_entries:
                self.mem.popitem(last=False)

    def put(self, key: str, value: dict) -> None:
        self._put_mem(key, value)
        if self.dir:
            path = os.path.join(self.dir, key + ".json")
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(value, f)
                os.replace(tmp, path)
                files = os.listdir(self.dir)
                if len(files) > self.max_entries:
                    paths = sorted((os.path.join(self.dir, x) for x in files), key=os.path.getmtime)
                    for p in paths[:len(files) - self.max_entries]:
                        os.remove(p)
            except OSError:
                pass

    def clear(self) -> None:
        with self.lock:
            self.mem.clear()


class UnsupportedOnEndpoint(ValueError):
    """What the program asks cannot be expressed on this endpoint (the message says what would work)."""


# ---- the backend -----------------------------------------------------------------------------------------------
class OpenAI:
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, *,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | None = None,
                 server: str = "auto", max_retries: int = 4, timeout: float = 600.0, cache: bool | str = False,
                 cache_dir: str | None = None, cache_max_entries: int = 10000, organization: str | None = None,
                 constraints: str = "auto", tokenizer=None):
        """`server`: "auto" (probe `base_url` for an lmc or SGLang server), "openai" (api.openai.com: standard
        fields only), "lmc", "sglang", "vllm", "dynamo" (NVIDIA Dynamo: compiled programs' hints go as
        `nvext.agent_hints`) or "compatible" (extras are sent as extra body fields).
        `constraints`: how regex / JSON-schema / typed gens and select run: "auto" (the best the endpoint supports,
        see the module docstring) or one forced: "server", "json_schema", "logit_bias". An endpoint of unknown
        kind ("compatible") is assumed to decode constraints itself; give "logit_bias" for a plain one.
        `tokenizer`: the model's tokenizer, for logit-bias stepping: a transformers tokenizer or its local
        directory, or a tiktoken encoding or its name. Default: tiktoken's encoding of an OpenAI model, or the
        tokenizer directory an lmc server reports when it exists on this machine."""
        if constraints not in LOWERINGS:
            raise ValueError(f"lmc.OpenAI: constraints must be one of {', '.join(LOWERINGS)}, not {constraints!r}")
        self.constraints, self.tokenizer = constraints, tokenizer
        self._vocab: Vocabulary | None = None
        self.model = model
        self.base_url = (base_url or os.environ.get("OPENAI_BASE_URL") or "").rstrip("/") or None
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or ("EMPTY" if self.base_url else None)
        if self.api_key is None:
            raise ValueError("lmc.OpenAI: no API key: pass api_key=... or set OPENAI_API_KEY")
        self.organization = organization
        self.timeout, self.max_retries = timeout, max_retries
        self.is_chat_model = model not in COMPLETION_MODELS if is_chat_model is None else is_chat_model
        self.model_info: dict = {}
        self.server = self._detect(server)
        tmpl = chat_template
        if tmpl is None and self.server == "lmc":

            tmpl = template_from_model_info(self.model_info)
        self.chat_template = tmpl or ChatTemplate.plain()
        self.exact_template = self.server == "lmc" and chat_template is None
        self.capabilities = Capabilities(images=self.is_chat_model and self.server != "lmc", planned_speculation=True)
        self.usage = Usage()
        self._usage_lock = threading.Lock()
        self._clients: dict[int, Any] = {}
        self._lock = threading.Lock()
        directory = cache_dir or os.environ.get("LMC_CACHE_DIR")
        self.cache_mode = cache
        self._cache = _ResponseCache(directory, cache_max_entries) if cache else None

    def __repr__(self) -> str:
        return f"OpenAI({self.model!r}{', ' + repr(self.base_url) if self.base_url else ''})"

    # ---- setup -------------------------------------------------------------------------------------------
    @property
    def root_url(self) -> str | None:
        if not self.base_url:
            return None
        return self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url

    def _detect(self, server: str) -> str:
        if server != "auto":
            return server
        if not self.base_url or "api.openai.com" in self.base_url:
            return "openai"

        httpx = _httpx()
        try:
            r = httpx.get(self.root_url + "/get_model_info", timeout=10,
                          headers={"Authorization": f"Bearer {self.api_key}"})
            if r.status_code == 200:
                self.model_info = r.json()
                return "lmc" if self.model_info.get("engine") == "lmc" else "sglang"
        except (httpx.HTTPError, ValueError):
            return "compatible"
        if r.status_code in (401, 403):
            raise ValueError(f"{self.base_url}: the server refused the API key (HTTP {r.status_code}); pass "
                             "api_key=... or set OPENAI_API_KEY")
        try:  # vLLM names itself as the owner of its models
            models = httpx.get(self.base_url + "/models", timeout=10,
                               headers={"Authorization": f"Bearer {self.api_key}"}).json().get("data") or []
            if any(m.get("owned_by") == "vllm" for m in models):
                return "vllm"
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        return "compatible"

    def _client(self):
        import openai

        loop = asyncio.get_running_loop()
        with self._lock:
            c = self._clients.get(id(loop))
            if c is None or getattr(c, "_lmc_loop", None) is not loop:
                c = openai.AsyncOpenAI(api_key=self.api_key, base_url=self.base_url, organization=self.organization,
                                       timeout=self.timeout, max_retries=0)
                c._lmc_loop = loop
                self._clients[id(loop)] = c
            return c

    # ---- calls (retry, cache, usage) ---------------------------------------------------------------------
    def _cacheable(self, kw: dict) -> bool:
        if self._cache is None or kw.get("stream"):
            return False
        return self.cache_mode == "always" or kw.get("temperature") == 0 or kw.get("seed") is not None

    async def _create(self, kind: str, kw: dict) -> dict:
        """One API call (chat or completions); returns the response as a dict. Counts usage."""
        import openai

        key = None
        if self._cacheable(kw):
            key = hashlib.sha256(json.dumps({"url": self.base_url, "kind": kind, "request": kw}, sort_keys=True,
                                            default=str).encode()).hexdigest()
            hit = self._cache.get(key)
            if hit is not None:
                record_usage(None, self, usage=Usage(cache_hits=1))
                return hit
        kw = self._with_program_hints(kw)  # after the cache key: hints never change a response
        client = self._client()
        fn = client.chat.completions.create if kind == "chat" else client.completions.create
        retries = 0
        while True:
            try:
                resp = await fn(**kw)
                break
            except (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError,
                    openai.RateLimitError, openai.ConflictError) as e:
                if retries >= self.max_retries:
                    raise ConnectionError(f"{self!r}: {type(e).__name__} after {retries} retries: "
                                          f"{_err_message(e)}") from None
                delay = _retry_after(e)
                if delay is None:
                    delay = min(30.0, 0.5 * 2 ** retries) * (1 + 0.25 * random.random())
                retries += 1
                record_usage(None, self, usage=Usage(retries=1))
                await asyncio.sleep(min(delay, 120.0))
            except openai.APIStatusError as e:
                if e.status_code in _RETRY_STATUS and retries < self.max_retries:
                    retries += 1
                    record_usage(None, self, usage=Usage(retries=1))
                    await asyncio.sleep(min(_retry_after(e) or 0.5 * 2 ** retries, 120.0))
                    continue
                raise ValueError(f"{self!r} refused the request (HTTP {e.status_code}): {_err_message(e)}") \
                    from None
        out = resp.model_dump() if hasattr(resp, "model_dump") else dict(resp)
        u = out.get("usage") or {}
        details = u.get("prompt_tokens_details") or {}
        record_usage(None, self, usage=Usage(calls=1, prompt_tokens=u.get("prompt_tokens") or 0,
                                             cached_tokens=details.get("cached_tokens") or 0,
                                             completion_tokens=u.get("completion_tokens") or 0))
        if key is not None:
            self._cache.put(key, out)
        return out

    def _with_program_hints(self, kw: dict) -> dict:
        """The running call's program hints (lmc.protocol.current_hints), where the endpoint is known to take
        them: an lmc server's `program` body field, NVIDIA Dynamo's `nvext` (agent_context + agent_hints)."""
        hints = current_hints()
        if hints is None or self.server not in ("lmc", "dynamo"):
            return kw
        extra = {**(kw.get("extra_body") or {}),
                 **({"program": hints.as_dict()} if self.server == "lmc" else {"nvext": hints.dynamo_nvext()})}
        return {**kw, "extra_body": extra}

    # ---- request construction ----------------------------------------------------------------------------
    def _messages(self, text: str, images: list[Image]) -> tuple[list[dict], str]:
        """(messages up to the open assistant turn, the assistant text already written in it)."""
        stream = current_stream()
        if self.exact_template or stream is None:
            msgs, role, partial = split_chat(text, self.chat_template)
        else:
            msgs = [{"role": m["role"], "content": m["content"]} for m in stream.messages]
            role = stream.role
            partial = text[stream.role_begin:] if role is not None else None
        if role != "assistant":
            raise ValueError(f"{self!r} is a chat model: a gen or select must be inside an assistant turn "
                             f"(e.g. s += lmc.assistant(lmc.gen('x'))); pass is_chat_model=False for a "
                             "completion model")
        if images and msgs:
            last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
            if last_user is not None:
                parts = [{"type": "text", "text": msgs[last_user]["content"]}]
                parts += [{"type": "image_url", "image_url": {
                    "url": f"data:{im.mime};base64,{base64.b64encode(im.data).decode()}"}} for im in images]
                msgs[last_user] = {"role": "user", "content": parts}
        return msgs, partial or ""

    def _sampling(self, params: GenParams, kind: str) -> tuple[dict, dict | None, str | None]:
        """(request kwargs, response_format or None, how to unwrap the answer: None or "value")."""
        p = params.engine_params()
        kw: dict[str, Any] = {"model": self.model}
        if kind == "chat" and self.server == "openai":
            kw["max_completion_tokens"] = p["max_new_tokens"]
        else:
            kw["max_tokens"] = p["max_new_tokens"]
        for k in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
            if p.get(k) is not None:
                kw[k] = p[k]
        if p.get("stop"):
            kw["stop"] = p["stop"] if isinstance(p["stop"], list) else [p["stop"]]
        extras: dict[str, Any] = {}
        if p.get("top_k", -1) not in (-1, None):
            extras["top_k"] = p["top_k"]
        if p.get("min_p"):
            extras["min_p"] = p["min_p"]
        if p.get("min_new_tokens"):
            extras["min_tokens"] = p["min_new_tokens"]
        if p.get("ignore_eos"):
            extras["ignore_eos"] = True
        if p.get("stop_token_ids"):
            extras["stop_token_ids"] = list(p["stop_token_ids"])
        if p.get("repetition_penalty", 1.0) not in (1.0, None):
            extras["repetition_penalty"] = p["repetition_penalty"]
        response_format, unwrap = None, None
        constraint = {k: p[k] for k in ("regex", "json_schema", "ebnf") if p.get(k) is not None}
        if constraint and self._lowering(params, kind) == "json_schema":
            response_format, unwrap = self._lower_constraint(params, constraint, kind)
        elif constraint and self.server == "vllm":
            # vLLM takes constraints in `structured_outputs` and ignores unknown top-level fields (a bare `regex`
            # would decode unconstrained without a word)
            extras["structured_outputs"] = {{"json_schema": "json", "ebnf": "grammar"}.get(k, k): v
                                            for k, v in constraint.items()}
        else:
            extras.update(constraint)  # decoded by the server
        if self.server == "openai":
            ids = [t for t in extras.pop("stop_token_ids", []) if t not in self.chat_template.stop_token_ids]
            if ids:  # the template's own end-of-turn ids are dropped: the API stops at the end of a turn itself
                extras["stop_token_ids"] = ids
            if extras:
                raise UnsupportedOnEndpoint(f"{', '.join(sorted(extras))}: not supported by the OpenAI API; use "
                                            "an lmc, SGLang or vLLM server for these sampling options")
        elif extras:
            kw["extra_body"] = extras
        if params.return_logprob:
            if kind == "chat":
                kw["logprobs"] = True
                if params.top_logprobs_num:
                    kw["top_logprobs"] = params.top_logprobs_num
            else:
                kw["logprobs"] = params.top_logprobs_num or 0
        if response_format is not None:
            kw["response_format"] = response_format
        return kw, response_format, unwrap

    def _route(self) -> str:
        """The API route of the running program's calls: "chat" or "completions". A chat model takes a program's
        role turns as messages; a program without roles has no turns to send, so where the server also offers
        the completions route (every server but api.openai.com) its text goes there as it is."""
        if not self.is_chat_model:
            return "completions"
        stream = current_stream()
        if self.server != "openai" and stream is not None and not stream.messages and stream.role is None:
            return "completions"
        return "chat"

    @property
    def continues_turns(self) -> bool:
        """Can a chat request continue a partial assistant message (`continue_final_message`)?"""
        return self.server in ("lmc", "vllm")

    def _lowering(self, params: GenParams, kind: str) -> str | None:
        """How a constrained gen runs here (module docstring): "server", "json_schema" or "logit_bias"; None for
        an unconstrained gen. Raises UnsupportedOnEndpoint where nothing fits."""
        if params.regex is None and params.json_schema is None and params.dtype is None:
            return None
        if self.constraints == "server" and self.server == "openai":
            raise UnsupportedOnEndpoint(f"{self!r}: constraints='server', but the OpenAI API decodes no regex or "
                                        "typed gen itself; use 'auto', 'json_schema' or 'logit_bias'")
        if self.constraints != "auto":
            return self.constraints
        if self.server != "openai":
            return "server"
        if kind == "chat" and params.regex is None:
            return "json_schema"
        if kind == "completions" and params.json_schema is None:
            return "logit_bias"
        if params.regex is not None:
            raise UnsupportedOnEndpoint(
                f"{self!r}: a regex constraint cannot be expressed on the OpenAI API: it decodes no regex itself, "
                "response_format takes JSON schemas only, and logit-bias stepping would have to continue a partial "
                "assistant message, which its chat API cannot; use a completion model, an lmc, SGLang or vLLM "
                "server, or json_schema / a typed gen instead")
        raise UnsupportedOnEndpoint(
            f"{self!r}: a JSON schema on a completion model of the OpenAI API: response_format needs a chat model "
            "and logit-bias stepping cannot follow a JSON schema; use a chat model or an lmc, SGLang or vLLM server")

    def _vocabulary(self, what: str) -> Vocabulary:
        """The model's vocabulary for logit-bias stepping, built once from `tokenizer` (or the default one)."""
        with self._lock:
            if self._vocab is None:
                self._vocab = Vocabulary(self._find_tokenizer(what), end_ids=[
                    *self.chat_template.stop_token_ids, *(self.model_info.get("eos_token_ids") or [])])
            return self._vocab

    def _find_tokenizer(self, what: str):
        spec, hint = self.tokenizer, ""
        if spec is None and self.server == "openai":
            try:
                import tiktoken

                return tiktoken.encoding_for_model(self.model)
            except ImportError:
                hint = "; for OpenAI models: pip install tiktoken"
            except KeyError:
                hint = f"; tiktoken knows no encoding for {self.model!r}"
        path = self.model_info.get("tokenizer_path") or ""
        if spec is None and self.server == "lmc" and os.path.isdir(path):
            spec = path
        if spec is not None:
            try:
                return load_tokenizer(spec)
            except Exception as e:  # noqa: BLE001 - any loader failure means the same thing here
                hint = f"; loading {spec!r} failed: {type(e).__name__}: {e}"
        why = "constraints='logit_bias'" if self.constraints == "logit_bias" else \
            "the endpoint offers no server-side constraint, prompt logprobs (echo) or JSON-schema response_format"
        raise UnsupportedOnEndpoint(
            f"{self!r}: {what} needs logit-bias stepping here ({why}), and that needs the model's tokenizer to name "
            "token ids: pass tokenizer=... (a transformers tokenizer or its local directory, or a tiktoken "
            f"encoding or its name){hint}")

    async def _step(self, text: str, stepper: Stepper, params: GenParams, images: list[Image],
                    max_calls: int) -> dict:
        """Run a Stepper: one call of one token per step until the value ends, no call is needed, or max_calls.
        Returns the value's meta_info."""
        kind = self._route()
        calls, prompt, cached, completion = 0, 0, 0, 0
        ended = False
        while not ended and calls < max_calls:
            bias = stepper.bias()
            if bias is None:  # nothing can extend the value, or one choice is left
                ended = True
                break
            if stepper.value and kind == "chat" and not self.continues_turns:
                raise UnsupportedOnEndpoint(
                    f"{self!r}: logit-bias stepping wrote {stepper.value!r} and must go on, but this chat API cannot "
                    "continue a partial assistant message (only a select decided by its first token works here); "
                    "use a completion model or an lmc or vLLM server")
            texts, metas = await self._call_gen(text + stepper.value, params, images, 1, logit_bias=bias)
            record_usage(None, self, usage=Usage(bias_calls=1))
            calls += 1
            m = metas[0]
            prompt += m.get("prompt_tokens") or 0
            cached += m.get("cached_tokens") or 0
            completion += m.get("completion_tokens") or 0
            ended = stepper.feed(texts[0])
        return {"lowering": "logit_bias", "bias_calls": calls, "finish_reason": {"type": "stop" if ended else "length"},
                "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion}

    async def _bias_gen(self, text: str, params: GenParams, images: list[Image]) -> tuple[str, dict]:
        """A regex or typed gen by logit-bias stepping."""
        if params.json_schema is not None:
            raise UnsupportedOnEndpoint(f"{self!r}: a JSON schema cannot be lowered to logit-bias stepping; use "
                                        "a chat model (response_format) or an lmc, SGLang or vLLM server")
        stepper = Stepper(self._vocabulary("a constrained gen"),
                          params.regex if params.regex is not None else DTYPE_PATTERNS[params.dtype])
        one = replace(params, max_new_tokens=1, min_new_tokens=None, n=None, stop=None, regex=None, dtype=None,
                      return_logprob=None, logprob_start_len=None, top_logprobs_num=None)
        meta = await self._step(text, stepper, one, images, params.max_new_tokens or 128)
        return stepper.result, meta

    def _lower_constraint(self, params: GenParams, constraint: dict, kind: str):
        if kind != "chat":
            raise UnsupportedOnEndpoint(f"{self!r}: constraints='json_schema' lowers to response_format, which "
                                        "needs a chat model; this is a completion model")
        if params.dtype in (int, float, bool, str):
            t = {int: "integer", float: "number", bool: "boolean", str: "string"}[params.dtype]
            schema = {"type": "object", "properties": {"value": {"type": t}}, "required": ["value"],
                      "additionalProperties": False}
            return _rf("value", schema, strict=True), "value"
        if "json_schema" in constraint:
            schema = constraint["json_schema"]
            schema = json.loads(schema) if isinstance(schema, str) else schema
            return _rf("output", schema, strict=False), None
        raise UnsupportedOnEndpoint(
            f"{self!r}: {'a regex' if 'regex' in constraint else 'an EBNF grammar'} constraint cannot be "
            "expressed as a JSON-schema response_format; use constraints='auto' (server-side decoding or "
            "logit-bias stepping), or json_schema / a typed gen instead")

    async def _call_gen(self, text: str, params: GenParams, images: list[Image], n: int,
                        *, max_tokens: int | None = None, no_stop: bool = False, partial_ok: bool = True,
                        logit_bias: dict | None = None):
        """One generation call: returns (texts, metas) (lists of n)."""
        kind = self._route()
        kw, response_format, unwrap = self._sampling(params, kind)
        if logit_bias:
            kw["logit_bias"] = logit_bias
        if max_tokens is not None:
            kw["max_completion_tokens" if "max_completion_tokens" in kw else "max_tokens"] = max_tokens
        if no_stop:
            kw.pop("stop", None)
        if n > 1:
            kw["n"] = n
        if kind == "chat":
            msgs, partial = self._messages(text, images)
            if partial and not partial_ok:
                return None
            if partial:
                if not self.continues_turns:
                    raise UnsupportedOnEndpoint(
                        f"{self!r} is a chat model on an API that cannot continue a partial assistant message: "
                        f"the gen must come right after assistant() (text {partial[-40:]!r} precedes it)")
                msgs = msgs + [{"role": "assistant", "content": partial}]
                extra = dict(kw.get("extra_body") or {})
                extra.update(continue_final_message=True, add_generation_prompt=False)
                kw["extra_body"] = extra
            kw["messages"] = msgs
        else:
            if images:
                raise ValueError(f"image(): {self.model} is a completion model; images need a chat model")
            kw["prompt"] = text
        out = await self._create(kind, kw)
        u = out.get("usage") or {}
        texts, metas = [], []
        for ch in sorted(out["choices"], key=lambda c: c.get("index", 0)):
            t = ch["message"]["content"] if kind == "chat" else ch["text"]
            t = t or ""
            if unwrap is not None:
                t = _unwrap(t, unwrap, params.dtype, self.model)
            meta = {"id": out.get("id"), "model": out.get("model"),
                    "finish_reason": {"type": ch.get("finish_reason")},
                    "prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
            if ch.get("logprobs"):
                meta["logprobs"] = ch["logprobs"]
                meta["output_token_logprobs"] = _logprob_triples(ch["logprobs"], kind)
            texts.append(t)
            metas.append(meta)
        return texts, metas

    # ---- Backend protocol --------------------------------------------------------------------------------
    async def generate(self, text: str, params: GenParams, images: list[Image], speculation: SpecStep | None = None):
        """`speculation`: a compiled plan's step (Capabilities.planned_speculation), which alone decides; without
        one (an interpreted program with num_api_spec_tokens) the rule of `_spec_generate` decides at run time.
        A gen whose options rule speculation out at run time (logprobs or a constraint from run()) is a normal
        call either way."""
        n = params.n or 1
        stream = current_stream()
        stream_usage(stream)
        spec_n = getattr(stream, "num_api_spec_tokens", None) if stream is not None else None
        if stream is not None and n == 1 and _speculable(params):
            got = None
            if speculation is not None:
                if speculation.group is not None:
                    got = await self._planned_generate(stream, text, params, images, speculation)
            elif spec_n:
                got = await self._spec_generate(stream, text, params, images, spec_n)
            if got is not None:
                return got
        if self._lowering(params, self._route()) == "logit_bias":
            # one after another in this task (not gathered): usage finds the program's stream from the running task
            outs = [await self._bias_gen(text, params, images) for _ in range(n)]
            return outs[0] if n == 1 else ([v for v, _ in outs], [m for _, m in outs])
        texts, metas = await self._call_gen(text, params, images, n)
        if n == 1:
            return texts[0], metas[0]
        return texts, metas

    async def generate_stream(self, text: str, params: GenParams, images: list[Image]):
        kind = self._route()
        stream_usage(current_stream())
        if self._lowering(params, kind) == "logit_bias":
            yield await self._bias_gen(text, params, images)
            return
        kw, response_format, unwrap = self._sampling(params, kind)
        if unwrap is not None:
            texts, metas = await self._call_gen(text, params, images, 1)
            yield texts[0], metas[0]
            return
        if kind == "chat":
            msgs, partial = self._messages(text, images)
            if partial:
                if not self.continues_turns:
                    raise UnsupportedOnEndpoint(f"{self!r}: the gen must come right after assistant()")
                msgs = msgs + [{"role": "assistant", "content": partial}]
                kw["extra_body"] = {**(kw.get("extra_body") or {}), "continue_final_message": True,
                                    "add_generation_prompt": False}
            kw["messages"] = msgs
        else:
            kw["prompt"] = text
        kw["stream"] = True
        kw["stream_options"] = {"include_usage": True}
        import openai

        kw = self._with_program_hints(kw)
        client = self._client()
        fn = client.chat.completions.create if kind == "chat" else client.completions.create
        try:
            resp = await fn(**kw)
        except openai.APIStatusError as e:
            raise ValueError(f"{self!r} refused the request (HTTP {e.status_code}): {_err_message(e)}") from None
        finish, usage = None, None
        async for chunk in resp:
            c = chunk.model_dump()
            if c.get("usage"):
                usage = c["usage"]
            for ch in c.get("choices") or []:
                delta = (ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
                if delta:
                    yield delta, None
        u = usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        record_usage(None, self, usage=Usage(calls=1, prompt_tokens=u.get("prompt_tokens") or 0,
                                             cached_tokens=cached, completion_tokens=u.get("completion_tokens") or 0))
        yield "", {"finish_reason": {"type": finish}, "prompt_tokens": u.get("prompt_tokens"),
                   "completion_tokens": u.get("completion_tokens"), "cached_tokens": cached}

    async def select(self, text: str, choices: list[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision:
        stream_usage(current_stream())
        how = self._select_lowering(self._route())
        if how == "server":
            return await self._select_logprobs(text, choices, method)
        if how == "json_schema":
            return await self._select_enum(text, choices, temperature)
        stepper = Stepper.select(self._vocabulary("select"), choices)
        # each call but the last adds at least one character: the longest choice bounds the calls
        meta = await self._step(text, stepper, GenParams(max_new_tokens=1, temperature=temperature), [],
                                max(len(c) for c in choices) + 1)
        if stepper.result not in choices:
            raise ValueError(f"{self!r}: logit-bias stepping for select stopped at {stepper.value!r}, which is not "
                             f"one of {choices}")
        return ChoicesDecision(stepper.result, {**meta, "method": "logit_bias"})

    def _select_lowering(self, kind: str) -> str:
        """How select runs here on route `kind` (module docstring): "server" (prompt logprobs), "json_schema" or
        "logit_bias"."""
        chat = kind == "chat"
        echo_ok = self.server in ("lmc", "vllm") or (not chat and self.server != "sglang")
        if chat and not self.exact_template:
            echo_ok = False  # the state text is not what the server's template renders: score via the chat API
        if self.constraints == "auto":
            return "server" if echo_ok else "json_schema" if chat else "logit_bias"
        if self.constraints == "server" and not echo_ok:
            raise UnsupportedOnEndpoint(f"{self!r}: constraints='server', but select needs prompt logprobs (echo) "
                                        "of the state text, which this endpoint does not give")
        if self.constraints == "json_schema" and not chat:
            raise UnsupportedOnEndpoint(f"{self!r}: constraints='json_schema', but select as a JSON-schema enum "
                                        "needs a chat model")
        return self.constraints

    async def _select_logprobs(self, text: str, choices: list[str], method: ChoicesSamplingMethod):
        """Local.select over the completions API: the prompt's length (lmc's /tokenize, else a prefill), then the
        choices' prompt logprobs (echo) from two tokens before the prompt's end (the token-healing window)."""
        start = max(await self._prompt_len(text) - 2, 0)
        out = await self._create("completions", {"model": self.model, "prompt": [text + c for c in choices],
                                                 "max_tokens": 0, "temperature": 0, "echo": True, "logprobs": 0})
        rows = sorted(out["choices"], key=lambda c: c.get("index", 0))
        input_lps = []
        for ch in rows:
            lp = ch.get("logprobs") or {}
            toks, vals = lp.get("tokens") or [], lp.get("token_logprobs") or []
            input_lps.append([(v, None, t) for v, t in zip(vals[start:], toks[start:])])
        uncond = None
        if method.requires_unconditional_logprobs:
            prompts = await self._choice_prompts(choices)
            ur = await self._create("completions", {"model": self.model, "prompt": prompts, "max_tokens": 0,
                                                    "temperature": 0, "echo": True, "logprobs": 0})
            uncond = []
            for ch in sorted(ur["choices"], key=lambda c: c.get("index", 0)):
                lp = ch.get("logprobs") or {}
                uncond.append([(v, None, t) for v, t in zip(lp.get("token_logprobs") or [], lp.get("tokens") or [])])
        return decide(method, choices, input_lps, uncond)

    async def _tokenize(self, prompt, add_special_tokens: bool = True):
        """The server's /tokenize (lmc's and vLLM's: no engine work, not billed), or None where it has none."""
        if self.server not in ("lmc", "vllm"):
            return None

        async with _httpx().AsyncClient(timeout=self.timeout) as c:
            r = await c.post(self.root_url + "/tokenize", json={"model": self.model, "prompt": prompt,
                                                                "add_special_tokens": add_special_tokens},
                             headers={"Authorization": f"Bearer {self.api_key}"})
        return r.json() if r.status_code == 200 else None

    async def _prompt_len(self, text: str) -> int:
        tok = await self._tokenize(text)
        if tok is not None:
            return int(tok["count"])
        pre = await self._create("completions", {"model": self.model, "prompt": text, "max_tokens": 1,
                                                 "temperature": 0})  # vLLM refuses max_tokens 0 without echo
        return int(pre["usage"]["prompt_tokens"])

    async def _choice_prompts(self, choices: list[str]):
        tok = await self._tokenize(choices, add_special_tokens=False)
        if tok is not None:
            eos = (self.model_info.get("eos_token_ids") or [0])[0]
            return [t or [eos] for t in tok["tokens"]]
        return list(choices)

    async def _select_enum(self, text: str, choices: list[str], temperature: float) -> ChoicesDecision:
        msgs, partial = self._messages(text, [])
        if partial:
            raise UnsupportedOnEndpoint(f"{self!r}: select on a chat model must come right after assistant()")
        schema = {"type": "object", "properties": {"choice": {"type": "string", "enum": list(choices)}},
                  "required": ["choice"], "additionalProperties": False}
        kw = {"model": self.model, "messages": msgs, "temperature": temperature,
              "response_format": _rf("choice", schema, strict=True)}
        longest = max(len(c) for c in choices)
        kw["max_completion_tokens" if self.server == "openai" else "max_tokens"] = 32 + longest
        out = await self._create("chat", kw)
        content = out["choices"][0]["message"]["content"] or ""
        try:
            decision = json.loads(content)["choice"]
        except (ValueError, KeyError, TypeError):
            decision = None
        if decision not in choices:
            raise ValueError(f"{self!r}: select got {content!r}, which is not one of {choices}")
        return ChoicesDecision(decision, {"method": "json_schema_enum", "raw": content})

    async def commit(self, text: str) -> None:
        stream_usage(current_stream())  # created before a fork copies the parent: the branches share it
        if text and self.server == "lmc":
            await self._create("completions", {"model": self.model, "prompt": text, "max_tokens": 0})

    def flush_cache(self) -> bool:
        if self._cache is not None:
            self._cache.clear()
        if self.server in ("lmc", "sglang"):
    
            r = _httpx().post(self.root_url + "/flush_cache", headers={"Authorization": f"Bearer {self.api_key}"},
                              timeout=self.timeout)
            return r.status_code == 200
        return True

    def shutdown(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            loop = c._lmc_loop
            if loop.is_running() and not loop.is_closed():
                try:
                    asyncio.run_coroutine_threadsafe(c.close(), loop).result(timeout=5)
                except Exception:  # noqa: BLE001
                    pass

    # ---- API speculative execution ----------------------------------------------------------------------
    async def _spec_generate(self, stream, text: str, params: GenParams, images, spec_n: int):
        """Interpreted programs (no plan): serve the gen from the stream's speculative text when the state still
        follows it; else make a speculative call (over-generate, no stop) when one can help. None: run the gen as
        a normal call.

        - the state follows the buffer: the value is the text up to the gen's stop (or the end of a completion
          the model finished); a value that would not fit the gen's max tokens runs as a normal call (it would
          have been cut); a buffer that ran out before the value ended is replaced by a new speculative call;
        - the state left the buffer inside it (a constant did not match what the model wrote): the model did
          not follow the template, so the remaining gens of this turn run as normal calls; a new speculative call
          is made only once a role turn has ended since (chat) or the buffer was used up."""
        buf = getattr(stream, _SPEC_ATTR, None)
        if buf is not None:
            full = buf["anchor"] + buf["text"]
            if full.startswith(text):
                status, value = _spec_take(buf, text, params)
                if status == "ok":
                    return self._served(buf, value)
                if status == "too_long":
                    return None
            elif not text.startswith(full) and len(stream.messages) <= buf["turn"]:
                return None  # diverged from the template inside the buffer: normal calls for this turn
        return await self._spec_call(stream, text, params, images, spec_n, None)

    async def _planned_generate(self, stream, text: str, params: GenParams, images, step: SpecStep):
        """Compiled programs: the gen's place in the plan's speculation groups decides. The group's first gen
        makes the over-generated call; the others take their value from its text, or (None) run as normal calls
        where the model did not follow the template. Nothing is decided here."""
        if step.first:
            return await self._spec_call(stream, text, params, images, step.tokens, step.group)
        buf = getattr(stream, _SPEC_ATTR, None)
        if buf is None or buf["group"] != step.group:
            return None  # the group's first call did not run as speculative (its value was cut short)
        status, value = _spec_take(buf, text, params)
        return self._served(buf, value) if status == "ok" else None

    def _served(self, buf: dict, value: str):
        record_usage(None, self, usage=Usage(calls_saved=1))
        return value, {"speculative": True, "finish_reason": {"type": "stop"}, "spec_call_id": buf["id"],
                       "spec_group": buf["group"]}

    async def _spec_call(self, stream, text: str, params: GenParams, images, spec_n: int, group: int | None):
        """One over-generated call continuing `text` (no stop), kept as the stream's speculative buffer (group:
        the plan's group it serves); the gen's value from it, or None (a normal call decides it)."""
        setattr(stream, _SPEC_ATTR, None)
        max_tokens = max(spec_n, params.max_new_tokens or 0)
        kind = self._route()
        if kind == "chat":
            msgs, partial = self._messages(text, images)
            anchor = text[:len(text) - len(partial)] if partial else text
        else:
            anchor = text
        spec_params = GenParams(**{f.name: getattr(params, f.name) for f in fields(params)})
        spec_params.stop = None
        own = self.chat_template.stop_token_ids
        spec_params.stop_token_ids = [t for t in (params.stop_token_ids or []) if t in own]
        kw, _, _ = self._sampling(spec_params, kind)
        kw["max_completion_tokens" if "max_completion_tokens" in kw else "max_tokens"] = max_tokens
        if kind == "chat":
            kw["messages"] = msgs  # the whole assistant turn is generated: the constant text must come back
        else:
            kw["prompt"] = anchor
        out = await self._create(kind, kw)
        ch = out["choices"][0]
        completion = (ch["message"]["content"] if kind == "chat" else ch["text"]) or ""
        u = out.get("usage") or {}
        ntok = u.get("completion_tokens") or 0
        buf = {"anchor": anchor, "text": completion, "id": out.get("id"), "turn": len(stream.messages),
               "complete": ch.get("finish_reason") == "stop", "group": group,
               "chars_per_token": len(completion) / ntok if ntok else 4.0}
        setattr(stream, _SPEC_ATTR, buf)
        status, value = _spec_take(buf, text, params)
        if status != "ok":
            return None
        return value, {"speculative": True, "spec_call_id": buf["id"], "spec_group": group,
                       "finish_reason": {"type": "stop"}, "prompt_tokens": u.get("prompt_tokens"),
                       "completion_tokens": ntok,
                       "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _speculable(params: GenParams) -> bool:
    return (params.regex is None and params.json_schema is None and params.dtype is None
            and not params.return_logprob)


SPEC_LENGTH_MARGIN = 0.8  # a value estimated above this share of the gen's max tokens runs as a normal call


def _spec_take(buf: dict, text: str, params: GenParams) -> tuple[str, str | None]:
    """("ok", value) when the speculative text determines the gen's value; ("too_long", None) when the value
    would not fit the gen's max tokens (a normal call cuts it where the model would); ("undetermined", None)
    when the text does not follow the buffer or the buffer ends before the value does."""
    full = buf["anchor"] + buf["text"]
    if not text.startswith(buf["anchor"]) or not full.startswith(text):
        return "undetermined", None
    rest = full[len(text):]
    stops = params.stop if isinstance(params.stop, list) else ([params.stop] if params.stop else [])
    hits = [i for i in (rest.find(s) for s in stops) if i >= 0]
    value = rest[:min(hits)] if hits else rest
    budget = (params.max_new_tokens or 128) * buf["chars_per_token"] * SPEC_LENGTH_MARGIN
    if len(value) > budget:
        return "too_long", None
    if not hits and not buf["complete"]:
        return "undetermined", None
    if not value.strip() and not (value == "" and hits):
        return "too_long", None  # only whitespace before the end: let a normal call decide
    return "ok", value


def _rf(name: str, schema: dict, strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


def _unwrap(content: str, key: str, dtype, model: str) -> str:
    try:
        v = json.loads(content)[key]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{model}: expected a JSON object with {key!r}, got {content!r}") from None
    if dtype is bool:
        return "True" if v else "False"
    if dtype is str:
        return json.dumps(v)  # a quoted string, as a regex-constrained str gen produces
    return str(v)


def _logprob_triples(lp: dict, kind: str) -> list:
    if kind == "chat":
        return [(c.get("logprob"), None, c.get("token")) for c in (lp.get("content") or [])]
    return [(v, None, t) for v, t in zip(lp.get("token_logprobs") or [], lp.get("tokens") or [])]


def _err_message(e) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return str(getattr(e, "message", None) or e)

