"""`lmc` command line.

    lmc generate PROMPT [--chat] [--json]           one prompt through the local engine
    lmc models                                      the built-in model names
    lmc run prog.py[:name] [--arg k=v ...] [--json] run one program of a file
    lmc run-batch prog.py[:name] -i in.jsonl -o out.jsonl
                                                    run it once per input line, resumable
    lmc serve --model M [--port 30000] [--api-key K]
                                                    the OpenAI-compatible and SGLang-native HTTP server

`run` and `run-batch` take `--backend local|openai|endpoint`: `openai` is any OpenAI-compatible API (`--base-url`,
`--model`, key from `--api-key` or OPENAI_API_KEY), `endpoint` an lmc or SGLang server's native API
(`--base-url`). With an API backend the usage (calls, billed and cached tokens, calls saved by speculation) is
printed to stderr at the end.

Exit status: 0 on success, 1 when a program failed (for run-batch: when some line failed), 2 for a usage error
(bad file, no or several programs, missing or unknown arguments, unknown backend or model; for run-batch also an
input whose lines changed since its partial output was written).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

BACKENDS = ("local", "openai", "endpoint")


class UsageError(Exception):
    """A problem with the command line or its inputs: reported as `lmc: ...`, exit status 2."""


def _generate(args) -> int:
    from lmc.runtime import Engine, RequestError, UnknownModelError

    try:
        engine = Engine(args.model, device=args.device, dtype=args.dtype)
    except UnknownModelError as e:
        print(f"lmc: {e}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.stop:
        params["stop"] = args.stop
    try:
        out = engine.generate(prompt, params)
    except RequestError as e:
        print(f"lmc: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    print(json.dumps(out) if args.json else out["text"])
    return 0


def _models(_args) -> int:
    from lmc.runtime.model.loader import known_models

    print("\n".join(known_models()))
    return 0


# ---- loading a program file ------------------------------------------------------------------------------------
def _split_target(target: str) -> tuple[Path, str | None]:
    """`prog.py` or `prog.py:name` (a path that exists as given wins over the split)."""
    if not os.path.exists(target) and ":" in target:
        path, _, name = target.rpartition(":")
        if name.isidentifier():
            return Path(path), name
    return Path(target), None


def _import_file(path: Path):
    """Import the file as a fresh module (its `if __name__ == "__main__":` block does not run); its directory goes
    on sys.path first, as for `python prog.py`, so it can import its neighbours."""
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    name = "_lmc_program_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, pickling and typing look the module up while it executes
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UsageError(f"cannot import {path}: SyntaxError: {e.msg} (line {e.lineno})") from None
    except Exception as e:
        raise UsageError(f"cannot import {path}: {_describe(e, path)}") from None
    return module


def _pick_program(module, path: Path, name: str | None):
    from lmc import Program

    found: dict[str, Program] = {}
    for k, v in vars(module).items():
        if isinstance(v, Program) and not k.startswith("_") and all(v is not p for p in found.values()):
            found[k] = v
    if name is not None:
        prog = vars(module).get(name)
        if not isinstance(prog, Program):
            raise UsageError(f"{path} has no program {name!r}; programs: {', '.join(found) or '(none)'}")
        return prog
    # Programs imported from elsewhere (helpers the file calls) count only when the file defines none itself.
    own = {k: p for k, p in found.items() if p.func.__module__ == module.__name__} or found
    if len(own) == 1:
        return next(iter(own.values()))
    if not own:
        raise UsageError(f"{path} defines no lmc program (a function decorated with @lmc.function)")
    raise UsageError(f"{path} defines {len(own)} programs: {', '.join(own)}; pick one with {path}:NAME")


def _parse_args(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UsageError(f"--arg {pair!r}: expected NAME=VALUE")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _check_arguments(prog, given: dict[str, Any]) -> str | None:
    """None when `given` are valid keyword arguments of the program, else what is wrong."""
    params = list(inspect.signature(prog.func).parameters.values())[1:]
    if not isinstance(given, dict):
        return f"expected a JSON object of arguments, got {type(given).__name__}"
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    unknown = [k for k in given if k not in named and not takes_any]
    if unknown:
        return (f"unknown argument(s) {', '.join(map(repr, unknown))} for {prog.__name__}; it takes: "
                f"{', '.join(_signature_names(params)) or '(no arguments)'}")
    missing = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.default is p.empty and p.name not in given and p.name not in prog.bind_arguments]
    if missing:
        return f"missing required argument(s) {', '.join(map(repr, missing))} for {prog.__name__}"
    return None


def _signature_names(params) -> list[str]:
    return [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _describe(e: BaseException, path: Path | None = None) -> str:
    """`Type: message`, plus the innermost line of the user's file the error passed through."""
    msg = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if path is not None:
        import traceback

        want = os.path.realpath(path)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == want]
        if frames:
            msg += f" (at {path}:{frames[-1].lineno})"
    return msg


def _load(args):
    """File, program and backend name checked before any model is loaded (usage errors are instant)."""
    if args.backend not in BACKENDS:
        raise UsageError(f"unknown backend {args.backend!r}; available backends: {', '.join(BACKENDS)}")
    path, name = _split_target(args.program)
    prog = _pick_program(_import_file(path), path, name)
    return path, prog


def _make_backend(args):
    import lmc

    if args.backend == "openai":
        try:
            return lmc.OpenAI(args.model, base_url=args.base_url, api_key=args.api_key,
                              is_chat_model=False if args.completion_model else None)
        except (ValueError, ConnectionError) as e:
            raise UsageError(str(e)) from None
    if args.backend == "endpoint":
        try:
            return lmc.RuntimeEndpoint(args.base_url or "http://127.0.0.1:30000", api_key=args.api_key)
        except (ValueError, ConnectionError) as e:
            raise UsageError(str(e)) from None
    from lmc.runtime import UnknownModelError

    kwargs = {"device": args.device, "dtype": args.dtype}
    if args.max_total_tokens is not None:
        kwargs["max_total_tokens"] = args.max_total_tokens
    try:
        return lmc.Local(args.model, **kwargs)
    except UnknownModelError as e:
        raise UsageError(str(e)) from None


def _sampling(args) -> dict[str, Any]:
    return {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}  # None: the program's default


def _execute(prog, arguments: dict, sampling: dict, backend):
    """`prog.run(**arguments)` without run()'s own keywords: a program argument named `stop`, `n` or `backend`
    stays a program argument. Raises the program's error."""
    state = prog._start((), arguments, sampling, backend)
    state.sync()
    if state.error() is not None:
        raise state.error()
    return state


def _jsonable(v):
    """v as JSON-serializable data: containers converted, anything else (and non-finite floats) as repr."""
    if v is None or isinstance(v, (str, bool, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, dict):
        return {k if isinstance(k, str) else repr(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return repr(v)


def _dumps(obj) -> str:
    return json.dumps(_jsonable(obj), ensure_ascii=False)


# ---- lmc run ----------------------------------------------------------------------------------------------------
def _run(args) -> int:
    path, prog = _load(args)
    arguments = _parse_args(args.arg or [])
    problem = _check_arguments(prog, arguments)
    if problem:
        raise UsageError(problem)
    backend = _make_backend(args)
    try:
        try:
            state = _execute(prog, arguments, _sampling(args), backend)
            variables, text, messages = state.variables(), state.text(), state.messages()
        except Exception as e:
            print(f"lmc: {prog.__name__} failed: {_describe(e, path)}", file=sys.stderr)
            return 1
    finally:
        backend.shutdown()
    variables = {k: v for k, v in variables.items() if not k.startswith("__lmc")}
    if args.backend != "local":
        from lmc.backend.openai import program_usage

        print(f"lmc: usage: {program_usage(state).summary()}", file=sys.stderr)
    if args.json:
        print(_dumps({"variables": variables, "text": text, "messages": messages}))
    else:
        for k, v in variables.items():
            print(f"{k} = {_dumps(v)}")
        print("--- text ---")
        print(text)
    return 0


# ---- lmc run-batch ----------------------------------------------------------------------------------------------
def _read_records(out_path: Path) -> dict[int, tuple[bool, str]]:
    """index -> (succeeded, line) of the records in the output; a success is never replaced by a later failure.
    Unreadable lines (a write cut short by a kill) are dropped."""
    records: dict[int, tuple[bool, str]] = {}
    if not out_path.exists():
        return records
    with open(out_path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("index"), int):
                continue
            ok = "error" not in rec
            if ok or not records.get(rec["index"], (False, ""))[0]:
                records[rec["index"]] = (ok, line.rstrip("\n"))
    return records


def _rewrite(out_path: Path, records: dict[int, tuple[bool, str]]) -> None:
    """Write the records sorted by index (atomically: a kill leaves the old file or the new one)."""
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(records[i][1] + "\n" for i in sorted(records))
    os.replace(tmp, out_path)


def _sidecar(out_path: Path) -> Path:
    """Beside the output: which input its records came from (how many lines, their sha256)."""
    return out_path.with_name(out_path.name + ".input.json")


def _digest(lines: list[str]) -> str:
    import hashlib

    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8") + b"\n")
    return h.hexdigest()


def _check_same_input(in_path: Path, lines: list[str], out_path: Path) -> None:
    """Raise UsageError unless the output's records came from this input: its first `lines` lines, as recorded in
    the sidecar, are unchanged (lines appended since are new work). Resuming on a changed input would mix the
    outputs of two inputs under the same indices."""
    side = _sidecar(out_path)
    start_over = f"write to a new output file, or remove {out_path} and {side} to start over"
    if not side.exists():
        raise UsageError(f"{out_path} has records but no {side.name} recording which input they came from, so "
                         f"resuming could mix two inputs; {start_over}")
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
        n, digest = int(meta["lines"]), str(meta["sha256"])
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"unreadable {side}: {e}; {start_over}") from None
    if len(lines) < n or _digest(lines[:n]) != digest:
        raise UsageError(f"input {in_path} changed since {out_path} was written (its first {n} line(s) are not "
                         f"the ones the records came from); refusing to resume; {start_over}")


def _write_sidecar(in_path: Path, lines: list[str], out_path: Path) -> None:
    """Atomically, and before any record from these lines is appended: a kill leaves the old sidecar or this."""
    side = _sidecar(out_path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps({"input": str(in_path), "lines": len(lines), "sha256": _digest(lines)}) + "\n",
                   encoding="utf-8")
    os.replace(tmp, side)


def _run_batch(args) -> int:
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    path, prog = _load(args)
    in_path, out_path = Path(args.input), Path(args.output)
    if not in_path.is_file():
        raise UsageError(f"no such input file: {in_path}")
    if args.num_threads < 1:
        raise UsageError("--num-threads must be at least 1")
    with open(in_path, encoding="utf-8") as f:
        lines = f.read().splitlines()

    previous = _read_records(out_path)
    if previous:
        _check_same_input(in_path, lines, out_path)
    # Successful records are kept; failed ones are dropped here and retried.
    done = {i: r for i, r in previous.items() if r[0]}
    _rewrite(out_path, done)
    _write_sidecar(in_path, lines, out_path)
    todo: list[tuple[int, dict]] = []
    invalid: list[dict] = []  # lines that fail without running
    for i, line in enumerate(lines):
        if i in done or not line.strip():  # blank lines are skipped; an index is always the line's number
            continue
        try:
            arguments = json.loads(line)
        except ValueError as e:
            invalid.append({"index": i, "error": f"malformed input line: {e}"})
            continue
        problem = _check_arguments(prog, arguments)
        if problem:
            invalid.append({"index": i, "error": problem})
        else:
            todo.append((i, arguments))
    total = len(todo) + len(invalid)
    if done:
        print(f"lmc: resuming {out_path}: {len(done)} line(s) already done, {total} to run", file=sys.stderr)
    if total == 0:
        return 0
    backend = _make_backend(args) if todo else None
    sampling = _sampling(args)
    api = args.backend != "local"
    if api:
        from lmc.backend.openai import Usage

        usage = Usage()

    out = open(out_path, "a", encoding="utf-8")
    lock = threading.Lock()
    failed = 0
    first_error: dict | None = None
    progress = tqdm(total=total, desc=prog.__name__, unit="program", file=sys.stderr, dynamic_ncols=True)

    def write(rec: dict) -> None:
        nonlocal failed, first_error
        line = _dumps(rec)
        with lock:
            out.write(line + "\n")
            out.flush()  # on disk as soon as it finishes: a killed batch resumes from here
            if "error" in rec:
                failed += 1
                progress.set_postfix(failed=failed, refresh=False)
                if first_error is None:  # the rest are counted on the bar: one message, not one per line
                    first_error = rec
                    progress.write(f"lmc: line {rec['index']} failed: {rec['error']}", file=sys.stderr)
            progress.update()

    def one(i: int, arguments: dict) -> None:
        # A worker holds its program until every gen finished: at most --num-threads programs are in flight.
        try:
            state = _execute(prog, arguments, sampling, backend)
            variables = {k: v for k, v in state.variables().items() if not k.startswith("__lmc")}
            rec = {"index": i, "variables": variables, "text": state.text()}
            if api:
                from lmc.backend.openai import program_usage

                u = program_usage(state)
                rec["usage"] = u.as_dict()
                with lock:
                    usage.add(u)
        except Exception as e:
            rec = {"index": i, "error": _describe(e, path)}
        write(rec)

    for rec in invalid:
        write(rec)
    if todo:
        pool = ThreadPoolExecutor(min(args.num_threads, len(todo)), thread_name_prefix="lmc-run-batch")
        try:
            for fut in as_completed([pool.submit(one, i, a) for i, a in todo]):
                fut.result()
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            with lock:
                out.close()
            progress.close()
            print(f"\nlmc: interrupted; rerun the same command to resume {out_path}", file=sys.stderr)
            os._exit(130)  # running programs hold worker threads; what finished is on disk
        pool.shutdown()
        backend.shutdown()
    progress.close()
    out.close()
    _rewrite(out_path, _read_records(out_path))  # in input order now that nothing is appended any more
    if api and todo:
        print(f"lmc: usage: {usage.summary()}", file=sys.stderr)
    print(f"lmc: {total - failed} of {total} line(s) succeeded, {failed} failed", file=sys.stderr)
    if first_error is not None:
        print(f"lmc: first failure, line {first_error['index']}: {first_error['error']}; see the \"error\" records "
              f"in {out_path} (rerun the same command to retry them)", file=sys.stderr)
        return 1
    return 0


# ---- lmc serve --------------------------------------------------------------------------------------------------
def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return v
    return parse


_positive_int, _positive_float = _positive(int), _positive(float)


def _worker_argv(args) -> list[str]:
    """The `lmc serve` options each replica of `--dp` runs with (everything but host, port and the router's)."""
    argv = ["--model", args.model, "--schedule-policy", args.schedule_policy, "--device", args.device,
            "--dtype", args.dtype, "--max-running-requests", str(args.max_running_requests),
            "--max-pending", str(args.max_pending), "--log-level", args.log_level]
    for flag, value in (("--api-key", args.api_key), ("--served-model-name", args.served_model_name),
                        ("--max-total-tokens", args.max_total_tokens), ("--context-length", args.context_length),
                        ("--busy-prefill-tokens", args.busy_prefill_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + [flag for flag, on in (("--disable-radix-cache", args.disable_radix_cache),
                                         ("--disable-continuation", args.disable_continuation),
                                         ("--enable-metrics", args.enable_metrics)) if on]


def _serve_replicas(args) -> int:
    import shlex

    from lmc.server.replicas import ReplicaError, ReplicaSet, plan_replicas

    try:
        plans = plan_replicas(args.dp, device=args.device)
        return ReplicaSet(plans, _worker_argv(args), port=args.port, host=args.host, policy=args.router_policy,
                          api_key=args.api_key, gateway_args=shlex.split(" ".join(args.router_arg or [])),
                          log_level=args.log_level).run()
    except ReplicaError as e:
        raise UsageError(str(e)) from None


def _serve(args) -> int:
    if args.dp is not None:
        if args.tp > 1:
            raise UsageError("--dp and --tp cannot be combined yet: each replica would need its own GPUs")
        return _serve_replicas(args)
    try:
        from lmc.server import serve
    except ImportError as e:
        raise UsageError(f"lmc serve needs the server extra (pip install 'lmc[server]'): {e}") from None
    from lmc.runtime import UnknownModelError
    from lmc.runtime.distributed import TensorParallelError

    kwargs = {"device": args.device, "dtype": args.dtype, "schedule_policy": args.schedule_policy,
              "disable_radix_cache": args.disable_radix_cache, "max_running_requests": args.max_running_requests,
              "tensor_parallel_size": args.tp, "enable_continuation": not args.disable_continuation,
              "busy_prefill_tokens": args.busy_prefill_tokens}
    if args.max_total_tokens is not None:
        kwargs["max_total_tokens"] = args.max_total_tokens
    if args.context_length is not None:
        kwargs["context_length"] = args.context_length
    try:
        serve(args.model, host=args.host, port=args.port, api_key=args.api_key,
              served_model_name=args.served_model_name, enable_metrics=args.enable_metrics,
              log_level=args.log_level, max_pending=args.max_pending, metrics_no_auth=args.metrics_no_auth,
              max_body_bytes=args.max_body_bytes, max_top_logprobs=args.max_top_logprobs,
              grammar_cache_size=args.grammar_cache_size, grammar_compile_timeout=args.grammar_compile_timeout,
              **kwargs)
    except (UnknownModelError, TensorParallelError) as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    return 0


# ---- argument parsing -------------------------------------------------------------------------------------------
def _compile(args) -> int:
    """Print the program's first segment (text, DOT, Mermaid or JSON) and the compiler's report: as comments after
    the text form, as the `report` of the one JSON object with --emit json."""
    from lmc.frontend.chat_template import ChatTemplate
    from lmc.ir.export import graph_dict, to_dot, to_mermaid
    from lmc.ir.text import print_graph

    from lmc.compiler.pipeline import PASSES

    if args.passes:
        for p in PASSES:
            print(f"{p.name:18s} {'on ' if p.default else 'off'}  {p.doc}")
        return 0
    if args.program is None:
        raise UsageError("compile needs a program (prog.py or prog.py:name), or --passes")
    path, prog = _load(args)
    concrete = {k: v for k, v in _parse_args(args.arg).items() if not isinstance(v, str)}
    try:
        compiled = prog.compile(hoist=args.hoist, disable=args.disable, enable=args.enable)
    except ValueError as e:
        raise UsageError(str(e)) from None
    g = compiled.graph(**concrete)
    tokenizer = _tokenizer(args.model) if args.emit in ("text", "json", "plan", "plan-text") else None
    template = ChatTemplate.from_tokenizer(tokenizer)
    if args.emit == "json":
        report = compiled.report(template=template, tokenizer=tokenizer, **concrete)
        print(json.dumps({"graph": graph_dict(g), "report": report}, indent=2, sort_keys=True, default=repr))
        return 0
    if args.emit in ("plan", "plan-text"):  # the first segment lowered for --target: what the executor runs
        from lmc.compiler.lower import format_plan
        from lmc.compiler.pipeline import Target
        from lmc.protocol import Capabilities

        caps = Capabilities(token_id_selects=args.target == "local" and tokenizer is not None,
                            planned_speculation=args.target == "openai")
        plan = compiled.plan_for(Target(args.target, template, tokenizer, caps), **concrete)
        print(json.dumps(plan.to_json(), indent=2, default=repr) if args.emit == "plan" else format_plan(plan),
              end="\n" if args.emit == "plan" else "")
        return 0
    emit = {"text": print_graph, "dot": to_dot, "mermaid": to_mermaid}[args.emit]
    sys.stdout.write(emit(g))
    if args.emit == "text":
        report = compiled.report(template=template, tokenizer=tokenizer, **concrete)
        for key, value in report.items():
            print(f"# {key}: {json.dumps(value)}")
    return 0


def _tokenizer(model: str):
    """The model's tokenizer alone (no weights), for token counts and the chat template of the report; None
    when transformers (or the model's files) are not there: the report then counts characters and says so."""
    try:
        from transformers import AutoTokenizer

        from lmc.runtime.model.loader import resolve
    except ImportError:
        return None
    src = resolve(model)
    return AutoTokenizer.from_pretrained(src.tokenizer_dir) if src.tokenizer_dir else None


def _add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="of the local engine. auto: bf16 on CUDA, fp32 on the CPU; bfloat16 on a CPU with AMX or "
                        "AVX-512 BF16 runs the linears in bf16, the rest in fp32")


def _add_program_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("program", metavar="prog.py[:name]",
                   help="a Python file defining @lmc.function programs; :name picks one when it defines several")
    p.add_argument("--backend", default="local", help=f"where programs run (available: {', '.join(BACKENDS)})")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model of the local backend (see `lmc models`), or the model name for --backend openai")
    p.add_argument("--base-url", default=None,
                   help="server URL for --backend openai (e.g. http://127.0.0.1:30000/v1; default: OPENAI_BASE_URL "
                        "or api.openai.com) or --backend endpoint (default http://127.0.0.1:30000)")
    p.add_argument("--api-key", default=None, help="API key of an API backend (default: OPENAI_API_KEY)")
    p.add_argument("--completion-model", action="store_true",
                   help="--backend openai: the model is a completion model (prompt text), not a chat model")
    p.add_argument("--device", default="auto", help="device of the local backend (auto, cpu, cuda)")
    _add_dtype(p)
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV cache size of the local engine in tokens (default: the engine's)")
    p.add_argument("--temperature", type=float, default=None,
                   help="program-level default temperature (default: the program's, 1.0 as in SGLang)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="program-level default max new tokens for gens without max_tokens (default 128)")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers' advice to library authors (e.g. 5.17's "Ignoring clean_up_tokenization_spaces=True" on the
    # first decode) is nothing a user of the CLI can act on, and its stderr carries lmc's own one-line errors;
    # TRANSFORMERS_VERBOSITY=warning brings it back
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ap = argparse.ArgumentParser(prog="lmc", description="An optimizing compiler and runtime for LM programs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from one prompt with the local engine")
    g.add_argument("prompt")
    g.add_argument("--model", default="smollm2-135m-instruct")
    g.add_argument("--device", default="auto")
    _add_dtype(g)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--stop", action="append")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print the whole result (text, ids, meta info)")
    g.set_defaults(fn=_generate)
    m = sub.add_parser("models", help="list the built-in model names")
    m.set_defaults(fn=_models)
    r = sub.add_parser("run", help="run a program from a Python file",
                       description="Import prog.py (its __main__ block does not run), run one of its programs "
                                   "and print its variables (name = JSON value) and its text.")
    _add_program_options(r)
    r.add_argument("--arg", action="append", metavar="NAME=VALUE",
                   help="a program argument; VALUE is parsed as JSON when it parses (numbers, lists, true), "
                        "else kept as a string. Repeatable")
    r.add_argument("--json", action="store_true", help='print {"variables", "text", "messages"} as one JSON object')
    r.set_defaults(fn=_run)
    b = sub.add_parser("run-batch", help="run a program once per line of a JSONL file (resumable)",
                       description="Each input line is a JSON object of program arguments. One JSON line per "
                                   "program is appended to the output as it finishes: {index, variables, text} or "
                                   "{index, error}. Rerunning with the same output skips the lines already done "
                                   "and retries the failed ones (also after a kill: a line cut short is dropped); "
                                   "the finished file is sorted by index. OUTPUT.input.json records the input's "
                                   "lines and sha256: a rerun refuses to resume when those lines changed (lines "
                                   "appended to the input are new work).")
    _add_program_options(b)
    b.add_argument("-i", "--input", required=True, help="input JSONL: one object of arguments per line")
    b.add_argument("-o", "--output", required=True, help="output JSONL (resumed when it exists)")
    b.add_argument("--num-threads", type=int, default=32, help="programs in flight at once (default 32)")
    b.set_defaults(fn=_run_batch)
    sv = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible and SGLang-native routes)",
                        description="Routes: /v1/completions, /v1/chat/completions, /v1/models, /generate, "
                                    "/get_model_info, /get_server_info, /get_load, /flush_cache, /health, "
                                    "/health_generate, "
                                    "/tokenize, /metrics (with --enable-metrics).")
    sv.add_argument("--model", "--model-path", dest="model", default="smollm2-135m-instruct",
                    help="model name (see `lmc models`), HF directory or .gguf file")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=30000)
    sv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route but /health")
    sv.add_argument("--metrics-no-auth", action="store_true",
                    help="with --api-key, serve /metrics without the key (for a Prometheus scraper)")
    sv.add_argument("--max-body-bytes", type=_positive_int, default=None,
                    help="larger request bodies get a 413 (default 4 MiB)")
    sv.add_argument("--max-top-logprobs", type=_positive_int, default=None,
                    help="most top logprobs a request may ask for per token (default 20)")
    sv.add_argument("--grammar-cache-size", type=_positive_int, default=None,
                    help="compiled grammars kept (LRU; default 256)")
    sv.add_argument("--grammar-compile-timeout", type=_positive_float, default=None,
                    help="seconds a grammar may take to compile before its request gets a 400 (default 30)")
    sv.add_argument("--served-model-name", default=None, help="the model name the API reports")
    sv.add_argument("--schedule-policy", default="program",
                    choices=["program", "lpm", "dfs-weight", "fcfs", "random"],
                    help="admission order; program: by the plan's remaining work where requests carry program "
                         "hints (KV kept by next use), else as lpm")
    sv.add_argument("--busy-prefill-tokens", type=_positive_int, default=None,
                    help="latency under load: while program instances decode, a prefill forward takes at most this "
                         "many new tokens, shortest remaining work first, and they decode in it (costs throughput "
                         "on batches submitted at once; 64 on a 2-core CPU)")
    sv.add_argument("--disable-radix-cache", action="store_true")
    sv.add_argument("--disable-continuation", action="store_true",
                    help="run each call of a /v1/programs program as its own engine request (the ablation)")
    sv.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics on /metrics")
    sv.add_argument("--device", default="auto")
    _add_dtype(sv)
    sv.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens")
    sv.add_argument("--max-running-requests", type=int, default=256)
    sv.add_argument("--context-length", type=int, default=None)
    sv.add_argument("--max-pending", type=int, default=4096,
                    help="requests in flight beyond which the server answers 503")
    sv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sv.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                    help="tensor parallelism: shard the model over N ranks (GPUs cuda:0..N-1, or CPU processes)")
    sv.add_argument("--dp", type=int, default=None, metavar="N",
                    help="N replicas behind SGLang's gateway on --port (needs the scale extra); each replica is "
                         "pinned to its share of the cores, or one GPU each")
    sv.add_argument("--router-policy", default="cache_aware",
                    choices=["cache_aware", "round_robin", "random", "power_of_two", "manual"],
                    help="the gateway's policy with --dp (manual: sticky by the X-SMG-Routing-Key header)")
    sv.add_argument("--router-arg", action="append", metavar="ARGS",
                    help="extra options for the gateway (sglang_router.launch_router), e.g. "
                         "--router-arg='--cache-threshold 0.5'; repeatable")
    sv.set_defaults(fn=_serve)
    c = sub.add_parser("compile", help="trace a program and print its graph and the compiler's report")
    c.add_argument("program", nargs="?", help="prog.py or prog.py:name")
    c.add_argument("--emit", choices=["text", "dot", "mermaid", "json", "plan", "plan-text"], default="text",
                   help="json: the graph and the report; plan: the plan of operations the executor runs for "
                        "--target, as JSON (plan-text: as text)")
    c.add_argument("--target", choices=["local", "endpoint", "openai"], default="local",
                   help="the backend kind --emit plan lowers for")
    c.add_argument("--passes", action="store_true", help="list the passes (name, on/off by default, what it does)")
    c.add_argument("--disable", action="append", default=[], metavar="PASS", help="switch a pass off (repeatable)")
    c.add_argument("--enable", action="append", default=[], metavar="PASS",
                   help="switch an opt-in pass on (repeatable)")
    c.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                   help="a non-text argument to specialise the graph on (text arguments stay symbolic)")
    c.add_argument("--hoist", choices=["safe", "aggressive", "off"], default="safe",
                   help="aggressive also applies the moves reported as suggestions (they change prompts)")
    c.add_argument("--model", default="smollm2-135m-instruct", help="tokenizer and chat template for the report")
    c.add_argument("--backend", default="local", help=argparse.SUPPRESS)
    c.set_defaults(fn=_compile)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        print(f"lmc: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlmc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
