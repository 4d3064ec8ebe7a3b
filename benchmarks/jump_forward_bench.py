"""Jump-forward constrained decoding on the embedded SmolLM2-135M-Instruct (CPU, fp32): the same engine with
jump-forward on and off, in one run.

- character:  SGLang's json_jump_forward workload: a Harry Potter character profile through a regex with long
              constant spans (greedy). Decode throughput (output characters/s and tokens/s, prompts already
              cached), forward passes per request and engine forwards; --sequential of them (default 4) one at a
              time, and --batch (default 16) in one batch. Jump-forward's output is canonically tokenized, i.e.
              fewer tokens for the same text than a model spelling token by token, so the headline ratio is on
              characters/s.
- city:       SGLang's json_decode_regex workload: 5 fields of a city extracted from a long document (~590 tokens,
              greedy), same measures: --sequential one at a time, and a batch of min(--batch, 8) (8 documents).
- reuse:      grammar reuse across a batch vs compiling per request: the time to admit a batch of 32 requests
              sharing one grammar (compile + matcher per request) with the compiled-grammar cache and without,
              for the character regex and a nested JSON schema; and a batch of --batch character requests end to
              end.
- validity:   (--validity) the corpus of tests/constrained_corpus.py, --samples per grammar (default 20) at
              temperature 1.0, jump-forward on and off: the share that finishes, and that every finished sample
              matches. One run (its figures are counts; its times are single runs).

Each timed comparison runs --repeat times (default 3), on then off (or reused then per request) within each
repetition, so both sides see the same load on a shared CPU; times are stored as record.spread (median, min, max,
runs) and ratios per repetition; counts that should repeat exactly as record.exact.

    python benchmarks/jump_forward_bench.py [character city reuse] [--repeat 3] [--sequential 4] [--batch 16]
        [--validity [--samples 20]] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from lmc.runtime import Engine  # noqa: E402
from lmc.runtime.core import SamplingParams  # noqa: E402

from record import SHARED_MACHINE_NOTE, exact, finish, median, provenance, spread  # noqa: E402

CHARACTER_REGEX = (r'\{"name": "[\w ]{1,20}", "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)", '
                   r'"blood status": "(Pure-blood|Half-blood|Muggle-born)", "occupation": "(student|teacher|auror|'
                   r'ministry of magic|death eater|order of the phoenix)", "wand": \{"wood": "[\w ]{1,20}", '
                   r'"core": "[\w ]{1,20}", "length": [0-9]{1,2}\.[0-9]\}, "alive": "(Alive|Deceased)", '
                   r'"patronus": "[\w ]{1,20}", "bogart": "[\w ]{1,20}"\}')
NAMES = ["Harry Potter", "Hermione Granger", "Ron Weasley", "Albus Dumbledore", "Severus Snape", "Rubeus Hagrid",
         "Draco Malfoy", "Ginny Weasley", "Neville Longbottom", "Luna Lovegood", "Sirius Black", "Remus Lupin",
         "Minerva McGonagall", "Bellatrix Lestrange", "Dobby", "Cedric Diggory"]

# SGLang's benchmark/json_decode_regex city regex (indented JSON with newlines).
CITY_REGEX = (r'\{\n'
              r'  "name": "[\w\d\s]{1,16}",\n'
              r'  "country": "[\w\d\s]{1,16}",\n'
              r'  "latitude": [-+]?[0-9]*\.?[0-9]{0,2},\n'
              r'  "population": [-+]?[0-9]{1,9},\n'
              r'  "top 3 landmarks": \["[\w\d\s]{1,16}", "[\w\d\s]{1,16}", "[\w\d\s]{1,16}"\]\n'
              r'\}')
CITIES = [("Lyon", "France", 45.76, 522969, ["Fourviere Basilica", "Place Bellecour", "Vieux Lyon"]),
          ("Porto", "Portugal", 41.15, 231800, ["Dom Luis Bridge", "Ribeira", "Clerigos Tower"]),
          ("Krakow", "Poland", 50.06, 804237, ["Wawel Castle", "Main Square", "Cloth Hall"]),
          ("Kyoto", "Japan", 35.01, 1463723, ["Kinkaku ji", "Fushimi Inari", "Gion"]),
          ("Quebec City", "Canada", 46.81, 549459, ["Chateau Frontenac", "Old Quebec", "Citadelle"]),
          ("Valparaiso", "Chile", -33.05, 296655, ["Cerro Alegre", "La Sebastiana", "Ascensor Artilleria"]),
          ("Bergen", "Norway", 60.39, 285911, ["Bryggen", "Floyen", "Fish Market"]),
          ("Cusco", "Peru", -13.53, 428450, ["Sacsayhuaman", "Plaza de Armas", "Qorikancha"])]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "tags", "address"]}


def chat(q: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def city_document(name, country, lat, pop, marks) -> str:
    """A long synthetic encyclopedia page (the benchmark's documents are Wikipedia pages; offline here)."""
    paras = [
        f"{name} is a city in {country}. It lies at a latitude of {lat} degrees and had a population of {pop} "
        f"at the last census. The city is known for {marks[0]}, {marks[1]} and {marks[2]}.",
        f"The history of {name} begins with a small settlement on the river. Over the centuries merchants built "
        "warehouses, bridges and a cathedral, and the town grew into a center of trade and learning. Its old "
        "quarter keeps the narrow streets, covered passages and stone houses of that period.",
        f"The economy of {name} rests on services, tourism, light industry and a large university. The port and "
        "the railway station connect it with the rest of the country, and a ring road carries most of the traffic "
        "around the historic center.",
        f"Visitors come for {marks[0]}, which dominates the skyline, for {marks[1]}, where markets have been held "
        f"since the middle ages, and for {marks[2]}. Festivals fill the streets in summer, and the museums hold "
        "collections of painting, sculpture, archaeology and natural history.",
        f"The climate of {name} is temperate, with warm summers and cool, wet winters. Parks and gardens cover a "
        "large share of the city, and the surrounding hills are popular for walking and cycling.",
    ]
    return "\n\n".join(paras * 2)


def city_prompt(doc: str) -> str:
    return chat("Please extract the information of a city from the following wikipedia page.\nPage begin.\n"
                f"{doc}\nPage end.\nHere is the name, country, and symbol of the city in JSON format.")


def character_prompt(name: str) -> str:
    return chat(f"{name} is a character in Harry Potter. Please fill in the following information about this "
                "character as JSON.")


def run_mode(eng: Engine, prompts, params, jf: bool, concurrency: int) -> dict:
    """Prompts cached first (a max_new_tokens=0 prefill), then the timed generation: decode + jump extends."""
    eng.scheduler.enable_jump_forward = jf
    eng.flush_cache()
    eng.generate(prompts, {"max_new_tokens": 0})
    s0 = dict(eng.stats())
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += eng.generate(prompts[i:i + concurrency], params)
    dt = time.perf_counter() - t0
    s1 = eng.stats()
    tokens = sum(len(o["output_ids"]) for o in outs)
    chars = sum(len(o["text"]) for o in outs)
    return {"seconds": dt, "output_tokens": tokens, "tok_per_s": tokens / dt, "output_chars": chars,
            "chars_per_s": chars / dt, "requests_per_s": len(outs) / dt,
            "forward_passes_per_request": sum(o["meta_info"]["forward_passes"] for o in outs) / len(outs),
            "engine_forwards": s1["forwards"] - s0["forwards"],
            "jump_forward_tokens_per_request": sum(o["meta_info"]["jump_forward_tokens"] for o in outs) / len(outs),
            "retokenized_tokens_per_request": sum(o["meta_info"]["retokenized_tokens"] for o in outs) / len(outs),
            "jump_seconds": s1["jump_seconds"] - s0["jump_seconds"],
            "finished": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs), "requests": len(outs),
            "texts": [o["text"] for o in outs]}


TIMED = ("seconds", "tok_per_s", "chars_per_s", "requests_per_s", "jump_seconds")


def summarize(runs: list[dict]) -> dict:
    """One configuration's repetitions: timed figures as a spread, counts as exact (greedy: they repeat)."""
    return {k: (spread if k in TIMED else exact)([r[k] for r in runs]) for k in runs[0]}


def compare(eng: Engine, prompts, params, concurrency: int, regex: str, repeat: int) -> dict:
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    examples: dict[str, str] = {}
    for _ in range(repeat):
        for jf in (True, False):  # on then off within each repetition
            r = run_mode(eng, prompts, params, jf, concurrency)
            texts = r.pop("texts")
            r["valid"] = sum(re.fullmatch(regex, t) is not None for t in texts)
            runs["on" if jf else "off"].append(r)
            examples.setdefault("on" if jf else "off", texts[0])
    out: dict = {key: {**summarize(runs[key]), "example": examples[key]} for key in ("on", "off")}
    pairs = list(zip(runs["on"], runs["off"]))
    # Jump-forward emits the canonical (longest-match) tokens, so the same text is fewer tokens than the model
    # spells when it samples every token: compare output text per second; tokens/s is kept for reference.
    out["throughput_ratio"] = spread([on["chars_per_s"] / off["chars_per_s"] for on, off in pairs])
    out["token_throughput_ratio"] = spread([on["tok_per_s"] / off["tok_per_s"] for on, off in pairs])
    out["request_throughput_ratio"] = spread([on["requests_per_s"] / off["requests_per_s"] for on, off in pairs])
    out["forward_pass_reduction"] = exact([1 - on["forward_passes_per_request"] / off["forward_passes_per_request"]
                                           for on, off in pairs])
    out["engine_forward_reduction"] = exact([1 - on["engine_forwards"] / off["engine_forwards"] for on, off in pairs])
    out["concurrency"] = concurrency
    return out


def character(eng: Engine, args) -> dict:
    prompts = [character_prompt(n) for n in NAMES][:args.batch]
    params = {"max_new_tokens": 256, "temperature": 0, "regex": CHARACTER_REGEX}
    return {"concurrency_1": compare(eng, prompts[:args.sequential], params, 1, CHARACTER_REGEX, args.repeat),
            f"concurrency_{len(prompts)}": compare(eng, prompts, params, len(prompts), CHARACTER_REGEX, args.repeat)}


def city(eng: Engine, args) -> dict:
    prompts = [city_prompt(city_document(*c)) for c in CITIES][:args.batch]
    params = {"max_new_tokens": 256, "temperature": 0, "regex": CITY_REGEX}
    out = {"prompt_tokens": sum(len(eng.tokenizer.encode(p)) for p in prompts) / len(prompts)}
    out["concurrency_1"] = compare(eng, prompts[:args.sequential], params, 1, CITY_REGEX, args.repeat)
    out[f"concurrency_{len(prompts)}"] = compare(eng, prompts, params, len(prompts), CITY_REGEX, args.repeat)
    return out


def reuse(eng: Engine, args) -> dict:
    cache = eng.grammars
    cache.compile("regex", "a")  # build the tokenizer info / compiler outside the timings
    compiler = cache._get_compiler()
    out = {}
    for label, params in (("character_regex", {"regex": CHARACTER_REGEX}), ("nested_json_schema",
                                                                            {"json_schema": SCHEMA})):
        sp = SamplingParams(**params)
        timings: dict[str, list[float]] = {"reuse": [], "per_request": []}
        for _ in range(args.repeat):
            for mode in ("reuse", "per_request"):  # alternating within each repetition
                cache.compiled.clear()
                compiler.clear_cache()
                t0 = time.perf_counter()
                for _ in range(32):
                    if mode == "per_request":
                        cache.compiled.clear()
                        compiler.clear_cache()
                    cache.matcher(sp)
                timings[mode].append(time.perf_counter() - t0)
        out[label] = {"batch": 32, "reuse_ms": spread([t * 1e3 for t in timings["reuse"]]),
                      "per_request_ms": spread([t * 1e3 for t in timings["per_request"]]),
                      "ratio": spread([p / r for r, p in zip(timings["reuse"], timings["per_request"])])}
    # End to end: a batch of character requests, grammar cached vs compiled in each request's admission.
    prompts = [character_prompt(n) for n in NAMES][:args.batch]
    params = {"max_new_tokens": 256, "temperature": 0, "regex": CHARACTER_REGEX}
    eng.scheduler.enable_jump_forward = True
    orig = cache.compile

    def per_request(kind, text):
        cache.compiled.pop((kind, text), None)
        compiler.clear_cache()
        return orig(kind, text)

    e2e: dict[str, list[float]] = {"reuse": [], "per_request": []}
    for mode in ("reuse", "per_request") * args.repeat:
        cache.compile = per_request if mode == "per_request" else orig
        try:
            eng.flush_cache()
            eng.generate(prompts, {"max_new_tokens": 0})
            t0 = time.perf_counter()
            eng.generate(prompts, params)
            e2e[mode].append(time.perf_counter() - t0)
        finally:
            cache.compile = orig
    out[f"end_to_end_{len(prompts)}_character_requests"] = {
        "reuse_s": spread(e2e["reuse"]), "per_request_s": spread(e2e["per_request"]),
        "ratio": spread([p / r for r, p in zip(e2e["reuse"], e2e["per_request"])])}
    return out


def validity(eng: Engine, samples: int = 20) -> dict:
    import jsonschema
    from constrained_corpus import REGEXES, SCHEMAS

    out = {}
    for kind, corpus in (("regex", REGEXES), ("json_schema", SCHEMAS)):
        for jf in (True, False):
            eng.scheduler.enable_jump_forward = jf
            prompts, params, grammars = [], [], []
            for _, q, g, m in corpus:
                for seed in range(samples):
                    prompts.append(chat(q))
                    params.append({"max_new_tokens": m, "temperature": 1.0, "seed": seed, kind: g})
                    grammars.append(g)
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params)
            dt = time.perf_counter() - t0
            finished = invalid = errors = 0
            for g, o in zip(grammars, outs):
                if "error" in o:
                    errors += 1
                    continue
                if o["meta_info"]["finish_reason"]["type"] != "stop":
                    continue
                finished += 1
                if kind == "regex":
                    invalid += re.fullmatch(g, o["text"]) is None
                else:
                    try:
                        jsonschema.validate(json.loads(o["text"]), g)
                    except (ValueError, jsonschema.ValidationError):
                        invalid += 1
            ok = [o for o in outs if "error" not in o]
            out[f"{kind}_{'on' if jf else 'off'}"] = {
                "grammars": len(corpus), "samples": len(outs), "finished": finished, "invalid": invalid,
                "errors": errors, "finished_share": finished / len(outs), "seconds": dt,
                "forward_passes_per_request": sum(o["meta_info"]["forward_passes"] for o in ok) / max(len(ok), 1),
                "jump_forward_tokens_per_request":
                    sum(o["meta_info"]["jump_forward_tokens"] for o in ok) / max(len(ok), 1)}
    out["canonical_checks"] = eng.stats()["canonical_checks"]
    return out


BENCHES = {"character": character, "city": city, "reuse": reuse}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("only", nargs="*", default=list(BENCHES), help=f"benchmarks to run (default: all of "
                                                                   f"{list(BENCHES)})")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of each timed comparison (default 3)")
    ap.add_argument("--sequential", type=int, default=4, help="requests run one at a time (default 4)")
    ap.add_argument("--batch", type=int, default=16, help="requests in one batch (default 16; city: at most 8)")
    ap.add_argument("--validity", action="store_true", help="also run the corpus sweep (--samples per grammar)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "jump_forward_cpu.json"))
    args = ap.parse_args()
    unknown = set(args.only) - set(BENCHES)
    if unknown:
        ap.error(f"unknown benchmark(s) {sorted(unknown)}")
    for name in ("repeat", "sequential", "batch", "samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    prov = provenance("benchmarks/jump_forward_bench.py", SHARED_MACHINE_NOTE)
    eng = Engine()  # timed runs without the per-step invariant checks; the validity sweep turns them on
    results: dict = {"model": eng.model_name, "device": "cpu", "threads": torch.get_num_threads(),
                     "repeat": args.repeat, "provenance": prov}
    for name in args.only:
        t0 = time.perf_counter()
        results[name] = BENCHES[name](eng, args)
        print(f"[{name}: {time.perf_counter() - t0:.0f}s]", flush=True)
    if args.validity:
        # Slot accounting after every step, and after every jump: output ids == canonical encoding of the text.
        eng.check_invariants = eng.scheduler.debug_checks = True
        t0 = time.perf_counter()
        results["validity"] = validity(eng, args.samples)
        print(f"[validity: {time.perf_counter() - t0:.0f}s]", flush=True)
    eng.shutdown()
    finish(prov)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    report(results)
    print(f"wrote {args.out}")


def report(res: dict) -> None:
    """Medians on the console (the JSON has the spreads)."""
    for name in ("character", "city"):
        if name not in res:
            continue
        print(f"\n{name}: jump-forward on vs off (same engine, prompts cached, greedy; medians of {res['repeat']})")
        print(f"{'concurrency':>11} {'mode':>4} {'chars/s':>8} {'tok/s':>8} {'passes/req':>10} {'engine fwd':>10} "
              f"{'jf tok/req':>10} {'valid':>6}")
        for key, c in res[name].items():
            if not key.startswith("concurrency_"):
                continue
            for mode in ("on", "off"):
                m = {k: median(v) for k, v in c[mode].items()}
                print(f"{c['concurrency']:>11} {mode:>4} {m['chars_per_s']:>8.1f} {m['tok_per_s']:>8.1f} "
                      f"{m['forward_passes_per_request']:>10.1f} {m['engine_forwards']:>10} "
                      f"{m['jump_forward_tokens_per_request']:>10.1f} {m['valid']:>3}/{m['requests']}")
            print(f"{'':>11} throughput x{median(c['throughput_ratio']):.2f} (chars/s; tokens/s "
                  f"x{median(c['token_throughput_ratio']):.2f}), forward passes per request "
                  f"-{100 * median(c['forward_pass_reduction']):.0f}%, "
                  f"engine forwards -{100 * median(c['engine_forward_reduction']):.0f}%")
    if "reuse" in res:
        print("\ngrammar reuse across a batch vs compiling per request (medians)")
        for label, r in res["reuse"].items():
            m = {k: median(v) for k, v in r.items()}
            unit = "ms" if "reuse_ms" in m else "s"
            print(f"  {label:>22}: {m[f'reuse_{unit}']:.2f} {unit} vs {m[f'per_request_{unit}']:.2f} {unit} "
                  f"(x{m['ratio']:.2f})")
    if "validity" in res:
        print("\nvalidity corpus (temperature 1.0, one run)")
        for key, v in res["validity"].items():
            if isinstance(v, dict):
                print(f"  {key:>16}: {v['finished']}/{v['samples']} finished ({100 * v['finished_share']:.1f}%), "
                      f"{v['invalid']} invalid, {v['errors']} errors, {v['seconds']:.0f} s, "
                      f"{v['forward_passes_per_request']:.1f} passes/req")


if __name__ == "__main__":
    main()
