"""diffusers' `generator=`: torch's CPU normal draws reproduced with numpy (models/engine/torch_generator.py),
the starting noise of each family laid out as diffusers' `prepare_latents` lays it, the calls at which each
stochastic scheduler's diffusers step draws from the generator (`generator_draws`), and a whole SDXL pipeline
given the same generators as diffusers' (so the same pictures, call after call, stochastic samplers too)."""

import json
import types

import numpy as np
import pytest

from meshserve.models import PipelineError, load_pipeline
from meshserve.models.engine.torch_generator import draw_noise, generator_seeds
from meshserve.models.schedulers import make_scheduler
from tests.fixtures.tiny_sdxl import SCHEDULER, diffusers_sdxl
from tests.models.test_schedulers import SHAPE, build, case_id, ref_loop, ref_step_kwargs, rel_err, run_loop


def _torch_generator(seed):
    import torch

    return torch.Generator("cpu").manual_seed(seed)


@pytest.mark.parametrize(
    "seed,shape",
    [
        (0, (1, 4, 8, 8)),
        (42, (2, 4, 16, 12)),
        (7, (1, 16, 3, 5, 5)),  # a video's [B, C, T, h, w]
        (2**40 + 3, (3, 17)),  # 51 values: torch redraws the last 16; a seed over 32 bits
        (1, (1, 16)),
    ],
)
def test_draws_are_torch_randn_and_advance_the_generator_as_torch(seed, shape):
    import torch

    ours_gen, torch_gen = _torch_generator(seed), _torch_generator(seed)
    for g in (ours_gen, torch_gen):  # a generator already used, by torch's other path (< 16 values) too
        torch.randn(5, generator=g)
    for _ in range(2):  # the second draw starts where the first left the generator
        ours = draw_noise(ours_gen, shape)
        expected = torch.randn(shape, generator=torch_gen).numpy()
        assert ours.shape == expected.shape
        assert np.abs(ours - expected).max() <= 5e-7
    assert torch.equal(ours_gen.get_state(), torch_gen.get_state())
    assert ours_gen.initial_seed() == seed  # the state's other fields are left as they were


def test_a_list_draws_one_row_from_each_and_a_list_of_one_is_one():
    import torch

    gens = [_torch_generator(s) for s in (3, 4)]
    ours = draw_noise([_torch_generator(3), _torch_generator(4)], (2, 4, 8, 8))
    expected = torch.cat([torch.randn((1, 4, 8, 8), generator=g) for g in gens]).numpy()
    assert np.abs(ours - expected).max() <= 5e-7
    one = draw_noise([_torch_generator(5)], (2, 4, 8, 8))
    assert np.abs(one - torch.randn((2, 4, 8, 8), generator=_torch_generator(5)).numpy()).max() <= 5e-7
    with pytest.raises(PipelineError, match="a list of 2 generators for 3 output rows"):
        draw_noise([_torch_generator(1), _torch_generator(2)], (3, 4, 8, 8))


def test_bfloat16_draws_are_torchs():
    import torch

    ours = draw_noise(_torch_generator(9), (2, 4, 8, 8), bfloat16=True)
    expected = torch.randn((2, 4, 8, 8), generator=_torch_generator(9), dtype=torch.bfloat16).float().numpy()
    assert np.abs(ours - expected).max() <= 2**-7  # one bfloat16 rounding of a value 2.4e-7 apart, at most
    assert np.mean(ours == expected) > 0.99
    with pytest.raises(PipelineError, match="not a multiple of 16"):
        draw_noise(_torch_generator(9), (1, 51), bfloat16=True)


def test_other_generators_are_refused_clearly():
    cuda = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), get_state=None, set_state=None)
    with pytest.raises(PipelineError, match="on 'cuda' draws other numbers"):
        draw_noise(cuda, (1, 4, 8, 8))
    with pytest.raises(PipelineError, match="must be a torch.Generator"):
        draw_noise(np.random.default_rng(0), (1, 4, 8, 8))
    with pytest.raises(PipelineError, match=r"\(< 16\) is not reproduced"):
        draw_noise(_torch_generator(0), (1, 8))


def test_seeds_for_the_step_noise_follow_the_generator_without_advancing_it():
    import torch

    g = _torch_generator(11)
    before = g.get_state().clone()
    seeds = generator_seeds(g, 3)
    assert seeds[1:] == [seeds[0] + 1, seeds[0] + 2] and torch.equal(g.get_state(), before)
    assert generator_seeds(_torch_generator(11), 3) == seeds
    assert generator_seeds(_torch_generator(12), 3) != seeds
    two = generator_seeds([_torch_generator(11), _torch_generator(12)], 2)
    assert two[0] == seeds[0] and two[1] != seeds[1]


def _our_noise(pipe, generator, rows, task="text-to-image", **settings):
    shape = pipe.noise_shape(settings)
    return pipe._generator_noise(generator, None, None, shape, rows, task, False, True)


def test_flux_and_wan_starting_noise_is_diffusers_prepare_latents(tiny_flux_dev_path, tiny_wan_path):
    """Flux packs its noise into 2x2 patches; Wan draws [B, C, T, h, w] in float32. Each against diffusers'
    own `prepare_latents` on the same generator (no program runs)."""
    import torch
    from diffusers import FluxPipeline, WanPipeline

    flux = FluxPipeline.from_pretrained(str(tiny_flux_dev_path), torch_dtype=torch.float32)
    expected, _ = flux.prepare_latents(
        2, flux.transformer.config.in_channels // 4, 36, 44, torch.float32, "cpu", _torch_generator(3)
    )
    ours = _our_noise(
        load_pipeline(tiny_flux_dev_path, dtype="float32"), _torch_generator(3), 2, height=36, width=44
    )
    assert ours.shape == tuple(expected.shape) and np.abs(ours - expected.numpy()).max() <= 5e-7

    wan = WanPipeline.from_pretrained(str(tiny_wan_path), torch_dtype=torch.float32)
    expected = wan.prepare_latents(
        1, wan.transformer.config.in_channels, 32, 48, 5, torch.float32, "cpu", _torch_generator(4)
    )
    ours = _our_noise(load_pipeline(tiny_wan_path), _torch_generator(4), 1, height=32, width=48, num_frames=5)
    assert ours.shape == tuple(expected.shape) and np.abs(ours - expected.numpy()).max() <= 5e-7


H, W = 64, 48  # test_sdxl_pipeline.py's size, steps and prompts: its programs, from the persistent cache


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl_path):
    return load_pipeline(tiny_sdxl_path, dtype="float32")


def test_sdxl_with_diffusers_generators_makes_diffusers_pictures_call_after_call(sdxl, tiny_sdxl_path):
    reference = diffusers_sdxl(tiny_sdxl_path)
    kw = {"height": H, "width": W, "num_inference_steps": 4, "guidance_scale": 5.0, "output_type": "np"}
    prompts = ["a photo of a cat", "the dog and the cat"]
    ours_gen, their_gen = _torch_generator(21), _torch_generator(21)
    for call in range(2):  # the second call: a list, the reused generator's row and a fresh one's
        gens = (
            (ours_gen, their_gen)
            if call == 0
            else ([ours_gen, _torch_generator(22)], [their_gen, _torch_generator(22)])
        )
        args = (prompts,) if call == 0 else (prompts[:1],)
        n = {} if call == 0 else {"num_images_per_prompt": 2}
        expected = reference(*args, generator=gens[1], **n, **kw).images
        out = sdxl(*args, generator=gens[0], **n, **kw)
        assert np.abs(out.images - expected).max() <= 1e-3, call
        assert len(set(out.seeds)) == 2
    first_rows = sdxl(prompts, generator=_torch_generator(21), **kw).images
    assert np.abs(first_rows[:1] - out.images[:1]).max() > 1e-2  # the reused generator drew new noise


def test_sdxl_generator_rules(sdxl):
    image = np.zeros((H, W, 3), np.uint8)
    with pytest.raises(PipelineError, match="give seed or generator, not both"):
        sdxl("a cat", seed=1, generator=_torch_generator(0), height=H, width=W)
    with pytest.raises(PipelineError, match="not for image-to-image from a picture"):
        sdxl("a cat", image=image, generator=_torch_generator(0), height=H, width=W)
    g = _torch_generator(0)
    state = g.get_state().clone()
    with pytest.raises(PipelineError, match="2 generators for 3 output rows"):
        sdxl(["a", "b", "c"], generator=[g, _torch_generator(1)], height=H, width=W)
    assert bool((g.get_state() == state).all())  # a refused call draws nothing


# Stochastic schedulers and when diffusers' step draws from the generator: every call (Euler a, DPM++ 2M SDE),
# only with eta > 0 (DDIM; TCD as LCM), where t > 0 (DDPM: linspace spacing ends at t = 0), all but the last
# step (LCM), a step's second call (DPM2 a).
DRAW_CASES = [
    ("euler_ancestral", {}, {}),
    ("dpmpp_2m_sde_karras", {}, {}),
    ("ddim", dict(clip_sample=False), dict(eta=0.7)),
    ("ddim", {}, {}),
    ("ddpm", dict(timestep_spacing="linspace", clip_sample=False), {}),
    ("lcm", {}, {}),
    ("tcd", {}, dict(eta=0.3)),
    ("tcd", {}, {}),
    ("dpm2_ancestral", {}, {}),
]


@pytest.mark.parametrize("case", DRAW_CASES, ids=case_id)
def test_generator_draws_replay_diffusers_steps(sdxl_config, case):
    """diffusers' loop with a generator against ours fed that generator's draws at `generator_draws`' calls:
    the same samples, and both generators left in the same state (as many draws, no more)."""
    import torch

    ours, ref = build(sdxl_config, case)
    steps = 4
    schedule = ours.schedule(steps)
    calls = int(schedule.timesteps.shape[0])
    latents = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    theirs, mine = _torch_generator(5), _torch_generator(5)
    expected = ref_loop(ref, steps, latents, {**ref_step_kwargs(ours, 0), "generator": theirs})
    noises = np.zeros((calls, *SHAPE), np.float32)
    draws = ours.generator_draws(schedule, 0, calls, calls, getattr(ours, "eta", 0.0))
    for i in draws:
        noises[i] = draw_noise(mine, SHAPE)
    assert rel_err(run_loop(ours, schedule, latents, noises), expected) <= 1e-4
    assert torch.equal(mine.get_state(), theirs.get_state()), (len(draws), calls)


@pytest.fixture(scope="module")
def sdxl_config(tmp_path_factory) -> dict:
    """The tiny SDXL scheduler_config.json as diffusers saves it (test_schedulers.py's)."""
    import diffusers

    folder = tmp_path_factory.mktemp("scheduler")
    diffusers.EulerDiscreteScheduler(**SCHEDULER).save_config(str(folder))
    return json.loads((folder / "scheduler_config.json").read_text())


def test_brownian_and_deterministic_schedulers_draw_nothing_from_the_generator(sdxl_config):
    for name in ("dpmpp_sde", "euler", "dpmpp_2m", "heun"):
        sched = make_scheduler(name, sdxl_config)
        schedule = sched.schedule(4)
        assert sched.generator_draws(schedule, 0, 7, 7, 0.0) == [], name


@pytest.mark.parametrize("scheduler", ["euler_ancestral", "dpm2_ancestral"])
def test_sdxl_stochastic_samplers_with_a_generator_are_diffusers(sdxl, tiny_sdxl_path, scheduler):
    """The starting noise and every step's draw from the same generator as diffusers' pipeline (DPM2 a: on a
    step's second UNet call)."""
    import diffusers

    reference = diffusers_sdxl(tiny_sdxl_path)
    cls = {
        "euler_ancestral": "EulerAncestralDiscreteScheduler",
        "dpm2_ancestral": "KDPM2AncestralDiscreteScheduler",
    }
    reference.scheduler = getattr(diffusers, cls[scheduler]).from_config(reference.scheduler.config)
    kw = {"height": H, "width": W, "num_inference_steps": 3, "guidance_scale": 5.0, "output_type": "np"}
    ours_gen, their_gen = _torch_generator(8), _torch_generator(8)
    expected = reference(["a photo of a cat", "a red car"], generator=their_gen, **kw).images
    out = sdxl(["a photo of a cat", "a red car"], generator=ours_gen, scheduler=scheduler, **kw)
    assert np.abs(out.images - expected).max() <= 1e-3
    assert bool((ours_gen.get_state() == their_gen.get_state()).all())
