"""The operator's routes that pause the engine and give its memory back (vLLM's sleep mode).

Served only with `--enable-sleep-mode`: any client that reaches them can stop the server
serving, so they sit behind the API key like every other route. What the levels and modes
mean is in vmkv/engine/sleep.py; requests that come while the engine is paused wait for it.
"""

from __future__ import annotations

from fastapi import APIRouter, Query

from vmkv.engine.errors import ControlRefused
from vmkv.server.engine_client import EngineClient, EngineDeadError
from vmkv.server.errors import APIError, bad_request


def sleep_router(engine: EngineClient) -> APIRouter:
    router = APIRouter()

    async def call(name: str, *args: object) -> object:
        try:
            return await engine.control(name, *args)
        except ValueError as error:
            raise bad_request(str(error)) from error
        except EngineDeadError as error:
            raise APIError(503, str(error)) from error
        except ControlRefused as error:  # the engine's state refuses it: resume while asleep
            raise APIError(409, str(error)) from error
        except RuntimeError as error:  # it failed: a checkpoint that cannot be read at wake-up
            raise APIError(500, str(error)) from error

    @router.post("/pause")
    async def pause(mode: str = "abort") -> dict:
        """Stop scheduling: in-flight requests are aborted, run to their end ("wait": answered
        once they are done) or kept frozen ("keep")."""
        await call("pause", mode)
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict:
        await call("resume")
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict:
        state = await call("state")
        return {"is_paused": state["paused"]}  # type: ignore[index]

    @router.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> dict:
        """Pause (as /pause), then give back the level's memory: 1 the KV cache's, 2 the
        weights' too."""
        await call("sleep", level, mode)
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> dict:  # noqa: B008 - FastAPI's idiom
        """Restore all that sleep gave back, or what the tags name (weights, kv_cache)."""
        awake = await call("wake_up", tags)
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        state = await call("state")
        return {"is_sleeping": state["paused"] or bool(state["asleep"])}  # type: ignore[index]

    return router
