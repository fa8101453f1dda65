"""What the servers tests share: SGLang stand-ins started on demand and cleaned up after."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from helpers.sglang_standin import StandinConfig, start_standin


@pytest.fixture
async def standin() -> AsyncIterator[Callable[[StandinConfig], Any]]:
    runners: list[web.AppRunner] = []

    async def start(cfg: StandinConfig) -> str:
        runner, url = await start_standin(cfg)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()
