"""Training an embedded model: `meshserve train-embedded --family sdxl|flux|wan --out FOLDER [--seed N]`.

One loop for the three families (what differs is each family's, in training/families/): two stages on
procedural data (pictures from training/shapes.py; clips of them moving from training/clips.py for Wan), both
on a pool mesh made by the serving code (models.parallel.placement.pipeline_placement, every device on the
`data` axis; weights placed by the same rules tables the serving pipeline uses, which replicate them at
tensor=1):

1. The VAE alone learns to reconstruct the pictures or clips (MSE plus a small KL term; with a `vae_crop`,
   random crops of them), from a sampled latent so the decoder tolerates the denoiser's errors. Its latents'
   statistics are then written to its config in the family's form (SDXL and Wan: per-channel latents_mean /
   latents_std; Flux: shift_factor and scaling_factor), which the pipeline undoes before decoding.
2. The denoiser and its text encoders learn to denoise the frozen VAE's normalised latents, on the objective
   the family's scheduler samples with (training/objectives.py: SDXL's v-prediction on a zero-terminal-SNR
   schedule, Flux's and Wan's flow matching with their shifts), through the serving pipeline's own modules
   and text encoding, with captions dropped at `caption_dropout` to what the pipeline feeds for an empty
   negative prompt (classifier-free guidance). The weights written are an EMA of the trained ones. Each
   step encodes fresh pictures, or, with a `latent_pool`, draws rows from a pool encoded once.

The folder written is an ordinary diffusers folder (model_index.json, tokenizers, configs, safetensors in
PyTorch layout) plus meshserve.json (serving defaults and the record of the run). A run is a function of the
recipe and the seed: every random draw comes from numpy or JAX generators seeded from it. Not bit for bit:
XLA:CPU's multithreaded reductions do not always sum in one order, so two runs agree to rounding at first
and then drift as any two trainings do; tests/training/test_train_shapes.py bounds it for a short run.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def _cpu_devices_flag() -> None:
    """Before JAX starts: one XLA host device per core (at least 2) on the CPU, unless XLA_FLAGS says
    otherwise. Data parallelism over 2 host devices trained the UNet 1.36x faster than one device using both
    cores (72 vs 53 samples/s, batch 32, 2-core EPYC, 2026-11-22): XLA:CPU runs many of the small
    element-wise and normalisation kernels of a tiny model on one thread."""
    from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        count = max(2, os.cpu_count() or 1)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    apply_cpu_defaults()


@dataclass
class Trainee:
    """A module split for jax.jit: its graph, its parameters (trained) and the rest of its state (kept)."""

    graph: object
    params: object
    rest: object

    def module(self, params=None):
        from flax import nnx

        return nnx.merge(self.graph, self.params if params is None else params, self.rest)


def _build(component, config: dict, rng: np.random.Generator, placement, weights=None) -> Trainee:
    """The component with random weights drawn from `rng`, or with `weights` (a PyTorch-named state dict)."""
    import jax.numpy as jnp
    from flax import nnx

    from meshserve.models.checkpoints.embedded_folder import random_weights
    from meshserve.models.checkpoints.loading import abstract_module, load_weights

    parsed = component.config_cls.from_config(config)
    module = abstract_module(lambda rngs: component.module_cls(parsed, dtype=jnp.float32, rngs=rngs))
    weights = random_weights(module, rng) if weights is None else weights
    load_weights(module, weights, where=component.name, place=placement.placer(component.rules))
    for name, value in component.training_attributes:
        setattr(module, name, value)
    return Trainee(*nnx.split(module, nnx.Param, ...))


def _schedule(lr: float, warmup: int, total: int):
    import optax

    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), end_value=lr * 0.1)


_logger = logging.getLogger("meshserve.training")


def curriculum_order(scenes: list[str], seed: int) -> list[int]:
    """The latent pool's rows (each row's scene) in the order a curriculum widens over: grouped by scene, so
    that a prefix holds few scenes, each in every motion; the scenes in a random order drawn from `seed`
    (in caption order the first 500 steps drew black shapes only). Tried on tiny-wan either way, the model
    came out drawing the background's colour on the shape and the shape's on the background in 69 (caption
    order) and 78 (this order) of 120 held-out clips, against none without a curriculum."""
    names = sorted(set(scenes))
    rank = dict(zip(names, np.random.default_rng(seed + 3).permutation(len(names)), strict=True))
    return sorted(range(len(scenes)), key=lambda i: rank[scenes[i]])


def pool_reach(recipe, step: int) -> int:
    """How many of the latent pool's clips (in curriculum_order) denoiser step `step` draws from: a prefix that
    doubles in equal numbers of steps, from `curriculum_start` to the whole pool at `curriculum_steps`."""
    if step >= recipe.curriculum_steps:
        return recipe.latent_pool
    start = min(recipe.curriculum_start, recipe.latent_pool)
    return int(start * (recipe.latent_pool / start) ** (step / recipe.curriculum_steps))


def random_crops(rng: np.random.Generator, pixels: np.ndarray, side: int) -> np.ndarray:
    """A `side` x `side` crop of each row of `pixels` ([B, ..., H, W, C]: pictures or clips), at a position
    drawn from `rng` per row, the same through a clip's frames."""
    *_, height, width, _ = pixels.shape
    if side > min(height, width):
        raise ValueError(f"a crop of {side} does not fit pictures of {height}x{width}")
    tops = rng.integers(height - side + 1, size=len(pixels))
    lefts = rng.integers(width - side + 1, size=len(pixels))
    return np.stack(
        [row[..., y : y + side, x : x + side, :] for row, y, x in zip(pixels, tops, lefts, strict=True)]
    )


def _log(message: str) -> None:
    _logger.info(message)


def train(
    out: Path,
    family="sdxl",
    recipe=None,
    *,
    devices=None,
    log_every: int = 100,
    vae_from: Path | None = None,
    xla_options: dict | None = None,
) -> dict:
    """Runs both stages for `family` (a name or a TrainingFamily) on `devices` (default: all of jax.devices(),
    on the mesh's `data` axis) and writes the model folder to `out`. Returns the run's record.

    `vae_from`: a folder an earlier run of the same family wrote; its VAE is taken as trained and stage 1 is
    skipped (for trying denoiser recipes: the VAE stage is a third to a half of a run). A shipped model comes
    from one whole run. `xla_options` go to every training program's compilation (load_pipeline's)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from meshserve.models.checkpoints.loading import export_weights
    from meshserve.models.components.autoencoder_kl import DiagonalGaussian
    from meshserve.models.parallel.placement import pipeline_placement
    from meshserve.training.families import family as family_named

    jit = functools.partial(jax.jit, compiler_options=xla_options)
    family = family_named(family) if isinstance(family, str) else family
    recipe = recipe or family.recipe
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    devices = list(jax.devices() if devices is None else devices)
    placement = pipeline_placement({"data": len(devices)}, devices)["placement"]
    data = placement.batch_spec  # (batch, ndim) -> the batch split over `data`
    for batch in (recipe.vae_batch, recipe.denoiser_batch, recipe.latent_pool, recipe.latent_stats):
        if batch % len(devices):
            raise ValueError(
                f"batch, pool or latent_stats {batch} does not split over {len(devices)} devices"
            )

    family.write_tokenizers(out)
    configs = family.configs()
    data_rng = np.random.default_rng(recipe.seed)
    key = jax.random.key(recipe.seed)

    def build(component, seed):
        return _build(component, configs[component.name], np.random.default_rng(seed), placement)

    if vae_from is None:
        vae = build(family.vae, recipe.seed + 1)
    else:
        vae = _build(family.vae, configs[family.vae.name], None, placement, family.read_vae(vae_from))
        # Draw (and drop) the VAE stage's data, so the denoiser stage sees what a whole run's would: a trial on
        # a whole run's VAE is that run's denoiser stage, to rounding (Wan's 4,800 clips: 8 s, beside a test run).
        for _ in range(recipe.vae_steps):
            family.data(data_rng, recipe.vae_batch)
        recipe = recipe.model_copy(update={"vae_steps": 0})

    def put(x: np.ndarray):
        return jax.device_put(x, data(x.shape[0], x.ndim))

    replicated = NamedSharding(placement.mesh, PartitionSpec())

    def on_mesh(opt_state):
        """optax's init leaves its step counts uncommitted on one device; the step returns them replicated
        over the mesh, and jit compiled each step a second time for that (a cold 2-step run on 2 devices:
        130 -> 82 s with them placed on the mesh from the start, the same losses)."""
        return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, replicated), opt_state)

    # ---- stage 1: the VAE
    # Every optimiser here updates one flat vector of all the parameters (optax.flatten): per parameter array,
    # the update was hundreds of small element-wise programs inside the step, and the tiny SDXL's denoiser
    # step compiled in 32-36 s against 13-16 s flat (2-core EPYC, XLA level 0, 2026-11-30). The same
    # arithmetic but for the order clip_by_global_norm sums the squares in (rounding).
    vae_opt = optax.flatten(
        optax.adamw(_schedule(recipe.vae_lr, recipe.warmup_steps, recipe.vae_steps), weight_decay=0.0)
    )
    vae_opt_state = on_mesh(vae_opt.init(vae.params))

    def vae_loss(params, pixels, key):
        model = vae.module(params)
        posterior = model.encode(pixels)
        recon = model.decode(posterior.sample(key))
        kl = 0.5 * jnp.mean(jnp.sum(posterior.mean**2 + jnp.exp(posterior.logvar) - 1 - posterior.logvar, -1))
        mse = jnp.mean((recon - pixels) ** 2)
        return mse + recipe.vae_kl_weight * kl, mse

    @jit
    def vae_step(params, opt_state, pixels, key):
        (_, mse), grads = jax.value_and_grad(vae_loss, has_aux=True)(params, pixels, key)
        updates, opt_state = vae_opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mse

    crop = f", crops of {recipe.vae_crop}" if recipe.vae_crop else ""
    _log(f"stage 1: VAE, {recipe.vae_steps} steps of {recipe.vae_batch}{crop} on {len(devices)} devices")
    # The crops' positions come from a generator of their own, so the data drawn (and a --vae-from trial's
    # denoiser stage) is the same with crops or without.
    crop_rng = np.random.default_rng(recipe.seed + 5)
    t0, vae_curve = time.monotonic(), []
    for step in range(recipe.vae_steps):
        pixels, _ = family.data(data_rng, recipe.vae_batch)
        if recipe.vae_crop:
            pixels = random_crops(crop_rng, pixels, recipe.vae_crop)
        vae.params, vae_opt_state, mse = vae_step(
            vae.params, vae_opt_state, put(pixels), jax.random.fold_in(key, step)
        )
        if step % log_every == 0 or step == recipe.vae_steps - 1:
            vae_curve.append(float(mse))
            _log(f"  vae step {step}: mse {vae_curve[-1]:.5f} ({time.monotonic() - t0:.0f} s)")
    vae_seconds = time.monotonic() - t0

    @jit
    def encode(params, pixels):
        return vae.module(params).encode(pixels)

    def encode_all(pixels, chunk: int = 64):
        """The posterior of every picture, as numpy mean and logvar, `chunk` at a time."""
        parts = [encode(vae.params, put(pixels[i : i + chunk])) for i in range(0, len(pixels), chunk)]
        return tuple(np.concatenate([np.asarray(getattr(q, f)) for q in parts]) for f in ("mean", "logvar"))

    probe, _ = family.data(np.random.default_rng(recipe.seed + 100), recipe.latent_stats)
    latents, _ = encode_all(probe)
    update, shift, scale = family.latent_normalisation(latents)
    configs[family.vae.name] |= update
    _log(f"  latent normalisation {update}")
    # Arguments of the denoiser's step, not constants inside it: each run measures its own statistics, and a
    # program with them as constants was a new program for every run, compiled again where a trial on another
    # run's VAE (--vae-from) or a second run of the recipe would take it from the compilation cache.
    shift, scale = (jax.device_put(np.asarray(x, np.float32), replicated) for x in (shift, scale))

    # ---- stage 2: the denoiser and the text encoders
    trainees = {c.name: build(c, recipe.seed + 2 + i) for i, c in enumerate(family.denoiser)}
    params = {name: t.params for name, t in trainees.items()}
    ema = jax.tree.map(jnp.copy, params)
    opt = optax.flatten(
        optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.adamw(
                _schedule(recipe.denoiser_lr, recipe.warmup_steps, recipe.denoiser_steps),
                weight_decay=recipe.weight_decay,
            ),
        )
    )
    opt_state = on_mesh(opt.init(params))
    objective = family.objective()

    def denoiser_loss(p, latents, inputs, key):
        noisy, t, target = objective(latents, key)
        modules = {name: trainee.module(p[name]) for name, trainee in trainees.items()}
        pred = family.predict(modules, noisy, t, inputs)
        return jnp.mean((pred.astype(jnp.float32) - target) ** 2)

    @jit
    def denoiser_step(p, ema, opt_state, vae_params, source, inputs, key, step, shift, scale):
        """`source`: the step's pictures, or their posteriors drawn from the latent pool; `shift` and `scale`
        the VAE's latent normalisation."""
        k_latent, k_loss = jax.random.split(key)
        posterior = source if isinstance(source, DiagonalGaussian) else vae.module(vae_params).encode(source)
        latents = (jax.lax.stop_gradient(posterior.sample(k_latent)) - shift) * scale
        loss, grads = jax.value_and_grad(denoiser_loss)(p, latents, inputs, k_loss)
        updates, opt_state = opt.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        decay = jnp.minimum(recipe.ema_decay, (1.0 + step) / (10.0 + step))
        ema = jax.tree.map(lambda e, x: decay * e + (1.0 - decay) * x, ema, p)
        return p, ema, opt_state, loss

    names = " + ".join(c.name for c in family.denoiser)
    t0 = time.monotonic()
    # A VAE-only run (--denoiser-steps 0) has no use for the pool (its 4,096 Wan clips take 2-3 minutes).
    if recipe.latent_pool and recipe.denoiser_steps:
        pool_pixels, pool_captions = [], []
        for start in range(0, recipe.latent_pool, 64):
            pixels, captions = family.data(data_rng, min(64, recipe.latent_pool - start))
            pool_pixels.append(pixels)
            pool_captions += captions
        pool = encode_all(np.concatenate(pool_pixels))
        del pool_pixels
        if recipe.curriculum_steps:
            order = curriculum_order([family.scene(c) for c in pool_captions], recipe.seed)
            pool = tuple(moment[order] for moment in pool)
            pool_captions = [pool_captions[i] for i in order]
        _log(f"  latent pool: {recipe.latent_pool} encoded ({time.monotonic() - t0:.0f} s)")

    def batch(step: int):
        """The step's rows: fresh pictures, or posteriors and captions drawn from the pool."""
        if not recipe.latent_pool:
            pixels, captions = family.data(data_rng, recipe.denoiser_batch)
            return put(pixels), captions
        rows = data_rng.integers(pool_reach(recipe, step), size=recipe.denoiser_batch)
        mean, logvar = (put(moment[rows]) for moment in pool)
        return DiagonalGaussian(mean=mean, logvar=logvar), [pool_captions[i] for i in rows]

    _log(f"stage 2: {names}, {recipe.denoiser_steps} steps of {recipe.denoiser_batch}")
    losses, denoiser_curve = [], []
    for step in range(recipe.denoiser_steps):
        source, captions = batch(step)
        keep = (data_rng.random(recipe.denoiser_batch) >= recipe.caption_dropout).astype(np.float32)
        inputs = {name: put(np.asarray(x)) for name, x in family.text_inputs(captions, keep).items()}
        params, ema, opt_state, loss = denoiser_step(
            params,
            ema,
            opt_state,
            vae.params,
            source,
            inputs,
            jax.random.fold_in(key, 1_000_000 + step),
            step,
            shift,
            scale,
        )
        losses.append(loss)
        if step % log_every == 0 or step == recipe.denoiser_steps - 1:
            denoiser_curve.append(float(np.mean([float(x) for x in losses[-log_every:]])))
            _log(f"  denoiser step {step}: loss {denoiser_curve[-1]:.4f} ({time.monotonic() - t0:.0f} s)")
    denoiser_seconds = time.monotonic() - t0

    record = {
        "family": family.name,
        "recipe": recipe.model_dump(),
        **({} if vae_from is None else {"vae_from": str(vae_from)}),
        "devices": len(devices),
        "vae_seconds": round(vae_seconds, 1),
        "denoiser_seconds": round(denoiser_seconds, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "latent_normalisation": update,
        # The VAE's MSE and the denoiser's loss (mean over the last `log_every` steps) at every logged step.
        "log_every": log_every,
        "vae_mse": vae_curve,
        "denoiser_loss": denoiser_curve,
    }
    weights = {family.vae.name: export_weights(vae.module())}
    weights |= {name: export_weights(t.module(ema[name])) for name, t in trainees.items()}
    family.write_folder(out, configs, weights, record)
    _log(f"done in {record['total_seconds']:.0f} s: {out}")
    return record


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="the model folder to write")
    parser.add_argument("--seed", type=int, default=0, help="every random draw of the run comes from it")
    parser.add_argument(
        "--family", default="sdxl", help="sdxl (tiny-sdxl), flux (tiny-flux) or wan (tiny-wan)"
    )
    parser.add_argument(
        "--vae-steps", type=int, default=None, help="default: the family's recipe (training/families/)"
    )
    parser.add_argument("--denoiser-steps", type=int, default=None, help="default: the family's recipe")
    parser.add_argument(
        "--vae-from",
        type=Path,
        default=None,
        help="a folder an earlier run of this family wrote: reuse its VAE, skip stage 1 (recipe trials)",
    )


def run(args: argparse.Namespace) -> int:
    """`meshserve train-embedded`: trains and writes the folder; prints the run's record as JSON."""
    _cpu_devices_flag()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from meshserve.training.families import family

    trained = family(args.family)
    overrides = {"seed": args.seed}
    if args.vae_steps is not None:
        overrides["vae_steps"] = args.vae_steps
    if args.denoiser_steps is not None:
        overrides["denoiser_steps"] = args.denoiser_steps
    record = train(args.out, trained, trained.recipe.model_copy(update=overrides), vae_from=args.vae_from)
    sys.stdout.write(json.dumps(record, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve train-embedded", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
