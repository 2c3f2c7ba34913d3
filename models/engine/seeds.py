"""Seeds and PRNG keys: every output row owns one key, so its result depends on its own seed alone.

A row's key is `jax.random.key(seed)` (threefry; seeds are taken modulo 2^32, as JAX does with 64-bit ints
off), built on the host as raw key data [B, 2] uint32 so a batch of seeds is one small array, not B device
calls. Inside a program:

    keys = row_keys(key_data)                 # [B] keys
    latents = initial_noise(keys, row_shape)  # row b = normal(key(seed_b)), whatever the batch around it
    step i's noise for row b comes from fold_in(fold_in(key_b, STEP_NOISE_STREAM), i)  (`step_keys`)

so a seed alone, or at any position of any batch, on any mesh layout, draws the same numbers (threefry is
partitionable: sharding the batch does not change the draws).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.models.engine.common import PipelineError

# Tags the per-step noise stream apart from the initial noise (which uses the row key itself).
STEP_NOISE_STREAM = 0x5EED


def per_row(value, prompts: int, n: int, name: str, kind) -> list:
    """One value, one per prompt (repeated for its n images) or one per image -> a list of prompts * n."""
    if isinstance(value, int | float):
        return [kind(value)] * (prompts * n)
    values = [kind(v) for v in value]
    if len(values) == prompts:
        return [v for v in values for _ in range(n)]
    if len(values) == prompts * n:
        return values
    raise PipelineError(f"{name}: expected one value, one per prompt or one per image, got {len(values)}")


def per_row_pairs(value, prompts: int, n: int, name: str) -> list[tuple[float, float] | None]:
    """One pair of numbers (a size, a corner) for every row, one per prompt or one per image -> a list of
    prompts * n pairs; None (or a None entry): the family's default for that row."""

    def pair(v):
        if v is None:
            return None
        if isinstance(v, str) or not hasattr(v, "__len__") or len(v) != 2:
            raise PipelineError(f"{name} must be a pair of numbers (height, width or top, left), got {v!r}")
        if not all(isinstance(x, int | float | np.integer | np.floating) and np.isfinite(x) for x in v):
            raise PipelineError(f"{name} must be a pair of finite numbers, got {v!r}")
        return float(v[0]), float(v[1])

    if isinstance(value, str):
        raise PipelineError(f"{name} must be a pair of numbers, or a list of pairs / None, got {value!r}")
    if value is None or (hasattr(value, "__len__") and len(value) == 2 and not _holds_pairs(value)):
        return [pair(value)] * (prompts * n)
    return per_row(value, prompts, n, name, pair)


def _holds_pairs(value) -> bool:
    return any(v is None or hasattr(v, "__len__") for v in value)


def row_seeds(seed, prompts: int, n: int) -> list[int]:
    """The seed of every output row: random when None; one int gives seed, seed + 1, ... (distinct noise per
    image, reproducible from one seed); one per prompt gives each prompt's images its seed, seed + 1, ...;
    else one per image."""
    if seed is None:
        rng = np.random.default_rng()
        return [int(s) for s in rng.integers(0, 2**31 - 1, size=prompts * n)]
    if isinstance(seed, int | np.integer):
        return [int(seed) + i for i in range(prompts * n)]
    seeds = per_row(seed, prompts, n, "seed", int)
    if n > 1 and len(seed) == prompts:  # a prompt's n images: not n copies of one picture (an audit)
        seeds = [s + i % n for i, s in enumerate(seeds)]
    return seeds


def key_data(seeds: list[int]) -> np.ndarray:
    """[B, 2] uint32: the raw data of jax.random.key(seed) for each seed (threefry2x32: [0, seed mod 2^32])."""
    data = np.zeros((len(seeds), 2), np.uint32)
    data[:, 1] = np.asarray([s % 2**32 for s in seeds], np.uint64).astype(np.uint32)
    return data


def row_keys(data) -> jax.Array:
    """[B, 2] uint32 key data -> [B] typed PRNG keys (traced)."""
    return jax.random.wrap_key_data(data)


def initial_noise(keys, row_shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """[B, *row_shape] standard normal, row b drawn from keys[b] alone."""
    return jax.vmap(lambda k: jax.random.normal(k, row_shape, dtype))(keys)


def step_keys(keys, i) -> jax.Array:
    """[B] keys for step i's noise (traced i): one independent stream per row."""
    return jax.vmap(lambda k: jax.random.fold_in(jax.random.fold_in(k, STEP_NOISE_STREAM), i))(keys)
