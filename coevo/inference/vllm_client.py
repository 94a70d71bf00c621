"""A vLLM server as an inference client, and the weight swap into it.

Prompts are tokenized here (with the served model's own tokenizer) and sent as token ids to
``/v1/completions`` with ``return_token_ids`` and ``logprobs``, so the ids the learner trains on are
exactly the ids the server saw; every sampling parameter is stated (``coevo.inference.sampling``), so
the model's ``generation_config.json`` defaults, which vLLM applies to what a request leaves out, never do. Constrained choices use ``allowed_token_ids``; with the server
started with ``--logprobs-mode processed_logprobs`` the returned log-probs are those of the
distribution actually sampled from.

Invariant: a completion is stamped with the weight version that produced it. Swaps go through
``swap_weights``, which holds a write lock: it waits for this client's requests in flight, pauses
the server (``mode=wait``: other clients' requests finish on the old weights), reloads from a
verified path, sets the version, resets the prefix cache and resumes; on any failure it resumes
the server with the old weights and raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from coevo.config import SamplingConfig
from coevo.errors import VLLMError
from coevo.inference import adapters
from coevo.inference.engine import Completion, choice_token_ids, encode_prompt, quiet_transformers
from coevo.inference.sampling import request_fields
from coevo.schemas import TransferOffer

SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""Environment of the vLLM servers coevo starts: the RL routes (pause, reload, weight transfer, adapters) on."""

MAX_STOPS = 4
"""the stop strings vLLM's completions API takes (it refuses more with a 400)"""

KEEPALIVE_S = 2.0
"""how long this client keeps an idle connection for reuse: under the server's own keep-alive
(vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s), so a request is never written into a connection the
server is closing at that moment (aiohttp's default, 15 s, met that race: "Can not write request body")"""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""the values vLLM accepts for ``--max-lora-rank``"""


def server_command(
    python: str,
    model: Path | str,
    port: int,
    *,
    transfer_backend: str = "coevo_gloo",
    lora_rank: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line coevo starts vLLM with (tests, benchmarks): log-probs of the distribution
    actually sampled from, fp32, pushed weights through ``transfer_backend``, and with ``lora_rank``
    LoRA adapters up to that rank (two at once: policy and judge on one base), and grammars held
    by xgrammar, as the learner replays them (``coevo.inference.grammar``)."""
    lora = []
    if lora_rank is not None:
        lora = [
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            str(next(r for r in LORA_RANKS if r >= lora_rank)),
        ]
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--logprobs-mode",
        "processed_logprobs",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--weight-transfer-config",
        json.dumps({"backend": transfer_backend}),
        # grammars compiled by xgrammar, the backend the learner replays them with (``auto`` may pick another)
        "--structured-outputs-config",
        json.dumps({"backend": "xgrammar"}),
        *lora,
        *extra,
    ]


class _RWLock:
    """Many readers (requests) or one writer (a weight swap)."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._cond = asyncio.Condition()

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            self._writer = True  # new readers wait from now on
            await self._cond.wait_for(lambda: self._readers == 0)

    async def release_write(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()


class VLLMClient:
    def __init__(
        self,
        url: str,
        model: str,
        *,
        name: str = "vllm",
        tokenizer_dir: str | Path | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 120.0,
        retries: int = 3,
        pause_mode: str = "wait",
        sampling: SamplingConfig | None = None,
    ) -> None:
        self.name = name
        self.base = url.rstrip("/")
        self.root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        self.model = model
        self.adapter_name = f"coevo-{name}"
        """the name this client's LoRA adapter is loaded under (``load_adapter``)"""
        self.served = model
        """what requests name: the model, or once an adapter was loaded, the adapter"""
        self.tokenizer_dir = Path(tokenizer_dir or model)
        self.retries = retries
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.pause_mode = pause_mode
        self.sampling = sampling or SamplingConfig()
        self._sem = asyncio.Semaphore(max_concurrency)
        self._lock = _RWLock()
        self._session: aiohttp.ClientSession | None = None
        self._version = 0
        self._choice_ids: dict[tuple[str, ...], list[int]] = {}
        quiet_transformers()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)

    @property
    def version(self) -> int:
        return self._version

    async def __aenter__(self) -> VLLMClient:
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(timeout=self.timeout, connector=connector)
        info = await self._get("/weight_info")
        try:
            self._version = int(info.get("weight_version") or 0)
        except (TypeError, ValueError):
            self._version = 0
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- HTTP --------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        retry: bool = True,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        if self._session is None:
            raise VLLMError(f"client {self.name} is not open (use `async with`)")
        url = self.root + path
        last: Exception | None = None
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else self._session.timeout
                async with self._session.request(method, url, json=json, params=params, timeout=timeout) as resp:
                    try:
                        body = await resp.json(content_type=None)
                    except ValueError:  # a plain-text answer (the LoRA routes')
                        body = {"text": await resp.text()}
                    if resp.status >= 400:
                        error = body.get("error") if isinstance(body, dict) else None
                        param = error.get("param") if isinstance(error, dict) else None
                        raise VLLMError(
                            f"{method} {path} -> {resp.status}: {str(body)[:500]}",
                            status=resp.status,
                            param=param if isinstance(param, str) else None,
                        )
                    return body if isinstance(body, dict) else {"result": body}
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = exc
                await asyncio.sleep(min(0.2 * 2**attempt, 3.0))
        raise VLLMError(f"{method} {path} failed after {attempts} attempt(s): {last!r}")

    async def _get(self, path: str) -> dict[str, Any]:
        return await self._call("GET", path)

    # ---- completions -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def choice_token_ids(self, choices: list[str]) -> list[int]:
        return choice_token_ids(self.tokenizer, choices, self._choice_ids)

    async def complete(
        self,
        prompt: str,
        *,
        choices: list[str] | None = None,
        max_tokens: int = 64,
        temperature: float = 1.0,
        index: int = 0,
        prompt_ids: list[int] | None = None,
        stop: list[str] | None = None,
        grammar: str | None = None,
    ) -> Completion:
        prompt_ids = list(prompt_ids) if prompt_ids is not None else self.encode(prompt)
        body: dict[str, Any] = {
            "model": self.served,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            **request_fields(self.sampling, temperature),
            "logprobs": 1,
            "return_token_ids": True,
        }
        if stop:  # vLLM takes at most 4 (a 400 beyond): the caller cuts at every stop string anyway
            body.update(stop=list(stop)[:MAX_STOPS], include_stop_str_in_output=True)
        if grammar is not None:  # vLLM's xgrammar backend compiles the same EBNF (``server_command``)
            body["structured_outputs"] = {"grammar": grammar}
        allowed = None
        if choices:
            allowed = self.choice_token_ids(choices)
            body.update(max_tokens=1, allowed_token_ids=allowed)
        async with self._sem:
            await self._lock.acquire_read()
            try:
                version = self._version
                data = await self._call("POST", "/v1/completions", json=body)
            finally:
                await self._lock.release_read()
        choice = data["choices"][0]
        out_ids = list(choice.get("token_ids") or [])
        lps = [float(x) if x is not None else 0.0 for x in (choice.get("logprobs") or {}).get("token_logprobs", [])]
        picked = allowed.index(out_ids[0]) if allowed and out_ids and out_ids[0] in allowed else None
        return Completion(
            text=choice.get("text", ""),
            prompt_token_ids=list(choice.get("prompt_token_ids") or prompt_ids),
            response_token_ids=out_ids,
            logprobs=lps,
            model_version=version,
            choice=picked,
            allowed_token_ids=allowed,
            finish_reason=choice.get("finish_reason") or "stop",
        )

    # ---- weights -----------------------------------------------------------------------------

    async def _swap(self, version: int, load: Callable[[], Awaitable[None]], *, pause_server: bool = True) -> float:
        """Wait for this client's requests in flight, pause the server, ``load``, reset the prefix
        cache and stamp ``version``; the server is resumed whatever happened. Returns the pause in ms.
        Without ``pause_server`` only this client waits (``load`` and the stamp)."""
        await self._lock.acquire_write()
        t0 = time.perf_counter()
        try:
            if not pause_server:
                await load()
                self._version = version
                return (time.perf_counter() - t0) * 1e3
            await self._call("POST", "/pause", params={"mode": self.pause_mode})
            try:
                await load()
                await self._call("POST", "/reset_prefix_cache")
                self._version = version
            finally:
                await self._call("POST", "/resume")
        finally:
            await self._lock.release_write()
        return (time.perf_counter() - t0) * 1e3

    async def swap_weights(self, path: Path, version: int) -> float:
        """Reload the server's weights from ``path``; returns the pause in milliseconds."""
        path = Path(path)
        if not path.is_dir() or not list(path.glob("*.safetensors")):
            # vLLM kills its engine on the *next* request after a reload from a bad path: never send one
            raise VLLMError(f"refusing to reload from {path}: no *.safetensors there")

        async def reload() -> None:
            await self._call(
                "POST",
                "/collective_rpc",
                retry=False,
                json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            )
            await self._call("POST", "/update_weight_version", json={"new_version": str(version)})

        return await self._swap(version, reload)

    async def load_adapter(self, path: Path, version: int, tensors: dict[str, Any] | None = None) -> float:
        """Load the LoRA adapter at ``path`` into the server (``/v1/load_lora_adapter``, in place under
        this client's adapter name) and send every later request to it; returns this client's pause in
        ms. The server needs ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; it is not
        paused. ``tensors`` is ignored: the server reads the files."""
        path = Path(path)
        if not adapters.is_adapter(path):
            raise VLLMError(f"refusing to load an adapter from {path}: no {adapters.ADAPTER_CONFIG} there")

        async def load() -> None:  # in place, under one name, from one path: a retry loads the same thing
            await self._call(
                "POST",
                "/v1/load_lora_adapter",
                json={"lora_name": self.adapter_name, "lora_path": str(path), "load_inplace": True},
            )
            self.served = self.adapter_name

        # no server pause and no prefix-cache reset: other adapters (another role on this base) go on
        # serving, and vLLM's prefix cache keys a LoRA request by its adapter's path, new per version
        return await self._swap(version, load, pause_server=False)

    async def workers(self) -> int:
        """The server's worker count across data parallel replicas (its ranks in a transfer group)."""
        return int((await self._get("/get_world_size")).get("world_size") or 1)

    async def init_transfer(self, init_info: dict[str, Any], timeout_s: float) -> None:
        """Have the server's workers join the learner's transfer group (blocks until they did)."""
        await self._call(
            "POST", "/init_weight_transfer_engine", json={"init_info": init_info}, retry=False, timeout_s=timeout_s
        )

    async def receive_weights(self, offer: TransferOffer, timeout_s: float) -> float:
        """Take the weights the learner is broadcasting now (vLLM's native weight transfer endpoints);
        returns the pause in milliseconds. Same lock, pause and version rules as ``swap_weights``; on a
        failure after the update started, the update is closed and the error raised (the caller
        reloads a consistent checkpoint: the server may hold part of the new tensors)."""

        async def receive() -> None:
            await self._call("POST", "/start_weight_update", retry=False)
            try:
                await self._call(
                    "POST",
                    "/update_weights",
                    json={"update_info": offer.update_info()},
                    retry=False,
                    timeout_s=timeout_s,
                )
            except BaseException:
                with contextlib.suppress(VLLMError):
                    await self._call("POST", "/finish_weight_update", json={}, retry=False)
                raise
            await self._call("POST", "/finish_weight_update", json={"weight_version": str(offer.version)}, retry=False)

        return await self._swap(offer.version, receive)

    async def weight_version(self) -> str:
        return str((await self._get("/weight_info")).get("weight_version"))
