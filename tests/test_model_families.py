"""Model sources and families: a HF directory, a GGUF file, Qwen2 (q/k/v bias), Mistral, Llama 3 RoPE scaling,
each against transformers on the same weights (tiny random models built here, fp32)."""
import pytest
import torch

from lmc.runtime import Engine
from lmc.runtime.model.loader import _embedded_gguf, resolve

IDS = [[5, 17, 300, 42, 9, 77, 123, 8, 250, 3, 61], [99, 4, 12]]


def tiny(model_type):
    from transformers import AutoConfig

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=320, max_position_embeddings=256, tie_word_embeddings=False)
    extra = {"llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           rope_theta=500000.0),
             "qwen2": dict(), "mistral": dict(head_dim=16)}[model_type]
    return AutoConfig.for_model(model_type, **common, **extra)


def prompt_logprobs(out):
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_family_matches_transformers(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny(model_type)).eval()
    if model_type == "qwen2":  # transformers initialises biases to zero: make them matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path)  # a plain HF directory: config.json + model.safetensors
    eng = Engine(str(tmp_path))
    try:
        assert eng.tokenizer is None
        out = eng.generate(input_ids=IDS, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=0)
        for ids, o in zip(IDS, out):
            with torch.no_grad():
                lp = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
            ref = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
            assert prompt_logprobs(o) == pytest.approx(ref, abs=1e-4)
        with pytest.raises(Exception, match="no tokenizer"):
            eng.generate("text needs a tokenizer", {"max_new_tokens": 1})
    finally:
        eng.shutdown()


def test_gguf_file_path_loads_the_embedded_model(engine):
    gguf = _embedded_gguf("smollm2-135m-instruct")
    src = resolve(str(gguf))
    assert src.tokenizer_dir == resolve("smollm2-135m-instruct").tokenizer_dir  # converted once, shared
    eng = Engine(str(gguf))
    try:
        p = {"max_new_tokens": 6, "temperature": 0}
        assert eng.generate("The capital of France is", p)["text"] == engine.generate("The capital of France is", p)["text"]
    finally:
        eng.shutdown()


def test_dummy_shapes_are_reproducible():
    a, b = Engine("dummy:tiny", seed=3), Engine("dummy:tiny", seed=3)
    try:
        pa = dict(a.runner.model.named_parameters())
        for name, p in b.runner.model.named_parameters():
            assert torch.equal(p, pa[name])
            assert p.abs().max() <= 1e-3
        out = a.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert len(out["output_ids"]) == 3
    finally:
        a.shutdown()
        b.shutdown()
