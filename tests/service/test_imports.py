"""The front end imports no JAX (nor torch, diffusers, models or workers): checked in a fresh interpreter where
importing them fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys
for name in ("jax", "jaxlib", "flax", "torch", "diffusers", "meshserve.models", "meshserve.workers"):
    sys.modules[name] = None  # any import of them raises ImportError
import meshserve.service.app, meshserve.service.store, meshserve.service.contract, meshserve.service.settings
import meshserve.service.metrics, meshserve.service.openapi_export
meshserve.service.app.create_app()
heavy = ("jax", "flax", "torch", "diffusers", "meshserve.models", "meshserve.workers")
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy)
                and sys.modules[m] is not None)
assert not loaded, loaded
print("ok")
"""


def test_service_imports_without_jax():
    r = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
