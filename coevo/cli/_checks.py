"""Checks of a command line made before a command builds, loads or creates anything, so that a wrong
path, a wrong run id or a dead server fails in a second with one line and leaves nothing on disk.

Invariant: every check here only reads (the file system, a TCP connect); a failure is a
``ConfigError`` (exit 2) naming the flag, or a ``BusError`` for a server that does not answer.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coevo.errors import BusError, ConfigError

RUN_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")
"""a run id: one plain name under ``run.runs_dir`` (as ``run.run_id``): never ``.``, ``..`` or a path"""
NATS_PROBE_S = 2.0
"""how long a TCP connect to a --nats server may take before the command gives up on it"""


def nats_addresses(url: str) -> list[tuple[str, int]]:
    """The (host, port) of each server of a NATS URL (``nats://h1:4222,nats://h2:4222``, ``h:4222``)."""
    out = []
    for part in url.split(","):
        text = part.strip()
        if not text:
            continue
        split = urlsplit(text if "://" in text else f"nats://{text}")
        try:
            port = split.port or 4222
        except ValueError:
            raise ConfigError(f"--nats {url}: {text} has no valid port", field="nats.url") from None
        if not split.hostname:
            raise ConfigError(f"--nats {url}: {text} names no host", field="nats.url")
        out.append((split.hostname, port))
    if not out:
        raise ConfigError(f"--nats {url!r}: no server in it", field="nats.url")
    return out


def check_nats(url: str | None, timeout_s: float = NATS_PROBE_S) -> None:
    """A --nats server answers a TCP connect (one of a cluster's is enough): a dead one fails in
    ``timeout_s`` rather than after the client's retries."""
    if url is None:
        return
    reasons = []
    for host, port in nats_addresses(url):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return
        except OSError as exc:
            reasons.append(f"{host}:{port} {exc.strerror or type(exc).__name__.replace('Error', '').lower()}")
    raise BusError(
        f"cannot reach NATS at {url} ({'; '.join(reasons)}): is the server running (coevo server) and the URL right?"
    )


def check_resume(runs_dir: Path, run: str | None) -> None:
    """``--resume RUN`` continues a run that exists: its directory under ``run.runs_dir`` (a run id,
    not ``.``, ``..`` or a path, which would name the runs directory itself or one outside it)."""
    if run is None:
        return
    if not RUN_ID.fullmatch(run):
        raise ConfigError(
            f"--resume {run}: not a run id (1-64 characters of A-Z a-z 0-9 _ -: the name of a run's "
            f"directory under {runs_dir}/, not a path)",
            field="run.run_id",
        )
    if (runs_dir / run).is_dir():
        return
    known = (
        sorted(p.name for p in runs_dir.iterdir() if p.is_dir() and (p / "config.json").exists())
        if runs_dir.is_dir()
        else []
    )
    there = f"runs there: {', '.join(known[-5:])}" if known else "no runs there"
    raise ConfigError(
        f"--resume {run}: no run {run} in {runs_dir}/ ({there}; --run.runs_dir DIR for another place)",
        field="run.run_id",
    )


def check_models(cfg: Any, args: Any) -> None:
    """The model directories the config names exist and are models (``resolve_model_path``), named
    by the flag that set them."""
    from coevo.inference.models import resolve_model_path

    base = getattr(args, "base", None)
    if cfg.policy.model is not None:
        flag = "--base" if base else "--policy-model" if getattr(args, "policy_model", None) else "policy.model"
        resolve_model_path(cfg.policy.model, flag, "policy.model")
    judge = cfg.judge
    if judge.backend == "local" and judge.model is not None:
        flag = "--base" if base else "--judge local:DIR" if getattr(args, "judge", None) else "judge.model"
        resolve_model_path(judge.model, flag, "judge.model")


def check_credentials_run(cfg: Any) -> None:
    """A role's credentials (``--nats.credentials_file``) allow only the runs the server was started
    for (``coevo server --run-id RUN``): a generated run id could never be served."""
    if cfg.nats.credentials_file is not None and not cfg.run.run_id:
        raise ConfigError(
            f"--nats.credentials_file {cfg.nats.credentials_file}: pass --run-id RUN, the run the server "
            "was started for (coevo server --run-id RUN); its credentials allow no other",
            field="run.run_id",
        )


def missing_api_keys(model: str, api_key_env: str | None, api_base: str | None) -> list[str]:
    """The environment variables an external model needs and does not have: ``api_key_env`` when it
    is set, else what LiteLLM itself reads for the provider (any one of several will do; an api_base
    variable does not count when ``url`` gives the base)."""
    if api_key_env is not None:
        return [] if os.environ.get(api_key_env) else [api_key_env]
    from coevo.inference.litellm_client import provider_keys_missing

    return provider_keys_missing(model, api_base)


API_ROLES = {"judge": ("judge",), "tasks": ("tasks.rewriter",)}
"""agent role -> the config sections (dotted) of external models it calls"""


def external_sections(cfg: Any, sections: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(dotted name, section) of each external (LiteLLM) judge or rewriter in ``sections`` that calls a
    model: those with ``api.mock_response`` (offline tests) call nothing."""
    out = []
    for role in sections:
        section = cfg
        for part in role.split("."):
            section = getattr(section, part)
        if getattr(section, "backend", None) == "litellm" and section.api.mock_response is None:
            out.append((role, section))
    return out


def check_api_keys(cfg: Any, sections: tuple[str, ...] = ("judge", "tasks.rewriter")) -> None:
    """Every external judge or rewriter in ``sections`` has its key in the environment: a missing key
    fails at start in one line naming the variable, not as every call's error once the run is under way."""
    for role, section in external_sections(cfg, sections):
        missing = missing_api_keys(section.model, section.api.api_key_env, section.url)
        if missing:
            names = f"{missing[0]} is not set" if len(missing) == 1 else f"none of {', '.join(missing)} is set"
            raise ConfigError(
                f"{role} litellm:{section.model}: {names} in the environment (LiteLLM reads the key "
                f"from it): export it, or name the variable that holds it with --set {role}.api.api_key_env=NAME",
                field=f"{role}.api.api_key_env",
            )


ENDPOINT_WAIT_S = 15.0
"""how long an external model's own endpoint may take to answer a TCP connect at start (a server started
alongside coevo comes up within it); each try gives up after ``ENDPOINT_PROBE_S``"""
ENDPOINT_PROBE_S = 2.0


def check_endpoints(cfg: Any, sections: tuple[str, ...] = ("judge", "tasks.rewriter")) -> None:
    """An external judge or rewriter that names its own endpoint (``url``: a self-hosted or proxied API)
    reaches it: a dead one fails at start in one line naming the field, not as every call's error. Not
    probed: a section with fallbacks (the primary may be down by design), and a URL a proxy serves."""
    import urllib.request

    for role, section in external_sections(cfg, sections):
        if section.url is None or section.api.fallbacks:
            continue
        split = urlsplit(section.url if "://" in section.url else f"http://{section.url}")
        if split.hostname and urllib.request.getproxies() and not urllib.request.proxy_bypass(split.hostname):
            continue
        check_endpoint(section.url, f"{role}.url", f"{role} litellm:{section.model}")


def check_endpoint(url: str, field: str, what: str, wait_s: float = ENDPOINT_WAIT_S) -> None:
    """``url``'s host answers a TCP connect on its port (80/443 by scheme when none is given) within
    ``wait_s``."""
    split = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = split.port or (443 if split.scheme == "https" else 80)
    except ValueError:
        raise ConfigError(f"{what}: {field} {url} has no valid port", field=field) from None
    if not split.hostname:
        raise ConfigError(f"{what}: {field} {url} names no host", field=field)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((split.hostname, port), timeout=ENDPOINT_PROBE_S):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                why = exc.strerror or type(exc).__name__.replace("Error", "").lower()
                raise ConfigError(
                    f"{what}: cannot reach {field} {url} ({split.hostname}:{port} {why}, {wait_s:g} s): "
                    "is the server up and the URL right?",
                    field=field,
                ) from None
            time.sleep(0.5)
