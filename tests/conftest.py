import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`make test` runs 2 workers) the cores are split between the workers: 2 threads each on 2
# cores would oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if not torch.cuda.is_available():  # CI has no GPU: Triton kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # On a GPU (benchmarks/gpu_suite.sh) the suite's engines get the CPU's defaults, what the tests were written
    # for: fp32 (on a GPU the default is bf16, whose rounding the tests' tolerances and greedy comparisons do not
    # allow for; the GPU tests that mean bf16 say so) and the CPU's KV pool (on a GPU an engine's pool takes most
    # of the card's free memory, so the first xdist worker's engine would leave the others none). An engine given
    # either keeps it.
    from lmc.runtime import engine as _engine

    _engine.Engine.__init__.__kwdefaults__.update(dtype="float32", max_total_tokens=_engine._CPU_DEFAULT_TOKENS)

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-test-key"


@pytest.fixture(scope="session")
def engine():
    """One engine on the embedded model for the whole session, checking slot accounting after every step. In fp32
    on every device (the CPU's default; on a GPU the default is bf16): the suite compares with transformers in
    fp32."""
    from lmc.runtime import Engine

    eng = Engine(MODEL, dtype="float32", check_invariants=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def plain(engine):
    """The reference without overlap (test_overlap, test_shared_blocks): the session engine where overlap is off by
    default (the CPU)."""
    if not engine.scheduler.overlap:
        yield engine
        return
    from lmc.runtime import Engine

    eng = Engine(check_invariants=True, overlap_schedule=False, max_total_tokens=8192)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def overlapped():
    """An engine with overlap scheduling on, checking slot accounting after every step."""
    from lmc.runtime import Engine

    eng = Engine(check_invariants=True, overlap_schedule=True, max_total_tokens=8192)
    assert eng.scheduler.overlap
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own LlamaForCausalLM on the same (converted) weights: the reference."""
    from transformers import AutoModelForCausalLM

    from lmc.runtime.model.loader import resolve

    path = resolve(MODEL).tokenizer_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(engine):
    """`lmc serve`'s app on a loopback port (one per test module), with an API key and metrics on."""
    from lmc.server import ServerThread, create_app

    with ServerThread(create_app(engine, api_key=API_KEY, enable_metrics=True)) as srv:
        yield srv
