"""Start a server to audit on this machine: ``kvlab serve`` or real ``vllm serve``, on a free
loopback port.

Each server is a subprocess; ``with start_kvlab(...) as server: server.base_url`` waits until it
answers ``GET /v1/models`` and stops it on exit. Its log goes to a temporary file, whose tail is in
the error when it fails to start. API keys are written to a new temporary file (the caller's files
are only read).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ServerError", "ServerProcess", "free_port", "start_kvlab", "start_vllm"]


class ServerError(RuntimeError):
    """The server process exited or did not answer in time; the message ends with its log's tail."""


# stopped at interpreter exit, so no server outlives its notebook or test
_LIVE: set[ServerProcess] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.close()


def _die_with_parent() -> None:  # pragma: no cover (runs in the child)
    """Linux: the server gets SIGTERM when the process that started it dies (even when it is
    killed)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server subprocess: ``base_url``, ``log()``, ``stop()``; a context manager."""

    def __init__(
        self,
        cmd: Sequence[str],
        port: int,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        cwd: str | None = None,
        name: str = "server",
        files: dict[str, str] | None = None,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="kvlab-audit-server-")
        # e.g. the key file; "{workdir}" in cmd points here
        for fname, text in (files or {}).items():
            (Path(self._dir.name) / fname).write_text(text)
        self.name, self.port = name, port
        self.cmd = [c.replace("{workdir}", self._dir.name) for c in cmd]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self._log_path = Path(self._dir.name) / "server.log"
        self._log = open(self._log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        _LIVE.add(self)
        self.started_s: float | None = None
        self._timeout = timeout
        self._t0 = time.perf_counter()

    @property
    def workdir(self) -> Path:
        """The server's private temporary folder (its log, its key file)."""
        return Path(self._dir.name)

    def log(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's output."""
        if not self._log.closed:
            self._log.flush()
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:  # closed: its folder is gone
            return "(the server's log is gone with it)"

    def wait_ready(self) -> ServerProcess:
        """Poll ``GET /v1/models`` until it answers 200 (any status but a refused connection counts
        as up)."""
        import httpx

        while True:
            if self.proc.poll() is not None:
                message = (f"{self.name} exited with code {self.proc.returncode}; its log ends "
                           f"with:\n{self.log()}")
                self.close()
                raise ServerError(message)
            try:
                r = httpx.get(self.base_url + "/models", timeout=5.0)
                if r.status_code in (200, 401):
                    self.started_s = time.perf_counter() - self._t0
                    return self
            except httpx.TransportError:
                pass
            if time.perf_counter() - self._t0 > self._timeout:
                message = (f"{self.name} did not answer within {self._timeout:.0f} s; its log ends "
                           f"with:\n{self.log()}")
                self.close()
                raise ServerError(message)
            time.sleep(0.2)

    def stop(self) -> None:
        """Terminate the process (kill after 10 s) and remove its temporary folder."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()

    def close(self) -> None:
        """``stop`` and delete the temporary folder."""
        self.stop()
        self._dir.cleanup()
        _LIVE.discard(self)

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env(threads: int | None) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's kvlab, whatever is installed
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def start_kvlab(
    model: str | None = None,
    isolation: str = "shared",
    keys: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    threads: int | None = 1,
    timeout: float = 180.0,
    python: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
) -> ServerProcess:
    """``python -m kvlab.serve`` on a free loopback port (not yet ready: use ``with`` or
    ``wait_ready()``).

    ``keys`` maps API key -> tenant (written to a temporary ``--api-keys`` file); ``extra_args`` go
    last.
    """
    port = free_port()
    cmd = [
        python or sys.executable,
        "-m",
        "kvlab.serve",
        "--port",
        str(port),
        "--isolation",
        isolation,
    ]
    if model is not None:
        cmd += ["--model", str(model)]
    cmd += ["--device", device] if device else []
    cmd += ["--dtype", dtype] if dtype else []
    if keys:
        cmd += ["--api-keys", "{workdir}/keys.json"]
    return ServerProcess(
        cmd + list(extra_args),
        port,
        _env(threads),
        timeout,
        name=f"kvlab serve ({isolation})",
        files={"keys.json": json.dumps(keys)} if keys else None,
    )


def start_vllm(
    model_folder: str | os.PathLike,
    python: str | os.PathLike | None = None,
    block_size: int = 32,
    api_key: str | None = None,
    max_model_len: int = 2048,
    extra_args: Sequence[str] = (),
    timeout: float = 600.0,
) -> ServerProcess:
    """Real ``vllm serve`` (the vLLM venv's interpreter, prefix caching on, float32) on a free
    loopback port."""
    from kvlab.vllm.bridge import vllm_python

    path = vllm_python(python)
    port = free_port()
    cmd = [
        str(path),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(Path(model_folder).resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--block-size",
        str(block_size),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enable-prompt-tokens-details",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": "",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.pop("PYTHONHOME", None)
    return ServerProcess(
        cmd + list(extra_args), port, env, timeout, cwd=tempfile.gettempdir(), name="vllm serve"
    )
