"""`lmc serve --dp N`: N engine processes behind SGLang's gateway (`sglang-router`, the `scale` extra).

    ReplicaSet(plan_replicas(2), worker_argv=["--model", "smollm2-135m-instruct"], port=30000).run()

- Each replica is `lmc serve` on a loopback port of its own, pinned to its share of the cores
  (`os.sched_setaffinity` before exec, and as many torch threads as cores), and to one GPU each
  (`CUDA_VISIBLE_DEVICES`) when the machine has at least N.
- The gateway is the real one: `python -m sglang_router.launch_router --worker-urls ... --policy POLICY`,
  started once every replica answers /health, on the port the user asked for. Clients (`lmc.RuntimeEndpoint`,
  `lmc.OpenAI`, the openai client) use its URL as they would one `lmc serve`.
- Every child runs in its own session (process group) and gets SIGTERM if the launcher dies (PR_SET_PDEATHSIG),
  so no child outlives it. Stopping (SIGTERM/SIGINT to the launcher, or `stop()`) terminates each group by its
  id, then kills what is left after a grace period.
- A replica that exits while the set runs is restarted on the same port; the gateway's health checker takes it
  back once it answers /health again. The gateway exiting stops the set.

Program affinity: the gateway's `manual` policy routes every request carrying the same `X-SMG-Routing-Key` header
to the same worker (its other policies ignore the header; `cache_aware` keeps a program's calls together through
their shared prefix). `lmc.RuntimeEndpoint` sends one key per program instance.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
# Gateway settings for replicas on one host: health checks often enough that a killed replica is dropped (and a
# restarted one taken back) within seconds; a replica failing 3 requests in a row (dead, or 503: its admission
# limit is full) is skipped for 5 s, so its traffic goes to the others; a short shutdown grace (default 180 s).
GATEWAY_DEFAULTS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                    "--health-success-threshold", "1", "--health-check-timeout-secs", "2",
                    "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "5",
                    "--shutdown-grace-period-secs", "2")
SCALE_EXTRA_HINT = "pip install 'lmc[scale]'"


class ReplicaError(ValueError):
    """A replica set that cannot be planned or started (bad --dp, no gateway, a child that would not start)."""


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica: its index, the cores it may run on (`threads` torch threads) and its GPU (None on CPU)."""
    index: int
    cpus: tuple[int, ...]
    threads: int
    gpu: int | None = None


def visible_gpus() -> list[int]:
    """GPU indices this process may use: CUDA_VISIBLE_DEVICES when set, else what `nvidia-smi -L` lists (no torch
    import: the launcher stays light)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(x) for x in env.split(",") if x.strip().isdigit()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [i for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def plan_replicas(n: int, *, device: str = "auto", cpus: list[int] | None = None,
                  gpus: list[int] | None = None) -> list[ReplicaPlan]:
    """Split the machine among `n` replicas. On CPU each gets a contiguous share of the cores (at least one);
    with GPUs (`device` auto or cuda) each gets one. Raises ReplicaError naming the problem."""
    if n < 1:
        raise ReplicaError(f"--dp must be at least 1 (got {n})")
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    gpus = (visible_gpus() if device in ("auto", "cuda") else []) if gpus is None else list(gpus)
    if device == "cuda" and len(gpus) < n:
        raise ReplicaError(f"--dp {n} with --device cuda needs {n} GPUs; {len(gpus)} visible")
    if n > len(cpus):
        raise ReplicaError(f"--dp {n} needs at least {n} cores (one per replica); this process may use "
                           f"{len(cpus)}: {','.join(map(str, cpus))}")
    use_gpus = len(gpus) >= n
    base, extra = divmod(len(cpus), n)
    plans, start = [], 0
    for i in range(n):
        share = tuple(cpus[start:start + base + (i < extra)])
        start += len(share)
        plans.append(ReplicaPlan(i, share, len(share), gpus[i] if use_gpus else None))
    return plans


def gateway_command(host: str, port: int, worker_urls: list[str], policy: str, api_key: str | None,
                    extra: list[str]) -> list[str]:
    """The gateway's command line; raises ReplicaError naming the extra when the package is missing."""
    try:
        import sglang_router  # noqa: F401
        from sglang_router import sglang_router_rs  # noqa: F401 - the Rust gateway itself
    except ImportError as e:
        raise ReplicaError(f"lmc serve --dp needs SGLang's gateway (the sglang-router package): "
                           f"{SCALE_EXTRA_HINT} ({e})") from None
    if policy not in POLICIES:
        raise ReplicaError(f"--router-policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    if policy == "power_of_two" and len(worker_urls) < 2:
        raise ReplicaError("--router-policy power_of_two needs at least 2 replicas (--dp 2)")
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
           "--policy", policy, *GATEWAY_DEFAULTS, "--worker-urls", *worker_urls]
    if "--prometheus-port" not in extra:  # its default (29000) would collide with a second gateway on the host
        cmd += ["--prometheus-port", str(free_port())]
    if api_key:
        cmd += ["--api-key", api_key]  # sent to the workers as Authorization: Bearer
    return cmd + list(extra)


def gateway_env() -> dict[str, str]:
    """The gateway's environment. It looks up a tokenizer for each worker's model_path on the Hugging Face hub
    (it needs none to route HTTP text) and ignores HF_HUB_OFFLINE; it honours HF_ENDPOINT, so offline that points
    at a closed loopback port: the lookup fails at once, and nothing reaches the hub."""
    env = dict(os.environ)
    if env.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> int:
    req = urllib.request.Request(url)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return 0


def _child_setup(cpus: tuple[int, ...] | None):
    """preexec_fn: die with the launcher, and run on `cpus` (inherited by the exec'd process and its threads)."""
    def setup() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass
class Child:
    """One child process (a replica or a gateway), restartable with the same command line."""
    name: str
    argv: list[str]
    env: dict[str, str]
    cpus: tuple[int, ...] | None
    url: str = ""
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self, log_file) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log_file, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=_child_setup(self.cpus))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the child's own session: its id is the child's pid
        except ProcessLookupError:
            pass


@dataclass
class ReplicaSet:
    """N `lmc serve` replicas and the gateway in front of them (see the module docstring)."""
    plans: list[ReplicaPlan]
    worker_argv: list[str]  # `lmc serve` options for each replica (model, api key, engine sizes), no host/port
    port: int = 30000
    host: str = "127.0.0.1"
    policy: str = "cache_aware"
    api_key: str | None = None
    gateway_args: list[str] = field(default_factory=list)
    log_level: str = "info"
    startup_timeout: float = 600.0
    log_file: object = None  # where the children write (default: the launcher's stderr)
    replicas: list[Child] = field(default_factory=list, init=False)
    gateway: Child | None = field(default=None, init=False)
    _stopping: bool = field(default=False, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def replica_urls(self) -> list[str]:
        return [c.url for c in self.replicas]

    # ---- starting ----------------------------------------------------------------------------------------
    def start(self) -> "ReplicaSet":
        out = self.log_file if self.log_file is not None else sys.stderr
        if self.port == 0:
            self.port = free_port(self.host)
        for p in self.plans:
            env = {**os.environ, "OMP_NUM_THREADS": str(p.threads), "MKL_NUM_THREADS": str(p.threads)}
            if p.gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(p.gpu)
            port = free_port()
            argv = [sys.executable, "-m", "lmc.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                    *self.worker_argv]
            self.replicas.append(Child(f"replica {p.index}", argv, env, p.cpus, f"http://127.0.0.1:{port}"))
        # before any child starts: a missing gateway or a bad policy fails now
        gw = gateway_command(self.host, self.port, self.replica_urls(), self.policy, self.api_key,
                             ["--log-level", {"warning": "warn"}.get(self.log_level, self.log_level),
                              *self.gateway_args])
        try:
            for c in self.replicas:
                c.start(out)
            self._wait_healthy()
            self.gateway = Child("gateway", gw, gateway_env(), None)
            self.gateway.start(out)
            self._wait_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pending = list(self.replicas)
        while pending:
            if self._stopping:
                raise ReplicaError("stopped while the replicas were starting")
            for c in list(pending):
                if not c.alive():
                    raise ReplicaError(f"{c.name} exited with status {c.proc.returncode} while starting "
                                       f"(its log is above)")
                if _get(c.url + "/health") == 200:
                    pending.remove(c)
            if pending and time.monotonic() > deadline:
                raise ReplicaError(f"{', '.join(c.name for c in pending)} did not answer /health within "
                                   f"{self.startup_timeout:.0f} s")
            time.sleep(0.2)

    def _wait_gateway(self) -> None:
        """Until the gateway routes: its /readiness is 200 once it holds a healthy worker. Workers are
        registered in the background, so also wait until it lists all of them."""
        deadline = time.monotonic() + 120
        while True:
            if self._stopping:
                raise ReplicaError("stopped while the gateway was starting")
            if not self.gateway.alive():
                raise ReplicaError(f"the gateway exited with status {self.gateway.proc.returncode} while "
                                   f"starting (its log is above)")
            if _get(self.url + "/readiness") == 200 and self.registered_workers() >= len(self.replicas):
                return
            if time.monotonic() > deadline:
                raise ReplicaError("the gateway did not become ready within 120 s")
            time.sleep(0.2)

    def registered_workers(self) -> int:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url + "/workers", headers=headers),
                                        timeout=2) as r:
                return len(json.load(r).get("workers", []))
        except (OSError, ValueError):
            return 0

    # ---- running -----------------------------------------------------------------------------------------
    def describe(self) -> dict:
        """What started (printed as one JSON line by `lmc serve --dp`: tests and scripts read the PIDs)."""
        return {"event": "ready", "url": self.url, "policy": self.policy, "gateway_pid": self.gateway.pid,
                "replicas": [{"index": p.index, "url": u, "pid": c.pid, "cpus": list(p.cpus), "gpu": p.gpu}
                             for p, c, u in zip(self.plans, self.replicas, self.replica_urls())]}

    def supervise(self, poll: float = 0.5, max_restarts: int = 5, window: float = 300.0) -> int:
        """Until stopped: restart a replica that exits; return the gateway's status if it exits, or 1 when a
        replica has exited `max_restarts` times within `window` seconds (a crash loop is not retried forever)."""
        out = self.log_file if self.log_file is not None else sys.stderr
        exits: list[float] = []
        while not self._stopping:
            if not self.gateway.alive():
                log.error("the gateway exited with status %s; stopping the replicas", self.gateway.proc.returncode)
                return self.gateway.proc.returncode or 1
            for c in self.replicas:
                if not c.alive() and not self._stopping:
                    now = time.monotonic()
                    exits = [t for t in exits if t > now - window] + [now]
                    if len(exits) > max_restarts:
                        print(f"lmc: replicas exited {len(exits)} times in {window:.0f} s; stopping",
                              file=sys.stderr, flush=True)
                        return 1
                    c.restarts += 1
                    print(json.dumps({"event": "restart", "replica": c.name, "status": c.proc.returncode,
                                      "restarts": c.restarts}), flush=True)
                    c.signal_group(signal.SIGKILL)  # anything the dead replica left in its group
                    c.start(out)
                    print(json.dumps({"event": "restarted", "replica": c.name, "pid": c.pid}), flush=True)
            time.sleep(poll)
        return 0

    def run(self) -> int:
        """start, print the ready line, supervise until SIGTERM/SIGINT, stop: what `lmc serve --dp` runs."""
        def on_signal(signum, _frame):
            self._stopping = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            print(json.dumps(self.describe()), flush=True)
            return self.supervise()
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)

    # ---- stopping ----------------------------------------------------------------------------------------
    def children(self) -> list[Child]:
        return [c for c in [self.gateway, *self.replicas] if c is not None]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every child's group (the gateway first, so it stops routing), SIGKILL what is left after
        `grace` seconds, and reap them all."""
        self._stopping = True
        for c in self.children():
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in self.children():
            if c.proc is None:
                continue
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            c.signal_group(signal.SIGKILL)  # the group may hold more than the child itself
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %s) did not exit after SIGKILL", c.name, c.pid)
