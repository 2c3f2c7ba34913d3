"""Training the embedded default model: `meshserve train-embedded --out FOLDER [--seed N]`.

Two stages on procedural pictures (training/shapes.py), both on a pool mesh made by the serving code
(models.parallel.placement.pipeline_placement, every device on the `data` axis; weights placed by the same
rules tables the serving pipeline uses, which replicate them at tensor=1):

1. The VAE alone learns to reconstruct the pictures (MSE plus a small KL term), from a sampled latent so the
   decoder tolerates the denoiser's errors. Its latents' per-channel mean and spread are then written to its
   config (latents_mean, latents_std), which the pipeline undoes before decoding.
2. The UNet and both CLIP text encoders learn to denoise the frozen VAE's normalised latents: v-prediction on
   the scheduler's own zero-terminal-SNR schedule (training/config.py says why), captions dropped to zero
   embeddings at `caption_dropout` for classifier-free guidance (exactly the zeros the pipeline feeds for an
   empty negative prompt). The weights written are an EMA of the trained ones.

The folder written is an ordinary diffusers SDXL folder (model_index.json, tokenizers, configs, safetensors in
PyTorch layout) plus meshserve.json (serving defaults and the record of the run). A run is a function of the
recipe and the seed: every random draw comes from numpy or JAX generators seeded from it. Not bit for bit:
XLA:CPU's multithreaded reductions do not always sum in one order, so two runs agree to rounding at first
and then drift as any two trainings do; tests/training/test_train_shapes.py bounds it for a short run.
"""

from __future__ import annotations

import argparse
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


def _build(module_cls, config_cls, config: dict, rng: np.random.Generator, place) -> Trainee:
    import jax.numpy as jnp
    from flax import nnx

    from meshserve.models.checkpoints.embedded_folder import random_weights
    from meshserve.models.checkpoints.loading import abstract_module, load_weights

    parsed = config_cls.from_config(config)
    module = abstract_module(lambda rngs: module_cls(parsed, dtype=jnp.float32, rngs=rngs))
    load_weights(module, random_weights(module, rng), place=place)
    return Trainee(*nnx.split(module, nnx.Param, ...))


def _schedule(lr: float, warmup: int, total: int):
    import optax

    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total, warmup + 1), end_value=lr * 0.1)


_logger = logging.getLogger("meshserve.training")


def _log(message: str) -> None:
    _logger.info(message)


def train(out: Path, recipe=None, *, devices=None, log_every: int = 100) -> dict:
    """Runs both stages on `devices` (default: all of jax.devices(), on the mesh's `data` axis) and writes the
    model folder to `out`. Returns the run's record."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from meshserve.models.checkpoints.embedded_folder import clip_text_config
    from meshserve.models.components.autoencoder_kl import SHARDING_RULES as VAE_RULES
    from meshserve.models.components.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
    from meshserve.models.components.clip import SHARDING_RULES as CLIP_RULES
    from meshserve.models.components.clip import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    from meshserve.models.components.clip_tokenizer import load_clip_tokenizer, tokenize
    from meshserve.models.parallel.placement import pipeline_placement
    from meshserve.models.schedulers import make_scheduler
    from meshserve.models.sdxl.unet_2d_condition import SHARDING_RULES as UNET_RULES
    from meshserve.models.sdxl.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel
    from meshserve.training import config as C
    from meshserve.training.caption_tokenizer import build_caption_tokenizer
    from meshserve.training.shapes import training_batch

    recipe = recipe or C.Recipe()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    devices = list(jax.devices() if devices is None else devices)
    placement = pipeline_placement({"data": len(devices)}, devices)["placement"]
    data = placement.batch_spec  # (batch, ndim) -> the batch split over `data`
    for batch in (recipe.vae_batch, recipe.unet_batch):
        if batch % len(devices):
            raise ValueError(f"batch {batch} does not split over {len(devices)} devices")

    vocab = build_caption_tokenizer(out / "tokenizer")
    build_caption_tokenizer(out / "tokenizer_2", pad_token="!")  # SDXL's second tokenizer pads with "!"
    tokenizers = [load_clip_tokenizer(out / "tokenizer"), load_clip_tokenizer(out / "tokenizer_2")]
    configs = {
        "vae": {"_class_name": "AutoencoderKL", **C.VAE},
        "unet": {"_class_name": "UNet2DConditionModel", **C.UNET},
        "text_encoder": clip_text_config("CLIPTextModel", vocab, C.TEXT_ENCODER),
        "text_encoder_2": clip_text_config("CLIPTextModelWithProjection", vocab, C.TEXT_ENCODER_2),
    }
    data_rng = np.random.default_rng(recipe.seed)
    key = jax.random.key(recipe.seed)
    vae = _build(
        AutoencoderKL,
        AutoencoderKLConfig,
        configs["vae"],
        np.random.default_rng(recipe.seed + 1),
        placement.placer(VAE_RULES),
    )

    def put(x: np.ndarray):
        return jax.device_put(x, data(x.shape[0], x.ndim))

    replicated = NamedSharding(placement.mesh, PartitionSpec())

    def on_mesh(opt_state):
        """optax's init leaves its step counts uncommitted on one device; the step returns them replicated
        over the mesh, and jit compiled each step a second time for that (a cold 2-step run on 2 devices:
        130 -> 82 s with them placed on the mesh from the start, the same losses)."""
        return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, replicated), opt_state)

    # ---- stage 1: the VAE
    vae_opt = optax.adamw(_schedule(recipe.vae_lr, recipe.warmup_steps, recipe.vae_steps), weight_decay=0.0)
    vae_opt_state = on_mesh(vae_opt.init(vae.params))

    def vae_loss(params, images, key):
        model = vae.module(params)
        posterior = model.encode(images)
        recon = model.decode(posterior.sample(key))
        kl = 0.5 * jnp.mean(jnp.sum(posterior.mean**2 + jnp.exp(posterior.logvar) - 1 - posterior.logvar, -1))
        mse = jnp.mean((recon - images) ** 2)
        return mse + recipe.vae_kl_weight * kl, mse

    @jax.jit
    def vae_step(params, opt_state, images, key):
        (_, mse), grads = jax.value_and_grad(vae_loss, has_aux=True)(params, images, key)
        updates, opt_state = vae_opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, mse

    _log(f"stage 1: VAE, {recipe.vae_steps} steps of {recipe.vae_batch} on {len(devices)} devices")
    t0, vae_curve = time.monotonic(), []
    for step in range(recipe.vae_steps):
        images, _ = training_batch(data_rng, recipe.vae_batch, C.IMAGE_SIZE)
        vae.params, vae_opt_state, mse = vae_step(
            vae.params, vae_opt_state, put(images), jax.random.fold_in(key, step)
        )
        if step % log_every == 0 or step == recipe.vae_steps - 1:
            vae_curve.append(float(mse))
            _log(f"  vae step {step}: mse {vae_curve[-1]:.5f} ({time.monotonic() - t0:.0f} s)")
    vae_seconds = time.monotonic() - t0

    @jax.jit
    def encode(params, images):
        return vae.module(params).encode(images).mean

    probe, _ = training_batch(np.random.default_rng(recipe.seed + 100), 512, C.IMAGE_SIZE)
    latents = np.asarray(encode(vae.params, put(probe)))
    latents_mean = [float(v) for v in latents.mean(axis=(0, 1, 2))]
    latents_std = [float(v) for v in latents.std(axis=(0, 1, 2))]
    configs["vae"] |= {"latents_mean": latents_mean, "latents_std": latents_std}
    _log(f"  latents mean {np.round(latents_mean, 3)}, std {np.round(latents_std, 3)}")
    mean = jnp.asarray(latents_mean, jnp.float32)
    inv_std = 1.0 / jnp.asarray(latents_std, jnp.float32)

    # ---- stage 2: the UNet and the text encoders
    text_place = placement.placer(CLIP_RULES)
    unet = _build(
        UNet2DConditionModel,
        UNet2DConditionConfig,
        configs["unet"],
        np.random.default_rng(recipe.seed + 2),
        placement.placer(UNET_RULES),
    )
    te = _build(
        CLIPTextModel,
        CLIPTextConfig,
        configs["text_encoder"],
        np.random.default_rng(recipe.seed + 3),
        text_place,
    )
    te2 = _build(
        CLIPTextModelWithProjection,
        CLIPTextConfig,
        configs["text_encoder_2"],
        np.random.default_rng(recipe.seed + 4),
        text_place,
    )
    trainees = {"unet": unet, "text_encoder": te, "text_encoder_2": te2}
    params = {name: t.params for name, t in trainees.items()}
    ema = jax.tree.map(jnp.copy, params)
    unet_opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            _schedule(recipe.unet_lr, recipe.warmup_steps, recipe.unet_steps),
            weight_decay=recipe.weight_decay,
        ),
    )
    unet_opt_state = on_mesh(unet_opt.init(params))

    # The schedule the pipeline samples with: the scheduler class's own alpha_bar (zero at the last step).
    schedule = make_scheduler(None, {"_class_name": "EulerDiscreteScheduler", **C.SCHEDULER})
    alphas_cumprod = jnp.asarray(schedule.alphas_cumprod(), jnp.float32)
    num_train = len(schedule.alphas_cumprod())
    size = C.IMAGE_SIZE
    time_ids = jnp.asarray([[size, size, 0, 0, size, size]], jnp.float32)

    def conditioning(p, ids, ids_2, keep):
        out_1 = te.module(p["text_encoder"])(ids)
        out_2 = te2.module(p["text_encoder_2"])(ids_2)
        embeds = jnp.concatenate([out_1.hidden_states[-2], out_2.hidden_states[-2]], axis=-1)
        return embeds * keep[:, None, None], out_2.text_embeds * keep[:, None]

    def unet_loss(p, latents, ids, ids_2, keep, key):
        k_t, k_noise = jax.random.split(key)
        batch = latents.shape[0]
        t = jax.random.randint(k_t, (batch,), 0, num_train)
        noise = jax.random.normal(k_noise, latents.shape)
        a = alphas_cumprod[t][:, None, None, None]
        noisy = jnp.sqrt(a) * latents + jnp.sqrt(1.0 - a) * noise
        target = jnp.sqrt(a) * noise - jnp.sqrt(1.0 - a) * latents  # v
        embeds, pooled = conditioning(p, ids, ids_2, keep)
        model = unet.module(p["unet"])
        pred = model(noisy, t, embeds, text_embeds=pooled, time_ids=jnp.tile(time_ids, (batch, 1)))
        return jnp.mean((pred - target) ** 2)

    @jax.jit
    def unet_step(p, ema, opt_state, vae_params, images, ids, ids_2, keep, key, step):
        k_latent, k_loss = jax.random.split(key)
        posterior = vae.module(vae_params).encode(images)
        latents = (jax.lax.stop_gradient(posterior.sample(k_latent)) - mean) * inv_std
        loss, grads = jax.value_and_grad(unet_loss)(p, latents, ids, ids_2, keep, k_loss)
        updates, opt_state = unet_opt.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        decay = jnp.minimum(recipe.ema_decay, (1.0 + step) / (10.0 + step))
        ema = jax.tree.map(lambda e, x: decay * e + (1.0 - decay) * x, ema, p)
        return p, ema, opt_state, loss

    _log(f"stage 2: UNet + text encoders, {recipe.unet_steps} steps of {recipe.unet_batch}")
    t0, losses, unet_curve = time.monotonic(), [], []
    for step in range(recipe.unet_steps):
        images, captions = training_batch(data_rng, recipe.unet_batch, size)
        keep = (data_rng.random(recipe.unet_batch) >= recipe.caption_dropout).astype(np.float32)
        ids = tokenize(tokenizers[0], captions)
        ids_2 = tokenize(tokenizers[1], captions)
        params, ema, unet_opt_state, loss = unet_step(
            params,
            ema,
            unet_opt_state,
            vae.params,
            put(images),
            put(ids),
            put(ids_2),
            put(keep),
            jax.random.fold_in(key, 1_000_000 + step),
            step,
        )
        losses.append(loss)
        if step % log_every == 0 or step == recipe.unet_steps - 1:
            unet_curve.append(float(np.mean([float(x) for x in losses[-log_every:]])))
            _log(f"  unet step {step}: loss {unet_curve[-1]:.4f} ({time.monotonic() - t0:.0f} s)")
    unet_seconds = time.monotonic() - t0

    record = {
        "recipe": recipe.model_dump(),
        "devices": len(devices),
        "vae_seconds": round(vae_seconds, 1),
        "unet_seconds": round(unet_seconds, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "latents_mean": latents_mean,
        "latents_std": latents_std,
        # The VAE's MSE and the UNet's loss (mean over the last `log_every` steps) at every logged step.
        "log_every": log_every,
        "vae_mse": vae_curve,
        "unet_loss": unet_curve,
    }
    modules = {"vae": vae.module()} | {name: t.module(ema[name]) for name, t in trainees.items()}
    _write_folder(out, configs, modules, record)
    _log(f"done in {record['total_seconds']:.0f} s: {out}")
    return record


def _write_folder(out: Path, configs: dict, modules: dict, record: dict) -> None:
    """The diffusers folder (tokenizers already in it) and meshserve.json: serving defaults and the record."""
    from meshserve.models.checkpoints.embedded_folder import write_component, write_json, write_model_index
    from meshserve.models.checkpoints.loading import export_weights
    from meshserve.training import config as C

    entries = {
        name: write_component(out / name, configs[name], export_weights(m)) for name, m in modules.items()
    }
    write_model_index(
        out,
        "StableDiffusionXLPipeline",
        entries,
        tokenizers={"tokenizer": "CLIPTokenizer", "tokenizer_2": "CLIPTokenizer"},
        scheduler=("EulerDiscreteScheduler", C.SCHEDULER),
        pipeline_config={"force_zeros_for_empty_prompt": True},
    )
    write_json(out, {"defaults": C.SERVING_DEFAULTS, "training": record}, "meshserve.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="the model folder to write")
    parser.add_argument("--seed", type=int, default=0, help="every random draw of the run comes from it")
    parser.add_argument(
        "--vae-steps", type=int, default=None, help="default: the recipe's (training/config.py)"
    )
    parser.add_argument("--unet-steps", type=int, default=None, help="default: the recipe's")


def run(args: argparse.Namespace) -> int:
    """`meshserve train-embedded`: trains and writes the folder; prints the run's record as JSON."""
    _cpu_devices_flag()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from meshserve.training.config import Recipe

    overrides = {"seed": args.seed}
    if args.vae_steps is not None:
        overrides["vae_steps"] = args.vae_steps
    if args.unet_steps is not None:
        overrides["unet_steps"] = args.unet_steps
    record = train(args.out, Recipe(**overrides))
    sys.stdout.write(json.dumps(record, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshserve train-embedded", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
