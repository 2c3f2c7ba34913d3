"""XLA:CPU flags only where JAX will run on the CPU, decided before (and without) importing JAX: the CLI's defaults
(models/cpu/xla_cpu_flags.py) and the worker's host-device count and CPU scheduler (workers/main.py)."""

import json
import os
import subprocess
import sys

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults, cpu_is_the_platform

CUDA_PLUGIN = ["xla_cuda12"]  # the jax_plugins module jax-cuda12-plugin installs


def test_jax_platforms_decides_by_its_first_entry():
    for value, cpu in [
        ("cpu", True),
        (" CPU ", True),
        ("cpu,cuda", True),  # JAX's default backend is the first listed
        ("cuda", False),
        ("cuda,cpu", False),
        ("tpu,cpu", False),
        ("rocm", False),
    ]:
        assert cpu_is_the_platform({"JAX_PLATFORMS": value}, plugins=CUDA_PLUGIN) is cpu, value
        assert cpu_is_the_platform({"JAX_PLATFORMS": value}, plugins=[]) is cpu, value
    assert cpu_is_the_platform({"JAX_PLATFORM_NAME": "gpu"}, plugins=[]) is False
    assert cpu_is_the_platform({"JAX_PLATFORMS": "", "JAX_PLATFORM_NAME": "cpu"}, plugins=CUDA_PLUGIN) is True


def test_unset_means_cpu_only_without_an_accelerator_plugin():
    assert cpu_is_the_platform({}, plugins=[]) is True
    assert cpu_is_the_platform({}, plugins=CUDA_PLUGIN) is False
    assert cpu_is_the_platform({}, plugins=["libtpu"]) is False


def test_cli_defaults_are_not_added_on_an_accelerator():
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_autotune_level=2"}
    assert apply_cpu_defaults(env, jaxlib_version="0.10.2") == "--xla_gpu_autotune_level=2"
    assert env["XLA_FLAGS"] == "--xla_gpu_autotune_level=2"
    env = {"JAX_PLATFORMS": "cpu"}
    assert "individual_convolution" in apply_cpu_defaults(env, jaxlib_version="0.10.2")


WORKER = """
import json, os, sys
from meshserve.workers.main import _ensure_host_devices, _prefer_memory_minimizing_cpu_scheduler
assert "jax" not in sys.modules
seen = {}
for platforms in ("cuda", "tpu", "cpu"):
    os.environ["JAX_PLATFORMS"] = platforms
    os.environ.pop("XLA_FLAGS", None)
    _ensure_host_devices(4)
    _prefer_memory_minimizing_cpu_scheduler()
    seen[platforms] = os.environ.get("XLA_FLAGS", "")
print(json.dumps(seen))
"""


def test_worker_sets_its_cpu_flags_only_on_the_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    out = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["cuda"] == seen["tpu"] == ""
    assert seen["cpu"] == (
        "--xla_force_host_platform_device_count=4 --xla_cpu_enable_concurrency_optimized_scheduler=false"
    )
