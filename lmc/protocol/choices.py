"""How `select` turns per-choice token logprobs into a decision (SGLang's three methods, same semantics).

Each method gets, per choice, the logprobs of the choice's tokens given the prompt (`input_token_logprobs[i]`,
a list of (logprob, token_id, text) tuples) and their mean (`normalized_prompt_logprobs[i]`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesSamplingMethod:
    requires_unconditional_logprobs = False

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        raise NotImplementedError


def decide(method: "ChoicesSamplingMethod", choices: list[str], input_token_logprobs: list[list],
           unconditional_token_logprobs: list[list] | None = None) -> ChoicesDecision:
    """The one scoring path of every backend: each choice's mean token logprob, then the method's decision.
    `input_token_logprobs[i]`: (logprob, token_id, text) tuples of choice i's tokens given the prompt."""
    normalized = [_mean([lp for lp, _, _ in lps if lp is not None]) for lps in input_token_logprobs]
    return method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=input_token_logprobs,
                  output_token_logprobs=[[] for _ in choices], unconditional_token_logprobs=unconditional_token_logprobs)


def token_select_prompt(encode, text: str, choices: list[str], token_ids: list[int]) -> tuple[list[int], int] | None:
    """The one request that scores single-token choices by their ids (select lowering): (its prompt ids, its
    prompt logprob start), or None where the choices are not single tokens here (score them one request each).

    The per-choice requests score `text + choice` from two tokens before the end of `encode(text)` (SGLang's
    token-healing window). Where each choice is its one token `token_ids[i]` after the text, that request's prompt
    is the text; where each merges with the text's last token instead, as a word does with a trailing space
    ("Action: " + "finish" encodes as "Action:" + " finish"), it is the text less that token. Either way its prompt
    logprobs from the start plus each id's next-token logprob are exactly the per-choice requests' vectors."""
    ids = encode(text)
    for cut in (len(ids), len(ids) - 1):
        if cut >= 1 and all(encode(text + c) == ids[:cut] + [t] for c, t in zip(choices, token_ids)):
            return ids[:cut], max(len(ids) - 2, 0)
    return None


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(choices[best], {"normalized_prompt_logprobs": normalized_prompt_logprobs,
                                               "input_token_logprobs": input_token_logprobs,
                                               "output_token_logprobs": output_token_logprobs})


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token (shorter ones padded with their own mean) and keep those at each column's
    maximum (within 1e-4) until one is left; ties go to the first."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        rows = [[lp for lp, _, _ in toks if lp is not None] for toks in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [sum(r) / len(r) if r else 0.0] * (width - len(r)) for r in rows]
        alive = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in alive)
            # a tolerance, not float equality: batch composition moves logprobs by ~1e-6
            alive = [i for i in alive if matrix[i][col] >= top - 1e-4]
            if len(alive) == 1:
                break
        return ChoicesDecision(choices[alive[0]], {"normalized_prompt_logprobs": normalized_prompt_logprobs,
                                                   "input_token_logprobs": input_token_logprobs,
                                                   "output_token_logprobs": output_token_logprobs,
                                                   "greedy_logprob_matrix": matrix})


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain the most from the prompt: mean(logprob given prompt - logprob alone)."""

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            c = [lp for lp, _, _ in cond]
            u = [lp if lp is not None else 0.0 for lp, _, _ in uncond]
            n = min(len(c), len(u))
            diffs = [(c[-n + k] or 0.0) - u[-n + k] for k in range(n)]
            scores.append(sum(diffs) / max(1, len(diffs)))
        return ChoicesDecision(choices[_argmax(scores)], {
            "normalized_prompt_logprobs": normalized_prompt_logprobs, "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores})


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
