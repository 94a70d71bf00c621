"""The vLLM client's HTTP behaviour where a real vLLM cannot be made to misbehave on cue: a real
aiohttp server with vLLM's routes for the calls under test drops a connection mid-request."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from coevo.inference import adapters
from coevo.inference.models import ensure_default_model
from coevo.inference.vllm_client import VLLMClient


async def _server(loads: list[dict], drop_first: int) -> tuple[web.AppRunner, str]:
    async def weight_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": "0"})

    async def load_lora_adapter(request: web.Request) -> web.Response:
        loads.append(await request.json())
        if len(loads) <= drop_first:
            assert request.transport is not None
            request.transport.close()  # the connection ends with no answer, as a closing keep-alive does
        return web.Response(text="Success: LoRA adapter loaded")

    app = web.Application()
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}/v1"


async def test_an_adapter_load_cut_off_mid_request_is_sent_again_and_served(model_cache: Path, tmp_path: Path) -> None:
    """Loading an adapter in place under one name from one path is idempotent, so a dropped
    connection is retried: the client ends up serving the adapter at the version it was given."""
    model = ensure_default_model("policy", model_cache)
    path = tmp_path / "adapter"
    path.mkdir()
    (path / adapters.ADAPTER_CONFIG).write_text("{}")
    loads: list[dict] = []
    runner, url = await _server(loads, drop_first=1)
    try:
        async with VLLMClient(url, str(model), name="policy", tokenizer_dir=model) as client:
            await client.load_adapter(path, 3)
            assert client.version == 3 and client.served == "coevo-policy"
    finally:
        await runner.cleanup()
    assert len(loads) == 2, loads
    assert loads[0] == loads[1] == {"lora_name": "coevo-policy", "lora_path": str(path), "load_inplace": True}
