"""Live previews: every N steps, the loop's latents as a small RGB picture, made on the device.

    out = pipe(prompt, preview_every=2, preview_callback=lambda step, total, rows: ...)
    # rows: {row index: uint8 [h, w, 3]} at the latents' resolution, for the rows due at that step

How a preview is made. A latent pixel maps to a colour by one affine map `rgb = [z, 1] @ M`, M [C+1, 3], per
family and per VAE: the classic "latent to RGB factors" trick, fitted here by least squares on the folder's
own VAE rather than copied from somewhere, so it holds for any checkpoint (the embedded models and random test
weights included). The fit decodes a few blocky random latents (Gaussian on a coarse grid, each value
repeated over 2x2 or 4x4 latent pixels, so most of the picture is flat colour, the way real latents are
locally smooth) and solves M against the decoded pictures average-pooled to the latent resolution. The map
(15-65 numbers) is stored with the model's cache, `$MESHSERVE_CACHE/previews/<key>.json`, keyed by the VAE's
files: the fit runs once per VAE, a later load reads it (`LatentPreviews.prepare`, which a serving pool calls
at warm-up; both costs measured in docs/previews.md).

In the loop (`denoise_loop(preview=...)`): each row has its own period (`preview_every` [B] int32, 0: none) as a
traced input, so turning previews on or changing N compiles nothing. At a step where some row is due, a
`lax.cond` branch unpacks the latents to channels-last (Flux's 2x2 patches: the transpose of the family's own
`pack`, which is a permutation; Wan: the middle latent frame), applies M, rounds to uint8 and hands
[B, h, w, 3] to the host in a second io_callback; on the other steps the branch is not taken and nothing
leaves the device. The loop's latents are the noisy x_t (not the predicted x0: that needs each scheduler's
own formula), so early previews are noisy and sharpen towards the last step.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

log = logging.getLogger(__name__)

# The fitting latents: this many pictures at the model's default size, capped at this side in pixels (a real
# SDXL decodes 4 x 256x256 instead of 4 x 1024x1024 for the same map), each half of them blocky at 2 and 4.
FIT_SAMPLES = 4
FIT_MAX_SIDE = 256
# A preview's period when a request asks for previews without naming one: about ten per generation.
PREVIEWS_PER_RUN = 10
# Bumped when the fit changes, so that cached maps of the old recipe are not read.
FIT_VERSION = 1

PreviewCallback = Callable[[int, int, dict[int, np.ndarray]], None]


def default_every(steps: int) -> int:
    """The period `previews: true` means: about `PREVIEWS_PER_RUN` previews over the run."""
    return max(1, int(steps) // PREVIEWS_PER_RUN)


def to_channels_last(pack: Callable, latents, shape: tuple[int, ...]):
    """Traced: the loop's latents -> channels-last [B, (T,) h, w, C] (the transpose of `pack`, a permutation,
    is its inverse), and a video's middle latent frame -> [B, h, w, C]."""
    spec = jax.ShapeDtypeStruct((latents.shape[0], *shape), latents.dtype)
    (x,) = jax.linear_transpose(pack, spec)(latents)
    if x.ndim == 5:
        x = x[:, x.shape[1] // 2]
    return x


def apply_map(x, rgb_map):
    """Traced: channels-last latents [B, h, w, C], map [C+1, 3] -> uint8 [B, h, w, 3]."""
    c = x.shape[-1]
    rgb = x.astype(jnp.float32) @ rgb_map[:c] + rgb_map[c]
    return jnp.round(jnp.clip(rgb, 0.0, 1.0) * 255.0).astype(jnp.uint8)


def fit_map(latents_cl: np.ndarray, images: np.ndarray) -> np.ndarray:
    """Least squares: channels-last latents [N, h, w, C] and their decoded pictures [N, H, W, 3] in [0, 1]
    (H = f h) -> M [C+1, 3] with [z, 1] @ M ~ the picture average-pooled to h x w."""
    n, h, w, c = latents_cl.shape
    f = images.shape[1] // h
    target = images[:, : h * f, : w * f].reshape(n, h, f, w, f, 3).mean(axis=(2, 4))
    a = np.concatenate([latents_cl.reshape(-1, c), np.ones((n * h * w, 1))], axis=1).astype(np.float64)
    m, *_ = np.linalg.lstsq(a, target.reshape(-1, 3).astype(np.float64), rcond=None)
    return m.astype(np.float32)


def blocky_latents(shape: tuple[int, ...], samples: int, seed: int = 0) -> np.ndarray:
    """[samples, *shape] channels-last Gaussian latents, flat over 2x2 (first half) or 4x4 (second half)
    blocks of latent pixels."""
    rng = np.random.default_rng(seed)
    *lead, h, w, c = shape
    out = []
    for i in range(samples):
        b = 2 if i < samples // 2 else 4
        coarse = rng.standard_normal((*lead, -(-h // b), -(-w // b), c)).astype(np.float32)
        fine = np.repeat(np.repeat(coarse, b, axis=-3), b, axis=-2)
        out.append(fine[..., :h, :w, :])
    return np.stack(out)


class LatentPreviews:
    """A pipeline's previews: its latent-to-RGB map (fitted once) and the host end of the preview callback."""

    def __init__(self, pipe):
        # Weakly: this object is the preview io_callback's host function, which every compiled program that
        # previews keeps alive from C++, where Python's collector cannot see it. A strong reference closed a
        # cycle (pipeline -> its programs -> the callback -> the pipeline) that nothing could free: every
        # pipeline a process loaded stayed, with its weights and its executables' memory mappings, until the
        # process hit vm.max_map_count (65,530) and XLA:CPU crashed in its next compile or cache write.
        self._pipe = weakref.ref(pipe)
        self.rgb_map: np.ndarray | None = None
        self.fit_seconds: float | None = None
        self.fitted = False
        self.listener: PreviewCallback | None = None
        self.total = 0

    @property
    def pipe(self):
        pipe = self._pipe()
        if pipe is None:
            raise RuntimeError("the pipeline of these previews was freed")
        return pipe

    # -- the map ---------------------------------------------------------------------------------------------

    def prepare(self) -> np.ndarray:
        """The map: read from the cache file of this VAE, else fitted and written there (seconds, either way,
        in `fit_seconds`; `fitted` says which)."""
        if self.rgb_map is None:
            t0 = time.perf_counter()
            path = self.cache_path()
            try:
                self.rgb_map = np.asarray(json.loads(path.read_text())["latent_rgb"], np.float32)
                self.fitted = False
            except (OSError, ValueError, KeyError, TypeError):
                self.rgb_map = self.fit()
                self.fitted = True
                with contextlib.suppress(OSError):  # a read-only cache only costs the next load a fit
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps({"latent_rgb": self.rgb_map.tolist()}))
                    tmp.replace(path)
            self.fit_seconds = time.perf_counter() - t0
            log.info(
                "%s: preview map %s in %.2f s",
                self.pipe.model_id,
                "fitted" if self.fitted else f"read from {path}",
                self.fit_seconds,
            )
        return self.rgb_map

    def cache_path(self) -> Path:
        """$MESHSERVE_CACHE/previews/<key>.json; the key hashes what the map depends on: the family, the VAE's
        config and weights files (names, sizes, modification times), the latent dtype and the fit's recipe."""
        from meshserve.models.checkpoints.embedded_folder import cache_root

        pipe = self.pipe
        vae = Path(pipe.folder) / "vae"
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in vae.iterdir() if f.is_file())
        recipe = (
            pipe.family,
            files,
            str(jnp.dtype(pipe.latent_dtype)),
            FIT_SAMPLES,
            FIT_MAX_SIDE,
            FIT_VERSION,
        )
        key = hashlib.sha256(repr(recipe).encode()).hexdigest()[:32]
        return cache_root() / "previews" / f"{key}.json"

    def fit_settings(self) -> dict:
        d, limits = self.pipe.defaults, self.pipe.limits
        multiple = int(limits.get("size_multiple", 8))
        side = lambda v: max(multiple, min(int(v), FIT_MAX_SIDE) // multiple * multiple)  # noqa: E731
        return {**d, "width": side(d["width"]), "height": side(d["height"]), "num_frames": 1}

    def fit(self) -> np.ndarray:
        """Decode `FIT_SAMPLES` blocky latents with the folder's VAE (the family's own `decode`, in a program
        of its own that is not counted among the request programs) and fit the map on them."""
        pipe = self.pipe
        shape = pipe.noise_shape(self.fit_settings())
        z = blocky_latents(shape, FIT_SAMPLES)
        decode = jax.jit(
            lambda vae, x: pipe.decode(vae, pipe.pack(x).astype(pipe.latent_dtype), shape=shape),
            compiler_options=pipe.programs.compiler_options,
        )
        # Replicated on the pool's devices and read back by `to_host`: in a multi-host pool every process runs
        # this (at warm-up, in the same order) as one program over the group.
        from meshserve.models.engine.pipeline import to_host

        images = to_host(decode(pipe._states["vae"], pipe.put_replicated(z))).astype(np.float32)
        if images.ndim == 5:  # video: one latent frame decodes to one frame
            images = images[:, images.shape[1] // 2]
            z = z[:, z.shape[1] // 2]
        return fit_map(z, images)

    # -- a call ----------------------------------------------------------------------------------------------

    def inputs(self, every: int | Sequence[int] | None, rows: int, channels: int):
        """The denoise program's preview inputs: (every [rows] int32, map [C+1, 3]); a zero map when no row
        asks for previews (the map is then not fitted)."""
        per_row = np.broadcast_to(np.asarray(0 if every is None else every, np.int32), (rows,))
        if np.any(per_row < 0):
            from meshserve.models.engine.common import PipelineError

            raise PipelineError("preview_every must be >= 0 (0: no previews)")
        if per_row.any():
            rgb_map = self.prepare()
        else:
            rgb_map = np.zeros((channels + 1, 3), np.float32)
        return self.pipe.put_batch(np.ascontiguousarray(per_row)), self.pipe.put_replicated(rgb_map)

    @contextlib.contextmanager
    def listening(self, callback: PreviewCallback | None, total: int):
        self.listener, self.total = callback, total
        try:
            yield
        finally:
            self.listener = None

    def in_loop(self, inputs, shape: tuple[int, ...]) -> Callable:
        """Traced: `preview(steps_done, latents) -> bool` for `denoise_loop` (always True: it never stops the
        loop; returning it keeps the callback alive and ordered before the next step)."""
        every, rgb_map = inputs
        pack = self.pipe.pack
        placement = self.pipe.placement
        replicate = lambda x: x  # noqa: E731
        if placement is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            whole = NamedSharding(placement.mesh, P())
            replicate = lambda x: jax.lax.with_sharding_constraint(x, whole)  # noqa: E731

        def preview(i, latents):
            due = (every > 0) & (i % jnp.maximum(every, 1) == 0)

            def emit(_):
                pixels = apply_map(to_channels_last(pack, latents, shape), rgb_map)
                # On a mesh: gathered whole (a few KB) before the callback, which reads them on one device;
                # left to the partitioner, it warns of an "involuntary full rematerialization" every compile.
                due_, pixels = replicate((due, pixels))
                return io_callback(self, jax.ShapeDtypeStruct((), jnp.bool_), i, due_, pixels, ordered=False)

            return jax.lax.cond(due.any(), emit, lambda _: jnp.bool_(True), None)

        return preview

    def __call__(self, step, due, pixels) -> np.bool_:
        """The host end: the due rows' pixels to the current call's listener."""
        listener = self.listener
        if listener is not None:
            rows = {int(r): np.asarray(pixels[r]) for r in np.flatnonzero(np.asarray(due))}
            try:
                listener(int(step), self.total, rows)
            except Exception:  # a preview must never fail a generation
                log.exception("preview callback failed")
        return np.bool_(True)


def encode_preview(pixels: np.ndarray, fmt: str = "webp", quality: int = 70, min_side: int = 128) -> str:
    """Host: uint8 [h, w, 3] -> a `data:image/...;base64,` URL, scaled up (bilinear) by a whole factor until
    its longer side is at least `min_side` (the latents of a 64 px picture are 8 px)."""
    import base64
    import io

    from PIL import Image

    image = Image.fromarray(np.asarray(pixels, np.uint8))
    factor = max(1, -(-min_side // max(image.size)))
    if factor > 1:
        image = image.resize((image.width * factor, image.height * factor), Image.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format=fmt.upper(), quality=quality)
    kind = "jpeg" if fmt.lower() in ("jpg", "jpeg") else fmt.lower()
    return f"data:image/{kind};base64," + base64.b64encode(buf.getvalue()).decode("ascii")
