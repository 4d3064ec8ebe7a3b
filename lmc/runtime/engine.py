"""Engine: the in-process runtime. Any number of threads or asyncio tasks submit requests; one scheduler thread
batches everything in flight (continuous batching) and resolves each request's future when it finishes.

    engine = Engine()                                   # the embedded SmolLM2-135M-Instruct
    engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    engine.generate(["a", "b"], [{"max_new_tokens": 4}, {"max_new_tokens": 2}])
    await engine.async_generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 0}, return_logprob=True)
    fut = engine.submit("Tell a long story", {"max_new_tokens": 4000}); engine.abort(fut.rid)

A request ends early with finish reason {"type": "abort", ...} when it is aborted: `abort(rid)`, closing its stream
before the end, or cancelling the `async_generate` awaiting it.

Isolation: every field of a request is validated in the caller's thread (RequestError naming the field), so nothing
a request carries reaches the scheduler thread unchecked. Should a step still raise, the scheduler singles out the
requests it fails for (scheduler/scheduler.py: bisection of the batch); they alone fail, with EngineError, and the failure is
logged with their ids. The prefix cache survives; only an error that leaves the KV memory untrusted (in scheduling
itself, or a device fault) rebuilds it, dropping the requests that held KV (queued ones carry on).
`shutdown()` releases the engine's memory (KV buffers, CUDA graphs, weights), so another Engine fits after it.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import operator
import os
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Iterator, Sequence

import torch

from . import continuation
from .continuation import ChainStep
from .core import EngineError, Req, RequestError, SamplingParams
from .grammar import GrammarCache
from .host_memory import keep_freed_memory
from .model.linear import bf16_supported
from .model.loader import resolve
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .scheduler.config import CHAIN_BATCH_STEPS

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never wait on a hub: a missing file fails fast

_CPU_DEFAULT_TOKENS = 65536
log = logging.getLogger(__name__)


class RequestFuture(Future):
    """The future of one submitted request. It cannot be cancelled (the scheduler owns the request once it is
    submitted); `Engine.abort(fut.rid)` stops it instead."""

    rid: str | None = None  # the request's id, as in its result's meta_info["id"]; None when it was refused


class Engine:
    def __init__(self, model: str = "smollm2-135m-instruct", *, device: str = "auto", dtype: str = "auto",
                 attention_backend: str = "auto", max_total_tokens: int | None = None,
                 max_running_requests: int = 256, max_prefill_tokens: int = 16384,
                 chunked_prefill_size: int | None = None, schedule_policy: str = "program",
                 disable_radix_cache: bool = False, context_length: int | None = None,
                 mem_fraction_static: float = 0.85, seed: int = 0, check_invariants: bool = False,
                 cuda_graph_max_bs: int = 256, weights=None, enable_jump_forward: bool = True,
                 max_top_logprobs: int = 20, start: bool = True, enable_torch_compile: bool = False,
                 tensor_parallel_size: int = 1, overlap_schedule: bool | None = None,
                 enable_continuation: bool = True, busy_prefill_tokens: int | None = None,
                 gguf_blocks: bool = True):
        """`weights`: optional callable returning (name, tensor) pairs in transformers' naming, loaded instead of
        the model's own (used to put one set of weights into lmc and a reference model).
        `dtype`: "auto" is bf16 on CUDA, fp32 on the CPU. "bfloat16" on a CPU with AMX or AVX-512 BF16 runs the
        linears in bf16 (oneDNN) and keeps norms, attention and the KV cache in fp32 (model/linear.py).
        `max_top_logprobs`: the largest `top_logprobs_num` a request may ask for (OpenAI's limit is 20).
        `schedule_policy`: the admission order, a name in scheduler.POLICIES; `program` (the default) orders by
        the plan's remaining work where requests carry program hints and keeps KV by next use, and orders as `lpm`
        where none do.
        `busy_prefill_tokens`: forward shaping for completion time under load (SchedulerConfig; off by default:
        it costs throughput on batches submitted at once).
        `start`: start the scheduler thread; False leaves `engine.scheduler.step()` to the caller (tests that
        drive the scheduler one step at a time).
        `enable_jump_forward`: append the strings a request's grammar forces without sampling them (constrained
        requests only; see jump_forward.py). Off, every token is sampled: the comparison baseline.
        `enable_torch_compile`: compile the model forward with torch.compile at start-up, cached on disk under
        the lmc cache dir (runtime/compiled.py); eager, with a warning, where compilation fails.
        `tensor_parallel_size`: shard the model over this many ranks (runtime/distributed): this process is rank 0
        and runs the scheduler, one worker process per other rank (GPUs cuda:0.., or all on the CPU).
        `check_invariants`: check slot accounting after every step, and that every jump leaves the output ids
        the tokenizer's canonical encoding of the output text (tests).
        `overlap_schedule`: process each step's output while the next step runs on the device (scheduler/). None:
        on where it pays, i.e. on CUDA; on the CPU the forward already uses every core, and the host's share of
        a step is too small to gain from it (benchmarks/overlap_bench.py; decode at batch 1, 4 and 16 within noise
        of it off). Outputs are the same either way.
        `enable_continuation`: whether program backends (lmc.Local) run a chain of calls as one request
        (`submit_chain`, runtime/continuation.py); off, they make one request per call. Outputs are the same.
        `gguf_blocks`: a model loaded from a GGUF (the embedded one) runs its Q4_1 and Q8_0 linears on the CPU from
        the file's blocks (model/gguf_blocks.py): a decode step reads ~96 MB instead of 540 (SmolLM2-135M). Off,
        from fp32 panels. Outputs are the same."""
        if busy_prefill_tokens is not None and (not isinstance(busy_prefill_tokens, int) or busy_prefill_tokens < 1):
            # (0 would never prefill while anything decodes)
            raise ValueError(f"busy_prefill_tokens must be a positive int or None, got {busy_prefill_tokens!r}")
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        dtypes = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32, "float32": torch.float32,
                  "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in dtypes:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {tuple(dtypes)}")
        dt = dtypes[dtype]
        # bf16 on the CPU: the linears in bf16 (oneDNN: AMX, AVX-512 BF16), the rest fp32 (model/linear.py); a CPU
        # without native bf16 runs the whole model in bf16 instead
        matmul_dt = None
        if dev.type == "cpu" and dt == torch.bfloat16 and bf16_supported():
            matmul_dt, dt = dt, torch.float32
        if dev.type == "cpu":
            keep_freed_memory()  # activations' memory reused across forwards, not page-faulted in each time
        src = resolve(model)
        self.model_name = src.name
        self.tokenizer = None
        if src.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(src.tokenizer_dir)
        hf = src.hf_config
        ctx = min(context_length or hf.max_position_embeddings, hf.max_position_embeddings)
        if max_total_tokens is None:
            max_total_tokens = _CPU_DEFAULT_TOKENS if dev.type == "cpu" else None
        self.overlap_schedule = dev.type == "cuda" if overlap_schedule is None else bool(overlap_schedule)
        blocks = src.gguf if gguf_blocks and weights is None and dev.type == "cpu" and matmul_dt is None else None
        self.runner = _make_runner(src, weights, dev, tensor_parallel_size, blocks, dict(
            dtype=dt, matmul_dtype=matmul_dt, attention=attention_backend, max_total_tokens=max_total_tokens or 0,
            max_running=max_running_requests, context_length=ctx, seed=seed, mem_fraction=mem_fraction_static,
            cuda_graph_max_bs=cuda_graph_max_bs, enable_torch_compile=enable_torch_compile))
        self.context_length = ctx
        self.device = dev
        self.vocab_size = self.runner.cfg.vocab_size
        self.max_top_logprobs = max_top_logprobs
        self.grammars = GrammarCache(self.tokenizer, self.runner.cfg.vocab_size, self.runner.cfg.eos_token_ids)
        self.max_total_tokens = self.runner.num_slots
        chunk = chunked_prefill_size or (8192 if dev.type == "cuda" else 4096)
        self.scheduler = Scheduler(
            self.runner, SchedulerConfig(policy=schedule_policy, max_running=max_running_requests,
                                         max_prefill_tokens=max_prefill_tokens, chunked_prefill_size=chunk,
                                         busy_prefill_tokens=busy_prefill_tokens,
                                         chain_batch_steps=CHAIN_BATCH_STEPS if self.runner.graphs is not None else 0),
            disable_radix_cache=disable_radix_cache, tokenizer=self.tokenizer, seed=seed, grammars=self.grammars,
            enable_jump_forward=enable_jump_forward, debug_checks=check_invariants, overlap=self.overlap_schedule)
        self.check_invariants = check_invariants
        self.enable_continuation = enable_continuation
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Per event loop: inbox items submitted by its coroutines during the loop's current iteration, put in the
        # inbox as one at the iteration's end (`_hold`).
        self._held: dict[asyncio.AbstractEventLoop, list] = {}
        self._flushes: list[Future] = []
        self._futures: dict[Req, Future] = {}
        self.busy_seconds = 0.0
        self._lock = threading.Lock()  # orders submissions against shutdown: nothing is queued after "stop"
        self._closed = False
        self._failed_in_a_row = 0  # steps in a row that needed recover(): a second one fails the queue too
        self._publish_load()
        self._thread = threading.Thread(target=self._loop, name="lmc-scheduler", daemon=True)
        if start:
            self._thread.start()

    # ---- submission ----------------------------------------------------------------------------------------
    def make_request(self, prompt: str | None = None, sampling_params: dict | SamplingParams | None = None,
                     input_ids: Sequence[int] | None = None, program=None, **logprob_opts) -> Req:
        """Validate and tokenize in the caller's thread; raises RequestError naming the problem. `program`: the
        request's program hints (lmc.protocol.ProgramHints or its dict), kept on `Req.program`."""
        self._check_open()
        if self.runner.failure is not None:  # a tensor-parallel worker died: no forward can run
            raise EngineError(f"the engine cannot run requests: {self.runner.failure}; restart it")
        hints = _program_hints(program)
        limits = dict(vocab_size=self.vocab_size, max_top_logprobs=self.max_top_logprobs)
        if isinstance(sampling_params, SamplingParams):
            params = sampling_params.validate(**limits)
        else:
            if sampling_params is not None and not isinstance(sampling_params, dict):
                raise RequestError(f"sampling_params must be a dict, got {type(sampling_params).__name__}")
            params = SamplingParams.from_dict({**(sampling_params or {}), **{k: v for k, v in logprob_opts.items()
                                                                             if v is not None}}, **limits)
        if input_ids is None:
            if prompt is None:
                raise RequestError("a request needs a prompt (text) or input_ids")
            if not isinstance(prompt, str):
                raise RequestError(f"the prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise RequestError(f"model {self.model_name!r} has no tokenizer: pass input_ids")
            input_ids = self.tokenizer.encode(prompt)
        ids = _token_ids(input_ids)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"input_ids must be in [0, {vocab}): got {min(ids)}..{max(ids)}")
        if len(ids) >= self.context_length:
            raise RequestError(f"the prompt has {len(ids)} tokens but the model's context length is "
                               f"{self.context_length}; shorten it")
        if len(ids) >= self.max_total_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens but the KV cache holds {self.max_total_tokens}")
        req = Req(ids, params, program=hints)
        req.grammar = self.grammars.matcher(params)  # compiles here, off the scheduler thread (cached per grammar)
        return req

    def submit(self, prompt=None, sampling_params=None, input_ids=None, program=None,
               **logprob_opts) -> RequestFuture:
        fut = RequestFuture()
        try:
            req = self.make_request(prompt, sampling_params, input_ids, program, **logprob_opts)
        except RequestError as e:
            fut.set_exception(e)
            return fut
        self._enqueue(req, fut)
        return fut

    def submit_chain(self, steps: Sequence[ChainStep], program=None, on_segment=None, *,
                     loop: asyncio.AbstractEventLoop | None = None) -> RequestFuture:
        """Run a chain of calls (gens and selects, each after its constant text) as one request that keeps its KV
        from one call to the next (runtime/continuation.py). `program`: the hints of steps that carry none. `on_segment(segment)`: called, on the
        scheduler thread, with each step's result as it finishes. The future's result is the last call's, with
        every step's `segments` and `stopped_at` (the first step not run, or None). A malformed chain fails the
        future with RequestError naming the step. `loop`: the running event loop of an async caller (`_hold`)."""
        fut = RequestFuture()
        try:
            self._check_open()
            if self.tokenizer is None:
                raise RequestError(f"model {self.model_name!r} has no tokenizer: a chain is text")
            chain = continuation.make_chain(steps, self.vocab_size, dict(vocab_size=self.vocab_size,
                                            max_top_logprobs=self.max_top_logprobs), self.grammars, _program_hints)
            first = chain.steps[0]
            req = self.make_request(first.text, first.gen or {"max_new_tokens": 1},
                                    program=first.program if first.program is not None else program)
            continuation.start(req, self.scheduler.encoder, chain, min(self.context_length, self.max_total_tokens))
        except RequestError as e:
            fut.set_exception(e)
            return fut
        if chain.stopped_at == 0:  # its first call is a select the engine cannot score by ids: nothing runs
            fut.set_running_or_notify_cancel()
            fut.set_result({"text": "", "output_ids": [], "meta_info": {}, "segments": [], "stopped_at": 0})
            return fut
        req.on_progress = _Segments(on_segment) if on_segment is not None else None
        self._enqueue_batch([(req, fut)], loop)
        return fut

    async def async_chain(self, steps: Sequence[ChainStep], program=None):
        """`submit_chain` for asyncio: yields each step's result (a segment) as it finishes, then the final result
        (its `segments` and `stopped_at`). Cancelled or closed early, the request is aborted."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut = self.submit_chain(steps, program, lambda seg: loop.call_soon_threadsafe(q.put_nowait, seg), loop=loop)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(q.put_nowait, None))
        try:
            while (seg := await q.get()) is not None:
                yield seg
            yield await asyncio.wrap_future(fut)
        finally:
            if not fut.done():
                self.abort(fut.rid)

    def _enqueue(self, req: Req, fut: RequestFuture) -> None:
        self._enqueue_batch([(req, fut)])

    def _enqueue_batch(self, batch: list[tuple[Req, RequestFuture]], loop=None) -> None:
        """Queue requests as one inbox item: requests submitted together are admitted together (one prefill).
        `loop`: submitted by a coroutine on this running loop: held until the loop's iteration ends (`_hold`)."""
        with self._lock:
            self._check_open()
            for req, fut in batch:
                fut.rid = str(req.rid)
                fut.set_running_or_notify_cancel()  # from now on cancel() is refused: it could not be resolved
            if loop is None:
                self._inbox.put(("reqs", batch))
            else:
                self._hold(loop, ("reqs", batch))

    def _hold(self, loop: asyncio.AbstractEventLoop, item: tuple) -> None:
        """Put `item` in the inbox at the end of `loop`'s current iteration, with everything else its coroutines
        submit meanwhile, as ONE item (their requests in one list, an abort after them in order): the tasks an
        asyncio.gather or a plan's fork starts together (a fork's prefix and its branches' chains) run in one
        iteration, so the scheduler admits them together instead of starting a forward with the first alone.
        Call with `_lock` held."""
        held = self._held.get(loop)
        if held is None:
            held = self._held[loop] = []
            loop.call_soon(self._release, loop)
        if item[0] == "reqs" and held and held[-1][0] == "reqs":
            held[-1] = ("reqs", held[-1][1] + item[1])
        else:
            held.append(item)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            items = self._held.pop(loop, [])
            if self._closed:  # shut down meanwhile: nothing will run them
                for kind, payload in items:
                    for _, fut in payload if kind == "reqs" else ():
                        fut.set_exception(RuntimeError("the engine was shut down"))
                return
            for item in items:
                self._inbox.put(item)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine was shut down: it takes no more requests (create a new Engine)")

    def abort(self, rid: int | str) -> None:
        """Stop request `rid` (a future's `rid`, or its result's meta_info["id"]) wherever it is: queued, decoding
        or prefilling in chunks. It finishes at once with finish reason {"type": "abort", ...} and the output so
        far; its KV slots are released (the computed prefix stays in the prefix cache). Returns without waiting;
        an id that is unknown or already finished is ignored. From a coroutine whose loop still holds submissions
        (`_hold`), the abort goes after them."""
        with self._lock:
            loop = _running_loop()
            if loop is not None and loop in self._held:
                self._hold(loop, ("abort", rid))
                return
        self._inbox.put(("abort", rid))

    def _submit_all(self, prompt, sampling_params, input_ids, logprob_opts,
                    program=None, loop=None) -> tuple[list[Future], bool]:
        if input_ids is not None and (isinstance(input_ids, (str, bytes, Mapping))
                                      or not hasattr(input_ids, "__len__")):
            raise RequestError("input_ids must be a list of token ids, or a list of such lists")
        nested = input_ids is not None and len(input_ids) and isinstance(input_ids[0], (list, tuple))
        single = not (isinstance(prompt, list) or nested)
        items = [prompt] if single and input_ids is None else (prompt if input_ids is None else None)
        ids = [input_ids] if single and input_ids is not None else input_ids
        n = len(items) if items is not None else len(ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise RequestError(f"{n} prompts but {len(params)} sampling_params")
        futs, batch = [], []
        for i in range(n):
            fut = RequestFuture()
            try:
                req = self.make_request(items[i] if items is not None else None, params[i],
                                        ids[i] if ids is not None else None, program, **logprob_opts)
                batch.append((req, fut))
            except RequestError as e:
                fut.set_exception(e)
            futs.append(fut)
        self._enqueue_batch(batch, loop)
        return futs, single

    @staticmethod
    def _collect(results: list, single: bool):
        if single:
            if isinstance(results[0], BaseException):
                raise results[0]
            return results[0]
        return [r if not isinstance(r, BaseException) else
                {"text": "", "output_ids": [], "error": str(r),
                 "meta_info": {"finish_reason": {"type": "abort", "message": str(r)}}} for r in results]

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool | None = None,
                 logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                 token_ids_logprob: list[int] | None = None, program=None):
        """SGLang's Engine.generate: one prompt -> one result dict, a list -> a list. In a batch, a request that
        fails gets a result with `error` and an abort finish reason; the others are unaffected. `program`: the
        program hints of every request of the call (lmc.protocol.ProgramHints)."""
        opts = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob)
        futs, single = self._submit_all(prompt, sampling_params, input_ids, opts, program)
        results = []
        for f in futs:
            try:
                results.append(f.result())
            except Exception as e:
                results.append(e)
        return self._collect(results, single)

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=None,
                             logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None, program=None):
        opts = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                    top_logprobs_num=top_logprobs_num, token_ids_logprob=token_ids_logprob)
        futs, single = self._submit_all(prompt, sampling_params, input_ids, opts, program,
                                        asyncio.get_running_loop())
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs), return_exceptions=True)
        except asyncio.CancelledError:  # the caller gave up: stop decoding for nobody
            for f in futs:
                if not f.done():
                    self.abort(f.rid)
            raise
        return self._collect(list(results), single)

    def stream(self, prompt=None, sampling_params=None, input_ids=None, program=None,
               **logprob_opts) -> Iterator[dict]:
        """Stream one request: yields {"text": delta} chunks as tokens arrive; the last chunk also carries the
        whole result (`output_ids`, `meta_info`). Text that may still turn out to be part of a stop string is held
        back until it is decided. Closing the stream before its end aborts the request."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        fut = self._submit_streaming(prompt, sampling_params, input_ids, logprob_opts, chunks.put, program=program)
        try:
            while True:
                chunk = chunks.get()
                if chunk is None:
                    fut.result()  # raises the request's error, if any
                    return
                yield chunk
        finally:
            if not fut.done():  # the consumer stopped early
                self.abort(fut.rid)

    async def async_stream(self, prompt=None, sampling_params=None, input_ids=None, *, executor=None,
                           program=None, **logprob_opts):
        """`executor`: where validation, tokenization and grammar compilation run (a server's worker pool, so that
        they never block its event loop); by default in this thread. A RequestError is raised by the first
        `__anext__`."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        req = None
        if executor is not None:  # cancelled while it runs, the request is dropped unsubmitted
            req = await loop.run_in_executor(executor, lambda: self.make_request(
                prompt, sampling_params, input_ids, program, **logprob_opts))
        fut = self._submit_streaming(prompt, sampling_params, input_ids, logprob_opts,
                                     lambda c: loop.call_soon_threadsafe(chunks.put_nowait, c), req, program)
        try:
            while (chunk := await chunks.get()) is not None:
                yield chunk
            await asyncio.wrap_future(fut)
        finally:
            if not fut.done():  # closed or cancelled before the end
                self.abort(fut.rid)

    def _submit_streaming(self, prompt, sampling_params, input_ids, logprob_opts, push,
                          req: Req | None = None, program=None) -> RequestFuture:
        """Submit a streamed request (`req`, when already made by make_request). Its chunks also carry
        `completion_tokens` and `cached_tokens` so far (SGLang's streamed meta_info has both in every event)."""
        fut = RequestFuture()
        fut.add_done_callback(lambda f: push(None))
        try:
            req = req or self.make_request(prompt, sampling_params, input_ids, program, **logprob_opts)
        except RequestError as e:
            fut.set_exception(e)
            return fut

        def push_counted(chunk: dict) -> None:  # called on the scheduler thread, right after `req` advanced
            push({**chunk, "completion_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens})

        req.on_progress = _Deltas(self.tokenizer, req.params.stop or (), push_counted)
        self._enqueue(req, fut)
        return fut

    def flush_cache(self) -> bool:
        """Drop the prefix cache once the engine is idle. Returns True when done."""
        fut: Future = Future()
        with self._lock:
            self._check_open()
            self._inbox.put(("flush", fut))
        return fut.result()

    def shutdown(self) -> None:
        """Fail the requests in flight, stop the scheduler thread and release the engine's memory (KV buffers,
        CUDA graphs, weights), so that another Engine in this process sizes its KV pool from a free device.
        Submitting afterwards raises RuntimeError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join()
        self.runner.close()
        self.runner = self.scheduler = self.grammars = None
        gc.collect()  # the runner and its CUDA graphs reference each other
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, where the next pool is sized

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def stats(self) -> dict[str, Any]:
        """The scheduler's counters, with the queues and slots of the last published load: one snapshot, so a
        reader on another thread never sees the queues of one moment beside the slots of another (an abort empties
        `running` before the load that frees its slots is published)."""
        self._check_open()
        load = self._load
        return {**self.scheduler.stats, "busy_seconds": self.busy_seconds, "waiting": load["waiting_requests"],
                "running": load["running_requests"], "free_slots": load["free_slots"],
                "cached_slots": load["cached_slots"], "total_slots": self.max_total_tokens}

    def load(self) -> dict[str, Any]:
        """KV slots by owner and the queues, as the scheduler thread last published them (after every step and
        every change to its queues, before any result of it is delivered): free + cached (evictable + protected)
        + request-owned == total. A snapshot: readers on other threads never touch the scheduler."""
        return self._load

    # ---- scheduler thread ----------------------------------------------------------------------------------
    def _publish_load(self) -> None:
        sched = self.scheduler
        resident, waiting, cache = sched.resident(), list(sched.waiting), sched.cache
        self._load = {
            "total_slots": self.max_total_tokens, "free_slots": sched.allocator.available,
            "evictable_slots": cache.evictable_size, "protected_slots": cache.protected_size,
            "cached_slots": cache.evictable_size + cache.protected_size,
            "request_owned_slots": sum(max(0, r.kv_len - r.cache_protected_len) for r in resident if r.row >= 0),
            "resident_requests": len(resident), "running_requests": len(sched.running),
            "waiting_requests": len(waiting), "waiting_prompt_tokens": sum(len(r.input_ids) for r in waiting)}

    def _loop(self) -> None:
        self.runner.host_thread()
        sched = self.scheduler
        while True:
            try:
                item = self._inbox.get(block=not sched.has_work)
            except queue.Empty:
                item = None
            took = item is not None  # (the load is published after a step; again here only if the inbox changed it)
            while item is not None:
                kind, payload = item
                if kind == "stop":
                    self._fail_all(RuntimeError("the engine was shut down"))
                    return
                if kind == "reqs":
                    for req, fut in payload:
                        self._futures[req] = fut
                    try:
                        for req, _ in payload:
                            sched.add(req)  # a request it fails for fails alone (scheduler.add)
                    except Exception as e:  # a device fault
                        self._recover(e)
                elif kind == "abort":
                    try:
                        req = sched.abort(payload)
                        if self.check_invariants:
                            sched.check_invariants()
                    except Exception as e:  # as in a step: recover, never kill this thread
                        self._recover(e)
                        req = None
                    if req is not None:
                        self._publish_load()  # before the caller hears of it: it may read the load next
                        self._deliver(req)
                elif kind == "flush":
                    self._flushes.append(payload)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = None
            if took:
                self._publish_load()
            if sched.has_work:
                t0 = time.perf_counter()
                try:
                    progressed = sched.step()
                    if self.check_invariants or any(r.error for r in progressed):  # a fault in the step:
                        sched.check_invariants()  # prove the memory consistent before going on
                except Exception as e:  # nobody to blame (see scheduler/scheduler.py): rebuild memory, keep the queue
                    self._recover(e)
                    self._publish_load()
                    continue
                finally:
                    self.busy_seconds += time.perf_counter() - t0
                self._failed_in_a_row = 0
                self._publish_load()
                for r in progressed:
                    self._deliver(r)
                if not sched.has_work and self._futures:  # never leave a caller waiting on a lost request
                    self._fail_all(RuntimeError(f"{len(self._futures)} request(s) left the scheduler unfinished"))
            if not sched.has_work and self._flushes:
                ok = sched.flush_cache()
                self._publish_load()
                for f in self._flushes:
                    f.set_result(ok)
                self._flushes = []

    def _deliver(self, r: Req) -> None:
        """Hand a request's progress to its stream, and its result (or the error it failed with) to its future
        once finished."""
        if r.fork_parent is not None:  # a fork's branch (the engine's own): its progress goes to its parent's stream
            if r.on_progress is not None and r.error is None:
                try:
                    r.on_progress(r)
                except Exception as e:  # the parent's stream is broken: stop the parent (and its branches)
                    log.error("the stream of request %s failed; aborting it", r.fork_parent.rid, exc_info=e)
                    if self.scheduler.abort(r.fork_parent.rid) is not None:
                        self._deliver(r.fork_parent)
            return
        if r.parent is not None or r not in self._futures:  # a select's choice (the engine's own), or delivered
            return
        for child in (r.chain.children or ()) if r.chain is not None else ():
            self._deliver(child)  # a forked parent's branches first: their last progress precedes its result
        if r.error is not None:
            self._futures.pop(r).set_exception(EngineError(f"request {r.rid} failed in the engine: {r.error}"))
            return
        if r.on_progress is not None:
            try:
                r.on_progress(r)
            except Exception as e:  # its stream is broken (e.g. the consumer's event loop closed): stop it alone
                log.error("the stream of request %s failed; aborting it", r.rid, exc_info=e)
                if not r.finished:
                    self.scheduler.abort(r.rid)
                self._futures.pop(r).set_exception(EngineError(f"the stream of request {r.rid} failed: {e!r}"))
                return
        if r.finished:
            self._futures.pop(r).set_result(r.result())

    def _recover(self, exc: BaseException) -> None:
        """A step (or an abort) raised with no request to blame: the scheduler rebuilds its memory and keeps its
        queue; requests that held KV fail, finished ones are delivered. A second such failure in a row fails the
        queue too (a queued request may be the cause)."""
        self._failed_in_a_row += 1
        kept = None
        if self._failed_in_a_row == 1:
            try:
                kept = set(self.scheduler.recover())
            except Exception as e:
                log.error("rebuilding the KV memory failed", exc_info=e)
        if kept is None:
            log.error("the scheduler failed again; failing all %d requests in flight", len(self._futures),
                      exc_info=exc)
            self._fail_all(EngineError(f"the engine failed: {type(exc).__name__}: {exc}"))
            return
        lost = [r for r in self._futures if not r.finished and r not in kept]
        log.error("the scheduler failed outside any request's forward; KV memory rebuilt, %d request(s) dropped "
                  "(ids %s), %d kept queued", len(lost), [r.rid for r in lost], len(kept), exc_info=exc)
        for r in [r for r in self._futures if r.finished]:
            self._deliver(r)
        for r in lost:
            self._futures.pop(r).set_exception(EngineError(
                f"request {r.rid} was dropped: the engine failed ({type(exc).__name__}: {exc}) and rebuilt its "
                "KV memory"))

    def _fail_all(self, exc: BaseException) -> None:
        for req, fut in self._futures.items():
            fut.set_exception(exc)
        self._futures.clear()
        try:
            self.scheduler.reset()
        except Exception as e:  # the device is gone; the queues are empty, later requests fail in their steps
            log.error("rebuilding the KV memory failed", exc_info=e)


def _make_runner(src, weights, device: torch.device, tensor_parallel_size: int, gguf_blocks, kwargs: dict
                 ) -> ModelRunner:
    """The whole model in this process, or rank 0 of `tensor_parallel_size` ranks (runtime/distributed; their
    shards keep fp32 panels)."""
    if tensor_parallel_size == 1:
        return ModelRunner(src.hf_config, weights or src.weights, device=device, gguf_blocks=gguf_blocks, **kwargs)
    if weights is not None:
        raise ValueError("weights= cannot be combined with tensor_parallel_size > 1: every rank reads its own "
                         "slices of the model's files")
    from .distributed import start_runner

    return start_runner(src, tensor_parallel_size, device=device, **kwargs)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _program_hints(program):
    """A request's program hints as ProgramHints (None stays None); RequestError naming the bad field."""
    if program is None:
        return None
    from ..protocol.hints import HintsError, ProgramHints

    try:
        return ProgramHints.from_dict(program)
    except HintsError as e:
        raise RequestError(str(e)) from None


def _token_ids(ids) -> list[int]:
    """input_ids as a list of ints: integers only (numpy / tensor integers too), never bools, floats or strings.
    Range checks are the caller's."""
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__len__"):
        raise RequestError(f"input_ids must be a list of token ids, got {type(ids).__name__}")
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise RequestError(f"input_ids must be integers, got {type(t).__name__} {repr(t)[:40]}") from None
    return out


class _Segments:
    """A chain request's progress callback: hands each newly finished step's result to `push`, in order; a fork
    branch's (the parent's callback) tagged with its `branch`, then its end (`stopped_at`, meta info)."""

    def __init__(self, push):
        self.push = push

    def __call__(self, r: Req) -> None:
        if r.fork_parent is not None:
            # the parent's calls before the fork first: a select the parent scored by child requests ended in
            # the branches' spawning step without delivering the parent (it waits in `forking`, not `out`)
            self(r.fork_parent)
        chain = r.chain
        while chain.emitted < len(chain.segments):
            seg = chain.segments[chain.emitted]
            chain.emitted += 1
            self.push(seg if chain.branch is None else {**seg, "branch": chain.branch})
        if chain.branch is not None and r.finished and not chain.closed:  # a fork's branch ended: how far it ran
            chain.closed = True
            self.push({"branch": chain.branch, "stopped_at": chain.stopped_at, "meta_info": r.meta_info()})


class _Deltas:
    """Turns a request's growing output into text deltas. It runs on the scheduler thread after every step, so its
    cost per step is bounded, not proportional to the output so far.

    Incremental detokenization (as vLLM's): `text` is the text of `output_ids[:read]`; a step decodes only the
    tokens from `prefix` (a little left context, so a token decodes as it does in the whole text) to the end, and
    tokens ending inside a multi-byte UTF-8 character wait (up to MAX_PENDING tokens) for the ones completing it.
    Text that may still become a stop string is held back; only the tail as long as the longest stop string is
    scanned. A jump-forward may rewrite output tokens already read (retokenization keeps the text, not the ids):
    then the text is decoded once from the start."""

    MAX_PENDING = 8  # tokens that still decode to an incomplete character are accepted as they are past this

    def __init__(self, tokenizer, stops, push):
        self.tokenizer, self.stops, self.push = tokenizer, stops, push
        self.sent = 0  # characters pushed
        self.text, self.prefix, self.read, self.jumps = "", 0, 0, 0

    def __call__(self, r: Req) -> None:
        if r.finished:
            text = r.text
        elif self.tokenizer is None:
            text = ""
        else:
            self._advance(r)
            text = self.text[:len(self.text) - _held_back(self.text, self.stops)]
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        chunk = {"text": delta}
        if r.finished:
            chunk.update(r.result(), text=delta)
        if delta or r.finished:
            self.push(chunk)

    def _advance(self, r: Req) -> None:
        ids = r.output_ids
        if r.jumps != self.jumps:  # ids before `read` may have been rewritten
            self.text, self.prefix, self.read, self.jumps = "", 0, 0, r.jumps
        if len(ids) <= self.read:
            return
        decode = self.tokenizer.decode
        known = decode(ids[self.prefix:self.read], skip_special_tokens=True)
        new = decode(ids[self.prefix:], skip_special_tokens=True)
        if len(new) > len(known) and (not new.endswith("\ufffd") or len(ids) - self.read >= self.MAX_PENDING):
            self.text += new[len(known):]
            self.prefix, self.read = self.read, len(ids)


def _held_back(text: str, stops) -> int:
    """Length of the longest tail of `text` that is a prefix of a stop string: it may still become one."""
    if not text:
        return 0
    best, last = 0, text[-1]
    for s in stops:
        k = min(len(s), len(text))
        while k > best:
            i = s.rfind(last, 0, k)  # s[:i + 1] ends with text's last character: the only candidates
            if i < 0:
                break
            if i + 1 > best and text.endswith(s[:i + 1]):
                best = i + 1
                break
            k = i
    return best
