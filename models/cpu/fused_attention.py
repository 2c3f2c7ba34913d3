"""cpu_fused: attention as one fused CPU kernel (fused_attention.cc, an XLA FFI custom call), built for the
machine it runs on.

XLA:CPU has no fused attention: every formulation in XLA (xla_blockwise, xla_chunked) runs the core as
separate dots, reductions and element-wise passes, each through the runtime's thread pool, at about half of
what the machine's matmul reaches, while torch runs it as one kernel (bench/README.md, "The attention core on
the CPU"). fused_attention.cc does what torch's does: per (batch row, head, block of query rows), the scores of
a block of keys in register tiles, the online softmax and the product with V, all in L1, with a polynomial
exp2.

The source is compiled on first use with the machine's C++ compiler (`$CXX`, else `c++`/`g++`), `-O3
-march=native`, into `cache_root()/cpu_kernels/<key>.so`, the key hashing the source, the compiler's version,
the CPU's model and flags, and jaxlib's version (its FFI headers): a machine, or a container image moved to other
hardware, builds its own. Where that fails (no compiler, as in a slim container; a build error) `available()`
says why once in the log and kernel selection keeps xla_chunked, so nothing but speed depends on it;
`MESHSERVE_CPU_FUSED_ATTENTION=0` turns it off.

What it takes: float32, no mask, not causal, heads of up to 128 (any [B, S, H, D] is computed right, but
wider heads were no faster than XLA's kernels). Other calls stay with the XLA kernels
(models.attention.kernels). Differentiated (training), a call runs xla_chunked (or xla_blockwise, where
xla_chunked refuses the sizes) forward and backward through a custom VJP, so training computes what it did
before this kernel; only calls that are not differentiated (serving) run the fused kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib
import numpy as np

from meshserve.models.attention.blockwise import xla_blockwise
from meshserve.models.attention.chunked import chunk_rows, xla_chunked
from meshserve.models.checkpoints.embedded_folder import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_attention.cc")
TARGET = "meshserve_cpu_fused_attention"
SYMBOL = "MeshserveFusedAttention"
ENV_SWITCH = "MESHSERVE_CPU_FUSED_ATTENTION"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for), or the machine's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return platform.machine() + "\n".join(sorted(set(keep)))


def _build(compiler: str, out: Path) -> None:
    """Compiles SOURCE into `out` through a temporary file beside it, renamed into place: processes that
    build at once each write their own and the last rename wins with an identical library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    command = [
        compiler,
        "-O3",
        "-march=native",
        "-std=c++17",
        "-fPIC",
        "-shared",
        "-w",
        f"-I{jax.ffi.include_dir()}",
        str(SOURCE),
        "-o",
        tmp,
    ]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"{' '.join(command)} failed:\n{error.stderr[-2000:]}") from error
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library_path() -> Path | None:
    """The compiled kernel for this machine, built on first use; None (logged once, with the reason) where it
    cannot be built or is turned off."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        log.info("cpu_fused attention off (%s=%s)", ENV_SWITCH, os.environ[ENV_SWITCH])
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning(
            "cpu_fused attention unavailable: no C++ compiler ($CXX, c++, g++, clang++); using xla_chunked"
        )
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256()
        for part in (
            SOURCE.read_bytes(),
            version.encode(),
            _cpu_identity().encode(),
            f"{jax.ffi.include_dir()} jaxlib {jaxlib.__version__}".encode(),
        ):
            key.update(hashlib.sha256(part).digest())
        path = cache_root() / "cpu_kernels" / f"fused_attention-{key.hexdigest()[:20]}.so"
        if not path.exists():
            _build(compiler, path)
        return path
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("cpu_fused attention unavailable, using xla_chunked: %s", error)
        return None


@functools.cache
def available() -> bool:
    """Whether the kernel is built, loaded and registered with XLA:CPU in this process."""
    path = library_path()
    if path is None:
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, SYMBOL)), platform="cpu")
    except (OSError, AttributeError, ValueError) as error:
        log.warning("cpu_fused attention unavailable, using xla_chunked: %s", error)
        return False
    return True


# Heads wider than this stay with XLA: at one head of 512 (SDXL's VAE at 256 px, [1, 1024, 1 x 512]) the
# kernel took 14.3 and 14.6 ms a call in two runs against XLA's 12.6-16.0 (xla_chunked, xla_blockwise) and
# torch's 12.2-12.8 (presumably its [rows, D] output tile outgrows L1 there; not profiled), while at heads
# of 64 and 128 it is 1.2-2.9x as fast as xla_chunked (bench/README.md, "One fused kernel: cpu_fused").
MAX_HEAD_DIM = 128


def accepts(*, dtype, causal: bool, masked: bool, head_dim: int) -> bool:
    """Whether a call is one the kernel computes: float32, no mask, not causal, heads of at most
    MAX_HEAD_DIM (and the kernel is here)."""
    return (
        np.dtype(dtype) == np.float32
        and not causal
        and not masked
        and head_dim <= MAX_HEAD_DIM
        and available()
    )


def _xla_kernel(q, k, v, scale):
    if chunk_rows(q.shape[2], q.shape[1], k.shape[1]) is not None:
        return xla_chunked(q, k, v, scale=scale)
    return xla_blockwise(q, k, v, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(q, k, v, scale: float):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(
        q, k, v, scale=np.float32(scale)
    )


def _fused_forward(q, k, v, scale):
    # Differentiated, the forward is the XLA kernel's own, with its residuals (the pullback is a pytree of
    # arrays): training computes exactly what it did before this kernel, and pays no recomputation.
    return jax.vjp(lambda q, k, v: _xla_kernel(q, k, v, scale), q, k, v)


def _fused_backward(scale, pullback, cotangent):
    return pullback(cotangent)


_fused.defvjp(_fused_forward, _fused_backward)


def cpu_fused_attention(q, k, v, *, scale: float | None = None):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], float32 -> [B, Sq, H, D]: softmax(q k^T * scale) v, scale
    D ** -0.5 by default. Raises where the kernel is not available (`available()`) or the dtype is not
    float32; kernel selection checks `accepts` first."""
    if not available():
        raise RuntimeError("cpu_fused attention is not available here (see the log for why)")
    if q.dtype != np.float32 or k.dtype != np.float32 or v.dtype != np.float32:
        raise ValueError(f"cpu_fused attention takes float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    return _fused(q, k, v, float(q.shape[-1] ** -0.5 if scale is None else scale))
