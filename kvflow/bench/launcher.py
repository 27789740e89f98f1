"""Start a server variant from a launch command on a free loopback port, wait for /health, stop it.

`--launch "kvflow serve MODEL --dtype float32" --vary max-num-seqs=8,32` runs `kvflow serve MODEL --dtype float32
--max-num-seqs 8 --host 127.0.0.1 --port P`, then the same with 32. A value `true`/`false` becomes `--flag` /
`--no-flag` (vLLM's and kvflow's boolean flags); any other value is passed as `--flag VALUE`. A flag already in
the launch command is replaced. Any server that takes `--host` and `--port` works (vllm serve, llama-server).
"""
from __future__ import annotations

import itertools
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvflow.server.testing import free_port

HOST = "127.0.0.1"


def parse_vary(items: list[str] | None) -> list[tuple[str, list[str]]]:
    """['max-num-seqs=8,32'] -> [('max-num-seqs', ['8', '32'])]."""
    out = []
    for item in items or []:
        flag, sep, values = item.partition("=")
        flag = flag.strip().lstrip("-")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not flag or not vals:
            raise ValueError(f"bad --vary {item!r}: expected FLAG=V1,V2,... e.g. max-num-seqs=8,32")
        out.append((flag, vals))
    return out


def variants(vary: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Every combination of the varied values: [{'max-num-seqs': '8'}, {'max-num-seqs': '32'}]."""
    if not vary:
        return [{}]
    flags = [f for f, _ in vary]
    return [dict(zip(flags, combo)) for combo in itertools.product(*[v for _, v in vary])]


def variant_name(settings: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "default"


def _remove_flag(argv: list[str], flag: str) -> list[str]:
    """Drop `--flag`, `--flag V`, `--flag=V` and `--no-flag` from argv."""
    out, i = [], 0
    names = {f"--{flag}", f"--no-{flag}"}
    while i < len(argv):
        a = argv[i]
        if a in names:
            takes_value = a == f"--{flag}" and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            i += 2 if takes_value else 1
            continue
        if any(a.startswith(n + "=") for n in names):
            i += 1
            continue
        out.append(a)
        i += 1
    return out


def build_argv(launch: str, settings: dict[str, str], port: int) -> list[str]:
    argv = shlex.split(launch)
    if not argv:
        raise ValueError("--launch is empty")
    if argv[0] == "kvflow":   # run the kvflow of this interpreter, whatever PATH says
        argv = [sys.executable, "-m", "kvflow.cli"] + argv[1:]
    for flag in ("host", "port", *settings):
        argv = _remove_flag(argv, flag)
    for flag, value in settings.items():
        if value.lower() in ("true", "false"):
            argv.append(f"--{flag}" if value.lower() == "true" else f"--no-{flag}")
        else:
            argv += [f"--{flag}", value]
    return argv + ["--host", HOST, "--port", str(port)]


class LaunchedServer:
    """One server subprocess; its output goes to `log_path`."""

    def __init__(self, launch: str, settings: dict[str, str], log_path: Path, port: int | None = None):
        self.settings = settings
        self.port = port or free_port()
        self.argv = build_argv(launch, settings, self.port)
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def root_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    def start(self, timeout: float = 300.0) -> "LaunchedServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        t0 = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.argv[1:3] == ["-m", "kvflow.cli"]:   # the kvflow this process runs, installed or not
            pkg_root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        log.close()
        deadline = t0 + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode} during startup: "
                                       f"{shlex.join(self.argv)}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")
                try:
                    if c.get(self.root_url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s: "
                                       f"{shlex.join(self.argv)}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")
                time.sleep(0.25)
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> "LaunchedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
