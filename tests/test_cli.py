"""`meshserve generate`: the main job on a fresh machine, and clear one-line errors (never a traceback)."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from PIL import Image


def _run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "meshserve.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


@pytest.mark.slow
def test_generate_with_embedded_model(tmp_path):
    out = tmp_path / "cat.png"
    r = _run("generate", "--prompt", "a cat", "-o", str(out), "--steps", "2", "--seed", "5")
    assert r.returncode == 0, r.stderr
    image = Image.open(out)
    assert image.size == (64, 64) and "seed 5" in r.stdout
    assert "denoise" in r.stderr  # the per-step progress bar


def test_generate_with_model_folder(tmp_path, tiny_sdxl_path):
    out = tmp_path / "x.png"
    r = _run(
        "generate",
        "--model",
        str(tiny_sdxl_path),
        "--prompt",
        "a cat",
        "-o",
        str(out),
        "--steps",
        "1",
        "--width",
        "48",
    )
    assert r.returncode == 0, r.stderr
    assert Image.open(out).size == (48, 64)


def test_generate_with_flux_folder_and_true_cfg(tmp_path, tiny_flux_dev_path):
    out = tmp_path / "flux.png"
    r = _run(
        "generate",
        "--model",
        str(tiny_flux_dev_path),
        "--prompt",
        "a lighthouse",
        "--negative-prompt",
        "fog",
        "--true-cfg-scale",
        "3",
        "-o",
        str(out),
        "--steps",
        "1",
        "--width",
        "32",
        "--seed",
        "4",
    )
    assert r.returncode == 0, r.stderr
    # The height left out: diffusers' Flux default, 128 latents x the tiny VAE's factor 2.
    assert Image.open(out).size == (32, 256) and "seed 4" in r.stdout


def test_generate_video_with_embedded_wan(tmp_path):
    """Video is a core family: the base install writes an MP4 (PyAV is a dependency)."""
    import av

    out = tmp_path / "clip.mp4"
    r = _run(
        "generate", "--model", "tiny-wan", "--prompt", "a cat", "-o", str(out), "--steps", "1", "--seed", "2"
    )
    assert r.returncode == 0, r.stderr
    with av.open(str(out)) as container:
        frames = list(container.decode(video=0))
    # The trained tiny-wan's defaults (models/wan/weights/tiny-wan/meshserve.json): 9 frames at 64x64.
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (64, 64) and "seed 2" in r.stdout


def _not_diffusers(tmp_path):
    (tmp_path / "x").mkdir()
    return str(tmp_path / "x")


def _unsupported(tmp_path):
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    return str(tmp_path / "y")


_LOADED: dict = {}  # test_generate_errors_are_one_clear_line's pipelines, by load arguments


@pytest.mark.parametrize(
    "make_args,match",
    [
        (lambda p: ["--model", str(p / "missing")], "does not exist"),
        (lambda p: ["--model", _not_diffusers(p)], "not a diffusers model folder"),
        (lambda p: ["--model", _unsupported(p)], "unsupported pipeline 'KandinskyPipeline'"),
        (lambda p: ["--height", "60"], "multiple of 8"),
        (lambda p: ["--steps", "0"], "at least 1"),
        (lambda p: ["--true-cfg-scale", "2"], "the sdxl model has no true CFG"),
        (lambda p: ["--guidance-scale-2", "2"], "--guidance-scale-2: the sdxl model has one denoiser"),
        (
            lambda p: ["--model", "tiny-wan", "-o", str(p / "o.mp4"), "--prompt-2", "x"],
            "--prompt-2: the wan model has one text encoder",
        ),
        (lambda p: ["--clip-skip", "99"], "clip_skip must be an integer between 0 and"),
        (lambda p: ["--sigmas", "1,3,0"], "--sigmas: sigmas must decrease strictly"),
        (lambda p: ["--scheduler", "euler", "--eta", "0.5"], "--eta: tiny-sdxl takes no eta with scheduler"),
        (lambda p: ["--timesteps", "900,x"], "expected comma-separated ints, got '900,x'"),
        (
            lambda p: ["--model", "tiny-wan", "-o", str(p / "o.mp4"), "--sigmas", "1,0.5"],
            "--sigmas: tiny-wan takes no custom sigmas",
        ),
        # A format the model's outputs cannot be written in is refused before generating anything.
        (lambda p: ["-o", str(p / "o.mp4")], "output_format 'mp4' is not one of ['png', 'jpeg', 'webp']"),
        (lambda p: ["--model", "tiny-wan"], "output_format 'png' is not one of ['mp4', 'webp'] for tiny-wan"),
        (lambda p: ["--frames", "5"], "tiny-sdxl makes images; num_frames must be left out"),
        # The step cache is checked by the pipeline against the model's methods and the threshold's range.
        (lambda p: ["--cache", "first_block"], "cache method must be one of ['deep_features', 'teacache']"),
        (lambda p: ["--cache", "teacache:2"], "cache threshold must be between 0 and 1, got 2.0"),
        (lambda p: ["--cache", "teacache:x"], "--cache 'teacache:x': the threshold must be a number"),
        (lambda p: ["--scheduler", "EulerDiscreteScheduler"], "scheduler must be one of ['euler', "),
        # A refiner: the switch, the task and both models are checked before anything runs.
        (lambda p: ["--denoising-end", "0.5"], "--denoising-end: the steps after it are a refiner's"),
        (
            lambda p: ["--refiner", "tiny-sdxl", "--denoising-end", "1"],
            "--denoising-end must be between 0 and 1",
        ),
        (
            lambda p: ["--model", "tiny-wan", "-o", str(p / "o.mp4"), "--refiner", "tiny-sdxl"],
            "--refiner: the wan model cannot hand its latents on (SDXL can)",
        ),
        (
            lambda p: ["--refiner", "tiny-flux"],
            "--refiner tiny-flux: a flux model; the refiner must be an SDXL one",
        ),
    ],
)
def test_generate_errors_are_one_clear_line(tmp_path, make_args, match, capsys, monkeypatch):
    """In the test process (`cli.main`, the console script's function): a subprocess per case took 3.2-3.7 s,
    mostly importing JAX (2026-11-29); the process's exit code and stderr are checked once, below."""
    from meshserve import cli

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds meshserve's CPU flags
    # Each model loaded once for all the cases (a refused call leaves its pipeline as it was): loading tiny-sdxl
    # again took 1.5-2 s of most cases, 33 s of the 24 on a Zen 3 EPYC (2026-11-30).
    from meshserve import models

    def load_once(model, **options):
        key = (model, tuple(sorted(options.items())))
        if key not in _LOADED:
            _LOADED[key] = load_pipeline(model, **options)
        return _LOADED[key]

    load_pipeline = models.load_pipeline
    monkeypatch.setattr(models, "load_pipeline", load_once)
    args = make_args(tmp_path)
    try:
        code = cli.main(["generate", "--prompt", "a cat", "-o", str(tmp_path / "o.png"), *args])
    except SystemExit as e:  # argparse's own refusals (a value of the wrong type)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and _last_line(err).startswith("meshserve generate: error:"), err
    assert match in _last_line(err), err
    if args[0] in ("--cache", "--scheduler", "--sigmas"):  # told before the progress bar (on the bar's line)
        assert "denoise" not in err, err


def test_a_generate_error_is_exit_code_2_and_one_line_from_the_process(tmp_path):
    r = _run("generate", "--prompt", "a cat", "-o", str(tmp_path / "o.png"), "--height", "60")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    # Refused by the pipeline's call, after the progress bar started: the bar is cleared, the error has its line.
    assert (
        _last_line(r.stderr) == "meshserve generate: error: height must be a positive multiple of 8, got 60"
    )


def _last_line(stderr: str) -> str:
    """The last line a terminal shows (a progress bar rewrites its line after carriage returns)."""
    return stderr.rstrip("\n").split("\n")[-1].split("\r")[-1]


class _RecordingPipe:
    """Stands in for a loaded pipeline: records the call, returns grey pictures (no compiling: the real image
    path is served end to end in tests/workers/test_image_serving.py)."""

    def __init__(self, video: bool):
        self.video, self.calls, self.outputs = video, [], []
        self.denoising_split, self.tasks = (
            not video,
            ("image-to-image",) if not video else ("image-to-video",),
        )
        self.model_id, self.family, self.row_fields = "fake", "wan" if video else "sdxl", ("guidance_scale",)
        self.second_prompt, self.text_fields = not video, () if video else ("clip_skip",)
        self.schedule_fields = () if video else ("timesteps", "sigmas", "eta")
        self.defaults = {"width": 32, "height": 16, "num_inference_steps": 2, "guidance_scale": 5.0, "fps": 8}
        self.limits = {"min_size": 8, "max_size": 64, "max_steps": 10, "max_n": 2}
        self.limits["cache"] = {"teacache": {"default_threshold": 0.2}}
        if not video:  # what the fake takes with its default scheduler: custom schedules and eta
            euler = {"sigmas": True, "timesteps": True, "sigmas_end": True, "max_sigma": 1e4, "eta": True}
            self.limits["scheduler_arguments"] = {"default": {**euler, "max_timestep": 999}}
        if video:
            self.limits["frames"] = {"min_frames": 1, "max_frames": 9, "default": 5}

    def __call__(self, prompt, **kwargs):
        self.calls.append(kwargs)
        shape = (1, 5, 16, 32, 3) if self.video else (1, 16, 32, 3)
        skipped = [1] if "cache" in kwargs else None
        self.outputs.append(np.full(shape, 0.5))
        return types.SimpleNamespace(
            images=self.outputs[-1], seeds=[kwargs["seed"]], timings={"denoise": 0.0}, cached_steps=skipped
        )


@pytest.mark.parametrize("video", [False, True], ids=["inpaint-png", "image-to-video-mp4"])
def test_generate_passes_image_mask_and_strength(tmp_path, monkeypatch, video):
    """--image/--mask/--strength reach the pipeline as diffusers' image, mask_image and strength (decoded under
    the API's rules: RGB, EXIF orientation applied); an image-to-video model (a Wan I2V folder) writes .mp4."""
    from meshserve import cli

    pipe = _RecordingPipe(video)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    Image.new("RGBA", (32, 16), (200, 20, 20, 255)).save(tmp_path / "in.png")
    Image.new("L", (32, 16), 255).save(tmp_path / "mask.png")
    out = tmp_path / ("clip.mp4" if video else "out.png")
    args = [
        "generate",
        "--prompt",
        "a cat",
        "--seed",
        "3",
        "--image",
        str(tmp_path / "in.png"),
        "-o",
        str(out),
    ]
    if not video:
        args += ["--mask", str(tmp_path / "mask.png"), "--strength", "0.6", "--padding-mask-crop", "8"]
    else:  # a first-last-frame folder's last frame
        Image.new("RGB", (32, 16), (10, 200, 30)).save(tmp_path / "last.png")
        args += ["--last-image", str(tmp_path / "last.png")]
    assert cli.main(args) == 0
    (call,) = pipe.calls
    assert call["image"].mode == "RGB" and call["image"].size == (32, 16)
    assert call["image"].getpixel((0, 0)) == (200, 20, 20)
    if video:
        import av

        assert call["last_image"].getpixel((0, 0)) == (10, 200, 30)
        assert "mask_image" not in call and "strength" not in call
        with av.open(str(out)) as container:
            assert len(list(container.decode(video=0))) == 5
    else:
        assert call["mask_image"].mode == "L" and call["strength"] == 0.6
        assert call["padding_mask_crop"] == 8
        assert Image.open(out).size == (32, 16)


def test_generate_passes_a_control_image_without_an_image(tmp_path, monkeypatch, capsys):
    """--control-image alone (a FLUX.1 Canny / Depth folder's edge or depth map) reaches the pipeline as
    diffusers' control_image, decoded as RGB; no --image needed."""
    from meshserve import cli

    pipe = _RecordingPipe(False)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    Image.new("L", (32, 16), 255).save(tmp_path / "edges.png")
    out = tmp_path / "out.png"
    args = ["generate", "--prompt", "a cat", "--control-image", str(tmp_path / "edges.png"), "-o", str(out)]
    assert cli.main(args) == 0
    (call,) = pipe.calls
    assert call["control_image"].mode == "RGB" and call["control_image"].getpixel((0, 0)) == (255, 255, 255)
    assert "image" not in call and "guess_mode" not in call and "controlnet_conditioning_scale" not in call
    steer = ["--controlnet-scale", "0.5", "--control-guidance-end", "0.6", "--guess-mode"]
    assert cli.main([*args, *steer]) == 0  # an SDXL ControlNet's settings, as diffusers names them
    assert (
        pipe.calls[1]["controlnet_conditioning_scale"] == 0.5 and pipe.calls[1]["control_guidance_end"] == 0.6
    )
    assert pipe.calls[1]["guess_mode"] is True and "control_guidance_start" not in pipe.calls[1]
    no_control = ["generate", "--prompt", "a cat", "--guess-mode", "-o", str(out)]
    assert cli.main(no_control) == 2
    assert "--guess-mode needs --control-image" in capsys.readouterr().err


def test_generate_with_a_refiner_hands_the_base_latents_on(tmp_path, monkeypatch, capsys):
    """--refiner: the base stops at --denoising-end with its latents (diffusers' denoising_end, output
    "latent"), the refiner starts there from them (denoising_start) on the same schedule and seeds; the
    numbers of the split are compared with diffusers in tests/models/test_sdxl_image_inputs.py."""
    from meshserve import cli

    base, refiner = _RecordingPipe(video=False), _RecordingPipe(video=False)
    loaded = {"base": base, "refiner": refiner}
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda model, **kw: loaded[model])
    out = tmp_path / "o.png"
    args = ["generate", "--model", "base", "--refiner", "refiner", "--prompt", "a cat", "--seed", "4"]
    assert cli.main([*args, "--steps", "5", "--timesteps", "999,700,500,300,100", "-o", str(out)]) == 0
    (first,), (second,) = base.calls, refiner.calls
    assert first["denoising_end"] == 0.8 and first["output_type"] == "latent"
    assert second["denoising_start"] == 0.8 and second["image"] is base.outputs[0]
    assert second["timesteps"] == first["timesteps"] == [999, 700, 500, 300, 100] and second["seed"] == 4
    assert second["output_type"] == "np" and Image.open(out).size == (32, 16)
    assert "refiner denoise" in capsys.readouterr().out  # both calls' stages
    # Without --steps the refiner runs the base's default step count (2 here), not its own folder's.
    refiner.defaults = {**refiner.defaults, "num_inference_steps": 50}
    assert cli.main([*args, "--denoising-end", "0.6", "-o", str(out)]) == 0
    assert base.calls[-1]["denoising_end"] == refiner.calls[-1]["denoising_start"] == 0.6
    assert base.calls[-1]["num_inference_steps"] is None and refiner.calls[-1]["num_inference_steps"] == 2
    assert "mask_image" not in refiner.calls[-1]
    # Inpainting: the base inpaints the picture at its strength, the refiner its latents with the same mask.
    Image.new("RGB", (32, 16), (200, 20, 20)).save(tmp_path / "in.png")
    Image.new("L", (32, 16), 255).save(tmp_path / "mask.png")
    pictures = [
        "--image",
        str(tmp_path / "in.png"),
        "--mask",
        str(tmp_path / "mask.png"),
        "--strength",
        "0.9",
    ]
    assert cli.main([*args, *pictures, "-o", str(out)]) == 0
    first, second = base.calls[-1], refiner.calls[-1]
    assert first["image"].size == (32, 16) and first["strength"] == 0.9 and first["denoising_end"] == 0.8
    assert second["image"] is base.outputs[-1] and second["mask_image"] is first["mask_image"]
    assert "strength" not in second  # denoising_start sets where the refiner starts


def test_generate_passes_the_second_texts_and_clip_skip(tmp_path, monkeypatch):
    from meshserve import cli

    pipe = _RecordingPipe(video=False)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    args = [
        "generate",
        "--prompt",
        "a cat",
        "--prompt-2",
        "oil",
        "--negative-prompt-2",
        "blur",
        "--clip-skip",
        "1",
        "--sigmas",
        "14.6,6,1.1,0",
    ]
    assert cli.main([*args, "-o", str(tmp_path / "o.png")]) == 0
    (call,) = pipe.calls
    assert (call["prompt_2"], call["negative_prompt_2"], call["clip_skip"]) == ("oil", "blur", 1)
    assert call["sigmas"] == [14.6, 6.0, 1.1, 0.0] and "timesteps" not in call
    assert (
        cli.main(["generate", "--prompt", "a", "--timesteps", "999,500", "-o", str(tmp_path / "t.png")]) == 0
    )
    assert pipe.calls[-1]["timesteps"] == [999, 500]
    assert cli.main(["generate", "--prompt", "a", "--eta", "0.3", "-o", str(tmp_path / "e.png")]) == 0
    assert pipe.calls[-1]["eta"] == 0.3


def test_a_first_last_frame_model_without_last_image_is_told_the_flag(tmp_path, monkeypatch, capsys):
    from meshserve import cli

    pipe = _RecordingPipe(video=True)
    pipe.first_last = True
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    image = _file(tmp_path, "first.png", image=Image.new("RGB", (8, 8)))
    args = ["generate", "--prompt", "a", "--image", image, "-o", str(tmp_path / "o.mp4")]
    assert cli.main(args) == 2 and not pipe.calls
    assert "--last-image: fake is a first-last-frame model" in capsys.readouterr().err


def _file(tmp_path, name, data=None, image=None):
    path = tmp_path / name
    if image is not None:
        image.save(path)
    else:
        path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "make_args,match",
    [
        (lambda p: ["--mask", _file(p, "m.png", image=Image.new("L", (8, 8)))], "--mask needs --image"),
        (
            lambda p: ["--last-image", _file(p, "l.png", image=Image.new("RGB", (8, 8)))],
            "--last-image needs --image",
        ),
        (lambda p: ["--strength", "0.5"], "--strength needs --image"),
        (
            lambda p: [
                "--image",
                _file(p, "i.png", image=Image.new("RGB", (8, 8))),
                "--padding-mask-crop",
                "4",
            ],
            "--padding-mask-crop needs --mask",
        ),
        (
            lambda p: ["--image", _file(p, "i.png", image=Image.new("RGB", (8, 8))), "--strength", "1.5"],
            "--strength must be in (0, 1]",
        ),
        (lambda p: ["--image", str(p / "missing.png")], "No such file"),
        (lambda p: ["--image", _file(p, "t.png", b"text")], "is not an image"),
        (lambda p: ["--image", _file(p, "g.gif", image=Image.new("RGB", (8, 8)))], "GIF image; supported"),
        (
            lambda p: [
                "--image",
                _file(p, "i.png", image=Image.new("RGB", (8, 8))),
                "--mask",
                _file(p, "m.png", image=Image.new("L", (9, 8))),
            ],
            "it must be the image's size",
        ),
    ],
)
def test_generate_image_input_errors_are_one_clear_line(tmp_path, make_args, match, capsys):
    """Refused before any model is loaded (in-process: the command's own error path, no subprocess)."""
    from meshserve import cli

    assert (
        cli.main(["generate", "--prompt", "a cat", "-o", str(tmp_path / "o.png"), *make_args(tmp_path)]) == 2
    )
    err = capsys.readouterr().err
    assert match in err and err.startswith("meshserve generate: error:"), err


@pytest.mark.parametrize(
    "spec,cache",
    [("teacache:0.3", {"method": "teacache", "threshold": 0.3}), ("teacache", {"method": "teacache"})],
)
def test_generate_passes_the_step_cache(tmp_path, monkeypatch, capsys, spec, cache):
    """--cache METHOD[:THRESHOLD] reaches the pipeline as its `cache` (no threshold: the method's default, filled
    in by the pipeline), and the line written says how many steps came from the cache; without it, no cache."""
    from meshserve import cli

    pipe = _RecordingPipe(video=False)
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    args = ["generate", "--prompt", "a cat", "--seed", "3", "-o", str(tmp_path / "out.png")]
    assert cli.main([*args, "--cache", spec]) == 0
    assert pipe.calls[-1]["cache"] == cache and "; cached steps 1)" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "cache" not in pipe.calls[-1] and "cached steps" not in capsys.readouterr().out
