"""The torch.compile'd forward (lmc/runtime/compiled.py) against the eager one, at a tiny shape (compiling the
embedded model costs minutes on CI's 2 cores): same greedy tokens, logprobs within 1e-4, prompt logprobs too."""
import pytest
import torch

from lmc.runtime import Engine
from lmc.runtime.model.linear import Linear


@torch.no_grad()
def spread_weights(eng: Engine) -> None:
    """dummy:tiny's own weights are uniform(+-1e-3): near-uniform logits, where greedy would be a coin toss. The
    compiled graph takes parameters as inputs (nothing is frozen into it), so new values in place are seen."""
    g = torch.Generator().manual_seed(0)
    model = eng.runner.model
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.05 if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape, generator=g))
    # Prepacked linears hold no dense parameter (linear.py): new values go through set_weight, the tied lm-head's
    # from the embedding it shares.
    for m in model.modules():
        if isinstance(m, Linear) and m.packed is not None:
            tied = m is model.lm_head and model.cfg.tie_word_embeddings
            m.set_weight(model.embed_tokens.weight if tied else torch.randn(m.out_features, m.in_features,
                                                                             generator=g) * 0.05)


def test_compiled_forward_matches_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    prompts = [[1, 5, 9, 33, 7], [3, 3, 3], [100, 200, 300, 400, 17, 18, 19, 20, 21], [42]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    results = {}
    for compiled in (False, True):
        eng = Engine("dummy:tiny", max_total_tokens=1024, enable_torch_compile=compiled)
        try:
            if compiled:
                assert eng.runner.step_model.failed is None, eng.runner.step_model.failed
            spread_weights(eng)
            results[compiled] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                             logprob_start_len=0)
            if compiled:  # the requests ran through the compiled graphs, not a silent eager fallback
                assert eng.runner.step_model.failed is None, eng.runner.step_model.failed
        finally:
            eng.shutdown()
    for eager, comp in zip(results[False], results[True]):
        assert comp["output_ids"] == eager["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            got = [lp for lp, _, _ in comp["meta_info"][key] if lp is not None]
            want = [lp for lp, _, _ in eager["meta_info"][key] if lp is not None]
            assert got == pytest.approx(want, abs=1e-4)
