"""Engine-side continuation: a chain of LM calls (gens and single-token selects, each after its constant text) run
as ONE request, which keeps its KV between the calls.

    steps = [ChainStep("Topic: moon\nFact 1:", gen={"max_new_tokens": 6, "stop": "\n", "temperature": 0}),
             ChainStep("\nIs it true? ", choices=["yes", "no"], token_ids=[7566, 1119], method=...)]
    async for event in engine.async_chain(steps): ...   # one event per finished step, then the end

When a step's call ends (stop, length), the scheduler does not finish the request: it appends the call's text and
the next step's text to the chain's text, and re-encodes that text with the tokenizer, exactly as the next
request of a step-by-step run would encode its prompt (`tokenizer.encode(text)`; the same ids computed from the
text's last stable cut on, prefix_encode.py), so the tokens are canonical and
outputs at temperature 0 equal the step-by-step ones. The KV of the longest common prefix of the old and new
tokens is kept (as jump-forward keeps the unchanged prefix when it retokenizes; jump_forward.py); the request
leaves the running batch for `Scheduler.continuing` and its next prefill chunk extends it from there: no return to
the frontend, no admission (only a look-up of the tree for more of its next text, below). Only when the
retokenization changed a token the radix tree already owns (or the request lost its KV, e.g. after a jump-forward)
does it go back to the queue and re-match.

A select step is scored in the engine as the step-by-step backend (lmc.Local) scores it, from the same logprobs,
decided by the step's method (lmc.protocol.decide); the chosen choice is the text appended:
- where each choice is one token after the text, or after the text less its last token (a word after a
  trailing space: lmc.protocol.token_select_prompt's rule, `single_tokens`), by the request itself
  (`select_tokens`): one forward over the prompt's end gives its last prompt logprobs and each choice id's
  next-token logprob. The ids come from the choices' encodings here, so a plan need not have lowered the select
  (a plan lowered for an endpoint, sent to /v1/programs, has no ids);
- otherwise (`select`), by one child request per choice (text + choice, prefill only, logprobs from two tokens
  before the text's end), queued by the scheduler itself: the parent puts its computed KV into the radix tree
  (keeping it) and waits, parked, while the children share that prefix; their logprobs decide, and the parent
  goes on with its KV. A select as a chain's first step queues its children as the request arrives, with no
  prefill of the prompt of its own (which would compute the prompt's end once more than the step-by-step
  select's requests, which share the prompt in their batch): the children share it in theirs.
  Select fusion: where the select is followed by a plain greedy gen (`fused_prompts`), each child prefills
  on through its choice into that gen's prompt and samples one token; the winner's prompt is the gen's prompt and
  its token the gen's first (greedy: what the gen's own first forward would pick), so the parent starts the gen
  from there, one forward sooner. The choice is scored from the same positions as without fusion (the child's
  prompt logprobs stop after its choice: `Req.logprob_end`; the gen's text needs none). Only where
  the losing choices' share of the gen's text is short (FUSE_MAX_EXTRA_TOKENS): they compute it for nothing.
  Scoring by ids goes before fusion (`plan_select`): fusion would save the forward over the next gen's prompt,
  but every losing choice's child computes that prompt too. Except in a small forward (latency fusion,
  `Continuation._latency_fusion`: nothing queued, so the children's forward holds only them and the running
  requests' decode step): a forward costs about the same for 1 token as for a couple of dozen (weight-read
  bound; 57 ms at 1-4 tokens, 69 at 16 on this CPU), so a select scored by ids followed by a gen is fused too
  where the children's tokens and the running requests' fit LATENCY_FUSE_TOKENS: one forward fewer per such
  select (chain6, react_agent at one instance), and no cost to the running requests, whose decode step mixes
  into it as into the unfused select's. Which way a select is scored never changes a decision or a token at
  temperature 0 (fusion needs a greedy gen): only the forward count.
When the parent goes on to its next call, the radix tree may already hold more of the new text than its own KV
(an earlier request's, or the winning child's): it adopts that prefix (`CacheManager.adopt`) instead of
recomputing it, as a new request's prefix match would.
A next prompt past the context ends the chain there: the result's `stopped_at` names the first step not run,
which the caller runs its usual way.

A fork (a last step with `branches`: each branch a list of steps continuing from the text so far) spawns one child
request per branch at the boundary, in the step that ended the parent's last call (`Continuation._fork`): the
parent puts its computed KV into the radix tree and waits (`Scheduler.forking`) without a row, and each child, a
chain request of its own queued by the scheduler ahead of the queue, matches that prefix as a select's choices
do and runs its branch's chain; its segments stream to the parent's caller tagged with the branch, then its end
(`stopped_at`, meta info). The parent finishes when every child has; aborted or failed, it takes its children
with it, and a child's abort or failure fails the parent (the instance), never another request.

Each finished step's result (`segment`) is kept on the chain and streamed to the engine's caller as it finishes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from .core import Req, RequestError, SamplingParams
from .prefix_encode import EncodedPrefix, PrefixEncoder

if TYPE_CHECKING:
    from .scheduler import Scheduler


# Select fusion's price: the tokens of the next gen's text that the losing choices' children compute for nothing.
# Fusion saves one forward; on CPU a forward of this size of model costs about as much as a dozen prefill tokens
# (judge's 5 choices x ' out of 5, because' cost more than they saved; chain6's 'yes'/'no' x '\nFact 2:' less).
FUSE_MAX_EXTRA_TOKENS = 16
# Latency fusion's budget: the tokens of the forward that replaces a select's own and the next gen's first (its choice
# children's and the running requests' decode step); on CPU at batch 1 a forward of 24 tokens costs ~1.3x one of 1.
LATENCY_FUSE_TOKENS = 24
CHARS_PER_TOKEN = 4  # a text's token estimate where it is not encoded yet (English prose: about 4 characters a token)


@dataclass
class ChainStep:
    """One LM call of a chain, after `text` (the constant text appended before it; step 0's is the prompt).
    Exactly one of `gen` (its sampling parameters) or `choices` (a select: with each choice's single token id
    after the text, `token_ids`, where the plan has them, and the lmc.protocol choice method deciding it) is set."""
    text: str
    gen: dict | SamplingParams | None = None
    choices: list[str] | None = None
    token_ids: list[int] | None = None
    method: Any = None
    program: Any = None  # the call's program hints (lmc.protocol.ProgramHints or its dict): Req.program during it
    grammar: Any = None  # the gen's GrammarMatcher, compiled when the chain is made (never on the scheduler thread)
    branches: list[list["ChainStep"]] | None = None  # a fork (the last step, with no call of its own): its branches


@dataclass
class Chain:
    """A request's chain: the steps, the one running (`at`), the whole text so far, the finished steps' results."""
    steps: list[ChainStep]
    text: str
    at: int = 0
    segments: list[dict] = field(default_factory=list)
    stopped_at: int | None = None  # the first step not run, when the chain ended before its last step
    # A select scored by child requests: each choice's prompt logprobs as its child finishes, then the segment.
    choice_logprobs: list | None = None
    scored: dict | None = None
    emitted: int = 0  # segments handed to the caller's stream so far (the engine's side)
    # Select fusion (fused_prompts): per choice, its child's (prompt ids, sampled token); then the winner's,
    # which the next gen starts from.
    fused: list | None = None
    first: tuple[list[int], int] | None = None
    # Latency fusion (latency_fusion) of the select running: its children go into one forward together, each
    # computing the text after the parent's KV, rather than one waiting a step to share it (in-batch dedup).
    latency_fused: bool = False
    branch: int | None = None  # this chain is that branch of its parent's fork
    children: list[Req] | None = None  # the fork's branch requests, once spawned
    closed: bool = False  # (a branch) its end was handed to the caller
    prefix: EncodedPrefix | None = None  # the text's encoded prefix, for re-encoding it (prefix_encode.py)
    # Per step, the tokens the request adds to its own KV after that step's call: the later steps' texts (estimated
    # at CHARS_PER_TOKEN) and calls (a gen's max_new_tokens, a select's choice); a fork's branches run as requests
    # of their own. Admission reserves them for a running chain (prefill.est_new).
    tokens_after: list[int] = field(init=False)

    def __post_init__(self):
        after, acc = [], 0
        for st in reversed(self.steps):
            after.append(acc)
            if st.branches is None:
                call = (st.gen.max_new_tokens if st.gen is not None
                        else 1 + max(len(c) for c in st.choices) // CHARS_PER_TOKEN)
                acc += len(st.text) // CHARS_PER_TOKEN + call
        self.tokens_after = after[::-1]


def select_params(start: int, token_ids: list[int]) -> SamplingParams:
    """A select step's request: one greedy token, with the prompt logprobs from `start` and the choices' ids'."""
    return SamplingParams(max_new_tokens=1, temperature=0, return_logprob=True, logprob_start_len=start,
                          token_ids_logprob=list(token_ids))


def single_tokens(ids: list[int], prompts: list[list[int]], step: ChainStep) -> tuple[list[int], int, list[int]] | None:
    """(prompt ids, logprob start, the choices' token ids) of the one request scoring a select whose choices are
    single tokens here, or None. `ids` is the text's encoding, `prompts` each choice's (text + choice). The rule is
    lmc.protocol.token_select_prompt's: each choice is one token after the text, or after the text less its last
    token (a word after a trailing space), so the request's prompt logprobs from two tokens before the text's end
    plus each id's next-token logprob are exactly the per-choice requests' vectors. The ids come from the
    encodings; where the plan lowered the select (`step.token_ids`), they must be the plan's."""
    for cut in (len(ids), len(ids) - 1):
        if cut >= 1 and all(len(p) == cut + 1 and p[:cut] == ids[:cut] for p in prompts):
            tokens = [p[cut] for p in prompts]
            if step.token_ids is None or tokens == step.token_ids:
                return ids[:cut], max(len(ids) - 2, 0), tokens
    return None


def fused_prompts(encoder: PrefixEncoder, chain: Chain, at: int, text: str, prompts: list[list[int]],
                  limit: int) -> list | None:
    """Select fusion: where the select at `at` is followed by a plain greedy gen, each choice's child may
    prefill on into that gen's prompt (text + choice + the gen's text) and sample its first token; the
    winner's prompt is the gen's prompt, so the gen starts from its KV with its first token known, one
    forward sooner. Only where each choice's own tokens are a prefix of its fused prompt (the choice scores
    from the same positions) and sampling is greedy with nothing that reads the outputs: the child's token
    is the one the gen's first forward would pick. Returns the fused prompts, or None."""
    nxt = chain.steps[at + 1] if at + 1 < len(chain.steps) else None
    g = nxt.gen if nxt is not None else None
    if (g is None or nxt.grammar is not None or not g.greedy or g.max_new_tokens < 1 or g.min_new_tokens
            or g.return_logprob or g.top_logprobs_num or g.token_ids_logprob is not None
            or g.logit_bias or g.frequency_penalty or g.presence_penalty or g.repetition_penalty != 1.0):
        return None
    choices = chain.steps[at].choices
    out = [encoder.encode(text + c + nxt.text, chain.prefix) for c in choices]
    if any(f[:len(p)] != p or len(f) >= limit for f, p in zip(out, prompts)):
        return None
    extra = sum(len(f) - len(p) for f, p in zip(out, prompts)) - min(len(f) - len(p) for f, p in zip(out, prompts))
    if extra > FUSE_MAX_EXTRA_TOKENS:
        return None  # the losing choices would compute more of the gen's text than the forward saved costs
    return out


@dataclass
class SelectPlan:
    """How a select step is scored: by the request itself (`by_ids`: single_tokens' prompt, logprob start and
    choice ids), or by one child request per choice (`prompts`; with select fusion, `fused`: each child's prompt
    reaching into the next gen's)."""
    by_ids: tuple[list[int], int, list[int]] | None = None
    prompts: list[list[int]] | None = None
    fused: list[list[int]] | None = None
    latency: bool = False  # fused although scorable by ids (latency fusion)


def plan_select(encoder: PrefixEncoder, chain: Chain, at: int, text: str, ids: list[int], limit: int,
                latency_fusion: Callable[[list[list[int]], int], bool] | None = None) -> SelectPlan | None:
    """How to score the select at `at` after `text` (encoded: `ids`); None: a choice's prompt reaches `limit`.
    Scoring by ids goes first (one request, one forward over the text's end), else the children, fused where
    fusion applies. Fusion would save the forward over the next gen's prompt but has every losing choice's child
    compute that prompt too: on run_batch of 32 react_agent instances it took prefill from 1,653 to 2,633 tokens
    for 3 forwards fewer, slower on the CPU (benchmarks/compiler_bench.py). `latency_fusion` (where nothing is
    queued): whether fused children's prompts (their prompt logprobs from a position) are cheap enough to fuse
    a select scored by ids too."""
    step = chain.steps[at]
    prompts = [encoder.encode(text + c, chain.prefix) for c in step.choices]
    by_ids = single_tokens(ids, prompts, step)
    if max(map(len, prompts)) >= limit:
        return SelectPlan(by_ids=by_ids) if by_ids is not None else None
    fused = fused_prompts(encoder, chain, at, text, prompts, limit)
    if by_ids is not None and (fused is None or latency_fusion is None
                               or not latency_fusion(fused, max(len(ids) - 2, 0))):
        return SelectPlan(by_ids=by_ids)
    return SelectPlan(prompts=prompts, fused=fused, latency=by_ids is not None)


def make_chain(steps, vocab_size: int, limits: dict, grammars, hints) -> Chain:
    """Validate the steps (RequestError naming the step and its field) and compile their grammars. `hints`:
    a step's program hints as ProgramHints (RequestError when malformed)."""
    out = _steps(steps, vocab_size, limits, grammars, hints, "chain step ", fork=True)
    if not out[0].text:
        raise RequestError("chain step 0: its text is the prompt and must not be empty")
    return Chain(out, out[0].text)


def _steps(steps, vocab_size: int, limits: dict, grammars, hints, label: str, fork: bool) -> list[ChainStep]:
    """make_chain's validation of a list of steps (a chain's, or a fork branch's: `fork`, whether it may fork)."""
    if not isinstance(steps, (list, tuple)) or not steps:
        raise RequestError("a chain is a non-empty list of steps (ChainStep, or dicts of its fields)")
    out = []
    for i, st in enumerate(steps):
        where = f"{label}{i}"
        if isinstance(st, dict):
            unknown = sorted(set(st) - {"text", "gen", "choices", "token_ids", "method", "program", "branches"})
            if unknown or "text" not in st:
                raise RequestError(f"{where}: a step has a text and a gen, or choices, token_ids and a method "
                                   f"(unknown field(s): {unknown})")
            st = ChainStep(**st)
        if not isinstance(st, ChainStep):
            raise RequestError(f"{where}: must be a ChainStep (or a dict of its fields), got {type(st).__name__}")
        if not isinstance(st.text, str):
            raise RequestError(f"{where}: text must be a string, got {type(st.text).__name__}")
        if st.branches is not None:
            if not fork or i == 0 or i != len(steps) - 1 or st.text or st.gen is not None or st.choices is not None:
                raise RequestError(f"{where}: a fork is a chain's last step after a call, with branches only "
                                   "(no text, gen or choices), and a branch does not fork")
            if not isinstance(st.branches, (list, tuple)) or not st.branches:
                raise RequestError(f"{where}: branches must be a non-empty list of branches (lists of steps)")
            out.append(ChainStep("", branches=[_steps(b, vocab_size, limits, grammars, hints,
                                                       f"{where} branch {k} step ", fork=False)
                                               for k, b in enumerate(st.branches)]))
            continue
        try:
            program = hints(st.program)
        except RequestError as e:
            raise RequestError(f"{where}: program: {e}") from None
        if (st.gen is None) == (st.choices is None):
            raise RequestError(f"{where}: set exactly one of gen (a gen's sampling parameters) or choices (a select)")
        if st.gen is not None:
            try:
                params = (st.gen.validate(**limits) if isinstance(st.gen, SamplingParams)
                          else SamplingParams.from_dict(st.gen, **limits))
            except RequestError as e:
                raise RequestError(f"{where}: {e}") from None
            out.append(ChainStep(st.text, gen=params, program=program, grammar=grammars.matcher(params)))
            continue
        if (not isinstance(st.choices, list) or not st.choices
                or not all(isinstance(c, str) and c for c in st.choices)):
            raise RequestError(f"{where}: choices must be a non-empty list of non-empty strings")
        ids = st.token_ids
        if ids is not None and (not isinstance(ids, list) or len(ids) != len(st.choices) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)):
            raise RequestError(f"{where}: token_ids must be None or one token id in [0, {vocab_size}) per choice")
        if not callable(st.method) or getattr(st.method, "requires_unconditional_logprobs", False):
            raise RequestError(f"{where}: method must be a choice method that scores from the prompt's logprobs "
                               "alone (token_length_normalized or greedy_token_selection)")
        out.append(ChainStep(st.text, choices=list(st.choices), token_ids=ids and list(ids), method=st.method,
                             program=program))
    return out


def start(r: Req, encoder: PrefixEncoder, chain: Chain, limit: int) -> None:
    """Point a new request at its chain's first step (its input ids are the encoded prompt). A first step that
    is a select scored by children (`at` -1: multi-token choices, or fusion) queues them as the scheduler adds r
    (r holds no KV: the children compute the prompt, sharing it in their batch)."""
    r.chain = chain
    chain.prefix = encoder.prefix(chain.text, r.input_ids, chain.prefix)
    step = chain.steps[0]
    plan = plan_select(encoder, chain, 0, chain.text, r.input_ids, limit) if step.choices is not None else None
    if plan is not None and plan.by_ids is not None:
        r.input_ids, start, tokens = plan.by_ids
        r.params = select_params(start, tokens)
    elif step.choices is not None:  # the children of step 0, queued by Scheduler.add (advance from `at` -1)
        r.params = SamplingParams(max_new_tokens=0)
        chain.at, chain.text = -1, ""
    else:
        r.params, r.grammar = step.gen, step.grammar


def ran_a_call(r: Req) -> bool:
    """Whether r's end ends an LM call of its own: not a chain's select that its choices' children scored (they
    ran the calls; r's ids are still its previous step's), nor a first select whose children never ran, nor a
    forked parent's end (its branches ran the calls)."""
    return r.chain is None or (r.chain.at >= 0 and r.chain.scored is None and r.chain.children is None)


class Continuation:
    """The scheduler's side: on the end of a step's call, advance the request to its next step."""

    def __init__(self, s: "Scheduler"):
        self.s = s

    def segment(self, r: Req, reason: dict, text: str) -> dict:
        """The result of r's running step: a gen's text and meta info; a select's decision and its meta info.
        `request_meta`: the step's token counts (usage), as a step-by-step request's meta_info."""
        step = r.chain.steps[r.chain.at]
        meta = {**r.meta_info(), "finish_reason": reason}
        seg = {"index": r.chain.at, "kind": "gen", "text": text, "output_ids": list(r.output_ids),
               "meta_info": meta, "request_meta": meta}
        if step.choices is not None:
            from ..protocol import decide  # (pure Python: the choice methods' one scoring path)

            prompt = r.input_logprobs
            nxt = r.output_token_ids_logprobs[0] if r.output_token_ids_logprobs else None
            if nxt is None:  # (a select's forward always samples its one token)
                seg.update(kind="select", text="", error=reason.get("message", "the select was not scored"))
                return seg
            d = decide(step.method, step.choices, [prompt + [lp] for lp in nxt])
            seg.update(kind="select", text=d.decision, meta_info=d.meta_info, output_ids=[])
        return seg

    def advance(self, r: Req, reason: dict, text: str) -> bool:
        """r's step ended with `reason` and output `text`. Record its segment; if another step follows and can
        run, set r up for it and return True (r goes on); else False (r finishes now)."""
        chain, s = r.chain, self.s
        if reason.get("type") not in ("stop", "length") or chain.children is not None:
            # aborted or failed: the call did not finish (its partial output is the request's result); a forked
            # parent ends with its branches
            return False
        if chain.at < 0:  # a first select's children not queued yet: no step of the caller's ran
            seg = {"text": ""}
        else:
            seg, chain.scored = chain.scored or self.segment(r, reason, text), None
            chain.segments.append(seg)
        nxt_at = chain.at + 1
        if "error" in seg or nxt_at >= len(chain.steps):
            return False
        step = chain.steps[nxt_at]
        new_text = chain.text + seg["text"] + step.text
        limit = min(s.context_length, s.memory.slots.num_slots)
        if step.branches is not None:
            return self._fork(r, new_text, step, nxt_at, limit)
        ids = s.encoder.encode(new_text, chain.prefix)
        if len(ids) >= limit:
            chain.stopped_at = nxt_at
            return False
        chain.prefix = s.encoder.prefix(new_text, ids, chain.prefix)
        plan = (plan_select(s.encoder, chain, nxt_at, new_text, ids, limit, self._latency_fusion(r))
                if step.choices is not None else None)
        if step.choices is not None and (plan is None or plan.by_ids is None):
            if plan is None:  # a choice's prompt is past the context
                chain.stopped_at = nxt_at
                return False
            return self._score_by_children(r, new_text, ids, step, nxt_at, plan)
        chain.text, chain.at = new_text, nxt_at
        r.program = step.program if step.program is not None else r.program
        params = step.gen
        if plan is not None:
            ids, start, tokens = plan.by_ids  # the text less its last token where the choices merge with it
            params = select_params(start, tokens)
        first, chain.first = chain.first, None
        if first is not None and first[0] != ids:
            first = None  # (cannot happen: the winner's prompt is this text's encoding)
        most = len(ids) - 1  # the last token is always computed: its logits are the next call's
        start = len(ids) if not params.return_logprob or params.logprob_start_len < 0 else min(
            params.logprob_start_len, len(ids))
        if start < len(ids):
            most = min(most, max(start - 1, 0))  # prompt logprobs are recorded from computed positions only
        if first is not None:
            most = len(ids)  # its first token is known: no logits of the prompt are needed
        keep = min(_common_prefix(r.fill_ids[:r.kv_done], ids), most)
        # After a select its children scored, the chosen child left text + choice in the tree, past r's own KV (the
        # text): the adoption below takes it rather than recompute the choice.
        held = r.row >= 0 and keep >= r.cache_protected_len
        if r in s.running:
            s.running.remove(r)
        if held:
            s.memory.truncate(r, keep)
            r.epoch += 1  # an entry of r scheduled before this (overlap) is stale now
            if r not in s.no_match:  # the tree may hold more of the new text (an earlier request's): take it
                keep = s.memory.adopt(r, ids[:most])
        else:
            s.memory.release(r)  # its computed KV goes to the tree under the old tokens; it re-matches below
        _reset(r, ids, params, step.grammar, keep if held else 0)
        s.stats["continuations"] += 1
        if held:
            s.stats["prompt_tokens"] += len(ids)
            s.stats["cached_tokens"] += keep
        if first is not None:  # the select's winning child computed this prompt and sampled the gen's first token
            r.output_ids.append(first[1])
            reason = s._finish_reason(r, first[1])
            if reason is not None:
                s.finish(r, reason)  # the gen ended on it: r goes on to its next step, or finishes
                return True
        if held:
            r.continuing_since = s.stats["forwards"]
            s.continuing.append(r)
        else:
            s.waiting.insert(0, r)
        return True

    def _latency_fusion(self, r: Req) -> Callable[[list[list[int]], int], bool] | None:
        """Where nothing is queued (the next forward holds the children and the running requests' decode step),
        the test of latency fusion (module docstring): the fused children's prompts, with prompt logprobs from
        `start`, are cheap when the tokens they compute plus the running requests' one each fit
        LATENCY_FUSE_TOKENS. A child reuses r's KV or the tree's prefix only up to the position before its first
        prompt logprob (prefill.match_limit). None where anything waits (a second branch's select, a new
        request): the forward would not be small."""
        s = self.s
        if s.waiting or s.continuing or s.parked or s.chunked is not None:
            return None
        own = r.fill_ids[:r.kv_done]
        decodes = sum(q is not r for q in s.running)

        def cheap(prompts: list[list[int]], start: int) -> bool:
            reused = (min(max(_common_prefix(own, p), len(s.memory.tree.peek(p))), max(start - 1, 0), len(p) - 1)
                      for p in prompts)
            return sum(len(p) for p in prompts) - sum(reused) + decodes <= LATENCY_FUSE_TOKENS

        return cheap

    def _score_by_children(self, r: Req, text: str, ids: list[int], step: ChainStep, at: int,
                           plan: SelectPlan) -> bool:
        """Queue one child request per choice of the select `step` (module docstring) and park r."""
        s, chain = self.s, r.chain
        prompts, fused = plan.prompts, plan.fused
        chain.text, chain.at = text, at
        r.program = step.program if step.program is not None else r.program
        if r in s.running:
            s.running.remove(r)
        if r.row >= 0:
            s.memory.truncate(r, r.kv_done)  # (a slot of a step in flight, with overlap)
            r.epoch += 1
            s.memory.cache_unfinished(r)  # the children find r's computed prefix in the tree
        chain.choice_logprobs = [None] * len(prompts)
        start = max(len(ids) - 2, 0)
        params = SamplingParams(max_new_tokens=0, return_logprob=True, logprob_start_len=start)
        chain.fused, chain.latency_fused = None, plan.latency
        if fused is not None:  # each child goes on into the next call's prompt and samples its first token
            prompts, chain.fused = fused, [None] * len(prompts)
            params = replace(chain.steps[at + 1].gen, max_new_tokens=1, return_logprob=True, logprob_start_len=start)
            s.stats["fused_selects"] += 1
        for i, p in enumerate(prompts):
            child = Req(p, params, program=r.program)
            child.parent, child.choice = r, i
            if fused is not None:
                child.logprob_end = len(plan.prompts[i])  # the choice's own tokens: what decides
            s.waiting.insert(i, child)
        s.parked.append(r)
        s.stats["continuations"] += 1
        return True

    def _fork(self, r: Req, text: str, step: ChainStep, at: int, limit: int) -> bool:
        """Spawn one child request per branch of the fork `step` after `text` (module docstring); r waits for
        them in `forking`, its computed KV in the tree and no row of its own. False (r ends, `stopped_at` the
        fork, which its caller runs its own way) where a branch's prompt is past the context."""
        s, chain = self.s, r.chain
        children = []
        for b, steps in enumerate(step.branches):
            sub = Chain(steps, text + steps[0].text, branch=b, prefix=chain.prefix)
            ids = s.encoder.encode(sub.text, sub.prefix)
            if len(ids) >= limit:
                chain.stopped_at = at
                return False
            child = Req(ids, SamplingParams(), program=steps[0].program if steps[0].program is not None
                        else r.program)
            start(child, s.encoder, sub, limit)
            child.fork_parent, child.on_progress = r, r.on_progress
            children.append(child)
        chain.text, chain.at, chain.children = text, at, children
        if r in s.running:
            s.running.remove(r)
        # r's computed KV goes to the tree, where the children (queued first, below) find it, as the most recently
        # used prefix; r gives up its row, which a parent waiting for its children must not hold: parents holding
        # every row would leave none to their children
        s.memory.release(r)
        s.forking.append(r)
        s.stats["continuations"] += 1
        s.stats["forked_branches"] += len(children)
        for b, child in enumerate(children):
            s.add(child, at=b)
        return True

    def branch_done(self, child: Req) -> None:
        """A fork's child finished (it has given up its KV): the last one finishes the parent; an aborted one
        fails it (and with it the other children)."""
        parent = child.fork_parent
        if parent.finished or parent not in self.s.forking:
            return  # (ended meanwhile)
        if child.finish_reason.get("type") == "abort":
            self.s.finish(parent, child.finish_reason)
        elif all(c.finished for c in parent.chain.children):
            self.s.finish(parent, {"type": "stop", "matched": None})
        else:
            return
        self.s.out.append(parent)

    def end_branches(self, r: Req) -> None:
        """r (a forked parent) ended before its children did (aborted, failed): abort what is left of them."""
        for child in r.chain.children:
            if not child.finished:
                self.s.abort(child.rid)

    def child_done(self, child: Req) -> None:
        """A choice's child finished: keep its logprobs; the last one decides, and the parent goes on."""
        parent = child.parent
        chain = parent.chain
        if parent.finished or parent not in self.s.parked:
            return  # the parent was aborted or failed meanwhile
        if child.finish_reason.get("type") == "abort":
            self.s.parked.remove(parent)
            self.s.finish(parent, child.finish_reason)
            return
        lps = child.input_logprobs  # (a fused child's: its choice's positions only, Req.logprob_end)
        if chain.fused is not None:  # the child's sampled token, for the gen
            chain.fused[child.choice] = (child.input_ids, child.output_ids[0]) if child.output_ids else None
        chain.choice_logprobs[child.choice] = (lps, child.meta_info())
        if any(x is None for x in chain.choice_logprobs):
            return
        from ..protocol import decide

        step = chain.steps[chain.at]
        d = decide(step.method, step.choices, [lps for lps, _ in chain.choice_logprobs])
        fused = chain.fused is not None
        if fused:
            chain.first, chain.fused = chain.fused[step.choices.index(d.decision)], None
        metas = [m for _, m in chain.choice_logprobs]
        usage = {k: sum(m[k] for m in metas) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}
        if fused:  # the children's sampled tokens are the gen's first (the winner's counts there): a select generates none
            usage["completion_tokens"] = 0
        reason = {"type": "stop", "matched": d.decision}
        chain.scored = {"index": chain.at, "kind": "select", "text": d.decision, "output_ids": [],
                        "meta_info": d.meta_info, "request_meta": {**usage, "finish_reason": reason}}
        chain.choice_logprobs = None
        self.s.parked.remove(parent)
        self.s.finish(parent, reason)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _reset(r: Req, ids: list[int], params: SamplingParams, grammar, kept: int) -> None:
    """r's per-call state for its next step: the new prompt, no output, its own counters (meta_info per call)."""
    r.input_ids, r.output_ids, r.params, r.grammar = ids, [], params, grammar
    r.finished, r.finish_reason, r.text = False, None, ""
    r.input_logprobs, r.input_top_logprobs = [], []
    r.output_logprobs, r.output_top_logprobs, r.output_token_ids_logprobs = [], [], []
    r.cached_tokens = r.computed_tokens = kept
    r.forward_passes = r.jump_forward_tokens = r.retokenized_tokens = r.jumps = r.canonical_len = 0
    r.match_version = -1
