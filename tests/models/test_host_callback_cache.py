"""A program with a host callback (every denoise program has one) is written to JAX's persistent cache, read
back by another process, and calls that process's function: models/engine/host_callback_cache.py."""

import json
import os
import subprocess
import sys

_PROGRAM = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax._src import monitoring
from jax.experimental import io_callback

if sys.argv[2] == "meshserve":
    from meshserve.models.engine.compile_cache import enable_compilation_cache

    enable_compilation_cache(sys.argv[1])
else:  # JAX's own cache setting (a library user's JAX_COMPILATION_CACHE_DIR): meshserve's programs bind too
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from meshserve.models.engine.programs import CompiledPrograms

hits = []
monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
seen = []


def on_step(i, x):
    seen.append(int(i))
    return np.bool_(int(i) < 3)  # stops the loop after step 3: the answer reaches the device


def loop(_weights, x):
    def body(c):
        i, _, x = c
        x = jnp.tanh(x @ x.T)
        return i + 1, io_callback(on_step, jax.ShapeDtypeStruct((), jnp.bool_), i, x[0, 0], ordered=False), x
    return jax.lax.while_loop(lambda c: (c[0] < 10) & c[1], body, (0, jnp.bool_(True), x))[0]


steps = int(CompiledPrograms().run("loop", loop, {}, None, jnp.full((32, 32), 0.01)))
names = sorted(n.split("-")[0] for n in os.listdir(sys.argv[1]))
print(json.dumps({"hits": len(hits), "seen": seen, "steps": steps, "entries": names}))
"""


def _run(cache_dir, how="meshserve"):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(cache_dir), how],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_program_with_a_host_callback_is_cached_and_calls_the_new_process(tmp_path):
    first = _run(tmp_path)
    assert "jit_loop" in first["entries"], first  # written, although it has a host callback
    assert first["seen"] == [0, 1, 2, 3] and first["steps"] == 4
    second = _run(tmp_path)
    assert second["hits"] >= 1, second  # read back, not compiled again
    # The callback ran in the second process (its own function), and its answers still stop the loop.
    assert second["seen"] == [0, 1, 2, 3] and second["steps"] == 4


def test_a_process_on_jax_s_own_cache_setting_binds_its_callbacks_too(tmp_path):
    """The entry written by a meshserve process, read by one that turned the cache on through JAX's setting
    alone: its programs (CompiledPrograms) still get their callbacks (before, JAX's own read loaded the entry
    without them and the first callback crashed the process)."""
    assert _run(tmp_path)["steps"] == 4
    reader = _run(tmp_path, how="jax")
    assert reader["hits"] >= 1, reader
    assert reader["seen"] == [0, 1, 2, 3] and reader["steps"] == 4
