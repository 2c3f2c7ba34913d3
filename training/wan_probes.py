"""Probes of the tiny Wan recipe (training/families/wan.py) that answer in minutes what a whole run answers in 40
(docs/embedded-model.md: what they found and how the recipe changed). Three train the transformer on hand-made
latents instead of a VAE's; one reads a trained VAE alone.

- `position`: pure noise in, a fixed centred square out. Wan's DiT sees positions only through RoPE in
  self-attention (relative offsets), and its patch embedding pads nothing, so it cannot tell the centre from the
  edge: the prediction inside the square should come out equal to the one outside.
- `grow`: flow matching on latents that hold one square (channels 0-3 raised on a 6 x 6 patch of the 16 x 16
  grid, every latent frame), then sampling 16 latents from noise with Euler: how many hold a square. The model
  has to place it where the noise leans (nothing else tells it where), as the real model has to place a shape.
- `motion`: flow matching on latents whose square moves a few latent pixels a latent frame, left, right, up,
  down or still, each direction conditioned on its own fixed text states, then 20 clips sampled with CFG 5:
  how many move the asked way. It asks what tiny-wan's direction words ask of the DiT, without the VAE and
  the text encoder; `--captions` conditions on tiny-wan's UMT5 instead, `--latents-from FOLDER` trains on a
  folder's VAE latents of real clips (of one training combination, or `--combinations N`).
- `roundtrip FOLDER`: the VAE of a tiny-wan folder (a whole run's, or `meshserve train-embedded --family wan
  --denoiser-steps 0`'s) encodes and decodes a clip of every held-out combination in every motion, and
  training/motion_score.py reads them as it reads generated clips: the most any denoiser on these latents
  can score.

    python -m meshserve.training.wan_probes grow --steps 2000 --lr 6e-3 --heads 2
    python -m meshserve.training.wan_probes position --steps 400
    python -m meshserve.training.wan_probes motion --steps 2000 --lr 5e-3 [--anywhere | --captions]
    python -m meshserve.training.wan_probes motion --steps 2000 --lr 5e-3 --layers 6 --width 64 --heads 2
    python -m meshserve.training.wan_probes motion --steps 1500 --lr 5e-3 --latents-from FOLDER
    python -m meshserve.training.wan_probes motion --steps 2000 --lr 5e-3 --first-frame-lead 0.5
    python -m meshserve.training.wan_probes motion --steps 2000 --lr 5e-3 --patch 3,2,2 --width 192
    python -m meshserve.training.wan_probes roundtrip FOLDER
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from meshserve.training import objectives
from meshserve.training.train_shapes import _build, _cpu_devices_flag, _schedule

GRID = (3, 16, 16)  # latent frames, height, width: the 9-frame 64 x 64 clips' latents
SQUARE = 6  # latent pixels on a side
SAMPLES = 16


def _shifted(u, shift: float):
    """Sampling's sigmas, shifted as objectives.flow_matching shifts the training ones, so the probes' Euler
    samplers visit the sigmas the model trained at."""
    return shift * u / (1 + (shift - 1) * u)


def _transformer(
    layers: int,
    ffn_dim: int | None = None,
    heads: int | None = None,
    width: int | None = None,
    patch: tuple[int, int, int] | None = None,
):
    """The recipe's transformer with `layers` blocks; `width` (default the recipe's 96) split into `heads`
    heads (default the recipe's 4) and an ffn of `ffn_dim` (default 4 x the width, the recipe's ratio), and
    `patch` (default the recipe's (1, 2, 2))."""
    import jax

    from meshserve.models.parallel.placement import pipeline_placement
    from meshserve.models.wan import transformer_wan as wan
    from meshserve.training.families import wan as family

    placement = pipeline_placement({"data": 1}, jax.devices()[:1])["placement"]
    config = {"_class_name": "WanTransformer3DModel", **family.TRANSFORMER, "num_layers": layers}
    heads = heads or config["num_attention_heads"]
    width = width or config["num_attention_heads"] * config["attention_head_dim"]
    if width % heads:
        raise ValueError(f"a width of {width} does not split into {heads} heads")
    config |= {
        "num_attention_heads": heads,
        "attention_head_dim": width // heads,
        "ffn_dim": ffn_dim or 4 * width,
        "patch_size": list(patch or config["patch_size"]),
    }
    trainee = _build(family.Family.denoiser[0], config, np.random.default_rng(2), placement)
    grid = tuple(n // p for n, p in zip(GRID, config["patch_size"], strict=True))
    return trainee, wan.wan_rope(grid, config["attention_head_dim"], config["rope_max_seq_len"])


def _squares(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, F, H, W, 16] latents: -0.5 everywhere, 1.5 on channels 0-3 of a square placed anywhere."""
    x = np.full((n, *GRID, 16), -0.5, np.float32)
    for i in range(n):
        r, c = rng.integers(0, GRID[1] - SQUARE + 1, 2)
        x[i, :, r : r + SQUARE, c : c + SQUARE, :4] = 1.5
    return x


def count_squares(latents: np.ndarray) -> int:
    """Samples whose middle latent frame, channels 0-3 above 0.5, is one compact blob of about a square's
    size (20-60 of 256 pixels) filling at least 70 % of its bounding box."""
    found = 0
    for frame in np.asarray(latents)[:, GRID[0] // 2, :, :, :4].mean(-1):
        mask = frame > 0.5
        if 20 <= mask.sum() <= 60:
            rows, cols = np.nonzero(mask)
            found += mask.sum() / ((np.ptp(rows) + 1) * (np.ptp(cols) + 1)) > 0.7
    return int(found)


def grow(
    steps: int,
    lr: float,
    layers: int = 3,
    ffn_dim: int | None = None,
    heads: int | None = None,
    shift: float = 3.0,
    batch: int = 16,
    seed: int = 0,
    width: int | None = None,
) -> list:
    """Trains as train_shapes trains the denoiser (the same optimiser and schedule, flow matching at Wan's
    shifted sigmas) and returns (step, loss over the last 100, squares out of 16) every 500 steps."""
    import jax
    import jax.numpy as jnp
    import optax

    trainee, rope = _transformer(layers, ffn_dim, heads, width)
    context = jnp.asarray(np.random.default_rng(seed).normal(size=(1, 16, 32)), jnp.float32)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 200, steps, end_value=lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))

    def velocity(p, x, sigma):
        return trainee.module(p)(x, sigma * 1000.0, jnp.repeat(context, x.shape[0], 0), rope)

    objective = objectives.flow_matching(shift)

    @jax.jit
    def step(p, state, clean, key):
        noisy, sigma, target = objective(clean, key)
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((velocity(p, noisy, sigma) - target) ** 2))(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    @jax.jit
    def sample(p, key):
        x = jax.random.normal(key, (SAMPLES, *GRID, 16))
        sigmas = _shifted(jnp.linspace(1.0, 0.0, 21), shift)
        for i in range(20):
            x = x + (sigmas[i + 1] - sigmas[i]) * velocity(p, x, jnp.full((SAMPLES,), sigmas[i]))
        return x

    rng, key = np.random.default_rng(seed), jax.random.key(seed)
    params, losses, rows, started = trainee.params, [], [], time.monotonic()
    state = opt.init(params)
    for i in range(steps):
        params, state, loss = step(
            params, state, jnp.asarray(_squares(rng, batch)), jax.random.fold_in(key, i)
        )
        losses.append(loss)
        if (i + 1) % 500 == 0 or i + 1 == steps:
            found = count_squares(sample(params, jax.random.key(99)))
            rows.append((i + 1, float(np.mean([float(x) for x in losses[-100:]])), found))
            report = f"step {i + 1}: loss {rows[-1][1]:.4f}, squares {found}/{SAMPLES}"
            print(f"{report} ({time.monotonic() - started:.0f} s)", flush=True)  # noqa: T201 - the output
    return rows


DIRECTIONS = ((0, -1), (0, 1), (-1, 0), (1, 0), (0, 0))  # (row, column) steps: left, right, up, down, still


def _moving_squares(
    rng: np.random.Generator, n: int, travel: int, anywhere: bool
) -> tuple[np.ndarray, np.ndarray]:
    """[n, F, H, W, 16] latents holding one square that moves `travel` latent pixels a latent frame in one of
    DIRECTIONS, and each row's direction index. The path is centred on the grid (as tiny-wan's clips are,
    so the word says where the square is in the first and last frames), or `anywhere` it fits."""
    x = np.full((n, *GRID, 16), -0.5, np.float32)
    labels = rng.integers(0, len(DIRECTIONS), n)
    frames = np.arange(GRID[0]) - (GRID[0] - 1) / 2
    for i, label in enumerate(labels):
        step = np.asarray(DIRECTIONS[label]) * travel
        reach = np.abs(step) * frames.max()
        low, high = reach, GRID[1] - SQUARE - reach  # the top-left corner's range for the path's centre
        centre = rng.integers(low, high + 1) if anywhere else np.full(2, (GRID[1] - SQUARE) // 2)
        for f, k in enumerate(frames):
            r, c = (centre + k * step).astype(int)
            x[i, f, r : r + SQUARE, c : c + SQUARE, :4] = 1.5
    return x, labels


def read_direction(latents: np.ndarray, travel: int) -> list[int | None]:
    """Each sample's direction index from its first and last latent frames' centroids (channels 0-3 above
    0.5), None where either frame holds no square; still below half the path's length."""
    found = []
    for sample in np.asarray(latents)[..., :4].mean(-1):
        centroids = []
        for frame in (sample[0], sample[-1]):
            rows, cols = np.nonzero(frame > 0.5)
            centroids.append(None if len(rows) < 9 else np.asarray([rows.mean(), cols.mean()]))
        if centroids[0] is None or centroids[1] is None:
            found.append(None)
            continue
        d = centroids[1] - centroids[0]
        if np.hypot(*d) < travel * (GRID[0] - 1) / 2:
            found.append(4)
        elif abs(d[1]) >= abs(d[0]):
            found.append(1 if d[1] > 0 else 0)
        else:
            found.append(3 if d[0] > 0 else 2)
    return found


def motion(
    steps: int,
    lr: float,
    travel: int = 2,
    anywhere: bool = False,
    captions: bool = False,
    latents_from=None,
    combinations: int = 1,
    name_combination: bool = False,
    guidance: float = 5.0,
    layers: int = 3,
    heads: int | None = None,
    shift: float = 3.0,
    batch: int = 16,
    seed: int = 0,
    width: int | None = None,
    ffn_dim: int | None = None,
    frame_weight: float = 0.0,
    first_frame_lead: float = 0.0,
    patch: tuple[int, int, int] | None = None,
) -> list:
    """Flow matching on _moving_squares, conditioned on each direction's own fixed random text states, or with
    `captions` on tiny-wan's UMT5 (trained alongside, from random) reading a training clip's caption in that
    direction (the square's colour and shape are not drawn: only the motion words matter); 10 % of the rows
    unconditioned, for CFG. Then 20 samples (4 a direction) by Euler with CFG: (step, loss, squares moving
    the asked way out of 20) every 500 steps.

    `latents_from` (a tiny-wan folder): instead of hand-made squares, the normalised latents of that folder's
    VAE for clips of one training combination (medium, every direction and still, the training jitter), and
    each sample decoded and read by motion_score: the same question on what the VAE makes of motion; with
    `combinations` > 1, clips of that many training combinations (144: all), conditioned on the direction
    alone, or with `name_combination` on states of their own for each (combination, direction).

    `frame_weight` adds that many times the same error on the differences between consecutive latent frames
    (objectives.frame_difference_error): an error the frames share costs nothing there, so the loss leans on
    what differs from frame to frame, the motion."""
    import tempfile
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import optax

    from meshserve.models.parallel.placement import pipeline_placement
    from meshserve.training.clips import ClipScene
    from meshserve.training.families import wan as family
    from meshserve.training.shapes import HELD_OUT, TRAINING

    if captions and latents_from is not None:
        raise ValueError("captions name a random training combination, not the VAE clips' own")
    trainee, rope = _transformer(layers, ffn_dim, heads, width, patch)
    trainees = {"transformer": trainee}
    # One set of states a direction, or with `name_combination` one a (combination, direction): a label is
    # direction + 5 x the combination's index (0 for hand-made squares and one combination).
    states = len(DIRECTIONS) * (combinations if name_combination else 1)
    contexts = jnp.asarray(np.random.default_rng(seed).normal(size=(states, 16, 32)), jnp.float32)
    names = ("left", "right", "up", "down", None)
    wan = family.Family()
    if captions:
        wan.write_tokenizers(Path(tempfile.mkdtemp(prefix="motion-probe-")))
        wan.rope = rope  # the probe's transformer's, whose patch may not be the family's
        placement = pipeline_placement({"data": 1}, jax.devices()[:1])["placement"]
        text = wan.denoiser[1]
        trainees[text.name] = _build(text, wan.configs()[text.name], np.random.default_rng(3), placement)

    def condition(rng, labels, keep):
        """The text states per row: the fixed ones, or the UMT5's inputs for captions of training
        combinations drawn from `rng` (training) or of one held-out combination (rng None: sampling)."""
        if not captions:
            labels = labels if name_combination else labels % len(DIRECTIONS)
            return contexts[labels] * jnp.asarray(keep, jnp.float32)[:, None, None]
        if rng is None:
            combos = [HELD_OUT[0]] * len(labels)
        else:
            combos = [TRAINING[k] for k in rng.integers(len(TRAINING), size=len(labels))]
        lines = [ClipScene(*c, names[int(k)]).caption for c, k in zip(combos, labels, strict=True)]
        return wan.text_inputs(lines, np.asarray(keep))

    draw, read = _moving_squares, read_direction
    if latents_from is not None:
        draw, read = _vae_clips(latents_from, names, seed, combinations)

    schedule = _schedule(lr, 200, steps)  # the same schedule as grow's, and short runs allowed
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))
    objective = objectives.flow_matching(shift)

    def velocity(p, x, sigma, context):
        if not captions:
            return trainee.module(p["transformer"])(x, sigma * 1000.0, context, rope)
        modules = {name: t.module(p[name]) for name, t in trainees.items()}
        return wan.predict(modules, x, sigma, context)

    @jax.jit
    def step(p, state, clean, context, key):
        noisy, sigma, target = objective(clean, key)
        if first_frame_lead:
            noisy = objectives.lead_first_frame(
                noisy, sigma, target, jax.random.fold_in(key, 1), first_frame_lead
            )

        def loss_of(p):
            error = velocity(p, noisy, sigma, context) - target
            return jnp.mean(error**2) + frame_weight * objectives.frame_difference_error(error)

        loss, grads = jax.value_and_grad(loss_of)(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    asked = np.repeat(np.arange(len(DIRECTIONS)), 4)
    shown = asked + len(DIRECTIONS) * (np.arange(len(asked)) % combinations) if name_combination else asked
    cond = condition(None, shown, np.ones(len(asked)))
    uncond = condition(None, asked, np.zeros(len(asked)))

    @jax.jit
    def sample(p, key):
        n = len(asked)
        x = jax.random.normal(key, (n, *GRID, 16))
        sigmas = _shifted(jnp.linspace(1.0, 0.0, 21), shift)
        for i in range(20):
            s = jnp.full((n,), sigmas[i])
            v_uncond, v_cond = velocity(p, x, s, uncond), velocity(p, x, s, cond)
            x = x + (sigmas[i + 1] - sigmas[i]) * (v_uncond + guidance * (v_cond - v_uncond))
        return x

    rng, key = np.random.default_rng(seed), jax.random.key(seed)
    params = {name: t.params for name, t in trainees.items()}
    losses, rows, started = [], [], time.monotonic()
    state = opt.init(params)
    for i in range(steps):
        clean, labels = draw(rng, batch, travel, anywhere)
        context = condition(rng, labels, rng.random(batch) >= 0.1)
        params, state, loss = step(params, state, jnp.asarray(clean), context, jax.random.fold_in(key, i))
        losses.append(loss)
        if (i + 1) % 500 == 0 or i + 1 == steps:
            found = read(sample(params, jax.random.key(99)), travel)  # direction indices
            right = sum(r == a for r, a in zip(found, asked, strict=True))
            rows.append((i + 1, float(np.mean([float(x) for x in losses[-100:]])), right))
            report = f"step {i + 1}: loss {rows[-1][1]:.4f}, moving as asked {right}/{len(asked)}"
            print(f"{report} {found} ({time.monotonic() - started:.0f} s)", flush=True)  # noqa: T201
    return rows


def _folder_vae(folder):
    """The VAE of a tiny-wan folder, built as `train(vae_from=)` builds it, on one device: (trainee, config)."""
    import json
    from pathlib import Path

    import jax

    from meshserve.models.parallel.placement import pipeline_placement
    from meshserve.training.families import wan as family

    wan = family.Family()
    placement = pipeline_placement({"data": 1}, jax.devices()[:1])["placement"]
    config = json.loads((Path(folder) / "vae" / "config.json").read_text())
    return _build(wan.vae, config, None, placement, wan.read_vae(folder)), config


def _vae_clips(folder, names, seed: int, combinations: int = 1, pool: int = 400):
    """(draw, read) for `motion` on a folder's VAE: draw(rng, n, travel, anywhere) gives n rows of a pool of
    normalised latents (the posterior means of `pool` clips of `combinations` training combinations spread
    evenly over TRAINING, each clip's drawn uniformly, as are the directions; 1: TRAINING[0]); read(latents,
    travel) decodes them and gives motion_score's direction index per clip (None: no shape found)."""
    import jax
    import jax.numpy as jnp

    from meshserve.training.clips import ClipScene, render_clip
    from meshserve.training.families import wan as family
    from meshserve.training.motion_score import read_motion
    from meshserve.training.shapes import TRAINING

    vae, config = _folder_vae(folder)
    mean, std = np.asarray(config["latents_mean"], np.float32), np.asarray(config["latents_std"], np.float32)
    encode = jax.jit(lambda x: vae.module().encode(x).mean)
    decode = jax.jit(lambda z: vae.module().decode(z * std + mean))

    rng = np.random.default_rng(seed + 7)
    labels = rng.integers(0, len(names), pool)
    chosen = np.linspace(0, len(TRAINING), max(combinations, 1), endpoint=False).astype(int)
    combos = chosen[rng.integers(0, combinations, pool)] if combinations > 1 else np.zeros(pool, int)
    latents = []
    for i in range(0, pool, 8):
        clips = [
            render_clip(ClipScene(*TRAINING[c], names[k]), family.FRAMES, family.SIZE, rng.uniform(-2, 2, 2))
            for k, c in zip(labels[i : i + 8], combos[i : i + 8], strict=True)
        ]
        clips = jnp.asarray(np.stack(clips).astype(np.float32) / 127.5 - 1.0)
        latents.append((np.asarray(encode(clips)) - mean) / std)
    latents = np.concatenate(latents)

    def draw(rng, n, travel, anywhere):
        rows = rng.integers(0, pool, n)
        return latents[rows], labels[rows] + len(names) * np.searchsorted(chosen, combos[rows])

    def read(samples, travel):
        pixels = np.asarray(decode(samples))
        pixels = np.clip((pixels + 1.0) * 127.5, 0, 255).round().astype(np.uint8)
        motions = [read_motion(clip).direction for clip in pixels]
        return [None if m is None else ("left", "right", "up", "down", "still").index(m) for m in motions]

    return draw, read


def position(
    steps: int, lr: float = 1e-3, layers: int = 3, batch: int = 8, seed: int = 0
) -> tuple[float, float]:
    """Trains the transformer at sigma 1 to map pure noise to a centred square on channel 0; returns the mean
    prediction (inside the square, outside it) at the end. Equal: the model cannot find the centre."""
    import jax
    import jax.numpy as jnp
    import optax

    trainee, rope = _transformer(layers)
    target = np.zeros((1, *GRID, 16), np.float32)
    lo, hi = (GRID[1] - SQUARE) // 2, (GRID[1] + SQUARE) // 2
    target[:, :, lo:hi, lo:hi, 0] = 1.0
    target = jnp.asarray(target)
    context = jnp.asarray(np.random.default_rng(seed).normal(size=(batch, 16, 32)), jnp.float32)
    opt = optax.adam(lr)

    @jax.jit
    def step(p, state, key):
        noise = jax.random.normal(key, (batch, *GRID, 16))

        def loss(p):
            out = trainee.module(p)(noise, jnp.full((batch,), 1000.0), context, rope)
            return jnp.mean((out - target) ** 2), out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(p)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state, out

    params, key = trainee.params, jax.random.key(seed)
    state = opt.init(params)
    for i in range(steps):
        params, state, out = step(params, state, jax.random.fold_in(key, i))
    mean = np.asarray(out[..., 0]).mean(0)
    inside = mean[:, lo:hi, lo:hi]
    outside = (mean.sum() - inside.sum()) / (mean.size - inside.size)
    print(f"after {steps} steps: inside {inside.mean():.3f}, outside {outside:.3f}")  # noqa: T201 - the output
    return float(inside.mean()), float(outside)


def held_out_clips(seed: int = 12345) -> tuple[np.ndarray, list[tuple[str, str, str, str]]]:
    """Every held-out combination in every direction and still, as the evaluation prompts them (medium, 9
    frames of 64 x 64), each path moved by up to 2 pixels as training moves it: float32 [120, 9, 64, 64, 3]
    in [-1, 1] and what motion_score should read from each."""
    from meshserve.training.clips import DIRECTIONS, ClipScene, render_clip
    from meshserve.training.families.wan import FRAMES, SIZE
    from meshserve.training.shapes import HELD_OUT

    rng = np.random.default_rng(seed)
    scenes = [ClipScene(*combo, direction) for combo in HELD_OUT for direction in (*DIRECTIONS, None)]
    clips = [render_clip(s, FRAMES, SIZE, tuple(rng.uniform(-2.0, 2.0, 2))) for s in scenes]
    wanted = [(s.colour, s.shape, s.background, s.motion) for s in scenes]
    return np.stack(clips).astype(np.float32) / 127.5 - 1.0, wanted


def roundtrip(folder, batch: int = 8):
    """The folder's VAE on held_out_clips (encode to the posterior's mean, decode), read by motion_score:
    (ClipAdherence, reconstruction MSE)."""
    import jax

    from meshserve.training.motion_score import clip_adherence

    vae, _ = _folder_vae(folder)

    @jax.jit
    def encode_decode(x):
        model = vae.module()
        return model.decode(model.encode(x).mean)

    clips, wanted = held_out_clips()
    out = np.concatenate(
        [np.asarray(encode_decode(clips[i : i + batch])) for i in range(0, len(clips), batch)]
    )
    pixels = np.clip((out + 1.0) * 127.5, 0, 255).round().astype(np.uint8)
    return clip_adherence(pixels, wanted), float(np.mean((out - clips) ** 2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshserve.training.wan_probes", description=__doc__)
    parser.add_argument("probe", choices=("grow", "position", "roundtrip", "motion"))
    parser.add_argument("folder", nargs="?", help="roundtrip: a tiny-wan model folder")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument(
        "--ffn-dim", type=int, default=None, help="grow, motion: the blocks' ffn_dim (default: 4 x the width)"
    )
    parser.add_argument(
        "--heads", type=int, default=None, help="grow, motion: the width in this many heads (default: 4)"
    )
    parser.add_argument(
        "--width", type=int, default=None, help="grow, motion: the transformer's width (default: 96)"
    )
    parser.add_argument("--travel", type=int, default=2, help="motion: latent pixels a latent frame")
    parser.add_argument("--anywhere", action="store_true", help="motion: paths anywhere, not centred")
    parser.add_argument(
        "--captions", action="store_true", help="motion: tiny-wan's UMT5 on captions, not fixed states"
    )
    parser.add_argument("--latents-from", help="motion: a tiny-wan folder whose VAE's latents to train on")
    parser.add_argument(
        "--combinations",
        type=int,
        default=1,
        help="motion --latents-from: clips of this many training combinations (144: all)",
    )
    parser.add_argument(
        "--name-combination", action="store_true", help="motion: states a (combination, direction)"
    )
    parser.add_argument(
        "--frame-weight",
        type=float,
        default=0.0,
        help="motion: weight of the error on consecutive latent frames' differences",
    )
    parser.add_argument(
        "--first-frame-lead",
        type=float,
        default=0.0,
        help="motion: share of rows whose first latent frame is less noised (objectives.lead_first_frame)",
    )
    parser.add_argument(
        "--patch",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        default=None,
        help="motion: the transformer's patch_size as T,H,W (default the recipe's 1,2,2)",
    )
    args = parser.parse_args(argv)
    _cpu_devices_flag()
    if args.probe == "grow":
        grow(args.steps, args.lr, args.layers, args.ffn_dim, args.heads, width=args.width)
    elif args.probe == "motion":
        motion(
            args.steps,
            args.lr,
            args.travel,
            args.anywhere,
            args.captions,
            args.latents_from,
            args.combinations,
            args.name_combination,
            layers=args.layers,
            heads=args.heads,
            width=args.width,
            ffn_dim=args.ffn_dim,
            frame_weight=args.frame_weight,
            first_frame_lead=args.first_frame_lead,
            patch=args.patch,
        )
    elif args.probe == "roundtrip":
        if args.folder is None:
            parser.error("roundtrip needs a model folder")
        adherence, mse = roundtrip(args.folder)
        print(f"{adherence}, reconstruction MSE {mse:.5f}")  # noqa: T201 - the output
    else:
        position(args.steps, args.lr, args.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
