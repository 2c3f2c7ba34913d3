"""`meshserve generate --lora NAME=PATH[:SCALE]` (repeatable), in-process with a recording pipeline (no model, no
compiling: the adapters' effect on a real model is tests/models/test_lora.py's and test_lora_serving.py's)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from meshserve import cli


class _RecordingPipe:
    def __init__(self):
        self.model_id, self.family, self.row_fields = "fake", "sdxl", ("guidance_scale",)
        self.defaults = {"width": 16, "height": 16, "num_inference_steps": 2, "guidance_scale": 5.0}
        self.limits = {"min_size": 8, "max_size": 64, "max_steps": 10, "max_n": 2}
        self.loaded, self.calls = [], []

    def load_lora(self, name, source):
        self.loaded.append((name, source))

    def __call__(self, prompt, **kwargs):
        self.calls.append(kwargs)
        return types.SimpleNamespace(images=np.full((1, 16, 16, 3), 0.5), seeds=[kwargs["seed"]], timings={})


def test_generate_loads_and_applies_each_lora(tmp_path, monkeypatch):
    pipe, options = _RecordingPipe(), []
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: options.append(kw) or pipe)
    out = tmp_path / "o.png"
    args = ["generate", "--prompt", "a cat", "--seed", "1", "-o", str(out)]
    args += [
        "--lora",
        "style=/l/style.safetensors:0.8",
        "--lora",
        "detail=owner/name",
        "--lora",
        "c=a:b.st:-1.5",
    ]
    assert cli.main(args) == 0
    assert pipe.loaded == [("style", "/l/style.safetensors"), ("detail", "owner/name"), ("c", "a:b.st")]
    (call,) = pipe.calls
    assert call["loras"] == [
        {"name": "style", "scale": 0.8},
        {"name": "detail", "scale": 1.0},
        {"name": "c", "scale": -1.5},
    ]
    pipe.calls.clear()
    assert cli.main(["generate", "--prompt", "a cat", "--seed", "1", "-o", str(out)]) == 0
    assert "loras" not in pipe.calls[0]  # none given: the program without adapters
    assert [o["lora_convs"] for o in options] == [False, False]  # none of the adapters is a local conv file


def test_a_local_file_with_conv_factors_brings_the_convs_into_the_table(tmp_path, monkeypatch):
    """LoCon / LCM-LoRA: a local file with 4-D factors loads the pipeline with lora_convs (or --lora-convs)."""
    from safetensors.numpy import save_file

    convs, linear = tmp_path / "convs.safetensors", tmp_path / "linear.safetensors"
    name = "unet.down_blocks.0.resnets.0.conv1"
    save_file(
        {
            f"{name}.lora_A.weight": np.zeros((2, 4, 3, 3), np.float32),
            f"{name}.lora_B.weight": np.zeros((4, 2, 1, 1), np.float32),
        },
        str(convs),
    )
    save_file({"unet.x.lora_A.weight": np.zeros((2, 4), np.float32)}, str(linear))
    pipe, options = _RecordingPipe(), []
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: options.append(kw) or pipe)
    out = str(tmp_path / "o.png")
    base = ["generate", "--prompt", "a cat", "--seed", "1", "-o", out]
    for extra in (
        ["--lora", f"l={linear}"],
        ["--lora", f"l={linear}", "--lora", f"c={convs}:0.5"],
        ["--lora", "h=owner/name", "--lora-convs"],
    ):
        assert cli.main(base + extra) == 0
    assert [o["lora_convs"] for o in options] == [False, True, True]


def test_a_conv_file_the_detection_missed_is_told_the_flag(tmp_path, monkeypatch, capsys):
    """A file the auto-detection cannot see into (a Hub id, or 2-D factors on 1x1 convs): the refusal names
    the adapter and --lora-convs."""
    from meshserve.models.lora.formats import AdapterFormatError

    pipe = _RecordingPipe()

    def refuse(name, source):
        raise AdapterFormatError(
            "LoRA module 'down_blocks.0.resnets.0.conv_shortcut' is a convolution: this pool's LoRA table holds "
            "convolutions only with lora_convs (LoCon files, LCM-LoRA)"
        )

    pipe.load_lora = refuse
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pipe)
    args = ["generate", "--prompt", "a cat", "-o", str(tmp_path / "o.png"), "--lora", "h=owner/name"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--lora h: LoRA module" in err and "(--lora-convs)" in err


@pytest.mark.parametrize(
    "spec,match",
    [
        ("style", "expected NAME=PATH"),
        ("=x.safetensors", "expected NAME=PATH"),
        ("a=:0.5", "expected NAME=PATH"),
    ],
)
def test_bad_lora_arguments_are_one_clear_line(tmp_path, monkeypatch, capsys, spec, match):
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pytest.fail("loaded a model"))
    args = ["generate", "--prompt", "a cat", "-o", str(tmp_path / "o.png"), "--lora", spec]
    assert cli.main(args) == 2
    assert match in capsys.readouterr().err


def test_a_repeated_lora_name_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("meshserve.models.load_pipeline", lambda *a, **kw: pytest.fail("loaded a model"))
    args = ["generate", "--prompt", "x", "-o", str(tmp_path / "o.png"), "--lora", "a=x", "--lora", "a=y"]
    assert cli.main(args) == 2
    assert "given twice" in capsys.readouterr().err
