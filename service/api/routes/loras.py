"""LoRA administration (admin key): `POST /v1/loras` adds an adapter to a model on every pool serving it,
`DELETE /v1/loras/{model}/{name}` removes one, `GET /v1/loras` says where each stands in each pool.

The API never touches adapter files: it checks the source against the rules (service/lora_sources.py: under the
LoRA root or a Hub id, never a URL or a path elsewhere), records the model's wanted adapters in Redis
(service/lora_requests.py) and reads the pools' answers from the registry, where each pool publishes what it
loaded or why it could not (the pools check the source again where the files are). POST waits up to
`lora_wait_s` for every ready pool of the model: 201 when all loaded it, 422 `lora_rejected` with the first
pool's reason when one could not (the request is withdrawn), else 202 with the pools still pending.

With `MESHSERVE_AUTH=keys` these routes need an admin key (401 without a key, 403 with another); with
`MESHSERVE_AUTH=none` the whole API is open and so are they (the source rules hold either way).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request, Response

from meshserve.service.api.catalog import common_adapters
from meshserve.service.api.deps import CatalogDep, SettingsDep, StoreDep, current_tenant
from meshserve.service.api.errors import ApiError, FieldError
from meshserve.service.contract import AdapterInfo, LoraSpec, PoolInfo
from meshserve.service.lora_requests import LoraRequests
from meshserve.service.lora_sources import LoraSourceError, resolve_source
from meshserve.service.schemas import ErrorResponse, LoraCreate, LoraEntry, LoraList, LoraPoolState


async def require_admin(request: Request) -> None:
    tenant = await current_tenant(request)
    if request.app.state.settings.auth == "keys" and not tenant.admin:
        raise ApiError(403, "admin_required", "LoRA administration needs an admin key", "Authorization")


# A router dependency: checked before the body is validated (a user key learns nothing of the body's rules).
router = APIRouter(tags=["loras"], dependencies=[Depends(require_admin)])

_ERR = {"model": ErrorResponse}
ERRORS = {
    403: {**_ERR, "description": "The key is not an admin key."},
    404: {**_ERR, "description": "Unknown model or adapter."},
    409: {**_ERR, "description": "The adapter is declared in pools.yaml: change it there."},
    422: {**_ERR, "description": "A field breaks a rule (`source`: url_not_allowed, outside_root, ...)."},
    503: {
        **_ERR,
        "description": "The store is down, no pool is ready (POST), or the API holds as many request bodies "
        "as it may (`server_busy`); see `Retry-After`.",
    },
}
_POLL_S = 0.2


def _pools_of(model: str, pools: list[PoolInfo]) -> list[tuple[PoolInfo, dict[str, AdapterInfo]]]:
    return [
        (p, {a.name: a for a in info.adapters})
        for p in pools
        if p.ready
        for info in p.models
        if info.id == model
    ]


def _entry(model: str, name: str, spec: LoraSpec, held, usable: set[str]) -> LoraEntry:
    states, origin, rank, nbytes = [], "api", None, None
    for pool, adapters in held:
        a = adapters.get(name)
        if a is None or a.spec != spec:
            states.append(LoraPoolState(pool=pool.name, status="pending"))
            continue
        origin = a.origin
        rank, nbytes = rank or a.rank, nbytes or a.bytes
        status = "failed" if a.error else "loaded"
        states.append(LoraPoolState(pool=pool.name, status=status, rank=a.rank, bytes=a.bytes, error=a.error))
    return LoraEntry(
        model=model,
        name=name,
        source=spec.source,
        load_into_transformer_2=spec.load_into_transformer_2,
        origin=origin,
        rank=rank,
        bytes=nbytes,
        usable=name in usable,
        pools=states,
    )


def _usable(model: str, pools: list[PoolInfo]) -> set[str]:
    infos = [info for p in pools if p.ready for info in p.models if info.id == model]
    return {a.name for a in common_adapters(infos)} if infos else set()


@router.get("/v1/loras", response_model=LoraList, responses=ERRORS, summary="List LoRA adapters (admin)")
async def list_loras(store: StoreDep) -> LoraList:
    pools = await store.list_pools()
    wanted = LoraRequests(store)
    models = sorted({info.id for p in pools if p.ready for info in p.models})
    data = []
    for model in models:
        held = _pools_of(model, pools)
        # What pools.yaml declares, and what is asked for now. An adapter added at run time that is no longer
        # asked for (deleted, or rejected by a pool) is on its way out: pools drop it at their next look, and
        # listing it meanwhile showed a rejected adapter as pending for ~40 s (an audit's finding).
        specs = {a.name: a.spec for _, adapters in held for a in adapters.values() if a.origin == "config"}
        specs.update(await wanted.get(model))
        usable = _usable(model, pools)
        data += [_entry(model, n, spec, held, usable) for n, spec in sorted(specs.items())]
    return LoraList(data=data)


@router.post(
    "/v1/loras",
    status_code=201,
    response_model=LoraEntry,
    responses={202: {"model": LoraEntry, "description": "Some pools have not answered yet."}, **ERRORS},
    summary="Add a LoRA adapter to a model's pools (admin)",
)
async def add_lora(body: LoraCreate, store: StoreDep, catalog: CatalogDep, settings: SettingsDep) -> Response:
    served = await catalog.resolve(body.model)  # 404 listing the served models, 503 when none is ready
    lora_limits = served.info.limits.loras
    if body.load_into_transformer_2 and not (lora_limits and lora_limits.load_into_transformer_2):
        raise FieldError(
            "load_into_transformer_2",
            "not_supported",
            f"{body.model} has no transformer_2 (Wan 2.2's two experts): leave load_into_transformer_2 out",
        )
    try:
        resolve_source(
            body.source, root=settings.lora_root, allow_hub=settings.lora_allow_hub, must_exist=False
        )
    except LoraSourceError as e:
        raise FieldError("source", e.rule, str(e)) from None
    pools = await store.list_pools()
    for _, adapters in _pools_of(body.model, pools):
        if adapters.get(body.name) is not None and adapters[body.name].origin == "config":
            raise ApiError(
                409,
                "declared_in_config",
                f"{body.model}'s adapter {body.name!r} is declared in pools.yaml; change it there",
                "name",
            )
    spec = LoraSpec(source=body.source, load_into_transformer_2=body.load_into_transformer_2)
    wanted = LoraRequests(store)
    await wanted.put(body.model, body.name, spec)
    deadline = time.monotonic() + settings.lora_wait_s
    while True:
        pools = await store.list_pools()
        held = _pools_of(body.model, pools)
        entry = _entry(body.model, body.name, spec, held, _usable(body.model, pools))
        failed = [s for s in entry.pools if s.status == "failed"]
        if failed:
            await wanted.delete(body.model, body.name)
            raise FieldError(
                "source", "lora_rejected", f"pool {failed[0].pool} could not load it: {failed[0].error}"
            )
        pending = any(s.status == "pending" for s in entry.pools)
        if not pending or time.monotonic() >= deadline:
            status = 202 if pending or not entry.pools else 201
            return Response(entry.model_dump_json(), status, media_type="application/json")
        await asyncio.sleep(_POLL_S)


@router.delete(
    "/v1/loras/{model}/{name}",
    status_code=204,
    responses=ERRORS,
    summary="Remove a LoRA adapter added with POST /v1/loras (admin)",
)
async def delete_lora(model: str, name: str, store: StoreDep) -> Response:
    if await LoraRequests(store).delete(model, name):
        return Response(status_code=204)
    for _, adapters in _pools_of(model, await store.list_pools()):
        if adapters.get(name) is not None and adapters[name].origin == "config":
            raise ApiError(
                409,
                "declared_in_config",
                f"{model}'s adapter {name!r} is declared in pools.yaml; remove it there",
                "name",
            )
    raise ApiError(
        404, "lora_not_found", f"{model} has no adapter {name!r} added with POST /v1/loras", "name"
    )
