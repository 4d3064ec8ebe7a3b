"""What every benchmark writes next to its numbers: the spread of repeated runs and how the runs were made.

A figure measured over several runs is stored as `spread(values)`: {"median", "min", "max", "runs"}. report.py
renders it as "median (min-max, n runs)". A count expected to repeat exactly is stored as `exact(values)`: the
plain value when all runs agree, a spread when they did not. `provenance()` records the command line and the
machine's load, since the machines these run on are shared and a number without its conditions cannot be judged.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time


def spread(values: list[float]) -> dict:
    """Median, min, max and the runs themselves (in the order they ran)."""
    if not values:
        raise ValueError("spread of no runs")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def median(v):
    """The median of a spread, or the value of an exact figure."""
    return v["median"] if isinstance(v, dict) else v


def exact(values: list):
    """A count that should be the same in every run (tokens, forward passes, valid outputs at temperature 0): the
    value itself when every run gave it, else its spread, so that a run that differed shows instead of hiding."""
    if not values:
        raise ValueError("exact value of no runs")
    return values[0] if all(v == values[0] for v in values) else spread(values)


def cpu_model() -> str:
    """The CPU's model name and widest vector ISA ("AMD EPYC, AVX2"): the kernels differ per ISA (the panel GEMM's
    tile), so a figure is only comparable with one measured on the same kind of CPU."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    flags = set(info.split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name}, {isa}"


def provenance(script: str, note: str = "") -> dict:
    """The command that produced a results file (script path relative to the repository) and the load average
    when it started. Call `finish(prov)` when the runs are done to add the load at the end."""
    return {"command": " ".join(["python", script, *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(), "cpu_model": cpu_model(), "load_avg_1m_start": os.getloadavg()[0], "note": note}


def finish(prov: dict) -> dict:
    prov["load_avg_1m_end"] = os.getloadavg()[0]
    return prov


# What the machine was doing, for the provenance: the default describes the shared 2-core machine most records were
# made on (a larger one is a lent GPU machine, which runs one command at a time); LMC_MACHINE_NOTE replaces it when
# anything else is worth saying.
SHARED_MACHINE_NOTE = os.environ.get("LMC_MACHINE_NOTE") or (
    "2-core machine shared with other engineers' jobs while this ran: absolute times move with their load (see "
    "load_avg_1m_*); systems alternate within each repetition" if (os.cpu_count() or 1) <= 2 else
    f"{os.cpu_count()}-CPU machine (a lent GPU machine runs one command at a time: nothing else ran); systems "
    "alternate within each repetition")


def jsonable(v):
    """v itself where JSON can hold it, else its repr (a program variable of any type, for an outputs check)."""
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)
