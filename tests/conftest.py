"""Test session set-up: 8 CPU devices for every mesh layout, JAX's persistent compilation cache, and one tiny
SDXL checkpoint per session."""

import os

# Before JAX is imported anywhere: 8 host devices so every mesh layout runs on the CPU, and XLA's backend set
# to compile fast (tests/xla_level.py: TEST_XLA_FLAGS). The suite is mostly compiling (each test builds its own
# small programs and runs them a few times):
# - Optimisation level 0: tests/models/test_wan_pipeline.py on a cold cache took 144 -> 94 s of CPU (level 1:
#   120 s; --xla_llvm_disable_expensive_passes: 142 s; user time, beside a training run, so only the ratios
#   count), and the whole suite on a clean clone 38:29 -> 28:30-31:06 (three runs; 2026-11-25, a 2-core EPYC).
#   Level 0 runs the programs slower (the embedded SDXL's 24 held-out captions: 8.5 s against 3.6-3.7 s at
#   levels 1, 2 and the default), but the whole suite at level 1 still took 22:19 against 20:10 at 0 (one run
#   each, another 2-core EPYC, README "Development").
# - XLA:CPU's older LLVM IR fusion emitters (`--xla_cpu_use_fusion_emitters=false`, jaxlib 0.10): on a cold
#   cache tests/models/test_transformer_flux.py and test_unipc.py took 53 s of CPU against 72 and 86 s with
#   the MLIR emitters (2026-11-27, a 2-core Zen 3 EPYC, user time, each run beside another), and
#   test_wan_pipeline.py 53 against 78 s on a Zen 1 EPYC (2026-11-27); the whole suite a third less: README
#   "Development".
# Results move at rounding level only: every tolerance against diffusers and every layout check holds as at
# serving's settings, but one, fp8 activations on two devices against one, where a few e4m3 roundings flip
# (test_quantize.py says by how much). The tests of properties that rest on codegen being the same across
# programs (bit-identity of a cached prompt row, a padded schedule against the exact one) compile with
# serving's emitters (tests/xla_level.py: SERVING_EMITTERS).
# Serving, the CLI and the benches keep XLA's default; the CLI and workers that tests start inherit this.
from tests.xla_level import TEST_XLA_FLAGS  # noqa: E402

os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The XLA:CPU flags meshserve serves with (the CLI sets them too), so the tests check what runs.
from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults  # noqa: E402

apply_cpu_defaults()

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_CACHE = Path(os.environ.get("MESHSERVE_TEST_CACHE", Path(__file__).resolve().parent.parent / ".cache"))
# The embedded model and the CLI's compilation cache go under the test cache too, not the user's home.
os.environ.setdefault("MESHSERVE_CACHE", str(_CACHE / "meshserve"))
# One persistent compilation cache for the test processes and what they start (the CLI, workers, `serve`), so
# a program compiled by one is read back by the others.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE / "jax"))


def pytest_configure(config):
    import jax

    from meshserve.models.engine.compile_cache import enable_compilation_cache

    # Compiling dominates on a 2-core machine: with the cache, a program (denoise programs, with their host
    # callback, included) compiled by one test file is read back by the next, and a second run is much faster.
    enable_compilation_cache(os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _share_the_cores_with_torch(config)


def _share_the_cores_with_torch(config):
    """torch (the diffusers references) gets the cores divided among the test processes: one intra-op thread
    each under .ci/run's two workers on two cores. Its OpenMP threads spin at every barrier, so two of them
    beside a busy core ran the tiny SDXL's diffusers call about 3x slower than one thread did, where XLA's pool
    (which does not spin) ran ours as fast either way; the torch-heavy files' time went down 16 %
    (bench/README.md, "The test suite's time"). Set in each xdist worker before torch is imported
    (it reads the variable once); one test process keeps torch's default (every core), and an OMP_NUM_THREADS
    of the user's wins."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))


def pytest_collection_modifyitems(config, items):
    from tests.file_order import file_seconds, longest_first

    # Longest files first, so that two workers end together (tests/file_order.py).
    items[:] = longest_first(items, file_seconds())


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of the test's own (tests/private_redis.py), killed at teardown; skipped without one."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tests.private_redis import PrivateRedis

    server = PrivateRedis(tmp_path)
    yield server
    server.kill()


@pytest.fixture(scope="session")
def tiny_sdxl_path(tmp_path_factory) -> Path:
    """A tiny random SDXL diffusers folder written by diffusers' own save_pretrained."""
    from tests.fixtures.tiny_sdxl import build_tiny_sdxl

    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl"))


@pytest.fixture(scope="session")
def tiny_sdxl_deep_path(tmp_path_factory) -> Path:
    """The tiny SDXL at SDXL's depth: three UNet levels, a VAE factor of 8 (tests/fixtures/tiny_sdxl.py)."""
    from tests.fixtures.tiny_sdxl import build_tiny_sdxl

    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl_deep"), deep=True)


@pytest.fixture(scope="session")
def tiny_sdxl_controlnet_path(tmp_path_factory, tiny_sdxl_path) -> Path:
    """The tiny SDXL with a tiny ControlNet: a StableDiffusionXLControlNetPipeline folder diffusers wrote."""
    from tests.fixtures.tiny_controlnet import build_tiny_sdxl_controlnet

    return build_tiny_sdxl_controlnet(tmp_path_factory.mktemp("tiny_sdxl_controlnet"), tiny_sdxl_path)


@pytest.fixture(scope="session")
def tiny_flux_dev_path(tmp_path_factory) -> Path:
    """A tiny random Flux.1-dev-type diffusers folder (guidance embedding) written by diffusers' save_pretrained."""
    from tests.fixtures.tiny_flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux_dev"), guidance_embeds=True)


@pytest.fixture(scope="session")
def tiny_flux_kontext_path(tmp_path_factory, tiny_flux_dev_path) -> Path:
    """The tiny Flux-dev's components as a FLUX.1 Kontext folder (model_index.json: FluxKontextPipeline)."""
    from tests.fixtures.tiny_flux import kontext_folder

    return kontext_folder(tiny_flux_dev_path, tmp_path_factory.mktemp("tiny_flux_kontext"))


@pytest.fixture(scope="session")
def tiny_flux_fill_path(tmp_path_factory, tiny_flux_dev_path) -> Path:
    """A tiny FLUX.1 Fill folder (FluxFillPipeline: a transformer taking the masked image and mask too)."""
    from tests.fixtures.tiny_flux import build_tiny_flux_fill

    return build_tiny_flux_fill(tmp_path_factory.mktemp("tiny_flux_fill"), tiny_flux_dev_path)


@pytest.fixture(scope="session")
def tiny_flux_control_path(tmp_path_factory, tiny_flux_dev_path) -> Path:
    """A tiny FLUX.1 Canny/Depth folder (FluxControlPipeline: a transformer taking the control image too)."""
    from tests.fixtures.tiny_flux import build_tiny_flux_control

    return build_tiny_flux_control(tmp_path_factory.mktemp("tiny_flux_control"), tiny_flux_dev_path)


@pytest.fixture(scope="session")
def tiny_flux_schnell_path(tmp_path_factory) -> Path:
    """A tiny random Flux.1-schnell-type diffusers folder (no guidance embedding, static shift)."""
    from tests.fixtures.tiny_flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux_schnell"), guidance_embeds=False)


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory) -> Path:
    """A tiny random Wan 2.1 diffusers folder (UMT5, transformer, VAE, UniPC) written by diffusers' save_pretrained."""
    from tests.fixtures.tiny_wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan"))


@pytest.fixture(scope="session")
def tiny_wan_i2v_path(tmp_path_factory) -> Path:
    """A tiny random Wan 2.1 image-to-video diffusers folder (UMT5, I2V transformer, VAE, UniPC, CLIP vision
    encoder and its image processor) written by diffusers' save_pretrained."""
    from tests.fixtures.tiny_wan_i2v import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny_wan_i2v"))


@pytest.fixture(scope="session")
def tiny_wan_flf2v_path(tmp_path_factory) -> Path:
    """The tiny Wan 2.1 image-to-video folder with a first-last-frame transformer (pos_embed_seq_len)."""
    from tests.fixtures.tiny_wan_i2v import build_tiny_wan_i2v

    return build_tiny_wan_i2v(tmp_path_factory.mktemp("tiny_wan_flf2v"), first_last=True)


@pytest.fixture(scope="session")
def embedded_sdxl():
    """The embedded tiny SDXL (a trained VAE: previews look like its pictures), loaded once per session so its
    compiled programs are shared without even a cache read. Tests that set `prompt_cache` on it reset it."""
    from meshserve.models import load_pipeline

    return load_pipeline(None)


@pytest.fixture(scope="module", autouse=True)
def _memory_mappings_in_bounds():
    """After each test file: if this process holds over half of vm.max_map_count's memory mappings, free what
    the file's programs left. XLA:CPU maps about three regions per compiled kernel and a cache write maps them
    again; at the limit (65,530 here) it does not fail but crashes (SIGSEGV/SIGABRT in serialize or compile),
    which lost a pytest worker in 3 of 5 full runs while every pipeline leaked (fixed: previews.py). A warning
    says when this ever fires again."""
    yield
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as maps:
            held = sum(1 for _ in maps)
    except (OSError, ValueError):
        return
    if held > limit // 2:
        import gc
        import warnings

        import jax

        jax.clear_caches()
        gc.collect()
        with open("/proc/self/maps", "rb") as maps:
            after = sum(1 for _ in maps)
        warnings.warn(
            f"{held} of {limit} memory mappings held after this file; {after} after clearing", stacklevel=1
        )
