"""The one-way dependency rule, checked by importing: models without Redis/HTTP/torch/transformers, service
without JAX; and serving Flux and Wan, with torch and transformers installed beside us, imports neither."""

import os
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
            [
                "meshserve.service",
                "meshserve.workers",
                "redis",
                "fastapi",
                "torch",
                "diffusers",
                "transformers",
            ],
            "import meshserve.models.sdxl.pipeline, meshserve.models.schedulers, meshserve.models.attention\n"
            "import meshserve.models.flux.transformer_flux, meshserve.models.components.t5, meshserve.models.components.t5_tokenizer\n"
            "from meshserve.models.components.clip_tokenizer import load_clip_tokenizer\n"
            "from meshserve.models.sdxl.embedded import embedded_model_path\n"
            "load_clip_tokenizer(embedded_model_path() / 'tokenizer')",
        ),
        (
            "meshserve.training",
            [
                "meshserve.service",
                "meshserve.workers",
                "redis",
                "fastapi",
                "torch",
                "diffusers",
                "transformers",
            ],
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


_SERVE = """
import importlib.util, sys
assert importlib.util.find_spec("torch") and importlib.util.find_spec("transformers")  # installed, importable
from meshserve.models.registry import load_pipeline
for model_id, size in (("tiny-flux", {}), ("tiny-wan", {"num_frames": 5})):
    pipe = load_pipeline(model_id)  # the folder is built here too (a fresh cache): its tokenizer files included
    out = pipe("a cat", seed=0, height=32, width=32, num_inference_steps=1, output_type="np", **size)
    assert out.images is not None
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "diffusers"))
assert not loaded, loaded[:20]
"""


def test_serving_flux_and_wan_imports_no_torch_nor_transformers(tmp_path):
    """Tokenizers are read with the `tokenizers` library (models/components/tokenizer_folder.py): building the
    tiny Flux and Wan folders, loading them and one generation each leave torch and transformers unimported."""
    env = dict(os.environ, MESHSERVE_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _SERVE], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
