"""`meshserve generate`: the main job on a fresh machine, and clear one-line errors (never a traceback)."""

import json
import subprocess
import sys

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
    assert Image.open(out).size == (32, 64) and "seed 4" in r.stdout


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
    assert len(frames) == 5 and (frames[0].width, frames[0].height) == (48, 32) and "seed 2" in r.stdout


def _not_diffusers(tmp_path):
    (tmp_path / "x").mkdir()
    return str(tmp_path / "x")


def _unsupported(tmp_path):
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    return str(tmp_path / "y")


@pytest.mark.parametrize(
    "make_args,match",
    [
        (lambda p: ["--model", str(p / "missing")], "does not exist"),
        (lambda p: ["--model", _not_diffusers(p)], "not a diffusers model folder"),
        (lambda p: ["--model", _unsupported(p)], "unsupported pipeline 'KandinskyPipeline'"),
        (lambda p: ["--height", "60"], "multiple of 8"),
        (lambda p: ["--steps", "0"], "at least 1"),
        (lambda p: ["--true-cfg-scale", "2"], "the sdxl model has no true CFG"),
        # A format the model's outputs cannot be written in is refused before generating anything.
        (lambda p: ["-o", str(p / "o.mp4")], "output_format 'mp4' is not one of ['png', 'jpeg', 'webp']"),
        (lambda p: ["--model", "tiny-wan"], "output_format 'png' is not one of ['mp4', 'webp'] for tiny-wan"),
        (lambda p: ["--frames", "5"], "tiny-sdxl makes images; num_frames must be left out"),
    ],
)
def test_generate_errors_are_one_clear_line(tmp_path, make_args, match):
    r = _run("generate", "--prompt", "a cat", "-o", str(tmp_path / "o.png"), *make_args(tmp_path))
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr, r.stderr
