"""The service's own routes: served models, health, Prometheus metrics and version."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from ..body import ParseFirstRoute
from ..errors import ERROR_RESPONSES, error_response
from ..prometheus import CONTENT_TYPE
from ..protocol import ModelCard, ModelList
from ..state import StateDep

router = APIRouter(route_class=ParseFirstRoute)  # bodies parsed first (server/body.py)


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def list_models(state: StateDep) -> ModelList:
    return ModelList(data=[ModelCard(id=name, created=state.created, root=state.root,
                                     max_model_len=state.max_model_len)
                           for name in state.names])


@router.get("/health", responses={503: ERROR_RESPONSES[503]})
async def health(state: StateDep) -> Any:
    engine = state.engine
    if engine.is_dead:
        return error_response(503, f"the engine has stopped ({engine.dead_reason})",
                              "server_error", code="engine_dead")
    stalled = engine.stalled_for
    if stalled is not None:  # up, but serving nobody: as unhealthy as dead
        return error_response(503, f"the engine has made no progress for {stalled:.0f} s "
                                   f"(a step or the workers hang)", "server_error",
                              code="engine_stalled")
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def metrics(state: StateDep) -> Response:
    return Response(state.engine.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/version")
async def version() -> dict:
    try:
        return {"version": package_version("stallfree")}
    except PackageNotFoundError:
        return {"version": "unknown"}
