"""The torch.compile'd forward (lmc/runtime/compiled.py) against the eager one, at a tiny shape (compiling the
embedded model costs a minute on CI's 2 cores; benchmarks/start_bench.py measures its start times): same greedy
tokens, logprobs within 1e-4, prompt logprobs too; a second engine loads the saved layer instead of compiling."""
import pytest
import torch

from lmc.runtime import Engine
from lmc.runtime.compiled import unsupported
from lmc.runtime.model.linear import Linear

# The CPU's compiled forward (on a GPU, decode steps replay CUDA graphs instead), on a torch that can save it.
_WHY_NOT = unsupported()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=str(_WHY_NOT))


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


PROMPTS = [[1, 5, 9, 33, 7], [3, 3, 3], [100, 200, 300, 400, 17, 18, 19, 20, 21], [42]]


def run(compiled: bool) -> tuple[list, tuple[int, int] | None]:
    """The prompts' greedy outputs with logprobs, and for the compiled forward how many layer variants it
    compiled and how many it loaded from disk."""
    eng = Engine("dummy:tiny", device="cpu", max_total_tokens=1024, enable_torch_compile=compiled)
    try:
        if compiled:
            assert eng.runner.step_model.failed is None, eng.runner.step_model.failed
        spread_weights(eng)
        out = eng.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 8, "temperature": 0,
                                                               "ignore_eos": True},
                           return_logprob=True, logprob_start_len=0)
        if not compiled:
            return out, None
        fwd = eng.runner.step_model  # the requests ran through the compiled graphs, not a silent eager fallback
        assert fwd.failed is None, fwd.failed
        return out, (fwd.layers.compiled, fwd.layers.loaded)
    finally:
        eng.shutdown()


def assert_same(comp: list, eager: list) -> None:
    for e, c in zip(eager, comp):
        assert c["output_ids"] == e["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            got = [lp for lp, _, _ in c["meta_info"][key] if lp is not None]
            want = [lp for lp, _, _ in e["meta_info"][key] if lp is not None]
            assert got == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def inductor_dir(tmp_path_factory):
    """An inductor cache of this module's own (so the first compiled engine compiles), set while it runs."""
    path = tmp_path_factory.mktemp("inductor")
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    yield path
    mp.undo()


def test_compiled_forward_matches_eager_and_loads_from_disk(inductor_dir):
    eager, _ = run(False)
    first, counts = run(True)
    # One graph for layer 0 (no residual yet) and one for all the others, decode and prefill alike.
    assert counts == (2, 0)
    assert sorted(p.name for p in inductor_dir.glob("lmc_layers/*/*")) == ["first-0.pt2", "rest-0.pt2"]
    assert_same(first, eager)
    second, counts = run(True)  # a later start: the saved layers, no compilation
    assert counts == (0, 2)
    assert_same(second, eager)


def test_layer_with_changed_source_is_not_loaded(inductor_dir, monkeypatch):
    """A saved layer is loaded only while the modules dynamo traced into have the source they had when it was
    compiled (the layers saved by the test above)."""
    from lmc.runtime import compiled

    if not list(inductor_dir.glob("lmc_layers/*")):  # run alone
        run(True)
    [directory] = inductor_dir.glob("lmc_layers/*")
    assert len(compiled._LayerVariants(directory)._load("rest")) == 1
    real = compiled.inspect.getsource
    monkeypatch.setattr(compiled.inspect, "getsource",
                        lambda m: real(m) + "# edited\n" if m.__name__ == "lmc.runtime.model.llama" else real(m))
    assert compiled._LayerVariants(directory)._load("rest") == []
