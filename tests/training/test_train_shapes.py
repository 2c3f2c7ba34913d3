"""The training script: runs on the serving mesh (batch split over `data`), writes a folder the serving
pipeline loads, and a 2-device run computes what a 1-device run does."""

import json
import logging

import jax
import numpy as np
import pytest

from meshserve.models import load_pipeline
from meshserve.models.checkpoints.loading import read_component_weights
from meshserve.training import families
from meshserve.training.families import wan as wan_family
from meshserve.training.recipe import Recipe
from meshserve.training.train_shapes import curriculum_order, pool_reach, random_crops, train

RECIPE = Recipe(vae_steps=2, denoiser_steps=2, vae_batch=4, denoiser_batch=4, warmup_steps=1, latent_stats=16)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS host device count)")
    out = tmp_path_factory.mktemp("trained")
    # "1" trains the VAE stage alone: compiling the UNet stage's step for a second mesh cost ~1 minute of
    # the suite, and the stages share the placement code (one `put` of every batch over `data`).
    runs = {"1": (1, RECIPE.model_copy(update={"denoiser_steps": 0})), "2": (2, RECIPE)}
    done = {
        name: (out / name, train(out / name, "sdxl", recipe, devices=jax.devices()[:n], log_every=1))
        for name, (n, recipe) in runs.items()
    }
    # "reuse" trains the denoiser on run 1's VAE (--vae-from): run 2's VAE to rounding (the same stage on one
    # device), so it is also run 2's denoiser stage run again, and with "1" it stands in for a whole second run
    # from the seed, which cost another 20 s of the suite (2026-11-25). Its denoiser step is run 2's program,
    # read back from the compilation cache, although the VAE's statistics differ from run 2's in their last
    # bits: they are inputs of the step (as constants, each run's made a new program, compiled again).
    hits = _CacheHits()
    with hits:
        reused = train(
            out / "reuse", "sdxl", RECIPE, devices=jax.devices()[:2], log_every=1, vae_from=out / "1"
        )
    return done | {"reuse": (out / "reuse", reused), "reuse cache hits": hits.programs}


class _CacheHits(logging.Handler):
    """While entered: the programs JAX reads back from its persistent compilation cache (its debug log)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.programs: list[str] = []
        self._logger = logging.getLogger("jax._src.compiler")

    def emit(self, record):
        if record.getMessage().startswith("Persistent compilation cache hit for"):
            self.programs.append(record.args[0])

    def __enter__(self):
        self._level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self)

    def __exit__(self, *exc):
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def test_a_run_is_a_function_of_its_seed(runs):
    # Same seed: the same data, initial weights and noise, so the same weights up to rounding. Not bit for
    # bit: XLA:CPU's multithreaded reductions do not always sum in one order (seen here: one text-encoder
    # weight differed in its last bits between two runs), and one device sums in another order than two. A
    # weight can then differ by at most what Adam's sign-like first updates move it (the peak learning rate
    # per step, 2 steps here); weights drawn from another seed differ by far more.
    # Each stage is run twice: the VAE's by runs "1" and "2", the denoiser's by "2" and "reuse" (on run 1's
    # VAE, run 2's to rounding; the UNet's losses there are compared in test_a_run_can_reuse_an_earlier_runs_vae).
    (first, record), (vae_again, record_vae_again) = runs["2"], runs["1"]
    np.testing.assert_allclose(record["vae_mse"][0], record_vae_again["vae_mse"][0], rtol=1e-5)
    files = sorted(p.relative_to(first) for p in first.rglob("*.safetensors"))
    assert len(files) == 4
    bound = 2 * max(RECIPE.vae_lr, RECIPE.denoiser_lr)
    for rel in files:
        again = vae_again if rel.parent.name == "vae" else runs["reuse"][0]
        a, b = read_component_weights(first / rel.parent), read_component_weights(again / rel.parent)
        assert a.keys() == b.keys()
        worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
        assert worst <= bound, (rel, worst)


def test_data_parallel_training_computes_the_single_device_losses(runs):
    (_, one), (_, two) = runs["1"], runs["2"]
    assert two["devices"] == 2 and one["devices"] == 1
    # Same seed, same batches: the VAE's first loss (before any update) agrees to rounding, and so do the
    # losses after its updates.
    np.testing.assert_allclose(one["vae_mse"][0], two["vae_mse"][0], rtol=1e-5)
    np.testing.assert_allclose(one["vae_mse"], two["vae_mse"], rtol=1e-3)
    np.testing.assert_allclose(
        one["latent_normalisation"]["latents_mean"],
        two["latent_normalisation"]["latents_mean"],
        rtol=1e-3,
        atol=1e-5,
    )


def test_a_run_can_reuse_an_earlier_runs_vae(runs):
    (source, record), (folder, reused) = runs["1"], runs["reuse"]
    assert (
        reused["recipe"]["vae_steps"] == 0 and reused["vae_mse"] == [] and reused["vae_from"] == str(source)
    )
    vae, again = read_component_weights(source / "vae"), read_component_weights(folder / "vae")
    assert vae.keys() == again.keys() and all(np.array_equal(vae[k], again[k]) for k in vae)
    # The latent statistics are measured again on the same VAE and probe pictures: the same to rounding.
    for name, value in record["latent_normalisation"].items():
        np.testing.assert_allclose(reused["latent_normalisation"][name], value, rtol=1e-5, atol=1e-6)

    def architecture(run):  # the VAE's config less the statistics just compared
        config = json.loads((run / "vae" / "config.json").read_text())
        return {k: v for k, v in config.items() if k not in record["latent_normalisation"]}

    assert architecture(folder) == architecture(source)
    # The VAE stage's data is drawn and dropped, so the denoiser stage saw run 2's batches, noise and initial
    # weights: the same losses, to rounding (without the drawing they differed by 7 %, 2026-11-24).
    np.testing.assert_allclose(reused["denoiser_loss"], runs["2"][1]["denoiser_loss"], rtol=1e-2)
    # Run 2's denoiser step, from the compilation cache: the latent statistics are not compiled in.
    assert "jit_denoiser_step" in runs["reuse cache hits"], runs["reuse cache hits"]


def test_the_folder_it_writes_serves(runs):
    folder, record = runs["2"]
    pipe = load_pipeline(folder)
    assert pipe.defaults["num_inference_steps"] == 20
    out = pipe("a red circle on a blue background", num_inference_steps=2, seed=0, output_type="np")
    assert np.asarray(out.images).shape == (1, 64, 64, 3)
    stats = record["latent_normalisation"]
    assert len(stats["latents_mean"]) == len(stats["latents_std"]) == 4 and min(stats["latents_std"]) > 0


# The other two families run the same loop (training/families/): a step or two of each stage write a folder
# that the serving pipeline loads and runs, with the family's latent normalisation and serving defaults.
FAMILY_RECIPE = Recipe(
    vae_steps=2, denoiser_steps=2, vae_batch=2, denoiser_batch=2, warmup_steps=1, latent_stats=8
)


@pytest.mark.parametrize(
    ("family", "stats", "frames"),
    [("flux", {"shift_factor", "scaling_factor"}, None), ("wan", {"latents_mean", "latents_std"}, 5)],
)
def test_flux_and_wan_train_in_the_same_loop(tmp_path, family, stats, frames):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS host device count)")
    # Wan on 5-frame clips (2 latent frames), not the shipped 9: the same programs, a smaller compile; with
    # the trial settings on, so their wiring runs too.
    trial = dict(anywhere=True, flow_shift=1.5, logit_normal=0.5)
    trained = families.family(family) if frames is None else wan_family.Family(frames=frames, **trial)
    # Wan draws its rows from a latent pool (its recipe's way), grouped by scene for a curriculum over the
    # first step; Flux encodes fresh pictures every step. Wan's VAE takes one step, at the full rate (no
    # warm-up), on 16 x 16 crops of the clips, and the folder's pipeline then decodes whole 64 x 64 clips: at
    # the suite's XLA level 0 (conftest) each step of its 3D VAE on two whole clips ran 26 s, after the 14 s
    # compile (2026-11-25; the recipe's steps of eight 9-frame clips take 2-3 s at the default); on 16 x 16
    # crops 1.7 s (32 x 32: 6 s). The pool holds as many clips as the latent statistics' probe (8), so one
    # encode program serves both (a pool of 6 compiled a second one).
    pooled = {
        "latent_pool": 8,
        "curriculum_steps": 1,
        "curriculum_start": 2,
        "vae_steps": 1,
        "vae_crop": 16,
        "warmup_steps": 0,
    }
    recipe = FAMILY_RECIPE.model_copy(update=pooled if frames else {})
    # At the suite's XLA level (conftest): on 32 x 32 crops, Wan's run took 29 s alone on a Zen 5 VM against 43 s
    # at serving's level, whose VAE step compiled in 21 s against 10 (2026-11-29, cold cache); 24.5 s on 16 x 16
    # crops with the pool of 8.
    options = dict(devices=jax.devices()[:2])
    record = train(tmp_path / family, trained, recipe, log_every=1, **options)
    assert record["family"] == family and set(record["latent_normalisation"]) == stats
    assert all(np.isfinite(record["vae_mse"])) and all(np.isfinite(record["denoiser_loss"]))
    folder = tmp_path / family
    # Each T5 encoder's vocabulary is its tokenizer's (the caption words, then letters).
    for encoder, tokenizer in {
        "flux": [("text_encoder_2", "tokenizer_2")],
        "wan": [("text_encoder", "tokenizer")],
    }[family]:
        vocab = json.loads((folder / encoder / "config.json").read_text())["vocab_size"]
        pieces = json.loads((folder / tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
        assert vocab == len(pieces), (encoder, vocab, len(pieces))
    pipe = load_pipeline(folder)
    assert pipe.defaults["max_sequence_length"] == 16 and pipe.defaults["num_inference_steps"] == 20
    out = pipe("a red circle on a blue background", num_inference_steps=1, seed=0, output_type="np")
    images = np.asarray(out.images)
    assert np.isfinite(images).all()
    if frames is not None:  # the folder's num_frames default is the clips' length
        assert pipe.defaults["num_frames"] == frames and images.shape[1] == frames
        # The folder samples at the shift it was trained at.
        assert json.loads((folder / "scheduler/scheduler_config.json").read_text())["flow_shift"] == 1.5
        # Wan's VAE is written in diffusers' names and shapes: --vae-from reads it back into ours. It is stored
        # in float16 (the shipped folder's size), so the latent statistics come back to that rounding: the
        # channel means, about 0.01-0.03 here, within 1.2e-5 of the float32 VAE's on 2026-11-28.
        # The VAE and its statistics are what it reads back: no denoiser steps (their program is the first run's).
        vae_only = recipe.model_copy(update={"denoiser_steps": 0})
        again = train(tmp_path / "again", trained, vae_only, vae_from=folder, **options)
        for name, value in record["latent_normalisation"].items():
            np.testing.assert_allclose(again["latent_normalisation"][name], value, rtol=1e-3, atol=1e-4)
        assert {str(w.dtype) for w in read_component_weights(folder / "vae").values()} == {"float16"}
        vae, reused = (read_component_weights(f / "vae") for f in (folder, tmp_path / "again"))
        assert vae.keys() == reused.keys() and all(np.array_equal(vae[k], reused[k]) for k in vae)


def test_a_curriculum_widens_the_pool_it_draws_from_to_the_whole_pool():
    recipe = Recipe(latent_pool=4096, curriculum_steps=3000, curriculum_start=32)
    reach = [pool_reach(recipe, step) for step in range(0, 6001, 100)]
    assert reach[0] == 32 and reach[30:] == [4096] * 31
    assert all(a <= b for a, b in zip(reach, reach[1:], strict=False))
    # Doubling in equal numbers of steps: 32 -> 4096 is 7 doublings over 3,000 steps.
    assert 60 <= pool_reach(recipe, 3000 // 7) <= 64
    assert {pool_reach(Recipe(latent_pool=64), step) for step in (0, 1, 1000)} == {64}
    with pytest.raises(ValueError, match="latent pool"):
        Recipe(curriculum_steps=10)


def test_a_curriculum_meets_the_scenes_one_group_at_a_time_in_a_random_order():
    rng = np.random.default_rng(0)
    scenes = [f"scene {i:02d}" for i in rng.integers(40, size=400)]
    order = curriculum_order(scenes, seed=0)
    assert sorted(order) == list(range(400))
    met = [scenes[i] for i in order]
    groups = [s for i, s in enumerate(met) if i == 0 or s != met[i - 1]]
    assert len(groups) == len(set(scenes))  # each scene's rows together
    assert groups != sorted(groups)  # not in caption order
    assert curriculum_order(scenes, seed=0) == order and curriculum_order(scenes, seed=1) != order


def test_the_vae_trains_on_random_crops_one_per_clip():
    rng = np.random.default_rng(0)
    clips = rng.integers(256, size=(64, 9, 64, 64, 3), dtype=np.uint8)
    crops = random_crops(np.random.default_rng(1), clips, 32)
    assert crops.shape == (64, 9, 32, 32, 3)
    corners = set()
    for clip, crop in zip(clips, crops, strict=True):
        # Where the crop's first frame sits in its clip's first frame; every frame is cut at the same place.
        (y, x), *_ = [
            (y, x)
            for y in range(33)
            for x in range(33)
            if np.array_equal(clip[0, y : y + 32, x : x + 32], crop[0])
        ]
        assert np.array_equal(clip[:, y : y + 32, x : x + 32], crop)
        corners.add((y, x))
    assert len(corners) > 50  # drawn per row, anywhere it fits
    assert random_crops(np.random.default_rng(0), clips[:, 0], 64).shape == (64, 64, 64, 3)  # pictures too
    with pytest.raises(ValueError, match="does not fit"):
        random_crops(rng, clips, 72)
    for side in (12, -8):
        with pytest.raises(ValueError, match="multiple of 8"):
            Recipe(vae_crop=side)
