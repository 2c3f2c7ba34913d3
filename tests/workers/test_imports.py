"""Dependency direction: a worker with a model-free runner, and `meshserve serve`'s module, never import JAX
(only a pool that runs a real model does) nor any model code beyond the JAX-free layout rules; the runner side
never imports torch or diffusers."""

import subprocess
import sys

from tests.workers.helpers import ROOT

CODE = """
import sys
import meshserve.workers.main, meshserve.workers.serve, meshserve.workers.pool, meshserve.workers.job_loop
import meshserve.workers.metrics
from meshserve.workers.fake_runner import FakeRunner
from meshserve.workers.runner import RunRequest
from meshserve.service.contract import JobParams
p = JobParams(model="f", prompt="x", width=8, height=8, num_inference_steps=1, guidance_scale=1.0, seed=0)
FakeRunner("f").run([RunRequest("j", p)])
heavy = sorted(m for m in ("jax", "flax", "torch", "diffusers") if m in sys.modules)
assert not heavy, heavy
# The config reads device slices, mesh sizes, attention options and Hub ids with the models' own JAX-free
# rules only (models/checkpoints/hub.py imports huggingface_hub and the pipelines only when it resolves an id).
models = sorted(m for m in sys.modules if m.startswith("meshserve.models"))
allowed = ["meshserve.models", "meshserve.models.attention", "meshserve.models.attention.options"]
allowed += ["meshserve.models.checkpoints", "meshserve.models.checkpoints.hub", "meshserve.models.parallel", "meshserve.models.parallel.layout_spec"]
assert models == allowed, models
"""


def test_workers_import_no_jax_until_a_real_model_runs():
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
