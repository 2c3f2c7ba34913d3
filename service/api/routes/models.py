"""`GET /v1/models`: what the ready pools serve now, with the defaults and limits requests are checked against."""

from __future__ import annotations

from fastapi import APIRouter

from meshserve.service.api.deps import CatalogDep
from meshserve.service.api.errors import COMMON_RESPONSES
from meshserve.service.schemas import ModelCard, ModelList

router = APIRouter(tags=["models"], responses=COMMON_RESPONSES)


@router.get("/v1/models", response_model=ModelList, summary="List served models")
async def list_models(catalog: CatalogDep) -> ModelList:
    served = await catalog.served()
    return ModelList(data=[ModelCard.build(s.info, s.pools) for _, s in sorted(served.items())])
