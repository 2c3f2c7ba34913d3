"""Served LoRA without a model: the source rules (service/lora_sources.py), pools.yaml's adapters, the request
field's 422s, the admin routes (auth, path rules, a run-time add/remove reaching the pool) and the worker's LoRA
metrics, with the API in-process over ASGI and a real worker pool running the fake runner (`lora_slots`: an LRU
of adapter names whose colour changes with the adapters), on the real Redis. No JAX: a few seconds."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from meshserve.service.auth import KeyStore
from meshserve.service.lora_sources import LoraSourceError, resolve_source
from meshserve.workers.config import ModelSpec, PoolConfig, WorkerConfig
from meshserve.workers.main import Worker
from meshserve.workers.pool import load_runners
from tests.service.conftest import api_client

pytestmark = pytest.mark.anyio


def lora_root(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    (root / "style").mkdir(parents=True)
    for name in ("style/pytorch_lora_weights.safetensors", "extra.safetensors", "third.safetensors"):
        (root / name).write_bytes(b"\0" * 16)
    (tmp_path / "secret.safetensors").write_bytes(b"\0" * 16)
    os.symlink(tmp_path / "secret.safetensors", root / "escape.safetensors")  # a link out of the root
    return root


def refused(source: str, root, **kw) -> str:
    with pytest.raises(LoraSourceError) as e:
        resolve_source(source, root=str(root) if root else None, **kw)
    return e.value.rule


def test_source_rules(tmp_path):
    root = lora_root(tmp_path)
    real = os.path.realpath(root)
    assert resolve_source("style", root=str(root)).value == os.path.join(real, "style")
    assert resolve_source(str(root / "extra.safetensors"), root=str(root)).kind == "path"
    assert resolve_source("owner/name", root=str(root)).kind == "hub"
    assert resolve_source("owner/name/lora.safetensors", root=None).value == "owner/name/lora.safetensors"
    assert refused("https://example.com/x.safetensors", root) == "url_not_allowed"
    assert refused("file:///etc/passwd", root) == "url_not_allowed"
    assert refused("s3://bucket/x", root) == "url_not_allowed"
    assert refused("../secret.safetensors", root) == "parent_reference"
    assert refused("style/../../secret.safetensors", root) == "parent_reference"
    assert refused(str(tmp_path / "secret.safetensors"), root) == "outside_root"
    assert refused("/etc/passwd", root) == "outside_root"
    assert refused("escape.safetensors", root) == "outside_root"  # the symlink is followed
    assert refused("missing.safetensors", root) == "not_found"
    assert refused("/abs/path.safetensors", None) == "no_lora_root"
    assert refused("owner/name", root, allow_hub=False) == "hub_not_allowed"
    assert (
        resolve_source("owner/name\n", root=str(root), must_exist=False).kind != "hub"
    )  # `$` before a newline
    # The API's check (the files are where the pools run): a missing relative file is left to the pools.
    assert resolve_source("later.safetensors", root=str(root), must_exist=False).kind == "path"


def test_pools_yaml_loras(tmp_path):
    with pytest.raises(ValidationError, match="url_not_allowed|URLs are not LoRA sources"):
        ModelSpec(runner="fake", loras={"a": "https://example.com/a.safetensors"})
    with pytest.raises(ValidationError, match="'..' is not allowed"):
        ModelSpec(runner="fake", loras={"a": "../a.safetensors"})
    with pytest.raises(ValidationError, match="must match"):
        ModelSpec(runner="fake", loras={"bad name": "a.safetensors"})
    with pytest.raises(ValidationError, match="lora_targets"):
        PoolConfig(name="p", models=["m"], lora_targets="(unclosed")
    assert PoolConfig(name="p", models=["m"], max_loras=2, lora_targets="attn").lora_options() == {
        "max_loras": 2,
        "lora_targets": "attn",
    }
    assert PoolConfig(name="p", models=["m"], lora_convs=True).lora_options() == {"lora_convs": True}
    root = lora_root(tmp_path)
    pool = PoolConfig(name="p", models=["fake"], devices="0")
    fake = {"runner": "fake", "options": {"lora_slots": 2}}
    # At start, against the root: a symlink out of it stops the pool, naming the adapter and the rule.
    with pytest.raises(ValueError, match="'esc'.*under the LoRA root"):
        load_runners(
            pool, {"fake": ModelSpec(**fake, loras={"esc": "escape.safetensors"})}, lora_root=str(root)
        )
    with pytest.raises(ValueError, match="no LoRA root"):
        load_runners(pool, {"fake": ModelSpec(**fake, loras={"a": "/x/a.safetensors"})})
    with pytest.raises(ValueError, match="takes no LoRA"):
        load_runners(
            pool, {"fake": ModelSpec(runner="fake", loras={"a": "extra.safetensors"})}, lora_root=str(root)
        )
    _, models = load_runners(pool, {"fake": ModelSpec(**fake, loras={"style": "style"})}, lora_root=str(root))
    (adapter,) = models["fake"].adapters
    assert (adapter.name, adapter.origin, adapter.error) == ("style", "config", None)


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def job_when_ended(client, job_id: str, headers: dict, timeout: float = 30) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        job = (await client.get(f"/v1/jobs/{job_id}", headers=headers)).json()
        if job["status"] in ("succeeded", "failed", "canceled", "expired"):
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end within {timeout} s")


async def test_served_loras_with_a_fake_pool(tmp_path, make_settings):
    root = lora_root(tmp_path)
    settings = make_settings(auth="keys", lora_root=str(root), lora_poll_s=0.05, lora_wait_s=10, lease_s=10)
    config = WorkerConfig(
        models={"toy": ModelSpec(runner="fake", options={"lora_slots": 2}, loras={"style": "style"})},
        pools=[PoolConfig(name="toy-0", models=["toy"], devices="0", max_batch=4, batch_wait_ms=0)],
        metrics_port=None,
    )
    loads = lambda reason: sample("meshserve_worker_lora_loads_total", model="toy", reason=reason)  # noqa: E731
    before = {
        "register": loads("register"),
        "reload": loads("reload"),
        "evictions": sample("meshserve_worker_lora_evictions_total", model="toy"),
        "hits": sample("meshserve_worker_lora_hits_total", model="toy"),
    }
    async with api_client(settings) as (client, store):
        keys = KeyStore(store.redis, store.prefix)
        user = {"Authorization": "Bearer " + await keys.create("alice", rate_per_minute=0, max_active=0)}
        admin = {
            "Authorization": "Bearer "
            + await keys.create("root", rate_per_minute=0, max_active=0, admin=True)
        }
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 30)
            (card,) = (await client.get("/v1/models", headers=user)).json()["data"]
            assert card["adapters"] == [{"name": "style", "rank": 4}]
            assert card["limits"]["loras"] == {
                "max_per_request": 2,
                "max_rank": 64,
                "scale_min": -4.0,
                "scale_max": 4.0,
            }

            async def generate(loras=None, headers=user):
                body = {"model": "toy", "prompt": "a cat", "seed": 7, **({"loras": loras} if loras else {})}
                return await client.post("/v1/generate", json=body, headers=headers)

            # The request field's rules: 422 naming the field and the rule.
            r = await generate([{"name": "nope", "scale": 1.0}])
            assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_adapter"
            assert (
                r.json()["error"]["field"] == "loras[0].name"
                and "available: style" in r.json()["error"]["message"]
            )
            r = await generate([{"name": "style"}, {"name": "a"}, {"name": "b"}])
            assert (r.status_code, r.json()["error"]["code"]) == (422, "too_many")
            r = await generate([{"name": "style", "scale": 4.5}])
            assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == (
                422,
                "out_of_range",
                "loras[0].scale",
            )
            r = await generate([{"name": "style"}, {"name": "style"}])
            assert (r.status_code, r.json()["error"]["code"]) == (422, "not_unique")

            # A job with the adapter: it runs, records it, and its output is not the plain one's.
            with_style = await job_when_ended(
                client, (await generate([{"name": "style", "scale": 0.5}])).json()["id"], user
            )
            plain = await job_when_ended(client, (await generate()).json()["id"], user)
            assert with_style["status"] == plain["status"] == "succeeded", with_style
            assert with_style["params"]["loras"] == [{"name": "style", "scale": 0.5}]
            assert plain["params"]["loras"] == []
            outputs = [
                (await client.get(job["outputs"][0]["url"], headers=user)).content
                for job in (with_style, plain)
            ]
            assert outputs[0] != outputs[1]

            # Admin routes: 401 without a key, 403 with a user's key.
            for method, path, body in (
                ("GET", "/v1/loras", None),
                ("POST", "/v1/loras", {"model": "toy", "name": "x", "source": "extra.safetensors"}),
                ("DELETE", "/v1/loras/toy/style", None),
            ):
                assert (await client.request(method, path, json=body)).status_code == 401
                r = await client.request(method, path, json=body, headers=user)
                assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_required")
            # Before the body's rules (an audit's finding: an empty body told a user key the fields).
            r = await client.post("/v1/loras", json={}, headers=user)
            assert (r.status_code, r.json()["error"]["code"]) == (403, "admin_required")

            async def add(name, source, model="toy"):
                return await client.post(
                    "/v1/loras", json={"model": model, "name": name, "source": source}, headers=admin
                )

            # Sources: URLs, paths out of the root (a symlink too, which only the pool can see), `..`.
            for source, rule in (
                ("https://example.com/a.safetensors", "url_not_allowed"),
                (str(tmp_path / "secret.safetensors"), "outside_root"),
                ("../secret.safetensors", "parent_reference"),
                ("escape.safetensors", "outside_root"),
            ):
                r = await add("x", source)
                assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["field"]) == (
                    422,
                    rule,
                    "source",
                ), r.text
            r = await add("x", "missing.safetensors")  # passes the API's check; the pool reports it
            assert (r.status_code, r.json()["error"]["code"]) == (422, "lora_rejected")
            assert "no file or folder" in r.json()["error"]["message"]
            # Withdrawn: not listed (it was listed as the pool's failure until the pool looked again).
            listed = [e["name"] for e in (await client.get("/v1/loras", headers=admin)).json()["data"]]
            assert listed == ["style"], listed
            assert (await add("x", "extra.safetensors", model="other")).status_code == 404
            r = await add("style", "extra.safetensors")
            assert (r.status_code, r.json()["error"]["code"]) == (409, "declared_in_config")

            # A run-time adapter reaches the pool, is listed, and serves; the table (2 slots) evicts.
            r = await add("extra", "extra.safetensors")
            assert r.status_code == 201, r.text
            assert r.json()["usable"] and [p["status"] for p in r.json()["pools"]] == ["loaded"]
            assert (await add("third", "third.safetensors")).status_code == 201  # evicts style (LRU)
            listed = {e["name"]: e for e in (await client.get("/v1/loras", headers=admin)).json()["data"]}
            assert sorted(listed) == ["extra", "style", "third"]
            assert listed["style"]["origin"] == "config" and listed["extra"]["origin"] == "api"
            job = await job_when_ended(
                client,
                (await generate([{"name": "style"}, {"name": "extra", "scale": -1}])).json()["id"],
                user,
            )
            assert job["status"] == "succeeded", job  # style loaded again from its source

            r = await client.delete("/v1/loras/toy/style", headers=admin)
            assert (r.status_code, r.json()["error"]["code"]) == (409, "declared_in_config")
            assert (await client.delete("/v1/loras/toy/nope", headers=admin)).status_code == 404
            assert (await client.delete("/v1/loras/toy/extra", headers=admin)).status_code == 204
            listed = [e["name"] for e in (await client.get("/v1/loras", headers=admin)).json()["data"]]
            assert listed == ["style", "third"], listed  # at once, though the pool still holds it
            for _ in range(100):
                (card,) = (await client.get("/v1/models", headers=user)).json()["data"]
                if [a["name"] for a in card["adapters"]] == ["style", "third"]:
                    break
                await asyncio.sleep(0.05)
            assert [a["name"] for a in card["adapters"]] == ["style", "third"]

            # An evicted adapter whose file went away since: the job naming it fails at once, saying so.
            (root / "third.safetensors").unlink()
            job = await job_when_ended(client, (await generate([{"name": "third"}])).json()["id"], user)
            assert job["status"] == "failed" and job["error"]["code"] == "invalid_request", job
            assert "'third' could not be loaded again" in job["error"]["message"]
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
    assert loads("register") - before["register"] == 3  # style (pools.yaml), extra, third
    assert loads("reload") - before["reload"] == 1  # style, evicted by third
    assert sample("meshserve_worker_lora_evictions_total", model="toy") - before["evictions"] == 2
    # style (first job); extra (the second: style was reloaded, not a hit)
    assert sample("meshserve_worker_lora_hits_total", model="toy") - before["hits"] == 2


async def test_a_slow_adapter_fetch_does_not_hold_the_jobs(tmp_path, make_settings):
    """An adapter's file is fetched beside the jobs (a Hub download took every batch's time with it when it ran
    on the pool thread: an audit saw a 2-step job take 22 s): jobs end while the fetch still runs, then the
    adapter is loaded between batches and serves."""
    root = lora_root(tmp_path)
    settings = make_settings(lora_root=str(root), lora_poll_s=0.05, lora_wait_s=0.2, lease_s=10)
    config = WorkerConfig(
        models={"toy": ModelSpec(runner="fake", options={"lora_slots": 2, "fetch_seconds": 6})},
        pools=[PoolConfig(name="toy-0", models=["toy"], devices="0", max_batch=4, batch_wait_ms=0)],
        metrics_port=None,
    )
    async with api_client(settings) as (client, _):
        worker = Worker(config, settings)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.ready.wait(), 30)
            r = await client.post(
                "/v1/loras", json={"model": "toy", "name": "extra", "source": "extra.safetensors"}
            )
            assert r.status_code == 202 and [p["status"] for p in r.json()["pools"]] == ["pending"], r.text
            await asyncio.sleep(0.5)  # the watcher has picked it up and is fetching
            for _ in range(3):
                job_id = (await client.post("/v1/generate", json={"model": "toy", "prompt": "x"})).json()[
                    "id"
                ]
                assert (await job_when_ended(client, job_id, {}))["status"] == "succeeded"
            (card,) = (await client.get("/v1/models")).json()["data"]
            assert card["adapters"] == [], "the jobs ended before the fetch did"
            for _ in range(300):
                (card,) = (await client.get("/v1/models")).json()["data"]
                if card["adapters"]:
                    break
                await asyncio.sleep(0.05)
            assert [a["name"] for a in card["adapters"]] == ["extra"]
            body = {"model": "toy", "prompt": "x", "loras": [{"name": "extra"}]}
            job_id = (await client.post("/v1/generate", json=body)).json()["id"]
            assert (await job_when_ended(client, job_id, {}))["status"] == "succeeded"
        finally:
            worker.stop()
            await asyncio.wait_for(task, 30)
