"""transformers as the suite's peer on a GPU machine (where vLLM cannot go): an lmc backend that runs every gen
with `model.generate` and every select with one forward per choice, one request at a time and without reusing any
prefix, on the same config and the same weights as lmc's engine (dummy weights: lmc's engine loads this model's
state dict). Regex / JSON-schema gens are refused (transformers decodes no grammar): such programs fail and are
counted as errors.
"""
from __future__ import annotations

import asyncio
import threading

import torch

from lmc.frontend.chat_template import ChatTemplate
from lmc.frontend.choices import ChoicesDecision, ChoicesSamplingMethod
from lmc.frontend.primitives import GenParams, Image


class TransformersBackend:
    supports_images = False

    def __init__(self, model: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from lmc.runtime.model.loader import fill_dummy, resolve

        src = resolve(model)
        if src.tokenizer_dir is None:
            raise ValueError(f"{model!r} has no tokenizer: use dummy:<shape>@<tokenizer model or directory>")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(src.tokenizer_dir)
        if src.weights is None:
            with torch.device(self.device):
                self.model = AutoModelForCausalLM.from_config(src.hf_config, dtype=dtype)
            fill_dummy(self.model)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(src.tokenizer_dir, dtype=dtype).to(self.device)
        self.model.eval()
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer)
        self._lock = threading.Lock()  # one request at a time: the peer batches nothing across programs
        self.requests: list | None = None  # (prompt ids, output ids, first position whose logits are needed)

    def weights(self):
        """(name, tensor) pairs for lmc's Engine(weights=...), so both systems hold the same weights."""
        return iter(self.model.state_dict().items())

    def __repr__(self) -> str:
        return "TransformersBackend()"

    @torch.inference_mode()
    def _generate(self, text: str, p: dict) -> tuple[str, dict]:
        if p.get("regex") or p.get("json_schema") or p.get("ebnf"):
            raise ValueError("transformers decodes no regex or JSON-schema constraint")
        ids = torch.tensor([self.tokenizer.encode(text)], device=self.device)
        kw = dict(max_new_tokens=p["max_new_tokens"], pad_token_id=self.tokenizer.eos_token_id)
        if p.get("temperature", 1.0) > 0:
            kw.update(do_sample=True, temperature=p["temperature"], top_p=p.get("top_p", 1.0))
        else:
            kw.update(do_sample=False)
        if p.get("ignore_eos"):
            kw.update(min_new_tokens=p["max_new_tokens"])
        with self._lock:
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, ids.shape[1]:].tolist()
        stops = set(p.get("stop_token_ids") or ()) | {self.tokenizer.eos_token_id}
        cut = next((i for i, t in enumerate(out) if t in stops), len(out)) if not p.get("ignore_eos") else len(out)
        if self.requests is not None:
            self.requests.append((ids[0].tolist(), out[:cut], None))
        gen = self.tokenizer.decode(out[:cut], skip_special_tokens=True)
        stop = p.get("stop") or []
        for s in [stop] if isinstance(stop, str) else stop:
            if s in gen:
                gen = gen[:gen.find(s)]
        return gen, {"prompt_tokens": ids.shape[1], "completion_tokens": cut, "cached_tokens": 0}

    async def generate(self, text: str, params: GenParams, images: list[Image]):
        p = params.engine_params()
        if (params.n or 1) > 1:
            outs = [await asyncio.to_thread(self._generate, text, p) for _ in range(params.n)]
            return [t for t, _ in outs], [m for _, m in outs]
        return await asyncio.to_thread(self._generate, text, p)

    async def generate_stream(self, text: str, params: GenParams, images: list[Image]):
        yield await self.generate(text, params, images)

    @torch.inference_mode()
    def _choice_logprobs(self, text: str, choice: str, start: int) -> list:
        ids = self.tokenizer.encode(text + choice)
        x = torch.tensor([ids], device=self.device)
        if self.requests is not None:
            self.requests.append((ids, [], 0))  # a full forward: every position's logits
        with self._lock:
            logits = self.model(x).logits[0].float()
        lps = torch.log_softmax(logits[:-1], dim=-1).gather(1, x[0, 1:, None])[:, 0].tolist()
        return [(lps[i - 1], ids[i], None) for i in range(max(start, 1), len(ids))]

    async def select(self, text: str, choices: list[str], temperature: float,
                     method: ChoicesSamplingMethod) -> ChoicesDecision:
        if method.requires_unconditional_logprobs:
            raise ValueError("the transformers peer scores choices with token_length_normalized or greedy only")
        start = max(len(self.tokenizer.encode(text)) - 2, 0)  # the token-healing window, as lmc.Local scores
        rows = [await asyncio.to_thread(self._choice_logprobs, text, c, start) for c in choices]
        normalized = [sum(lp for lp, _, _ in r) / len(r) if r else 0.0 for r in rows]
        return method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=rows,
                      output_token_logprobs=[[] for _ in choices], unconditional_token_logprobs=None)

    async def commit(self, text: str) -> None:
        return None  # nothing to prefill: no prefix is reused

    def flush_cache(self) -> bool:
        return True
