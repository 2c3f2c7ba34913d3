"""What a pool compiles at start, and later: the pool's warm-up options reach the runner's warm_up (tasks,
schedulers), a name the model does not offer stops the pool, and a pool that started without LoRA adapters
compiles their programs when the first one is added at run time, before it is published."""

from __future__ import annotations

import types

import pytest

from meshserve.service.contract import LoraSpec
from meshserve.workers.config import ModelSpec, PoolConfig


def _runner_recording_warm_ups():
    """A PipelineRunner whose pipeline records the keywords of each warm_up call in `runner.pipe.calls`."""
    from meshserve.workers.runner import PipelineRunner

    runner = PipelineRunner("m", None, "float32", None, None)
    calls = []
    runner.pipe = types.SimpleNamespace(
        calls=calls,
        defaults={"width": 64, "height": 64},
        limits={},
        compiled_batch_size=lambda b, data: b,
        warm_up=lambda **kw: calls.append(kw) or 1.0,
        previews=types.SimpleNamespace(prepare=lambda: None, fit_seconds=0.0),
    )
    return runner


def test_pools_warm_up_the_image_tasks_they_are_told_to():
    """`warm_up_tasks` reaches the pipeline's warm_up (so no image job compiles on the request path); a task
    the model does not take stops the pool at start."""

    from meshserve.workers.pool import load_runners

    runner = _runner_recording_warm_ups()
    calls = runner.pipe.calls
    runner.warm_up([(64, 64)], [1], None, tasks=["image-to-image", "inpaint"])
    runner.warm_up([(64, 64)], [1], None)
    assert calls[0]["tasks"] == ["image-to-image", "inpaint"] and "tasks" not in calls[1]

    pool = PoolConfig(name="p", models=["toy"], devices="0", warm_up_tasks=["inpaint"])
    with pytest.raises(ValueError, match=r"warm_up_tasks \['inpaint'\] are not tasks of toy"):
        load_runners(pool, {"toy": ModelSpec(runner="fake")})


def test_a_list_of_image_tasks_is_warmed_up_beside_the_text_task(monkeypatch):
    """README: "a list of them compiles those at start too". A list replaced the text task, so an audit's pool
    with `warm_up_tasks: [image-to-image]` compiled on the request path for its first text job."""
    from meshserve.workers.fake_runner import FakeRunner
    from meshserve.workers.pool import load_runners

    calls, real_info = [], FakeRunner.info

    def info(self):
        card = real_info(self)
        tasks = ["text-to-image", "image-to-image", "inpaint"]
        return card.model_copy(update={"limits": card.limits.model_copy(update={"tasks": tasks})})

    monkeypatch.setattr(FakeRunner, "info", info)
    monkeypatch.setattr(FakeRunner, "warm_up", lambda self, *args, **kw: calls.append(kw) or 0.0)
    for listed in (["image-to-image"], ["inpaint", "text-to-image"]):
        pool = PoolConfig(name="p", models=["toy"], devices="0", warm_up_tasks=listed)
        load_runners(pool, {"toy": ModelSpec(runner="fake")})
    assert [c["tasks"] for c in calls] == [["text-to-image", "image-to-image"], ["text-to-image", "inpaint"]]


def test_pools_warm_up_the_schedulers_they_are_told_to():
    """`warm_up_schedulers` reaches the pipeline's warm_up beside the folder's own scheduler (None); a name the
    model does not offer stops the pool at start."""

    from meshserve.workers.pool import load_runners

    runner = _runner_recording_warm_ups()
    calls = runner.pipe.calls
    runner.warm_up([(64, 64)], [1], None, schedulers=["ddim"])
    runner.warm_up([(64, 64)], [1], None)
    assert calls[0]["schedulers"] == [None, "ddim"] and calls[1]["schedulers"] == [None]

    pool = PoolConfig(name="p", models=["toy"], devices="0", warm_up_schedulers=["heun"])
    with pytest.raises(ValueError, match=r"warm_up_schedulers \['heun'\] are not schedulers of toy"):
        load_runners(pool, {"toy": ModelSpec(runner="fake")})


def test_the_first_adapter_added_at_run_time_compiles_the_lora_programs(tmp_path):
    """A pool without adapters at start has no LoRA programs: the first adapter added (POST /v1/loras) runs
    the pool's warm-up again, with the same sizes, tasks and options, before it is published; the next ones
    compile nothing. A pool that declared adapters compiled them at start: nothing more."""
    from meshserve.workers.pool import load_runners

    (tmp_path / "ink.safetensors").write_bytes(b"")
    (tmp_path / "oil.safetensors").write_bytes(b"")
    calls = []
    pool = PoolConfig(
        name="p", models=["toy"], devices="0", buckets=[[32, 32]], warm_up_tasks=["text-to-image"]
    )
    specs = {"toy": ModelSpec(runner="fake", options={"lora_slots": 2})}
    runners, _ = load_runners(pool, specs, lora_root=str(tmp_path))
    runner = runners["toy"]
    runner.warm_up = lambda *args, **kwargs: calls.append((args, kwargs)) or 0.0
    runner.adapters.add("ink", LoraSpec(source="ink.safetensors"), origin="api")
    assert calls == [(([(32, 32)], [1], None), {"tasks": ["text-to-image"]})]
    runner.adapters.add("oil", LoraSpec(source="oil.safetensors"), origin="api")
    assert len(calls) == 1
    assert [a.name for a in runner.adapters.published()] == ["ink", "oil"]

    declared = {"toy": ModelSpec(runner="fake", options={"lora_slots": 2}, loras={"ink": "ink.safetensors"})}
    runners, _ = load_runners(pool, declared, lora_root=str(tmp_path))
    assert runners["toy"].adapters.warm_up_loras is None
