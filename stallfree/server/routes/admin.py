"""POST /reset_prefix_cache: vLLM's admin route, behind the API key like every /v1 route."""
from __future__ import annotations

from fastapi import APIRouter

from ..body import ParseFirstRoute
from ..engine_errors import EngineDeadError
from ..errors import ERROR_RESPONSES, APIError
from ..state import StateDep

router = APIRouter(route_class=ParseFirstRoute)  # bodies parsed first (server/body.py)


@router.post("/reset_prefix_cache", responses={401: ERROR_RESPONSES[401],
                                               503: ERROR_RESPONSES[503]})
async def reset_prefix_cache(state: StateDep) -> dict:
    """Forgets every cached KV block (requests running keep theirs), e.g. between
    benchmark runs; answers how many blocks were cached."""
    state.check_alive()
    try:
        count = await state.engine.call(lambda engine: engine.reset_prefix_cache())
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "server_error", code="engine_dead") from exc
    return {"status": "ok", "num_cached_blocks": count}
