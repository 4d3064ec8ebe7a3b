"""The numbers on record are the numbers measured: RESULTS.md and README's numbers are what benchmarks/report.py
generates from benchmarks/results/*.json (a hand edit fails here), and every number README quotes is in the JSON."""
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

PERCENT_RANGE = re.compile(r"([\d.]+)% \(([\d.]+)-([\d.]+), (\d+ runs\))")
NUMBER = re.compile(r"(?<![\w.,])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?!\d)(%?)")


def test_results_md_is_what_report_generates():
    assert report.RESULTS_MD.read_text() == report.render_results(), (
        "benchmarks/RESULTS.md differs from what benchmarks/report.py generates from benchmarks/results/*.json: "
        "run `python benchmarks/report.py` (do not edit RESULTS.md by hand)")


def test_readme_block_is_what_report_generates():
    readme = report.README.read_text()
    assert readme == report.readme_with_block(readme, report.render_readme_block()), (
        "README.md's results block is stale: run `python benchmarks/report.py`")


def _json_numbers(results_dir: Path) -> list[float]:
    """Every numeric leaf of every results file, and the length of every list (run counts)."""
    out: list[float] = []

    def walk(v):
        if isinstance(v, bool):
            return
        if isinstance(v, (int, float)):
            out.append(float(v))
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            out.append(float(len(v)))
            for x in v:
                walk(x)

    for p in results_dir.glob("*.json"):
        walk(json.loads(p.read_text()))
    return out


def _quoted_numbers(text: str) -> list[tuple[str, float, int, bool]]:
    """(as written, value, decimals, is a percentage) for each number outside code spans (names like
    `llama-2-7b` and commands are not quotes of a measurement)."""
    text = re.sub(r"`[^`]*`", "", text)
    # the range of a percentage, "74.0% (72.0-74.0, 3 runs)", is in percent too
    text = PERCENT_RANGE.sub(lambda m: f"{m[1]}% ({m[2]}%-{m[3]}%, {m[4]}", text)
    found = []
    for m in NUMBER.finditer(text):
        whole, frac, percent = m.groups()
        value = float(whole.replace(",", "") + ("." + frac if frac else ""))
        found.append((m.group(0), value, len(frac or ""), bool(percent)))
    return found


def _in_json(value: float, decimals: int, percent: bool, numbers: list[float]) -> bool:
    scale = 100 if percent else 1
    return any(abs(round(n * scale, decimals) - value) < 1e-9 for n in numbers)


def _numbers_section(readme: str) -> str:
    start = readme.index("## Numbers")
    end = readme.find("\n## ", start + 1)
    return readme[start:end if end != -1 else None]


def test_every_number_in_readme_numbers_section_is_in_the_json():
    section = _numbers_section(report.README.read_text())
    assert report.README_BEGIN in section and report.README_END in section
    numbers = _json_numbers(report.RESULTS_DIR)
    quoted = _quoted_numbers(section)
    assert len(quoted) >= 10  # the section does quote numbers: the check below is not vacuous
    missing = [q for q, v, d, p in quoted if not _in_json(v, d, p, numbers)]
    assert not missing, f"README quotes numbers that no results JSON holds: {missing}"


def test_number_check_catches_a_hand_typed_number():
    numbers = _json_numbers(report.RESULTS_DIR)
    (_, v, d, p), = _quoted_numbers("the few-shot workload runs 8.7123x transformers")
    assert not _in_json(v, d, p, numbers)
    (_, v, d, p), = _quoted_numbers("93.8% of prompt tokens")
    assert _in_json(v, d, p, [0.9376])
    assert [q[1:] for q in _quoted_numbers("74.0% (72.0-74.0, 3 runs)")] == \
        [(74.0, 1, True), (72.0, 1, True), (74.0, 1, True), (3, 0, False)]


def test_a_missing_results_file_omits_its_section(tmp_path):
    shutil.copy(report.RESULTS_DIR / "frontend_overhead.json", tmp_path)
    text = report.render_results(tmp_path)
    assert "## Frontend (interpreter) overhead" in text and "## CPU" not in text and "## Compiler" not in text
    assert "Command: `python benchmarks/frontend_overhead.py" in text
    assert "Compiled / interpreted" not in report.render_readme_block(tmp_path)  # README's line goes with it


def test_every_results_file_is_optional(tmp_path):
    """Without the compiler_examples records their sections go (and the report renders without any other file)."""
    for p in report.RESULTS_DIR.glob("*.json"):
        if not p.name.startswith("compiler_examples"):
            shutil.copy(p, tmp_path)
    text = report.render_results(tmp_path)
    assert "## Compiler" not in text and "## Jump-forward" in text and "## API speculative" in text
    assert report.render_results(tmp_path / "absent") == report.HEADER


def test_a_file_its_renderer_cannot_read_is_named(tmp_path):
    (tmp_path / "speculation.json").write_text(json.dumps({"provenance": {"command": "python x.py"}}))
    with pytest.raises(ValueError, match="results/speculation.json"):
        report.render_results(tmp_path)


def test_exact_counts_show_a_run_that_differed():
    import record

    assert record.exact([34.5, 34.5, 34.5]) == 34.5 and report.count(34.5, 1) == "34.5"
    differed = record.exact([130, 134, 130])
    assert differed == {"median": 130, "min": 130, "max": 134, "runs": [130, 134, 130]}
    assert report.count(differed) == "130 (130-134, 3 runs)"
    assert report.pct(0.75, 0, exact=True) == "75%" and report.pct(0.75, 0) == "75% (1 run)"


TIMED = {"seconds", "chars_per_s", "tok_per_s", "requests_per_s", "throughput_ratio", "token_throughput_ratio",
         "request_throughput_ratio", "reuse_ms", "per_request_ms", "reuse_s", "per_request_s", "ratio", "wall_s",
         "wall_ratio"}
ONCE = {"validity", "robustness"}  # sections the scripts run once, and say so


def _timed_figures(v, path=""):
    """(path, value) of every timed figure in a results file, outside the sections run once."""
    if isinstance(v, dict) and not report.is_spread(v):
        for k, x in v.items():
            if k in TIMED:
                yield f"{path}/{k}", x
            elif k not in ONCE:
                yield from _timed_figures(x, f"{path}/{k}")


@pytest.mark.parametrize("name, script", [("jump_forward_cpu.json", "jump_forward_bench.py"),
                                          ("speculation.json", "speculation_bench.py")])
def test_recorded_times_are_medians_of_at_least_3_runs_with_their_command(name, script):
    """No best-of-two: every time in the file is a spread of its --repeat (>= 3) alternated runs, and the file
    says how it was made (command, machine load)."""
    r = json.loads((report.RESULTS_DIR / name).read_text())
    prov = r["provenance"]
    assert prov["command"].startswith(f"python benchmarks/{script}")
    assert {"load_avg_1m_start", "load_avg_1m_end", "cpus"} <= set(prov)
    figures = list(_timed_figures(r))
    assert len(figures) >= 6 and r["repeat"] >= 3
    for path, f in figures:
        assert report.is_spread(f) and len(f["runs"]) == r["repeat"], (path, f)
        assert f["min"] <= f["median"] <= f["max"], path


def test_a_registered_section_renders_each_matching_file(tmp_path, monkeypatch):
    """How another engineer adds a section: a renderer keyed by a results-file glob."""
    for name, value in (("suite_a.json", 1.5), ("suite_b.json", 2.5)):
        (tmp_path / name).write_text(json.dumps({"x": {"median": value, "min": 1, "max": 3, "runs": [1, value, 3]},
                                                 "provenance": {"command": f"python make_{name}"}}))
    monkeypatch.setitem(report.SECTIONS, "suite*.json",
                        lambda r, d: f"## test section\n\n{report.command(r)} x = {report.fig(r['x'])}\n")
    text = report.render_results(tmp_path)
    assert "Command: `python make_suite_a.json`. x = 1.50 (1.00-3.00, 3 runs)" in text
    assert "Command: `python make_suite_b.json`. x = 2.50 (1.00-3.00, 3 runs)" in text


def test_figures_state_their_spread_and_a_file_without_its_command_is_refused(tmp_path):
    assert report.fig({"median": 2.0, "min": 1.0, "max": 4.0, "runs": [1.0, 2.0, 4.0]}, 1, " ms") == \
        "2.0 ms (1.0-4.0, 3 runs)"
    assert report.fig(7.444, 2, "x") == "7.44x (1 run)"
    (tmp_path / "frontend_overhead.json").write_text(json.dumps(
        {k: v for k, v in json.loads((report.RESULTS_DIR / "frontend_overhead.json").read_text()).items()
         if k != "provenance"}))
    with pytest.raises(ValueError, match="records no command"):
        report.render_results(tmp_path)


def test_plots_are_drawn_from_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    import plot

    for p in report.RESULTS_DIR.glob("*.json"):
        shutil.copy(p, tmp_path)
    panels = {title: vals for title, vals, _ in plot.summary_panels(tmp_path)}
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert panels["CPU few-shot (programs/s)"]["lmc"] == cpu["few_shot"]["lmc_programs_s"]
    plot.main(tmp_path)
    assert (tmp_path / "summary.png").stat().st_size > 0 and (tmp_path / "compiler_examples.png").stat().st_size > 0


@pytest.mark.parametrize("record", ["compiler_examples.json", "compiler_examples_h200.json"])
def test_compiler_examples_section_shows_each_example_from_the_json(record):
    r = json.loads((report.RESULTS_DIR / record).read_text())
    assert r["provenance"]["command"].startswith("python benchmarks/compiler_bench.py")
    text = report.render_compiler(r, report.RESULTS_DIR)
    assert ("NVIDIA H200" in text.splitlines()[0]) == r["config"]["device"].startswith("cuda")
    for name, e in r["examples"].items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert report.fig(e["interpreted"]["programs_s"]) in row and report.fig(e["compiled"]["programs_s"]) in row
        assert f"{report.num(e['ratio_of_medians'])}x" in row
        assert e["ratio"]["min"] <= e["ratio"]["median"] <= e["ratio"]["max"]


def test_scale_section_shows_each_system_and_its_command_from_the_json():
    r = json.loads((report.RESULTS_DIR / "scale.json").read_text())
    assert r["provenance"]["command"].startswith("python benchmarks/scale_bench.py")
    text = report.render_scale(r, report.RESULTS_DIR)
    for name, label in report.SCALE_SYSTEMS.items():
        s = r["summary"][name]
        assert report.is_spread(s["requests_s"]) and len(s["requests_s"]["runs"]) == r["runs"] >= 3
        row = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        assert report.fig(s["requests_s"]) in row and report.pct(s["hit_rate"]) in row
    assert "Command: `python benchmarks/scale_bench.py" in text and "results/scale.png" in text


def test_cpu_speed_section_shows_each_configuration_and_both_commands():
    r = json.loads((report.RESULTS_DIR / "cpu_speed.json").read_text())
    text = report.render_cpu_speed(r, report.RESULTS_DIR)
    assert text.count("Command: `python benchmarks/cpu_speed.py") == 2 and "--only-start" in text
    row = next(line for line in text.splitlines() if line.startswith("| decode, batch 16"))
    assert [report.fig(r["results"][n]["decode_b16_tok_s"], 1) for n in r["configs"]] == \
        row.strip("| ").split(" | ")[1:]
