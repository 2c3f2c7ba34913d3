"""A Wan pool serves exactly the frame counts it compiled (issue 10): a pool on the embedded tiny Wan warmed up
for `frames: [5]` publishes them as the only ones served and compiles nothing when it runs a 5-frame job, while
a frame count it did not warm up (9) compiles on the request path, which is why the API refuses it."""

from __future__ import annotations

from meshserve.service.contract import JobParams
from meshserve.workers.config import WorkerConfig
from meshserve.workers.pool import load_runners
from meshserve.workers.runner import RunRequest


def _params(num_frames: int, width: int, height: int) -> JobParams:
    return JobParams(
        model="tiny-wan",
        prompt="waves",
        width=width,
        height=height,
        num_frames=num_frames,
        num_inference_steps=2,
        guidance_scale=5.0,
        fps=16,
        seed=3,
        output_format="webp",
    )


def test_a_pool_warmed_for_its_frames_compiles_nothing_serving_them():
    cfg = WorkerConfig.model_validate(
        {
            "models": {"tiny-wan": {"path": "tiny-wan"}},
            "pools": [{"name": "wan-0", "models": ["tiny-wan"], "devices": "0", "frames": [5]}],
            "metrics_port": None,
        }
    )
    pool = cfg.pools[0]
    runners, models = load_runners(pool, cfg.models)
    runner, info = runners["tiny-wan"], models["tiny-wan"]
    assert info.limits.frames.served == [5] and info.limits.frames.default == 5
    ((width, height),) = info.limits.buckets
    warmed = runner.compilations
    assert warmed > 0  # the warm-up compiled the 5-frame programs (with and without CFG)

    (result,) = runner.run([RunRequest("j5", _params(5, width, height))])
    assert runner.compilations == warmed and not result.compiled
    assert result.outputs[0].num_frames == 5

    # The check can fail: 9 frames is another shape, compiled on the request path.
    (result,) = runner.run([RunRequest("j9", _params(9, width, height))])
    assert runner.compilations > warmed and result.compiled
    assert result.outputs[0].num_frames == 9
