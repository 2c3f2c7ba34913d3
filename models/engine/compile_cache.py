"""JAX's persistent compilation cache, on by default for the command line and the workers.

Compiling the denoising loop dominates a cold start (seconds for the tiny model, minutes for SDXL on a
CPU); with the cache a restarted worker or a second `meshserve generate` reads the programs back.
"""

from __future__ import annotations

import os

import jax

from meshserve.models.checkpoints.embedded_folder import cache_root
from meshserve.models.engine.host_callback_cache import cache_programs_with_host_callbacks


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Points JAX's persistent cache at `path`; with no path, at $MESHSERVE_CACHE/jax unless one is already set.
    Programs with a host callback (every denoise program) are kept too: models/engine/host_callback_cache.py."""
    cache_programs_with_host_callbacks()
    current = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if path is None and current:
        return current
    path = path or str(cache_root() / "jax")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path
