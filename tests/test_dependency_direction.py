"""The one-way dependency rule, checked by importing: models without Redis/HTTP/torch, service without JAX."""

import subprocess
import sys

import pytest

_BLOCKER = """
import sys
# A None entry in sys.modules is how Python spells "not installed": import raises ImportError and
# importlib.util.find_spec answers None, as libraries probing for optional packages expect.
for name in BLOCKED:
    sys.modules[name] = None
import PACKAGE
EXTRA
"""


@pytest.mark.parametrize(
    "package,blocked,extra",
    [
        (
            "meshserve.models",
            ["meshserve.service", "meshserve.workers", "redis", "fastapi", "torch", "diffusers"],
            "import meshserve.models.sdxl.pipeline, meshserve.models.schedulers, meshserve.models.attention\n"
            "import meshserve.models.flux.transformer_flux, meshserve.models.components.t5, meshserve.models.components.t5_tokenizer\n"
            "from meshserve.models.components.clip_tokenizer import load_clip_tokenizer\n"
            "from meshserve.models.sdxl.embedded import embedded_model_path\n"
            "load_clip_tokenizer(embedded_model_path() / 'tokenizer')",
        ),
        (
            "meshserve.training",
            ["meshserve.service", "meshserve.workers", "redis", "fastapi", "torch", "diffusers"],
            "import meshserve.training.train_shapes, meshserve.training.evaluate, meshserve.training.shape_score",
        ),
        (
            "meshserve.service",
            ["jax", "flax", "meshserve.models", "meshserve.workers", "torch", "diffusers"],
            "import meshserve.service.app, meshserve.service.store, meshserve.service.contract",
        ),
    ],
)
def test_package_imports_without_the_other_side(package, blocked, extra):
    code = _BLOCKER.replace("BLOCKED", repr(blocked)).replace("PACKAGE", package).replace("EXTRA", extra)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
