"""Dependencies of the route handlers, as `Annotated` aliases (the objects live on `app.state`, set by the
lifespan in `service/app.py`). All are `async def`: FastAPI runs a plain `def` dependency in a thread pool, which
cost ~100 us per dependency per request on the submit path."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from meshserve.service.api.catalog import Catalog
from meshserve.service.api.errors import ApiError
from meshserve.service.auth import Tenant
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


async def current_tenant(request: Request) -> Tenant:
    """The caller, as the authentication middleware found it (`service/api/authentication.py`). Fails closed:
    a request that reached a route without passing it is a 401."""
    tenant = request.scope.get("state", {}).get("tenant")
    if tenant is None:
        raise ApiError(401, "missing_api_key", "send Authorization: Bearer <API key>", "Authorization")
    return tenant


TenantDep = Annotated[Tenant, Depends(current_tenant)]


async def get_job(job_id: str, store: StoreDep, tenant: TenantDep) -> Job:
    """The job named in the path, or 404: unknown, expired, or another tenant's (the same answer, so ids of
    other tenants' jobs cannot be probed). An admin key reaches every job."""
    job = await store.get(job_id, None if tenant.admin else tenant.name) if len(job_id) <= 64 else None
    if job is None:
        shown = job_id if len(job_id) <= 64 else job_id[:64] + "..."
        raise ApiError(404, "job_not_found", f"no job {shown!r} (unknown, or expired)", "job_id")
    return job


JobDep = Annotated[Job, Depends(get_job)]

LastEventId = Annotated[
    str | None, Header(alias="Last-Event-ID", description="Resume an event stream after it.")
]
