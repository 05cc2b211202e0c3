"""Systems under test: a server command started on a free loopback port, stopped by PID.

A `System` is a label plus either a URL of a running server or a command
(with `{port}` where the port goes). Our own server's configurations
(`--policy sarathi,vllm --token-budget 256,512`) become commands of
`python -m stallfree serve`, one per (policy, budget) pair; a budget of `slo`
starts sarathi with `--tbt-slo {tbt_slo}`. A command holding `{tbt_slo}` is
started once per SLO under test, with that SLO (`System.at_slo`).

The server runs in a new session (process group) so that a server which
forks workers (vLLM's engine core) can be cleaned up completely: stop()
sends SIGTERM to the PID it started, waits, then SIGKILLs whatever is left
of that process group, which only holds processes it started.
"""
from __future__ import annotations

import itertools
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import httpx

from .capacity import SLO_BUDGET, Budget, check_slo_budget

TBT_SLO_FIELD = "{tbt_slo}"  # in a command: the TBT SLO under test, in seconds


@dataclass
class System:
    label: str
    base_url: str | None = None  # a server already running
    command: list[str] | None = None  # start this ({port} substituted) instead
    env: dict[str, str] = field(default_factory=dict)

    @property
    def targets_slo(self) -> bool:
        """Its command takes the SLO under test: it is started (and searched) once per SLO."""
        return any(TBT_SLO_FIELD in a for a in self.command or ())

    def at_slo(self, slo: float | None) -> System:
        """This system with the SLO under test in its command (itself if it takes none)."""
        if not self.targets_slo:
            return self
        if slo is None:
            raise ValueError(f"{self.label}: its command needs the TBT SLO under test")
        assert self.command is not None
        return replace(self, command=[a.replace(TBT_SLO_FIELD, repr(float(slo)))
                                      for a in self.command])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stallfree_systems(policies: list[str], budgets: list[Budget], extra_args: list[str],
                      max_model_len: int | None = None, model: str | None = None) -> list[System]:
    """Our server for every (policy, token budget) pair; a budget of `slo` is sarathi with
    the SLO under test as its --tbt-slo."""
    systems = []
    for policy, budget in itertools.product(policies, budgets):
        check_slo_budget(policy, budget)
        budget_args = ["--tbt-slo", TBT_SLO_FIELD] if budget == SLO_BUDGET \
            else ["--token-budget", str(budget)]
        cmd = [sys.executable, "-m", "stallfree", "serve", *([model] if model else []),
               "--host", "127.0.0.1", "--port", "{port}", "--policy", policy, *budget_args,
               "--uvicorn-log-level", "warning"]
        if max_model_len is not None and "--max-model-len" not in extra_args:
            cmd += ["--max-model-len", str(max_model_len)]
        systems.append(System(f"stallfree-{policy}-{budget}", command=cmd + list(extra_args),
                              env={"HF_HUB_OFFLINE": "1"}))
    return systems


def build_systems(base_urls: list[str], server_cmds: list[str], labels: list[str],
                  policies: list[str], budgets: list[Budget], server_args: str = "",
                  max_model_len: int | None = None, model: str | None = None) -> list[System]:
    """Running servers, then server commands (labelled in that order), then our own server
    for every (policy, token budget) pair."""
    labels = list(labels)
    systems = []
    for url in base_urls:
        systems.append(System(labels.pop(0) if labels else url, base_url=url))
    for cmd in server_cmds:
        systems.append(command_system(cmd, labels.pop(0) if labels else None))
    if policies:
        systems += stallfree_systems(policies, budgets, shlex.split(server_args), max_model_len,
                                     model)
    if not systems:
        raise ValueError("give at least one system: --policy, --server-cmd or --base-url")
    names = [s.label for s in systems]
    if len(set(names)) != len(names):
        raise ValueError(f"system labels must differ: {names} (use --system-label)")
    return systems


def command_system(command: str, label: str | None = None) -> System:
    """A peer server from a shell-like command line holding `{port}` (and `{tbt_slo}` to
    start it once per SLO under test)."""
    argv = shlex.split(command)
    if not any("{port}" in a for a in argv):
        raise ValueError(f"--server-cmd must contain {{port}}: {command!r}")
    return System(label or os.path.basename(argv[0]), command=argv)


class ServerProcess:
    """Starts a System's command on a free port and waits until it answers."""

    def __init__(self, system: System, startup_timeout: float = 600.0,
                 log_dir: str | None = None) -> None:
        assert system.command is not None
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [a.replace("{port}", str(self.port)) for a in system.command]
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        fd, self.log_path = tempfile.mkstemp(prefix=f"{system.label}-", suffix=".log",
                                             dir=log_dir)
        self._log = os.fdopen(fd, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **system.env)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            for path in ("/health", "/v1/models"):
                try:
                    if httpx.get(self.base_url + path, timeout=2,
                                 trust_env=False).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready after {timeout:.0f}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self, grace: float = 30.0) -> None:
        pid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:  # leftovers of the group we created (forked workers)
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
