"""Dependencies of the route handlers, as `Annotated` aliases (the objects live on `app.state`, set by the
lifespan in `service/app.py`). All are `async def`: FastAPI runs a plain `def` dependency in a thread pool, which
cost ~100 us per dependency per request on the submit path."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from meshserve.service.api.catalog import Catalog
from meshserve.service.api.errors import ApiError
from meshserve.service.contract import Job
from meshserve.service.settings import Settings
from meshserve.service.store import Store


async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_catalog(request: Request) -> Catalog:
    return request.app.state.catalog


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


StoreDep = Annotated[Store, Depends(get_store)]
CatalogDep = Annotated[Catalog, Depends(get_catalog)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_job(job_id: str, store: StoreDep) -> Job:
    """The job named in the path, or 404."""
    job = await store.get(job_id)
    if job is None:
        raise ApiError(404, "job_not_found", f"no job {job_id!r} (unknown, or expired)", "job_id")
    return job


JobDep = Annotated[Job, Depends(get_job)]

LastEventId = Annotated[
    str | None, Header(alias="Last-Event-ID", description="Resume an event stream after it.")
]
