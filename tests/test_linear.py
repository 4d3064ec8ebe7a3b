"""The model's Linear (lmc/runtime/model/linear.py): prepacked on the CPU in fp32 (panels for the C++ GEMM where it
is built, oneDNN's layout else), F.linear elsewhere."""
import pytest
import torch
import torch.nn.functional as F

from lmc.runtime.model import linear
from lmc.runtime.model.linear import Linear, prepack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


@pytest.fixture(params=["panels", "onednn"])
def layout(request, monkeypatch):
    """Each test under both packed layouts: oneDNN's by hiding the panel GEMM."""
    if request.param == "onednn":
        monkeypatch.setattr(linear, "_panel_ops", lambda: None)
    elif linear._panel_ops() is None:
        pytest.skip("no panel GEMM here (neither AVX-512 nor AVX2, or no C++ toolchain)")
    return request.param


def make(in_f: int, out_f: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_matches_dense_at_every_batch_size(bias, layout):
    lin = make(96, 170, bias)  # 170 outputs: a partial last panel
    w, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    assert lin.prepack() and lin.packed is not None
    assert lin.panels == (layout == "panels")
    assert lin.weight is None  # oneDNN's packed weight serves the large inputs the panels hand on
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 8, 16, 17, 100):  # groups of 8 rows (panels), a layout packed for 16 (oneDNN): all must work
        x = torch.randn(m, 96, generator=g)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 5, 96, generator=g)  # leading dimensions pass through
    torch.testing.assert_close(lin(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


def test_panels_at_prefill_sizes_match_dense(monkeypatch):
    """The panel GEMM's blocking (chunks of rows, blocks of 64 k-rows, a partial last panel) at a prefill's row
    count, with the large-input switch to oneDNN moved out of the way; then that switch itself."""
    if linear._panel_ops() is None:
        pytest.skip("no panel GEMM here (neither AVX-512 nor AVX2, or no C++ toolchain)")
    lin = make(200, 170, True)  # K = 200: k-blocks of 64 (AVX-512) or 128 (AVX2), the last partial
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.prepack()
    x = torch.randn(1500, 200, generator=torch.Generator().manual_seed(3))  # > one chunk of rows (40 groups of 8)
    monkeypatch.setattr(linear, "LARGE_ROWS", 10**9)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    small = lin(x[:13])
    torch.testing.assert_close(small, F.linear(x[:13], w, b), rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(linear, "LARGE_ROWS", 8)
    onednn = torch.ops.mkldnn._linear_pointwise(x[:13], lin.large, lin.bias, "none", [], "")
    calls = []
    real = linear._onednn_linear
    monkeypatch.setattr(linear, "_onednn_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    assert torch.equal(lin(x[:13]), onednn)  # at and past LARGE_ROWS: oneDNN on its packed weight
    assert calls == [13]  # (its output can equal the panels' bit for bit: the summation orders may coincide)


def test_set_weight_repacks(layout):
    lin = make(32, 48, False)
    lin.prepack()
    new = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    lin.set_weight(new)
    x = torch.randn(4, 32)
    torch.testing.assert_close(lin(x), F.linear(x, new), rtol=1e-5, atol=1e-4)


def test_only_cpu_fp32_is_prepacked():
    lin = make(32, 48, True).to(torch.bfloat16)
    assert not lin.prepack() and lin.weight is not None and lin.packed is None
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_tied_lm_head_is_the_embedding_and_packs_from_it(layout):
    from transformers import LlamaConfig

    from lmc.runtime.model.llama import LlamaForCausalLM, ModelConfig

    hf = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, vocab_size=50, tie_word_embeddings=True)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf))
    assert model.lm_head.weight is model.embed_tokens.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names  # one parameter, loaded once
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(50, 32))
    h = torch.randn(3, 32)
    want = F.linear(h, model.embed_tokens.weight)
    assert prepack_linears(model) == 5  # qkv, o, gate_up, down, lm-head
    assert model.embed_tokens.weight is not None  # the embedding keeps its table
    torch.testing.assert_close(model.lm_head(h), want, rtol=1e-5, atol=1e-4)


needs_bf16 = pytest.mark.skipif(not linear.bf16_supported(), reason="this CPU has neither AMX nor AVX-512 BF16")


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_matmuls_match_rounded_operands(bias, layout):
    """Packed in bf16 (Engine(dtype="bfloat16") on the CPU): x and W rounded to bf16, products summed in fp32, y
    rounded to bf16, the bias added in fp32: on bf16 panels below BF16_LARGE_ROWS rows (y widened to fp32), oneDNN's
    bf16 GEMM from there on and everywhere without panels (y left in bf16 for the next kernel unless there is a
    bias), the same y either way up to the summation order."""
    lin = make(96, 170, bias)
    w, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    assert lin.prepack(torch.bfloat16) and lin.weight is None
    assert lin.panels == (layout == "panels") and (lin.large is not None) == lin.panels
    assert lin.packed.dtype == torch.bfloat16 and "prepacked=" in repr(lin)
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 8, 9, linear.BF16_LARGE_ROWS - 1, linear.BF16_LARGE_ROWS, 100):
        x = torch.randn(m, 96, generator=g)
        y = lin(x)
        onednn = layout != "panels" or m >= linear.BF16_LARGE_ROWS
        assert y.dtype == (torch.bfloat16 if onednn and not bias else torch.float32)
        y = y.float()
        exact = F.linear(x.bfloat16().double(), w.bfloat16().double())  # the rounded operands' exact products
        want = exact.float().bfloat16().float()
        want = want if b is None else want + b
        torch.testing.assert_close(y, want, rtol=8e-3, atol=1e-2)  # one bf16 rounding step apart at most
        assert (y - F.linear(x, w, b)).abs().max() > 0  # it did run in bf16, not in fp32
    x3 = torch.randn(2, 5, 96, generator=g)  # leading dimensions pass through
    assert lin(x3).shape == (2, 5, 170)


@needs_bf16
def test_bf16_set_weight_repacks_in_bf16(layout):
    lin = make(32, 48, False)
    lin.prepack(torch.bfloat16)
    new = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    lin.set_weight(new)
    assert lin.packed.dtype == torch.bfloat16
    for m in (4, linear.BF16_LARGE_ROWS):
        x = torch.randn(m, 32)
        torch.testing.assert_close(lin(x).float(), F.linear(x, new), rtol=2e-2, atol=0.1)
