"""The model forward through torch.compile (inductor, dynamic shapes), precompiled once and loaded from disk after.

What is compiled: the decoder layer (regional compilation), once for all layers. Its parameters are graph inputs,
so the one graph serves every layer, and a start traces one layer instead of the model. Attention runs inside the
layer's graph as the custom op `lmc::attend` (opaque to inductor), which calls the eager `llama.attend` with the
batch the forward is running (a thread-local set around each forward, as vLLM's forward context): the layer has
no graph break, so it can be captured whole with `torch.compile(...).aot_compile` and saved with its guards, its
dynamo bytecode and inductor's code (`AOTCompiledFunction.save_compiled_function`, under
`$TORCHINDUCTOR_CACHE_DIR/lmc_layers`). A later start loads that (`torch.compiler.load_compiled_function`) and runs
no dynamo at all; inductor's own caches (default `$LMC_CACHE_DIR/inductor`) keep the kernels' shared objects.
The token count is an unbacked dynamic size, so one graph serves decode (1 token or many) and prefill alike.

Around the layers (embedding, RoPE gather, the final norm and the lm-head) the model runs eagerly: a few ops.

A saved layer is used only if its guards pass for the call (shapes, dtypes, constants) and the source of every
module dynamo traced into is unchanged since it was saved; otherwise the layer is compiled again and the file
replaced. Compilation failing (no C++ compiler, an unsupported op, a graph break as on the GPU, where the Triton
launches stay outside graphs) never fails a request: the forward warns once and runs eagerly from then on.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .model.llama import DecoderLayer

_batch = threading.local()  # .ctx: the ForwardBatch whose forward runs on this thread (lmc::attend reads it)
_eager_attend = None  # llama.attend as defined, before register_attend_op() replaced it


def enable_disk_cache() -> str:
    """Point inductor's caches (FX graph cache, autotuning, compiled kernels) into the lmc cache dir unless the
    user chose a place already (TORCHINDUCTOR_CACHE_DIR)."""
    from .model.loader import cache_dir

    path = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.makedirs(path, exist_ok=True)
    return path


def register_attend_op() -> None:
    """Define `lmc::attend(q, k, v, layer_id)` and route llama.attend through it while dynamo traces (eager
    calls keep the plain function). Once per process.

    The op declares no mutation although it writes the batch's K/V into the pool: the pool is not a graph input
    (the op reaches it through the batch), and inside a layer the write is ordered by the data flow q, k, v ->
    attend -> output, which is all a graph could reorder."""
    global _eager_attend
    if _eager_attend is not None:
        return
    from .model import llama

    eager = llama.attend

    @torch.library.custom_op("lmc::attend", mutates_args=())
    def attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return eager(q, k, v, layer_id, _batch.ctx)

    @attend_op.register_fake
    def _(q, k, v, layer_id):
        return q.new_empty(q.shape)

    def attend(q, k, v, layer_id, ctx):
        if torch.compiler.is_compiling():
            return attend_op(q, k, v, layer_id)
        return eager(q, k, v, layer_id, ctx)

    attend.__doc__ = eager.__doc__
    llama.attend, _eager_attend = attend, eager


def _artifact_dir(model: torch.nn.Module) -> Path:
    """Where this model's compiled layers live: next to the inductor code they run, one directory per torch build
    and layer shape (the guards check the rest)."""
    layer = model.layers[0]
    shapes = sorted((n, tuple(t.shape), str(t.dtype)) for n, t in
                    [*layer.named_parameters(), *((n, b) for n, b in _tensor_attrs(layer))])
    key = hashlib.sha256(repr((torch.__version__, shapes)).encode()).hexdigest()[:16]
    return Path(enable_disk_cache()) / "lmc_layers" / key


def _tensor_attrs(module: torch.nn.Module):
    """Tensors held as plain attributes (the prepacked linears' weights), which named_parameters does not list."""
    for name, m in module.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                yield f"{name}.{attr}", value


def _sources_unchanged(fn) -> bool:
    """Whether every module dynamo traced into when `fn` was compiled still has the source it had then."""
    for src in fn.source_info().inlined_sources:
        try:
            if inspect.getsource(importlib.import_module(src.module)) != src.content:
                return False
        except (ImportError, OSError, TypeError):
            return False
    return True


@dataclass
class _RopeTables:
    """What of the ForwardBatch a decoder layer reads inside its graph: the RoPE tables (the attention op reads
    the rest from the thread's batch)."""
    cos: torch.Tensor
    sin: torch.Tensor


def _decoder_layer(layer, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
    """DecoderLayer.forward with tensors only as inputs: the batch object (backends, pool) is no graph input
    and so is not in the saved guards."""
    for t in (cos, sin, *(() if residual is None else (residual,))):  # one token count (each is unbacked)
        torch._check(t.shape[0] == h.shape[0])
    return DecoderLayer.forward(layer, h, residual, _RopeTables(cos, sin))


def _guard_filter(entries) -> list[bool]:
    """The guards saved with a layer: none on globals (modules, functions: the source check covers them) and none
    on the packed weights, whose oneDNN tensors cannot be pickled (their shapes are in the artifact's key)."""
    return [not e.is_global and not e.name.endswith(".packed") for e in entries]


# Inductor's kernels here are the elementwise work between the GEMMs (oneDNN, threaded on its own) and attention:
# at decode sizes a parallel region costs more than it saves, and each of its barriers can wait a whole scheduler
# slice for the other thread on a busy machine, so they run on one thread.
_OPTIONS = {"guard_filter_fn": _guard_filter, "cpp.threads": 1}


class _LayerVariants:
    """The decoder layer's compiled variants (layer 0, whose `residual` is None, and the rest; more if a guard
    fails for a shape), each saved as `<dir>/<variant>-<i>.pt2`. `loaded` and `compiled` count where they came
    from in this process."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.fns: dict[str, list] = {}
        self.loaded = self.compiled = 0

    def _load(self, variant: str) -> list:
        fns = []
        for path in sorted(self.dir.glob(f"{variant}-*.pt2")):
            try:
                with open(path, "rb") as f:
                    fn = torch.compiler.load_compiled_function(f, f_globals=globals())  # _decoder_layer's
            except Exception as e:  # written by another torch, truncated: compile again and overwrite it
                warnings.warn(f"not using the compiled layer {path} ({type(e).__name__}: {e}); compiling it again",
                              RuntimeWarning, stacklevel=2)
                break
            if not _sources_unchanged(fn):
                break
            fn.disable_guard_check()  # __call__ checks them, once
            fns.append(fn)
        self.loaded += len(fns)
        return fns

    def __call__(self, layer, h, residual, ctx):
        variant = "first" if residual is None else "rest"
        fns = self.fns.get(variant)
        if fns is None:
            fns = self.fns[variant] = self._load(variant)
        args = (layer, h, residual, ctx.cos, ctx.sin)
        for fn in fns:
            if fn.guard_check(*args):
                return fn(*args)
        # The saved guards pickle the layer's state: without the dispatching forward (a closure over all of this).
        dispatch = layer.__dict__.pop("forward")
        for t in args[1:]:  # the token count, unbacked: no 0/1 specialization, so 1 token shares the graph
            if t is not None:
                torch._dynamo.decorators.mark_unbacked(t, 0)
        try:
            fn = torch.compile(_decoder_layer, fullgraph=True,
                               options=dict(_OPTIONS)).aot_compile((args, {}))  # (it pops from it)
        finally:
            layer.forward = dispatch
        self.dir.mkdir(parents=True, exist_ok=True)
        fn.save_compiled_function(str(self.dir / f"{variant}-{len(fns)}.pt2"))
        fn.disable_guard_check()
        fns.append(fn)
        self.compiled += 1
        return fn(*args)


def unsupported() -> str | None:
    """Why this torch cannot compile the layers as saved artifacts (None: it can). Saving needs
    `torch.compile(...).aot_compile`, which older torch releases lack (2.11 has none)."""
    if not hasattr(torch.compile(_decoder_layer), "aot_compile"):
        return f"torch {torch.__version__} has no torch.compile(...).aot_compile to save compiled layers with"
    return None


class CompiledForward:
    """Calls `model(input_ids, ctx)` with its decoder layers compiled (see the module docstring); on any
    compilation error, warns and runs eagerly."""

    def __init__(self, model: torch.nn.Module):
        from .model import linear

        self.model = model
        linear.register_compile_op()
        register_attend_op()
        # Each layer would otherwise get a graph of its own for its `layer_id` (an int attribute, static by
        # default): one graph must serve all layers.
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        self.layers = _LayerVariants(_artifact_dir(model))
        for layer in model.layers:  # an instance attribute: nn.Module.__call__ runs it instead of the class's
            layer.forward = self._layer_forward(layer)
        self.failed: str | None = None
        if (why := unsupported()) is not None:
            self._fall_back(why)

    def _layer_forward(self, layer):
        def forward(h, residual, ctx):
            return self.layers(layer, h, residual, ctx)
        return forward

    def _fall_back(self, why: str) -> None:
        """Run eagerly from now on, saying why once."""
        self.failed = why
        for layer in self.model.layers:
            layer.__dict__.pop("forward", None)
        warnings.warn(f"torch.compile of the model failed ({why[:500]}); running it eagerly", RuntimeWarning,
                      stacklevel=3)

    def __call__(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        if self.failed is None:
            _batch.ctx = ctx
            try:
                return self.model(input_ids, ctx)
            except Exception as e:  # compile-time or backend failure: keep serving, eagerly
                self._fall_back(f"{type(e).__name__}: {e}")
            finally:
                _batch.ctx = None
        return self.model(input_ids, ctx)
