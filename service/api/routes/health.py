"""Probes and metrics: `/livez` (the process answers), `/readyz` (Redis answers and a pool is ready), `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from redis.exceptions import RedisError

from meshserve.service import metrics
from meshserve.service.api.deps import CatalogDep, SettingsDep, StoreDep
from meshserve.service.schemas import ErrorResponse, HealthResponse

router = APIRouter(tags=["health"])


@router.get("/livez", response_model=HealthResponse, summary="Liveness")
async def read_liveness() -> HealthResponse:
    return HealthResponse(status="ok")


@router.get(
    "/readyz",
    response_model=HealthResponse,
    responses={503: {"model": ErrorResponse, "description": "Redis unreachable or no ready pool."}},
    summary="Readiness",
)
async def read_readiness(store: StoreDep, catalog: CatalogDep, settings: SettingsDep) -> Response:
    retry = {"Retry-After": str(settings.retry_after_s)}
    try:
        await store.ping()
        pools = await store.list_pools()
    except (RedisError, OSError) as e:
        body = {
            "error": {"code": "store_unavailable", "message": f"Redis is unreachable: {e}", "field": None}
        }
        return JSONResponse(body, 503, headers=retry)
    ready = [p.name for p in pools if p.ready]
    if not ready:
        body = {
            "error": {"code": "no_ready_pool", "message": f"no ready pool ({len(pools)} live)", "field": None}
        }
        return JSONResponse(body, 503, headers=retry)
    return JSONResponse(HealthResponse(status="ready", detail={"ready_pools": ready}).model_dump())


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
async def read_metrics(store: StoreDep) -> Response:
    await metrics.refresh_from_store(store)
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
