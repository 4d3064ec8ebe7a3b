"""API speculative execution against `lmc serve` (the paper's Wikipedia-style 3-field extraction), plus a server
robustness pass.

Each program reads a short biography and fills Name / Birth date / Occupation with three gens (stop at the line
end). Without speculation that is three API calls per program, each re-sending the whole prompt; with
`@function(num_api_spec_tokens=N)` the first gen over-generates and the other two are read from its text while it
follows the template. Both runs go through `lmc.OpenAI` pointed at an lmc server on loopback, as one run_batch of
`--programs` programs each, for a completion model (prompt text) and a chat model (messages).

Each model kind runs --repeat times (default 3), normal then speculative within each repetition, the server's
cache flushed before every run. Wall times and their ratio are stored as record.spread (median, min, max, runs);
token and call counts as record.exact (temperature 0: the same in every run, else their spread).

Robustness (`--robustness`): 200 concurrent requests (chat, completions, native, streaming), bad requests, and
clients that hang up mid-stream; afterwards the server must still serve and hold no request-owned KV slot.

    python benchmarks/speculation_bench.py [--programs 100] [--spec-tokens 32] [--repeat 3] [--base-url URL]
        [--robustness]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lmc  # noqa: E402
from lmc.backend.openai import program_usage, total_usage  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from extraction import chat_body, completion_body  # noqa: E402  (the program under test is the example's)

sys.path.insert(0, os.path.dirname(__file__))
from record import SHARED_MACHINE_NOTE, exact, finish, median, provenance, spread  # noqa: E402

FIRST = ["Anna", "Boris", "Clara", "David", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas"]
LAST = ["Berg", "Costa", "Dumont", "Eriksen", "Fischer", "Garcia", "Horvat", "Ivanova", "Janssen", "Kowalski"]
JOBS = [("a German", "chemist", "who studied the structure of proteins"),
        ("an Italian", "architect", "who designed several museums"),
        ("a Brazilian", "composer", "known for her symphonies"),
        ("a Danish", "astronomer", "who catalogued variable stars"),
        ("a Polish", "mathematician", "who worked on number theory")]
MONTHS = ["January", "March", "May", "July", "September", "November"]


def documents(n: int) -> list[str]:
    docs = []
    for i in range(n):
        first, last = FIRST[i % 10], LAST[(i // 10 + i) % 10]
        nat, job, what = JOBS[i % len(JOBS)]
        born = f"{1 + (i * 7) % 28} {MONTHS[i % 6]} {1850 + (i * 13) % 120}"
        died = f"{1 + (i * 11) % 28} {MONTHS[(i + 3) % 6]} {1930 + (i * 17) % 80}"
        docs.append(f"{first} {last} ({born} - {died}) was {nat} {job} {what}.")
    return docs


def run_once(mode: str, backend, docs: list[str], spec_tokens: int) -> dict:
    """One repetition: the normal run, then the speculative one, each from a cold server cache."""
    body = completion_body if mode == "completion" else chat_body
    plain, spec = lmc.function(body), lmc.function(body, num_api_spec_tokens=spec_tokens)
    args = [{"doc": d} for d in docs]
    out = {}
    states = {}
    for name, prog in (("normal", plain), ("speculative", spec)):
        backend.flush_cache()
        t0 = time.perf_counter()
        states[name] = prog.run_batch(args, backend=backend, temperature=0, num_threads=32)
        wall = time.perf_counter() - t0
        errors = [s.error() for s in states[name] if s.error() is not None]
        u = total_usage(states[name])
        out[name] = {**u.as_dict(), "wall_s": wall, "errors": len(errors)}
    pairs = list(zip(states["normal"], states["speculative"]))
    n, sp = out["normal"], out["speculative"]
    out["summary"] = {
        "programs": len(docs), "followed_template": sum(1 for _, s in pairs if program_usage(s).calls == 1),
        "values_equal": sum(1 for p, s in pairs if p.variables() == s.variables()),
        "values_equal_when_followed": sum(1 for p, s in pairs
                                          if program_usage(s).calls == 1 and p.variables() == s.variables()),
        "name_from_own_document": sum(1 for a, (_, s) in zip(docs, pairs)
                                      if s["name"].strip() and s["name"].strip() in a),
        "normal_calls_per_program": n["calls"] / len(docs), "speculative_calls_per_program": sp["calls"] / len(docs),
        "prompt_token_ratio": sp["prompt_tokens"] / n["prompt_tokens"],
        "billed_token_ratio": sp["billed_tokens"] / n["billed_tokens"],
        "wall_ratio": sp["wall_s"] / n["wall_s"]}
    return out


def run_mode(mode: str, backend, docs: list[str], spec_tokens: int, repeat: int) -> dict:
    """--repeat repetitions of run_once: wall times as a spread, everything else exact."""
    runs = [run_once(mode, backend, docs, spec_tokens) for _ in range(repeat)]
    timed = {"wall_s", "wall_ratio"}
    return {part: {k: (spread if k in timed else exact)([r[part][k] for r in runs]) for k in runs[0][part]}
            for part in ("normal", "speculative", "summary")}


async def robustness(url: str, api_key: str | None) -> dict:
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx
    import openai

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "EMPTY", max_retries=0, timeout=600)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        async def one(i):
            k = i % 5
            if k == 0:
                r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Say {i}"}],
                                                         max_tokens=8, temperature=0)
                return r.choices[0].message.content is not None
            if k == 1:
                r = await client.completions.create(model="m", prompt=f"Number {i} is", max_tokens=8, temperature=0)
                return r.choices[0].text is not None
            if k == 2:
                r = await http.post("/generate", json={"text": f"Item {i}:", "sampling_params": {"max_new_tokens": 8}})
                return r.status_code == 200
            if k == 3:
                s = await client.chat.completions.create(model="m", stream=True, max_tokens=8,
                                                         messages=[{"role": "user", "content": f"Count to {i}"}])
                return bool([c async for c in s])
            async with http.stream("POST", "/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 32,
                                                                    "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break  # hang up mid-stream
            return True

        t0 = time.perf_counter()
        oks = await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)
        wall = time.perf_counter() - t0
        bad = {"malformed": (await http.post("/v1/completions", content=b"{nope")).status_code,
               "unknown_field": (await http.post("/v1/completions", json={"prompt": "x", "bogus": 1})).status_code,
               "oversized": (await http.post("/v1/completions", json={"prompt": "hi " * 20000})).status_code,
               "bad_temperature": (await http.post("/generate", json={"text": "x", "sampling_params": {
                   "temperature": -1}})).status_code}
        deadline = time.monotonic() + 300
        while True:
            info = (await http.get("/get_server_info")).json()
            st = info["internal_states"][0]
            if st["waiting"] == 0 and st["running"] == 0 and info["in_flight_requests"] == 0:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        still = (await http.post("/generate", json={"text": "ok",
                                                    "sampling_params": {"max_new_tokens": 1}})).status_code
    await client.close()
    return {"concurrent": 200, "completed": sum(1 for o in oks if o is True),
            "failed": [repr(o) for o in oks if o is not True][:5], "wall_s": round(wall, 2), "bad_requests": bad,
            "slots_after": info["slots"], "still_serving": still}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, default=100)
    ap.add_argument("--spec-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of each model kind (default 3)")
    ap.add_argument("--modes", default="completion,chat")
    ap.add_argument("--base-url", default=None, help="an lmc server (default: start one in-process)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--robustness", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "speculation.json"))
    args = ap.parse_args()
    for name in ("programs", "spec_tokens", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    prov = provenance("benchmarks/speculation_bench.py", SHARED_MACHINE_NOTE)
    srv = engine = None
    url = args.base_url
    if url is None:
        from lmc.runtime import Engine
        from lmc.server import ServerThread, create_app

        engine = Engine()
        srv = ServerThread(create_app(engine, api_key=args.api_key)).start()
        url = srv.url
    docs = documents(args.programs)
    results = {"programs": args.programs, "spec_tokens": args.spec_tokens, "repeat": args.repeat,
               "model": "smollm2-135m-instruct", "provenance": prov}
    for mode in args.modes.split(","):
        backend = lmc.OpenAI("smollm2", base_url=url + "/v1", api_key=args.api_key,
                             is_chat_model=(mode == "chat"))
        results[mode] = run_mode(mode, backend, docs, args.spec_tokens, args.repeat)
        backend.shutdown()
        s, n, sp = ({k: median(v) for k, v in results[mode][part].items()}
                    for part in ("summary", "normal", "speculative"))
        print(f"\n{mode} model, {s['programs']} programs (temperature 0, medians of {args.repeat})")
        print("| run | calls | prompt tokens (cached) | completion tokens | wall s |")
        print("| --- | --- | --- | --- | --- |")
        for name, r in (("normal", n), ("speculative", sp)):
            print(f"| {name} | {r['calls']} | {r['prompt_tokens']} ({r['cached_tokens']}) | "
                  f"{r['completion_tokens']} | {r['wall_s']:.2f} |")
        print(f"followed the template: {s['followed_template']}/{s['programs']}; values equal: "
              f"{s['values_equal']}/{s['programs']} ({s['values_equal_when_followed']} of those that followed); "
              f"prompt-token ratio {s['prompt_token_ratio']:.3f}, billed-token ratio {s['billed_token_ratio']:.3f}, "
              f"wall ratio {s['wall_ratio']:.3f}")
    if args.robustness:
        results["robustness"] = asyncio.run(robustness(url, args.api_key))
        print("\nrobustness:", json.dumps(results["robustness"]))
    finish(prov)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.out}")
    if srv is not None:
        srv.stop()
        engine.shutdown()


if __name__ == "__main__":
    main()
