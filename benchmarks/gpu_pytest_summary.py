"""The test suite's outcome on the GPU machine, from pytest's JUnit XML -> results/gpu_pytest.json: counts per
test file and the failures and errors grouped by their first message line (numbers as N), so RESULTS.md can say what passed
there and why the rest did not.

    python benchmarks/gpu_pytest_summary.py gpu_pytest.xml --device "..." --command "..." --note "..." \
        --out results/gpu_pytest.json

(benchmarks/gpu_suite.sh runs the suite there and this script after it.)
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import xml.etree.ElementTree as ET


def summarize(xml_path: str) -> dict:
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    causes: collections.Counter = collections.Counter()
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = (case.get("classname") or "").split(".")[-1] or "(collection)"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                text = (child.get("message") or child.text or "").strip()
                first = text.splitlines()[0][:160] if text else child.tag
                causes[re.sub(r"-?\d+", "N", first)] += 1  # one cause whatever its numbers
            elif child.tag == "skipped":
                outcome = "skipped"
        files[name][outcome] += 1
    total = collections.Counter()
    for c in files.values():
        total.update(c)
    return {"total": dict(total), "files": {f: dict(c) for f, c in sorted(files.items())},
            "causes": [{"count": n, "message": m} for m, n in causes.most_common()]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("xml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", required=True, help="the pytest command that wrote the XML")
    ap.add_argument("--device", default="NVIDIA H200")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    res = {"device": args.device, "command": args.command, "note": args.note, **summarize(args.xml)}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res["total"]))


if __name__ == "__main__":
    main()
