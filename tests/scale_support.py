"""`lmc serve --dp N` run as a user runs it (the real CLI in a subprocess, the real gateway), for tests/test_scale*.py.

The launcher prints one JSON line per event on stdout ({"event": "ready", "url", "replicas": [{"url", "pid"}],
"gateway_pid"}, then "restart"/"restarted"); the children's logs go to a file, shown when a test fails to start.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import httpx
except ImportError:  # installs that ship httpx under the name httpx2
    import httpx2 as httpx

from lmc.server.replicas import free_port

from conftest import API_KEY


class LaunchedSet:
    def __init__(self, args: list[str], log_path: Path, timeout: float = 240.0):
        self.port = free_port()
        self.log_path = log_path
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.pids: set[int] = set()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmc.cli", "serve", "--dp", "2", "--port", str(self.port),
                 "--api-key", API_KEY, "--enable-metrics", "--log-level", "warning", *args],
                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self.wait_event("ready", timeout)
        self.url = self.info["url"]
        self.pids |= {self.info["gateway_pid"], *(r["pid"] for r in self.info["replicas"])}
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if "pid" in event:
                self.pids.add(event["pid"])
            self.events.put(event)

    def wait_event(self, name: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                event = None
            if event is not None and event.get("event") == name:
                return event
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"no {name!r} event from `lmc serve --dp` (exit {self.proc.returncode}); "
                                     f"log:\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def replica(self, i: int) -> httpx.Client:
        return httpx.Client(base_url=self.info["replicas"][i]["url"],
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)

    def requests_served(self, i: int) -> int:
        """Finished requests of replica i (its own counter, lmc:num_requests_total)."""
        with self.replica(i) as c:
            for line in c.get("/metrics").text.splitlines():
                if line.startswith("lmc:num_requests_total{"):
                    return int(float(line.rsplit(" ", 1)[1]))
        raise AssertionError("lmc:num_requests_total missing from /metrics")

    def replica_up(self, i: int) -> bool:
        with self.replica(i) as c:
            try:
                return c.get("/health").status_code == 200
            except httpx.TransportError:
                return False

    def healthy_workers(self) -> int:
        return sum(w["is_healthy"] for w in self.http.get("/workers").json()["workers"])

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
