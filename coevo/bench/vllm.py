"""A vLLM server (CPU build) as the benches start one: coevo's command line, a free port, gone with
the block (and with the bench: ``die_with_parent``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from coevo.inference.vllm_client import SERVER_ENV, server_command
from coevo.runtime.proc import die_with_parent


@contextlib.asynccontextmanager
async def served(
    python: str, model: Path, extra: Sequence[str] = (), start_s: float = 300.0, lora_rank: int | None = None
) -> AsyncIterator[str]:
    """vLLM serving ``model`` until the block ends: its base URL (``http://127.0.0.1:PORT/v1``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.create_subprocess_exec(
            *server_command(python, model, port, lora_rank=lora_rank, extra=extra),
            env={**os.environ, **SERVER_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + start_s
            while True:
                try:
                    await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/v1/models", timeout=2)
                    break
                except OSError:
                    if proc.returncode is not None or loop.time() > deadline:
                        log.seek(0)
                        raise RuntimeError(
                            f"vLLM did not start (exit {proc.returncode}):\n"
                            f"{log.read().decode(errors='replace')[-3000:]}"
                        ) from None
                    await asyncio.sleep(1)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 60)
                except TimeoutError:
                    os.killpg(proc.pid, signal.SIGKILL)
