"""A GGUF's Q4_1 / Q8_0 linears run from their blocks on the CPU (lmc/runtime/model/gguf_blocks.py, the block
panels of attention/cpu_kernel.py): the same outputs as the fp32 panels of the dequantized weights, bit for bit.
And the CPU engine's torch work: its OpenMP regions on the process's one device thread (runner.py)."""
import dataclasses
import logging

import numpy as np
import pytest
import torch

from conftest import MODEL
from lmc.runtime.model import linear
from lmc.runtime.model.gguf_blocks import Blocks, checked_gguf_blocks, rope_row_order

pytestmark = pytest.mark.skipif(linear._panel_ops() is None,
                                reason="no panel GEMM here (neither AVX-512 nor AVX2, or no C++ toolchain)")


def blocks(n: int, k: int, bits: int, seed: int) -> Blocks:
    """Random blocks as a GGUF holds them: fp16 scales (and Q4_1's fp16 mins), 4-bit or int8 codes."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        mins = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).view(torch.uint8)
        mins = torch.zeros(n, k // 32)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    return Blocks(codes, scales, mins, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 17, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_block_panels_give_the_fp32_panels_result_on_the_dequantized_weight(bits, rows, bias):
    """Up to the fused row count each weight is dequantized in registers, above it into a scratch per k-block; either
    way y is the fp32 panels' y on the dequantized weight to the bit (170 outputs: a partial last panel; K = 192:
    several quantization blocks and a partial k-block)."""
    ops = linear._panel_ops()
    b = blocks(170, 192, bits, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, 192, generator=g)
    bvec = torch.randn(170, generator=g) if bias else None
    got = ops.block_panel_linear(x, ops.pack_block_panels(b.codes, b.scales, b.mins, bits), 170, bits, bvec)
    want = ops.panel_linear(x, ops.pack_panels(b.dequantize()), 170, bvec)
    assert torch.equal(got, want)


def test_dequantize_is_gguf_pys():
    """Blocks.dequantize (what a layer's blocks are checked against) is gguf-py's dequantization of the same bytes."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    for kind, nbytes in ((gguf.GGMLQuantizationType.Q4_1, 20), (gguf.GGMLQuantizationType.Q8_0, 34)):
        raw = rng.integers(0, 256, size=(6, 3 * nbytes), dtype=np.uint8)
        scales = rng.standard_normal((6, 3, 2 if kind == gguf.GGMLQuantizationType.Q4_1 else 1)).astype(np.float16)
        raw.reshape(6, 3, nbytes)[..., :scales.shape[-1] * 2] = scales.view(np.uint8).reshape(6, 3, -1)
        from lmc.runtime.model.gguf_blocks import read_blocks

        ours = read_blocks(raw, int(kind)).dequantize()
        theirs = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
        assert torch.equal(ours, theirs)


def test_bad_blocks_are_refused_by_name():
    ops = linear._panel_ops()
    b = blocks(48, 64, 4, seed=0)
    with pytest.raises(RuntimeError, match="bits must be 4"):
        ops.pack_block_panels(b.codes, b.scales, b.mins, 5)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        ops.pack_block_panels(b.codes[:, :40], b.scales, b.mins, 4)
    packed = ops.pack_block_panels(b.codes, b.scales, b.mins, 4)
    with pytest.raises(RuntimeError, match="not an \\[N, K\\] weight's"):
        ops.block_panel_linear(torch.randn(1, 96), packed, 48, 4, None)


@pytest.mark.parametrize("heads", [9, 3])
def test_rope_row_order_is_transformers_reverse_permutation(heads):
    """The q / k rows of a llama GGUF in transformers' order, as transformers' GGUF loader reorders them."""
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc = mod.LlamaTensorProcessor()
    n = heads * 64
    assert np.array_equal(rope_row_order(n, heads), proc._reverse_permute_weights(np.arange(n), heads, heads))


@pytest.fixture(scope="module")
def cpu_engine(engine):
    """The session engine where it runs on the CPU (CI); on a GPU machine a CPU engine of its own: blocks are the
    CPU's."""
    if engine.device.type == "cpu":
        yield engine
        return
    from lmc.runtime import Engine

    eng = Engine(MODEL, device="cpu", dtype="float32", check_invariants=True)
    yield eng
    eng.shutdown()


def test_the_embedded_model_runs_every_linear_from_its_blocks(cpu_engine):
    """SmolLM2's 30 layers' four linears from Q4_1 blocks, its tied lm-head from the Q8_0 embedding table: each
    layer took its blocks only after they dequantized to its loaded weight exactly."""
    model = cpu_engine.runner.model
    assert cpu_engine.runner.gguf_block_linears == 4 * model.cfg.num_layers + 1
    assert model.layers[0].mlp.down_proj.block_bits == 4 and model.lm_head.block_bits == 8


def test_outputs_are_the_fp32_panels_outputs(cpu_engine):
    """Greedy tokens and their logprobs, at decode and prefill row counts: identical with blocks and without."""
    from lmc.runtime import Engine

    dense = Engine(MODEL, device="cpu", gguf_blocks=False, max_total_tokens=4096)
    try:
        assert dense.runner.gguf_block_linears == 0
        prompts = ["The capital of France is", "List three colors:" * 12, "1, 2, 3,"]
        params = {"max_new_tokens": 12, "temperature": 0}
        got, want = ([eng.generate(p, params, return_logprob=True, logprob_start_len=0) for p in prompts]
                     for eng in (cpu_engine, dense))
        for a, b in zip(got, want):
            assert a["output_ids"] == b["output_ids"]
            assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
            assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]
    finally:
        dense.shutdown()


def test_blocks_that_are_not_the_weight_are_not_taken(caplog):
    """Another model of the same shape: no layer takes the file's blocks (each warns) and its panels stay fp32."""
    from lmc.runtime.model.llama import LlamaForCausalLM, ModelConfig
    from lmc.runtime.model.loader import resolve

    src = resolve(MODEL)
    cfg = dataclasses.replace(ModelConfig.from_hf(src.hf_config), num_layers=2)  # (the file's first two layers)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="lmc.runtime.model.gguf_blocks"):
        assert checked_gguf_blocks(model, src.gguf) == {}
    assert sum("keeps fp32 panels" in r.message for r in caplog.records) == 4 * 2 + 1


def test_the_scheduler_thread_runs_torch_serially_and_the_device_thread_keeps_its_threads():
    """The engine's OpenMP regions start on the process's CPU device thread only: libgomp, seeing more threads with
    teams than cores, would cut its spin-wait short and wake a thread through the kernel in each of a decode step's
    ~120 small parallel regions (the embedded model's linears took 8.0 ms a step instead of 3.6). Run at two threads
    (under xdist each worker has one, where no team forms either way)."""
    from lmc.runtime import Engine
    from lmc.runtime.runner import _cpu_device

    before = torch.get_num_threads()
    device_before = _cpu_device().submit(torch.get_num_threads).result()
    torch.set_num_threads(2)  # the default count of threads yet to run a torch op: the scheduler thread's
    eng = Engine("dummy:tiny", device="cpu", max_total_tokens=512)
    try:
        seen = []
        step = eng.scheduler.step

        def probe(*a, **k):
            seen.append(torch.get_num_threads())
            return step(*a, **k)

        eng.scheduler.step = probe
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert seen and set(seen) == {1}
        assert eng.runner.run_on_device(torch.get_num_threads) == device_before
        assert torch.get_num_threads() == 2  # the caller's own count is left alone
    finally:
        eng.shutdown()
        torch.set_num_threads(before)


def test_the_blocks_are_cached_and_read_back_the_same(tmp_path, monkeypatch):
    """The first read parses the GGUF and writes the blocks under the lmc cache dir; the next reads them back."""
    from lmc.runtime.model.gguf_blocks import gguf_linear_blocks
    from lmc.runtime.model.llama import LlamaForCausalLM, ModelConfig
    from lmc.runtime.model.loader import resolve

    src = resolve(MODEL)
    with torch.device("meta"):
        model = LlamaForCausalLM(dataclasses.replace(ModelConfig.from_hf(src.hf_config), num_layers=2))
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    first = gguf_linear_blocks(src.gguf, model)
    assert len(list((tmp_path / "gguf_blocks").glob("*.safetensors"))) == 1
    again = gguf_linear_blocks(src.gguf, model)
    assert sorted(first) == sorted(again) and len(first) == 4 * 2 + 1
    for name, b in first.items():
        c = again[name]
        assert b.bits == c.bits and all(torch.equal(getattr(b, f), getattr(c, f)) for f in ("codes", "scales", "mins"))
