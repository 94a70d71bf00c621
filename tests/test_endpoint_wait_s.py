"""The pool request's ``wait_s``: a number of seconds, clamped to 0-300; anything else is a 400
naming the field (it was a 500: ``float()`` raised inside the handler)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from coevo.agents.policy import PolicyAgent
from coevo.config import CoevoConfig
from coevo.errors import ApiError
from coevo.runtime.bus import NatsBus
from coevo.serve.endpoint import wait_seconds
from tests.test_byo_endpoint import endpoint_cfg, post, running

BAD: list[Any] = ["soon", "5", None, [1], {"s": 1}, True, math.nan, math.inf]


@pytest.mark.parametrize("value", BAD)
def test_wait_s_that_is_not_a_finite_number_is_a_400(value: Any) -> None:
    with pytest.raises(ApiError) as err:
        wait_seconds({"wait_s": value})
    assert err.value.status == 400 and err.value.param == "wait_s" and "wait_s must be a number" in err.value.message


def test_wait_s_is_clamped_to_0_300_with_a_default_of_30() -> None:
    assert [wait_seconds(b) for b in ({}, {"wait_s": 2}, {"wait_s": 0.5}, {"wait_s": -3}, {"wait_s": 1e9})] == [
        30.0,
        2.0,
        0.5,
        0.0,
        300.0,
    ]


async def test_the_endpoint_answers_a_bad_wait_s_with_a_400(bus: NatsBus, loop_cfg: CoevoConfig) -> None:
    cfg = endpoint_cfg(loop_cfg, **{"env.tasks_from": "quickgame"})
    async with running([PolicyAgent(bus, cfg)], f"http://127.0.0.1:{cfg.policy.serve_port}") as http:
        for value in ("soon", [1], None):
            out = await post(http, "/coevo/v1/episodes", {"wait_s": value}, status=400)
            assert out["error"]["param"] == "wait_s" and out["error"]["type"] == "invalid_request_error", out
        out = await post(http, "/coevo/v1/episodes", {"wait_s": 0}, status=503)  # a number: served as before
        assert out["error"]["code"] == "no_task_available", out
