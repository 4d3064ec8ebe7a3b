"""`lmc.Local`: programs on the in-process engine (lmc.runtime, imported only when a Local is made).

Every engine request carries the running call's program hints (Req.program) and its token counts go to the
program's usage (lmc.backend.usage.program_usage), as over an endpoint."""
from __future__ import annotations

from ..protocol import (Capabilities, ChatTemplate, ChoicesDecision, ChoicesSamplingMethod, GenParams, Image,
                        current_hints, decide, token_select_prompt)
from .usage import record_usage


class Local:
    def __init__(self, model: str = "smollm2-135m-instruct", engine=None, **engine_kwargs):
        from ..runtime import Engine

        self.engine = engine or Engine(model, **engine_kwargs)
        self.model = self.engine.model_name
        self.tokenizer = self.engine.tokenizer
        self.chat_template = ChatTemplate.from_tokenizer(self.engine.tokenizer)

    def __repr__(self) -> str:
        return f"Local({self.model!r})"

    @property
    def capabilities(self) -> Capabilities:
        """Selects by token ids; whether queued requests share a prefix's computation is the scheduler's; chains
        of calls as one request where the engine's continuation is on."""
        return Capabilities(token_id_selects=True,
                            batch_prefix_sharing=self.engine.scheduler.shares_prefixes_in_batch,
                            engine_chains=self.engine.enable_continuation)

    def _check(self, images: list[Image]) -> None:
        if images:
            raise ValueError(f"model {self.model!r} is text-only: image() needs a vision-capable backend")

    async def generate(self, text: str, params: GenParams, images: list[Image]):
        self._check(images)
        p, n = params.engine_params(), params.n or 1
        if n == 1:
            r = await self._engine_call(text, p)
            return r["text"], r["meta_info"]
        seeds = [None if p.get("seed") is None else p["seed"] + i for i in range(n)]
        rs = await self._generate([text] * n, [{**p, "seed": s} for s in seeds])
        return [r["text"] for r in rs], [r["meta_info"] for r in rs]

    async def generate_stream(self, text: str, params: GenParams, images: list[Image]):
        self._check(images)
        async for chunk in self.engine.async_stream(text, params.engine_params(), program=current_hints()):
            if "meta_info" in chunk:
                record_usage(chunk["meta_info"])
            yield chunk["text"], chunk.get("meta_info")

    async def select(self, text: str, choices: list[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score every choice in one batched call that shares the prompt's cached prefix. Scoring starts two
        tokens before the prompt's end (SGLang's token-healing window), since the prompt's last token may merge
        with a choice's first one. SGLang's frontend first prefills the prompt alone (a pre-cache call) so that
        the choices find it cached; here the scheduler's in-batch sharing does that within the call: one choice
        computes the uncached prompt, the others wait a step and take it from the cache (scheduler/prefill.py)."""
        start = max(len(self.engine.tokenizer.encode(text)) - 2, 0)
        rs = await self._generate([text + c for c in choices], {"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=start)
        return await self._decide(choices, [r["meta_info"]["input_token_logprobs"] for r in rs], method)

    async def select_tokens(self, text: str, choices: list[str], token_ids: list[int],
                            method: ChoicesSamplingMethod) -> ChoicesDecision | None:
        """The compiler's lowered select (lmc.passes.select_lowering): each choice is the single token
        `token_ids[i]` after `text` (or after `text` less its last token: lmc.protocol.token_select_prompt), so
        one request scores them all: its prompt logprobs plus each id's next-token logprob are exactly the vectors
        `select` computes per choice. None (use `select`) when the prompt's real tokenization disagrees with the
        plan."""
        found = token_select_prompt(self.engine.tokenizer.encode, text, choices, token_ids)
        if found is None:
            return None
        ids, start = found
        r = (await self._generate(None, {"max_new_tokens": 1, "temperature": 0}, input_ids=[ids], return_logprob=True,
                                  logprob_start_len=start, token_ids_logprob=list(token_ids)))[0]
        prompt = r["meta_info"]["input_token_logprobs"]
        nxt = r["meta_info"]["output_token_ids_logprobs"][0]
        return await self._decide(choices, [prompt + [lp] for lp in nxt], method)

    async def chain(self, steps):
        """Run lmc.runtime.ChainStep's as one engine request (Engine.async_chain) with the program's hints; yields
        each step's result as it finishes (its tokens go to the program's usage, one call each), then the final
        result (`stopped_at`: the first step not run)."""
        async for item in self.engine.async_chain(steps, program=current_hints()):
            if "index" in item:
                record_usage(item["request_meta"])
            yield item

    async def _engine_call(self, prompts, params, **kw):
        """One engine call (a prompt, or a batch of them) with the program's hints; its tokens go to the program's
        usage."""
        out = await self.engine.async_generate(prompts, params, program=current_hints(), **kw)
        record_usage([r["meta_info"] for r in out] if isinstance(out, list) else out["meta_info"])
        return out

    async def _generate(self, prompts: list[str] | None, params: dict, **kw) -> list[dict]:
        rs = await self._engine_call(prompts, params, **kw)
        for r in rs:
            if "error" in r:
                raise ValueError(r["error"])
        return rs

    async def _decide(self, choices: list[str], input_lps: list[list], method: ChoicesSamplingMethod):
        uncond = None
        if method.requires_unconditional_logprobs:
            tok = self.engine.tokenizer
            ids = [tok.encode(c, add_special_tokens=False) or [tok.eos_token_id] for c in choices]
            ur = await self._generate(None, {"max_new_tokens": 0}, input_ids=ids, return_logprob=True,
                                      logprob_start_len=0)
            uncond = [r["meta_info"]["input_token_logprobs"] for r in ur]
        return decide(method, choices, input_lps, uncond)

    async def commit(self, text: str) -> None:
        if text:
            await self._engine_call(text, {"max_new_tokens": 0})

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

