"""Output encoding (decoded back and compared) and the fake runner's contract: batches, seeds, callbacks."""

import io

import numpy as np
import pytest
from PIL import Image

from meshserve.service.contract import JobParams
from meshserve.workers.config import PoolConfig
from meshserve.workers.encoding import (
    DEFAULT_QUALITY,
    encode_image,
    encode_output,
    encode_video,
    to_uint8,
)
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.runner import Cancelled, InvalidRequest, RunRequest, make_runner


def _image(h=16, w=24):
    rng = np.random.default_rng(0)
    return rng.random((h, w, 3), dtype=np.float32)


def test_png_round_trips_exactly():
    img = _image()
    data, ctype = encode_image(img, "png")
    assert ctype == "image/png"
    back = np.asarray(Image.open(io.BytesIO(data)))
    assert back.shape == (16, 24, 3)
    np.testing.assert_array_equal(back, to_uint8(img))


@pytest.mark.parametrize("fmt, ctype", [("jpeg", "image/jpeg"), ("webp", "image/webp")])
def test_lossy_formats_decode_close(fmt, ctype):
    img = np.full((32, 32, 3), 0.5, np.float32)  # flat: lossy codecs keep it within a few levels
    data, got = encode_image(img, fmt)
    assert got == ctype
    back = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)
    assert np.abs(back - 128).max() <= 3


def test_a_jobs_output_compression_is_its_encoders_quality():
    """`output_compression` is the quality of JPEG, WebP and animated WebP (None: DEFAULT_QUALITY's bytes); the
    runner passes each job's own."""
    img = _image(64, 64)
    for fmt in ("jpeg", "webp"):
        small, default, high = (encode_image(img, fmt, q)[0] for q in (10, None, 100))
        assert len(small) < len(default) < len(high), fmt
        assert default == encode_image(img, fmt, DEFAULT_QUALITY)[0]
    frames = np.stack([_image(32, 32)] * 3)
    assert len(encode_video(frames, "webp", 8, quality=10)[0]) < len(encode_video(frames, "webp", 8)[0])
    runner = FakeRunner("fake")
    sizes = {}
    for quality in (5, 95):
        params = _req("a").params.model_copy(update={"output_format": "jpeg", "output_compression": quality})
        (result,) = runner.run([RunRequest("a", params)])
        sizes[quality] = len(result.outputs[0].data)
    assert sizes[5] < sizes[95], sizes


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="gif"):
        encode_image(_image(), "gif")


def test_video_hooks():
    av = pytest.importorskip("av")
    frames = np.stack([np.full((16, 16, 3), i / 8, np.float32) for i in range(8)])
    data, ctype = encode_video(frames, "mp4", fps=8)
    assert ctype == "video/mp4"
    with av.open(io.BytesIO(data)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == 8
    assert abs(int(decoded[4].mean()) - 128) <= 6
    data, ctype = encode_output(frames, "webp")
    assert ctype == "image/webp" and Image.open(io.BytesIO(data)).n_frames == 8


def _req(job_id, prompt="p", n=1, seed=7, steps=3):
    params = JobParams(
        model="fake",
        prompt=prompt,
        width=16,
        height=8,
        num_inference_steps=steps,
        guidance_scale=5.0,
        seed=seed,
        n=n,
    )
    return RunRequest(job_id, params)


def test_fake_runner_batch_seeds_and_callback():
    runner = make_runner("fake", "fake", path=None, dtype="float32", mesh=None, devices=None, options={})
    assert isinstance(runner, FakeRunner)
    steps = []
    results = runner.run([_req("a", n=2, seed=10), _req("b", seed=3)], lambda s, t: steps.append((s, t)))
    assert steps == [(1, 3), (2, 3), (3, 3)]
    assert [r.job_id for r in results] == ["a", "b"]
    assert [o.seed for o in results[0].outputs] == [10, 11] and [o.index for o in results[0].outputs] == [
        0,
        1,
    ]
    out = results[1].outputs[0]
    assert (out.width, out.height, out.content_type) == (16, 8, "image/png")
    assert Image.open(io.BytesIO(out.data)).size == (16, 8)
    # Deterministic: the same job gives the same bytes.
    assert runner.run([_req("b", seed=3)])[0].outputs[0].data == out.data
    assert runner.info().defaults.num_inference_steps == 4


def test_fake_runner_stop_and_faults():
    runner = FakeRunner("fake")
    with pytest.raises(Cancelled):
        runner.run([_req("a")], lambda s, t: s < 2)
    with pytest.raises(InvalidRequest):
        runner.run([_req("a", prompt="FAKE_REJECT")])
    with pytest.raises(RuntimeError):
        runner.run([_req("a", prompt="FAKE_RAISE")])


def test_batches_pad_to_power_of_two_buckets():
    from meshserve.models.engine.pipeline import batch_bucket

    assert [batch_bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [batch_bucket(n, data=2) for n in (1, 2, 3)] == [2, 2, 4]
    assert batch_bucket(3, data=3) == 6


# -------------------------------------------------------------------------------------------------
# PipelineRunner through the pipeline contract alone, on stand-in pipelines (no weights, no compiling)


def _contract_pipeline(video: bool = False, fail: Exception | None = None, row_fields=("guidance_scale",)):
    from meshserve.models.registry import DiffusionPipeline, PipelineOutput

    class StandIn(DiffusionPipeline):
        family = "standin-video" if video else "standin"
        task = "text-to-video" if video else "text-to-image"
        batch_fields = DiffusionPipeline.batch_fields + (("num_frames",) if video else ())
        pads_batches = not video
        scheduler_config = {}

        def __init__(self):
            super().__init__()
            self.calls = []
            self.row_fields = row_fields

        @property
        def defaults(self):
            return {"width": 16, "height": 8, "num_inference_steps": 2, "guidance_scale": 5.0}

        @property
        def limits(self):
            return {}

        def __call__(self, prompt, **kw):
            self.calls.append({"prompt": prompt, **kw})
            if fail is not None:
                raise fail
            frames = (kw["num_frames"],) if video else ()
            rows = np.stack(
                [np.full((*frames, kw["height"], kw["width"], 3), s % 7 / 7, np.float32) for s in kw["seed"]]
            )
            return PipelineOutput(images=rows, seeds=list(kw["seed"]), timings={"denoise": 0.0})

    return StandIn()


def _pipeline_runner(pipe, mesh=None):
    from meshserve.workers.runner import PipelineRunner

    runner = PipelineRunner("m", None, "float32", mesh, None)
    runner.pipe = pipe
    return runner


def test_pipeline_runner_passes_only_contract_arguments():
    """Per-row lists, the batch fields the pipeline names, nothing SDXL-specific; images pad to a power of
    two (the padding rows are dropped), video runs the exact batch with its frames."""
    image = _contract_pipeline()
    results = _pipeline_runner(image).run([_req("a", n=2, seed=10), _req("b", seed=3)])
    (call,) = image.calls
    assert set(call) == {
        "prompt", "negative_prompt", "guidance_scale", "seed", "num_images_per_prompt", "output_type",
        "callback", "width", "height", "num_inference_steps",
    }  # fmt: skip
    assert call["seed"] == [10, 11, 3, 10] and len(call["prompt"]) == 4  # 3 rows padded to 4
    assert [[o.seed for o in r.outputs] for r in results] == [[10, 11], [3]]

    video = _contract_pipeline(video=True)
    params = _req("v", n=3).params.model_copy(update={"num_frames": 5, "output_format": "webp"})
    (result,) = _pipeline_runner(video, mesh={"data": 2}).run([RunRequest("v", params)])
    (call,) = video.calls
    assert call["num_frames"] == 5 and call["seed"] == [7, 8, 9]  # exact: no padded fourth video
    assert [o.num_frames for o in result.outputs] == [5, 5, 5]
    runner = _pipeline_runner(video)
    assert runner.batch_key(params) != runner.batch_key(params.model_copy(update={"num_frames": 9}))


def test_pipeline_runner_passes_the_declared_row_fields_per_row():
    """A family's own row fields (Flux: true_cfg_scale) go per output row, repeated for a job's n images: jobs
    with and without true CFG share a batch. The runner knows no field by name."""
    pipe = _contract_pipeline(row_fields=("guidance_scale", "true_cfg_scale"))
    a = _req("a", n=2).params.model_copy(update={"true_cfg_scale": 4.0, "negative_prompt": "fog"})
    b = _req("b").params.model_copy(update={"true_cfg_scale": 1.0, "guidance_scale": 2.0})
    _pipeline_runner(pipe).run([RunRequest("a", a), RunRequest("b", b)])
    (call,) = pipe.calls
    assert call["true_cfg_scale"] == [4.0, 4.0, 1.0, 4.0]  # 3 rows padded to 4 with the first
    assert call["guidance_scale"] == [5.0, 5.0, 2.0, 5.0]
    assert call["negative_prompt"] == ["fog", "fog", None, "fog"]


def test_a_row_field_a_job_does_not_carry_takes_the_pipelines_default():
    """A job admitted on a card without the field (SDXL's guidance_rescale: a pool from before it, or a job
    queued then) runs with the pipeline's default, not None."""
    pipe = _contract_pipeline(row_fields=("guidance_scale", "guidance_rescale"))
    type(pipe).defaults = property(lambda self: {"width": 16, "height": 8, "num_inference_steps": 2,
                                                 "guidance_scale": 5.0, "guidance_rescale": 0.0})  # fmt: skip
    a = _req("a").params.model_copy(update={"guidance_rescale": 0.7})
    _pipeline_runner(pipe).run([RunRequest("a", a), _req("b")])
    (call,) = pipe.calls
    assert call["guidance_rescale"] == [0.7, 0.0]


def test_a_row_field_that_falls_back_goes_as_none_where_a_job_has_none():
    """Wan 2.2's guidance_scale_2 falls back to the row's own guidance_scale (diffusers'), not to the model's
    default: a job without it (admitted before the card had it) passes None, which the pipeline resolves."""
    pipe = _contract_pipeline(row_fields=("guidance_scale", "guidance_scale_2"))
    pipe.row_field_fallbacks = {"guidance_scale_2": "guidance_scale"}
    a = _req("a").params.model_copy(update={"guidance_scale_2": 2.0})
    _pipeline_runner(pipe).run([RunRequest("a", a), _req("b")])
    (call,) = pipe.calls
    assert call["guidance_scale_2"] == [2.0, None]


def test_a_job_with_more_images_than_max_batch_runs_in_parts():
    """max_batch bounds one call's rows (the device memory the pool is sized for), also for one job's n: a
    job of 5 images on a pool of max_batch 2 runs as calls of 2, 2 and 1 rows (warmed-up sizes) with the
    seeds, outputs and previews of one call, and a step count that never goes back. Before, the job ran as
    one call of 8 rows (5 padded), a batch size the pool had not compiled."""
    pipe = _contract_pipeline()
    runner = _pipeline_runner(pipe)
    runner.max_rows = 2
    steps, previews = [], []
    results = runner.run([_req("a", n=5, seed=10)], callback=lambda s, t: steps.append((s, t)))
    assert [call["seed"] for call in pipe.calls] == [[10, 11], [12, 13], [14]]
    (result,) = results
    assert [o.seed for o in result.outputs] == [10, 11, 12, 13, 14]
    whole = _pipeline_runner(_contract_pipeline()).run([_req("a", n=5, seed=10)])[0]
    assert [o.data for o in result.outputs] == [o.data for o in whole.outputs]

    # Two jobs that together exceed max_rows (a pool whose batcher allows it) split at the call boundary.
    pipe = _contract_pipeline()
    runner = _pipeline_runner(pipe)
    runner.max_rows = 3
    a, b = runner.run([_req("a", n=2, seed=1), _req("b", n=3, seed=20)])
    assert [call["seed"] for call in pipe.calls] == [[1, 2, 20, 1], [21, 22]]  # 3 rows padded to 4
    assert [o.seed for o in a.outputs] == [1, 2] and [o.seed for o in b.outputs] == [20, 21, 22]

    # The step callback counts over the parts; a cancel in a part stops the job.
    from meshserve.models.registry import PipelineOutput

    class Stepping(type(_contract_pipeline())):
        def __call__(self, prompt, **kw):
            for i in range(kw["num_inference_steps"]):
                if kw["callback"] is not None and kw["callback"](i + 1, kw["num_inference_steps"]) is False:
                    from meshserve.models import GenerationCancelled

                    raise GenerationCancelled("stopped")
            rows = np.zeros((len(kw["seed"]), kw["height"], kw["width"], 3), np.float32)
            return PipelineOutput(images=rows, seeds=list(kw["seed"]), timings={"denoise": 1.0})

    runner = _pipeline_runner(Stepping())
    runner.max_rows = 1
    (result,) = runner.run([_req("a", n=3, steps=2)], callback=lambda s, t: steps.append((s, t)))
    assert steps[-6:] == [(0, 2), (0, 2), (1, 2), (1, 2), (1, 2), (2, 2)]  # the job's 2 steps over 3 calls
    assert result.timings["denoise"] == 3.0  # the job's calls together
    with pytest.raises(Cancelled):
        runner.run([_req("a", n=3, steps=2)], callback=lambda s, t: s < 1)

    # Previews name each part's rows by their index in the job.
    class Previewing(type(_contract_pipeline())):
        def __call__(self, prompt, **kw):
            kw["preview_callback"](1, 2, {row: np.zeros((2, 2, 3), np.uint8) for row in range(len(prompt))})
            return super().__call__(prompt, **kw)

    runner = _pipeline_runner(Previewing())
    runner.max_rows = 2
    params = _req("a", n=3).params.model_copy(update={"preview_every": 1})
    runner.generate([RunRequest("a", params)], previews=lambda job, i, *_: previews.append((job, i)))
    assert sorted(previews) == [("a", 0), ("a", 1), ("a", 2)]


def test_pools_warm_up_every_batch_size_up_to_max_batch():
    """No batch size a pool runs (1 to max_batch rows) compiles on the request path unless the pool says so."""
    assert PoolConfig(name="p", models=["m"], max_batch=4).batch_sizes() == [1, 2, 3, 4]
    assert PoolConfig(name="p", models=["m"], max_batch=4, warm_up_batch_sizes=[4]).batch_sizes() == [4]
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PoolConfig(name="p", models=["m"], warm_up_batch_sizes=[0])
    with pytest.raises(ValueError, match=r"warm_up_batch_sizes \[4\] are over max_batch 2"):
        PoolConfig(name="p", models=["m"], max_batch=2, warm_up_batch_sizes=[1, 4])
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PoolConfig(name="p", models=["m"], warm_up_steps=0)


def test_only_a_model_with_two_experts_takes_load_into_transformer_2(tmp_path):
    """A one-denoiser pipeline's load_lora has no such argument (diffusers' SDXL and Flux mixins neither): the
    runner refuses it as a load error, which the registry shows, instead of a TypeError."""
    from meshserve.service.lora_sources import LoraSource
    from meshserve.workers.adapters import LoraLoadError

    pipe = _contract_pipeline()
    pipe.load_lora = lambda name, source: {"name": name, "rank": 4, "bytes": 1}
    runner = _pipeline_runner(pipe)
    source = LoraSource("path", str(tmp_path / "a.safetensors"))
    with pytest.raises(LoraLoadError, match="load_into_transformer_2: m has no transformer_2"):
        runner.load_lora("a", source, load_into_transformer_2=True)
    assert runner.load_lora("a", source)["rank"] == 4


def test_only_pipeline_errors_are_the_jobs_fault():
    """An engine bug that raises ValueError (a layout, a trace, a shape) must stay a worker fault (retried,
    then dead-lettered), not become InvalidRequest. Before the fix the runner caught every ValueError."""
    from meshserve.models import PipelineError

    with pytest.raises(InvalidRequest, match="multiple of 8"):
        _pipeline_runner(_contract_pipeline(fail=PipelineError("height must be a multiple of 8"))).run(
            [_req("a")]
        )
    engine_bug = ValueError("Incompatible shapes for broadcasting: (2, 4) and (3, 4)")
    with pytest.raises(ValueError, match="Incompatible shapes") as caught:
        _pipeline_runner(_contract_pipeline(fail=engine_bug)).run([_req("a")])
    assert not isinstance(caught.value, InvalidRequest)


@pytest.mark.parametrize(
    "name, path, loaded",
    [
        ("tiny-wan", None, "embedded:tiny-wan"),  # it loaded tiny-sdxl under the name tiny-wan
        ("tiny-flux", None, "embedded:tiny-flux"),
        ("sdxl", None, None),  # any other name: the default embedded model
        ("tiny-wan", "/models/wan", "/models/wan"),
    ],
)
def test_a_model_without_a_path_named_as_an_embedded_model_loads_that_one(monkeypatch, name, path, loaded):
    import meshserve.models
    from meshserve.workers.runner import PipelineRunner

    seen = []
    monkeypatch.setattr(meshserve.models, "load_pipeline", lambda path, **kw: seen.append(path))
    PipelineRunner(name, path, "float32", None, None).load()
    assert seen == [loaded]
