"""Run a real `colibri gateway` subprocess on a loopback port in tests, and talk raw HTTP to it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from engine_util import ENGINE_VARS

START_TIMEOUT = 180.0  # engine start + a cold compile cache on a busy 2-core box
HOST = "127.0.0.1"  # the only address these tests ever use


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def gateway_command(model_dir: Path, *args: str) -> list[str]:
    cmd = [sys.executable, "-m", "colibri.cli", "gateway", "--model", str(model_dir)]
    return [*cmd, *args]


def gateway_env(**env: str) -> dict[str, str]:
    """os.environ without engine settings or a key, plus env. Give STATE_DIR (a scratch folder
    the caller removes) to any gateway that starts an engine."""
    full = {k: v for k, v in os.environ.items() if k not in ENGINE_VARS}
    full.pop("COLIBRI_API_KEY", None)
    full.update(env)
    return full


class Gateway:
    """`colibri gateway` on a free loopback port; `url` once /health answers 200."""

    def __init__(self, model_dir: Path, *args: str, log: Path, key: str | None = None, **env):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.key = key
        extra = ["--api-key", key] if key else []
        cmd = gateway_command(model_dir, "--host", HOST, "--port", str(self.port), *extra, *args)
        self.log = log
        self.scratch = None  # usage counts go to a scratch folder, not the checkpoint's
        if "STATE_DIR" not in env:
            self.scratch = env["STATE_DIR"] = tempfile.mkdtemp(prefix="colibri-gw-state-")
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=gateway_env(**env)
            )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited ({self.proc.returncode}):\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"gateway not healthy in {START_TIMEOUT:.0f} s:\n{self.logs()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=10)

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kw)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self, timeout: float = 60) -> int:
        """SIGTERM (graceful: the engine gets EOF and finishes), then wait; kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)


def raw_get(port: int, target: str, timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of `GET <target>` sent byte for byte, so no client normalises the path."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def wait_for(predicate, timeout: float = 30, every: float = 0.05):
    """Poll predicate() until it returns something truthy; that value, or TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"condition not met in {timeout:.0f} s")
