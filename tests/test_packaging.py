"""The wheel holds only `meshserve/`: the repository's top-level models/, service/ and workers/ install as
meshserve.models, meshserve.service and meshserve.workers (pyproject's package-dir mapping)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("meshserve-*.whl")
    return path


def test_wheel_installs_only_the_meshserve_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"meshserve"}, tops
    # Every source package is in it (a folder missing from pyproject's list would silently drop out).
    for folder in ("models", "service", "workers", "training"):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT).as_posix()
            assert f"meshserve/{rel}" in names, f"{rel} is not in the wheel: add it to pyproject's packages"
    # The embedded model's folder ships whole: every file of it, weights included.
    shipped = ROOT / "models" / "sdxl" / "weights" / "tiny-sdxl"
    for path in shipped.rglob("*"):
        if path.is_file():
            rel = path.relative_to(ROOT).as_posix()
            assert f"meshserve/{rel}" in names, f"{rel} is not in the wheel: see pyproject's package-data"
    # So does the playground page (service/static: no build step, served from the package).
    static = sorted(p.name for p in (ROOT / "service" / "static").iterdir() if p.is_file())
    assert "playground.html" in static
    for name in static:
        assert f"meshserve/service/static/{name}" in names, f"{name} is not in the wheel: see package-data"
    # And the CPU's fused attention kernel, compiled from its source where it runs.
    assert "meshserve/models/cpu/fused_attention.cc" in names, "the kernel's source is not in the wheel"


def test_installed_wheel_imports_from_outside_the_repository(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    code = (
        "import meshserve.models, meshserve.service.app, meshserve.workers.main, meshserve.cli\n"
        "from meshserve.models.sdxl.embedded import embedded_model_path\n"
        "assert (embedded_model_path() / 'model_index.json').is_file()\n"
        "from meshserve.service.api.routes.playground import FILES, STATIC\n"
        "assert all((STATIC / name).is_file() for name, _ in FILES.values())\n"
        "import importlib.util\n"
        f"assert meshserve.models.__file__.startswith({str(target)!r}), meshserve.models.__file__\n"
        "assert importlib.util.find_spec('models') is None and importlib.util.find_spec('workers') is None\n"
    )
    # -s: no user site; PYTHONPATH puts the wheel's copy ahead of the editable install of this checkout.
    r = subprocess.run(
        [sys.executable, "-s", "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
