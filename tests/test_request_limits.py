"""meshserve/limits.py: the one request check the API, the pools and the pipelines share (pure Python), on a
pipeline's limits mapping and on the service's ModelLimits alike."""

import pytest

from meshserve.limits import (
    IMAGE_FORMATS,
    VIDEO_FORMATS,
    LimitError,
    check_request,
    min_strength,
    output_formats,
)
from meshserve.service.contract import FrameLimits, ModelLimits

IMAGE = {
    "size_multiple": 8,
    "min_size": 8,
    "max_size": 256,
    "min_steps": 1,
    "max_steps": 50,
    "max_n": 4,
    "schedulers": ["euler", "ddim"],
    "output_formats": list(IMAGE_FORMATS),
}
VIDEO = {
    **IMAGE,
    "size_multiple": 16,
    "output_formats": list(VIDEO_FORMATS),
    "frames": {"min_frames": 1, "max_frames": 33, "step": 4, "offset": 1, "default": 5},
    "max_sequence_length": 512,
}


def refused(limits, request, **kw) -> tuple[str, str, str]:
    with pytest.raises(LimitError) as caught:
        check_request(limits, request, model="m", **kw)
    return caught.value.field, caught.value.rule, str(caught.value)


@pytest.mark.parametrize("limits", [IMAGE, ModelLimits(**IMAGE)], ids=["mapping", "ModelLimits"])
def test_the_same_rules_on_a_mapping_and_on_model_limits(limits):
    check_request(limits, {"width": 64, "height": 48, "num_inference_steps": 4, "n": 2, "scheduler": "euler"})
    assert refused(limits, {"width": 60}) == (
        "width",
        "not_multiple",
        "width must be a positive multiple of 8, got 60",
    )
    assert refused(limits, {"height": 264})[:2] == ("height", "out_of_range")
    assert refused(limits, {"num_inference_steps": 51})[2] == (
        "num_inference_steps must be an integer between 1 and 50, got 51"
    )
    assert refused(limits, {"n": 5})[:2] == ("n", "out_of_range")
    assert refused(limits, {"n": 5}, names={"n": "num_images_per_prompt"})[0] == "num_images_per_prompt"
    assert refused(limits, {"scheduler": "nope"})[:2] == ("scheduler", "not_supported")
    assert refused(limits, {"output_format": "mp4"})[:2] == ("output_format", "not_supported")
    assert refused(limits, {"num_frames": 5}) == (
        "num_frames",
        "not_supported",
        "m makes images; num_frames must be left out",
    )
    assert refused(limits, {"fps": 8})[:2] == ("fps", "not_supported")
    assert refused(limits, {"max_sequence_length": 77})[:2] == ("max_sequence_length", "not_supported")
    assert refused(limits, {"width": 64.0})[:2] == ("width", "int_type")
    check_request(limits, {"width": None, "scheduler": None})  # absent fields are not checked


def test_video_frames_text_length_and_formats():
    check_request(VIDEO, {"num_frames": 9, "output_format": "mp4", "fps": 16, "max_sequence_length": 512})
    assert refused(VIDEO, {"num_frames": 8}) == (
        "num_frames",
        "not_multiple",
        "num_frames must be 4k+1, got 8",
    )
    assert refused(VIDEO, {"num_frames": 37})[:2] == ("num_frames", "out_of_range")
    assert refused(VIDEO, {"max_sequence_length": 513})[:2] == ("max_sequence_length", "out_of_range")
    assert refused(VIDEO, {"output_format": "png"})[:2] == ("output_format", "not_supported")
    served = {**VIDEO, "frames": {**VIDEO["frames"], "served": [5, 9]}}
    assert refused(served, {"num_frames": 13})[:2] == ("num_frames", "frames_not_supported")
    # A video model that names no formats writes video formats (the service's ModelLimits agrees).
    bare = {k: v for k, v in VIDEO.items() if k != "output_formats"}
    assert output_formats(bare) == list(VIDEO_FORMATS)
    limits = ModelLimits(**{**bare, "frames": FrameLimits(**VIDEO["frames"])})
    assert limits.output_formats == list(VIDEO_FORMATS)


def test_buckets_are_the_only_sizes_and_name_the_field_at_fault():
    limits = {**IMAGE, "buckets": [(64, 48), (96, 64)]}
    check_request(limits, {"width": 96, "height": 64})
    assert refused(limits, {"width": 128, "height": 128})[:2] == ("width", "size_not_supported")
    field, rule, message = refused(limits, {"width": 64, "height": 64})
    assert (field, rule) == ("height", "size_not_supported") and "served sizes: 64x48, 96x64" in message


@pytest.mark.parametrize(
    "steps,expected", [(1, 1.0), (3, 0.334), (4, 0.25), (9, 0.112), (10, 0.1), (11, 0.0910), (1000, 0.001)]
)
def test_min_strength_is_a_strength_that_runs_a_step(steps, expected):
    """The bound the no_steps errors quote: at 3 digits, rounded up (0.333 of 3 steps runs none)."""
    assert min_strength(steps) == pytest.approx(expected)
    assert int(steps * min_strength(steps)) >= 1
    assert int(steps * float(f"{min_strength(steps):g}")) >= 1  # as printed
