"""The embedded model's converted directory is a complete Hugging Face directory (other engines load it as it is:
vLLM needs config.json's architectures and a generation_config.json), and a directory converted by an older lmc
(format 1: `"architectures": null`, no generation config, no format marker) is completed in place on load."""
import json
import os
import shutil
from pathlib import Path

from transformers import AutoConfig, GenerationConfig

from lmc.runtime.model.loader import CONVERTED_FORMAT, resolve

from conftest import MODEL


def _assert_complete(path):
    assert AutoConfig.from_pretrained(path).architectures == ["LlamaForCausalLM"]
    gen = GenerationConfig.from_pretrained(path)
    assert (gen.bos_token_id, gen.eos_token_id) == (1, 2)
    assert json.loads((path / "lmc_source.json").read_text())["format"] == CONVERTED_FORMAT


def test_converted_directory_is_complete():
    _assert_complete(Path(resolve(MODEL).tokenizer_dir))


def test_old_conversion_is_completed_in_place(tmp_path, monkeypatch):
    src = Path(resolve(MODEL).tokenizer_dir)
    old = tmp_path / "models" / src.name
    old.mkdir(parents=True)
    for f in src.iterdir():  # weights hard-linked (or copied across devices): the repair never rewrites them
        if f.name.endswith(".safetensors"):
            try:
                os.link(f, old / f.name)
            except OSError:
                shutil.copy(f, old / f.name)
        elif f.name != "generation_config.json":
            shutil.copy(f, old / f.name)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "architectures": None}))
    (old / "lmc_source.json").write_text(json.dumps({"gguf": "x.gguf"}))  # format 1 had no marker
    monkeypatch.setenv("LMC_CACHE_DIR", str(tmp_path))
    assert Path(resolve(MODEL).tokenizer_dir) == old
    _assert_complete(old)
    assert json.loads((old / "lmc_source.json").read_text())["gguf"] == "x.gguf"


def test_dummy_shape_with_a_borrowed_tokenizer():
    """dummy:<shape>@<model>: the shape's layers with the model's tokenizer, vocabulary and bos/eos ids (what the
    suite runs on a GPU: dummy:llama-2-7b@smollm2-135m-instruct)."""
    src = resolve(f"dummy:llama-2-7b@{MODEL}")
    assert src.weights is None and src.tokenizer_dir == resolve(MODEL).tokenizer_dir
    cfg = src.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (4096, 32, 49152)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert resolve(f"dummy:tiny@{src.tokenizer_dir}").hf_config.vocab_size == 49152  # a tokenizer directory too


def test_dummy_shape_of_the_embedded_model():
    """dummy:smollm2-135m is the embedded model's shape: built as ModelConfig, the two are the same model."""
    from lmc.runtime.model.llama import ModelConfig

    dummy = ModelConfig.from_hf(resolve(f"dummy:smollm2-135m@{MODEL}").hf_config)
    real = ModelConfig.from_hf(resolve(MODEL).hf_config)
    assert dummy == real
