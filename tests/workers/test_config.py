"""pools.yaml validation: device slices, mesh sizes, model references; every error names what is wrong."""

import pytest
from pydantic import ValidationError

from meshserve.models.parallel.layout_spec import AXES
from meshserve.service.contract import FrameLimits, ModelDefaults, ModelInfo, ModelLimits
from meshserve.workers.config import MeshSizes, PoolConfig, WorkerConfig, load_config, single_model_config
from meshserve.workers.pool import served_info


def _cfg(**pool):
    base = {"name": "p0", "models": ["m"], **pool}
    return {"models": {"m": {"path": None}}, "pools": [base]}


def _device_ids(devices, **pool) -> list[int]:
    return WorkerConfig.model_validate(_cfg(devices=devices, **pool)).pools[0].device_ids


def test_device_slices_are_read_by_the_mesh_parser():
    assert _device_ids("0") == [0] and _device_ids(3) == [3]
    assert _device_ids("0,2,5-6", mesh={"data": 4}, max_batch=4) == [0, 2, 5, 6]
    # Before: the config's own parser read "0,3-1" as [0] (an empty range) and let the pool start on one device
    # while models.parallel.mesh rejected the same slice.
    for bad, message in [
        ("0,3-1", "runs backwards"),
        ("", "not N or N-M"),
        ("1-", "not N or N-M"),
        ("0,0", "twice"),
    ]:
        with pytest.raises(ValidationError, match=message):
            WorkerConfig.model_validate(_cfg(devices=bad))


def test_mesh_sizes_use_the_mesh_axes_and_rules():
    assert tuple(MeshSizes.model_fields) == AXES
    for mesh, message in [
        ({"cfg": 3}, "cfg must be 1 or 2"),
        ({"tensor": 0}, "positive integer"),
        ({"seq": 2}, "seq"),
    ]:
        with pytest.raises(ValidationError, match=message):
            WorkerConfig.model_validate(_cfg(mesh=mesh))


def test_example_config_from_the_architecture(tmp_path):
    path = tmp_path / "pools.yaml"
    path.write_text(
        "models:\n  sdxl: {path: /models/sdxl-base-1.0, dtype: bfloat16}\n"
        'pools:\n  - name: sdxl-0\n    devices: "0-3"\n    mesh: {cfg: 2, context: 2}\n    models: [sdxl]\n'
        "    max_batch: 4\n    buckets: [[1024, 1024], [832, 1216]]\n"
    )
    cfg = load_config(path)
    pool = cfg.pools[0]
    assert pool.device_ids == [0, 1, 2, 3]
    assert pool.mesh.as_dict() == {"data": 1, "cfg": 2, "context": 2, "tensor": 1}
    assert pool.buckets == [(1024, 1024), (832, 1216)]
    assert cfg.models["sdxl"].dtype == "bfloat16"


def test_devices_default_to_the_mesh_size():
    cfg = WorkerConfig.model_validate(_cfg(mesh={"tensor": 2, "data": 2}, max_batch=2))
    assert cfg.pools[0].device_ids == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "pool, message",
    [
        ({"devices": "0-2", "mesh": {"cfg": 2}}, "needs 2 devices"),
        ({"mesh": {"cfg": 3}}, "cfg"),
        ({"devices": "0-1", "mesh": {"data": 2}, "max_batch": 3}, "multiple of mesh data=2"),
        ({"models": ["other"]}, "unknown models ['other']"),
        ({"max_bacth": 2}, "max_bacth"),
        ({"devices": "x"}, "not N or N-M"),
        ({"any_size": True}, "any_size and max_programs go together"),
        ({"max_programs": 4}, "any_size and max_programs go together"),
        ({"buckets": [[64, 64], [64, 64]]}, "repeat a size"),
        ({"frames": [81, 49, 81]}, "repeat a frame count"),
        ({"frames": [0]}, "must be positive frame counts"),
        ({"weights": {"shard_over": ["data"]}}, "mesh has data=1"),
        (
            {"devices": "0-1", "mesh": {"tensor": 2}, "weights": {"shard_over": ["tensor"]}},
            "cannot name 'tensor'",
        ),
        (
            {"devices": "0-1", "mesh": {"context": 2}, "weights": {"shard_over": ["contxt"]}},
            "unknown mesh axis",
        ),
        ({"weights": {"shard": ["data"]}}, "shard"),
        # Only "hybrid" reads ulysses_degree: under any other strategy it was ignored without a word.
        (
            {
                "devices": "0-1",
                "mesh": {"context": 2},
                "attention": {"context_strategy": "ulysses", "ulysses_degree": 2},
            },
            "applies to context_strategy 'hybrid' only .the pool's is 'ulysses'",
        ),
        ({"attention": {"ulysses_degree": 1}}, "hybrid' only .the pool's is 'auto'"),
        (
            {
                "devices": "0-3",
                "mesh": {"context": 4},
                "attention": {"context_strategy": "hybrid", "ulysses_degree": 3},
            },
            "ulysses_degree 3 does not divide mesh context=4",
        ),
    ],
)
def test_bad_pool_is_a_clear_error(pool, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        WorkerConfig.model_validate(_cfg(**pool))


def test_overlapping_slices_and_duplicate_names():
    base = {"models": {"m": {}}}
    with pytest.raises(ValidationError, match="device 1 is in two pools"):
        WorkerConfig.model_validate(
            {
                **base,
                "pools": [
                    {"name": "a", "models": ["m"], "devices": "0-1", "mesh": {"data": 2}, "max_batch": 2},
                    {"name": "b", "models": ["m"], "devices": "1"},
                ],
            }
        )
    with pytest.raises(ValidationError, match="repeated"):
        WorkerConfig.model_validate(
            {
                **base,
                "pools": [
                    {"name": "a", "models": ["m"], "devices": "0"},
                    {"name": "a", "models": ["m"], "devices": "1"},
                ],
            }
        )


def test_deploy_pool_files_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "deploy" / "pools").glob("*.yaml")):
        load_config(path)


def test_single_model_config():
    cfg = single_model_config(None)
    assert list(cfg.models) == ["tiny-sdxl"] and cfg.models["tiny-sdxl"].path is None
    assert cfg.pools[0].device_ids == [0]
    assert list(single_model_config("/models/my-sdxl").models) == ["my-sdxl"]
    assert single_model_config("/models/my sdxl (v2)/").pools[0].name == "my-sdxl--v2--0"


def test_pool_attention_options_reach_the_pipeline():
    from meshserve.workers.pool import runner_options

    cfg = WorkerConfig.model_validate(
        {
            "models": {"m": {"path": None}},
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "mesh": {"context": 2},
                    "attention": {"context_strategy": "ring", "block_kv": 256},
                }
            ],
        }
    )
    pool_cfg = cfg.pools[0]
    assert pool_cfg.attention.model_dump(exclude_none=True) == {"context_strategy": "ring", "block_kv": 256}
    opts = runner_options(pool_cfg, cfg.models["m"])
    assert opts == {"attention": {"context_strategy": "ring", "block_kv": 256}}
    with pytest.raises(ValidationError, match="context_strategy"):
        WorkerConfig.model_validate(
            {
                "models": {"m": {"path": None}},
                "pools": [{"name": "p", "models": ["m"], "attention": {"context_strategy": "spiral"}}],
            }
        )


def test_pool_weight_sharding_reaches_the_pipeline():
    """`weights: {shard_over: [...]}` is checked against the pool's mesh before JAX loads and handed to
    load_pipeline as its `weights` argument (the placement's FSDP axes)."""
    from meshserve.workers.pool import runner_options

    cfg = WorkerConfig.model_validate(
        {
            "models": {"m": {"path": None}},
            "pools": [
                {
                    "name": "p",
                    "models": ["m"],
                    "mesh": {"data": 2, "context": 2},
                    "max_batch": 2,
                    "weights": {"shard_over": ["context", "data"]},
                },
                {"name": "q", "models": ["m"], "devices": "4"},
            ],
        }
    )
    opts = runner_options(cfg.pools[0], cfg.models["m"])
    assert opts == {"weights": {"shard_over": ["context", "data"]}}
    assert runner_options(cfg.pools[1], cfg.models["m"]) == {}


# A video model as a runner reports it (the tiny Wan's shape of limits: 4k+1 frames up to 33, default 5).
_VIDEO = ModelInfo(
    id="v",
    family="wan",
    task="text-to-video",
    defaults=ModelDefaults(width=48, height=32, num_inference_steps=4, guidance_scale=5.0, fps=16),
    limits=ModelLimits(
        size_multiple=16,
        min_size=16,
        max_size=512,
        max_steps=200,
        max_n=8,
        output_formats=["mp4", "webp"],
        frames=FrameLimits(min_frames=1, max_frames=33, step=4, offset=1, default=5),
    ),
)


def _pool_cfg(**fields) -> PoolConfig:
    return WorkerConfig.model_validate(_cfg(**fields)).pools[0]


def test_a_video_pool_publishes_its_frame_counts_as_the_only_ones_it_serves():
    """Before: FrameLimits had no served list, so any 4k+1 count was admitted and compiled on the request path."""
    served = served_info(_VIDEO, _pool_cfg(frames=[9, 5]))
    assert served.limits.frames.served == [9, 5] and served.limits.frames.default == 5
    # The default count not among them: the first becomes the default (a request naming none is admitted).
    served = served_info(_VIDEO, _pool_cfg(frames=[9, 17]))
    assert (served.limits.frames.served, served.limits.frames.default) == ([9, 17], 9)
    # No frames: the model's default count alone.
    assert served_info(_VIDEO, _pool_cfg()).limits.frames.served == [5]
    # any_size serves every count the model allows (the pool's frames are only warmed up).
    any_pool = _pool_cfg(frames=[9], any_size=True, max_programs=4)
    assert served_info(_VIDEO, any_pool).limits.frames.served is None


@pytest.mark.parametrize(
    "frames, message", [([8], "8 frames is not a frame count v can run"), ([37], "37 frames")]
)
def test_a_frame_count_the_model_cannot_run_is_a_clear_error(frames, message):
    with pytest.raises(ValueError, match=message):
        served_info(_VIDEO, _pool_cfg(frames=frames))


def test_frames_on_an_image_model_pool_is_a_clear_error():
    image = _VIDEO.model_copy(update={"limits": _VIDEO.limits.model_copy(update={"frames": None})})
    with pytest.raises(ValueError, match="makes images"):
        served_info(image, _pool_cfg(frames=[5]))
