"""Keep programs with host callbacks in JAX's persistent compilation cache.

Every denoise program calls back to the host after each step (progress, cancel: models/engine/denoise_loop.py),
and jax 0.10 never writes such a program to its persistent cache ("it uses host callbacks"), so a restarted
worker, a second `meshserve generate` and every test process compiled the largest program cold, the one the
cache exists for.

Upstream's reason is older than its callbacks: a callback is now an FFI custom call that names its Python
function by an index into the executable's list of host callbacks (jax/_src/callback.py, `index=`), not by a
pointer baked into the HLO, and `Client.deserialize_executable` takes that list (`host_callbacks=`). So the
entry can be written like any other and, when read, loaded with the callbacks of the program being compiled
now: the same HLO, hence the same indices, bound to this process's functions. Three module attributes of
jax._src are wrapped; where they are not what this was written against (another jax), nothing is patched and
such programs are compiled as before. tests/models/test_host_callback_cache.py checks, across two processes,
that the entry is written, read back, and that the callback runs in the reading process.
"""

from __future__ import annotations

import inspect
import logging
import threading

logger = logging.getLogger(__name__)

_current = threading.local()  # the host callbacks of the program this thread is compiling
_installed = False

# The signatures the wrappers forward to (jax 0.10); anything else leaves jax alone.
_EXPECTED = {
    "compile_or_get_cached": ["backend", "computation", "devices", "compile_options", "host_callbacks"],
    "_cache_write": [
        "cache_key",
        "compile_time_secs",
        "module_name",
        "backend",
        "executable",
        "host_callbacks",
    ],
    "get_executable_and_time": ["cache_key", "compile_options", "backend", "executable_devices"],
}


def _matches(fn, names) -> bool:
    try:
        return list(inspect.signature(fn).parameters)[: len(names)] == names
    except (TypeError, ValueError):
        return False


def cache_programs_with_host_callbacks() -> bool:
    """Installs the wrappers once per process; True when programs with host callbacks are now cached."""
    global _installed
    if _installed:
        return True
    try:
        from jax._src import compilation_cache, compiler
    except ImportError:
        return False
    originals = {
        "compile_or_get_cached": getattr(compiler, "compile_or_get_cached", None),
        "_cache_write": getattr(compiler, "_cache_write", None),
        "get_executable_and_time": getattr(compilation_cache, "get_executable_and_time", None),
    }
    helpers = ("_get_cache", "decompress_executable", "extract_executable_and_time")
    if not all(fn is not None and _matches(fn, _EXPECTED[name]) for name, fn in originals.items()) or not all(
        hasattr(compilation_cache, h) for h in helpers
    ):
        logger.info(
            "this jax's compilation cache is not the one expected: programs with host callbacks stay uncached"
        )
        return False
    compile_or_get_cached = originals["compile_or_get_cached"]
    cache_write = originals["_cache_write"]
    get_executable_and_time = originals["get_executable_and_time"]

    def compile_remembering_callbacks(
        backend, computation, devices, compile_options, host_callbacks, *a, **k
    ):
        _current.host_callbacks = host_callbacks
        try:
            return compile_or_get_cached(
                backend, computation, devices, compile_options, host_callbacks, *a, **k
            )
        finally:
            _current.host_callbacks = ()

    def write_even_with_callbacks(
        cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
    ):
        return cache_write(cache_key, compile_time_secs, module_name, backend, executable, ())

    def read_with_callbacks(cache_key, compile_options, backend, executable_devices):
        callbacks = getattr(_current, "host_callbacks", ())
        if not callbacks:
            return get_executable_and_time(cache_key, compile_options, backend, executable_devices)
        cache = compilation_cache._get_cache(backend)
        entry = cache.get(cache_key) if cache is not None else None
        if entry is None:
            return None, None
        serialized, compile_time = compilation_cache.extract_executable_and_time(
            compilation_cache.decompress_executable(entry)
        )
        executable = backend.deserialize_executable(
            serialized, executable_devices, compile_options, host_callbacks=callbacks
        )
        return executable, compile_time

    compiler.compile_or_get_cached = compile_remembering_callbacks
    compiler._cache_write = write_even_with_callbacks
    compilation_cache.get_executable_and_time = read_with_callbacks
    _installed = True
    return True
