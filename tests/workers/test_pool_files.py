"""Every shipped pools.yaml (deploy/pools/) is a valid worker config, and the Flux and Wan ones fit their
models' heads (tensor and Ulysses split heads: a count that does not divide would fail at start)."""

from pathlib import Path

import pytest

from meshserve.models.parallel.mesh import MeshSizes, validate_layout
from meshserve.workers.config import load_config

POOLS = Path(__file__).resolve().parents[2] / "deploy" / "pools"
FILES = sorted(POOLS.glob("*.yaml"))
# FLUX.1-dev's transformer attends with 24 heads; its T5-XXL encoder's 64 heads split over tensor too.
FLUX_HEADS = (24, 64)
# Wan 2.1's transformers attend with 40 (14B) and 12 (1.3B) heads (their transformer/config.json num_attention_heads);
# the UMT5-XXL text encoder of both has 64.
HEADS = {"flux-": FLUX_HEADS, "wan-14b-": (40, 64), "wan-1.3b-": (12, 64)}


def test_pool_files_exist():
    names = {f.name for f in FILES}
    assert {"cpu.yaml", "gpu.yaml", "flux-dev-1.yaml", "flux-dev-4.yaml", "flux-dev-8.yaml"} <= names
    assert {"wan-1.3b-1gpu.yaml", "wan-14b-8dev.yaml"} <= names


def test_wan_pool_files_serve_frame_counts_with_the_default_first():
    for name in ("wan-1.3b-1gpu.yaml", "wan-14b-8dev.yaml"):
        for pool in load_config(POOLS / name).pools:
            # 4k+1 counts Wan 2.1 runs; 81 (its default) among them, so a request naming none is served as is.
            assert pool.frames and all((n - 1) % 4 == 0 and 1 <= n <= 81 for n in pool.frames)
            assert 81 in pool.frames


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_pool_file_is_a_valid_config(path):
    config = load_config(path)
    for pool in config.pools:
        assert len(pool.device_ids) == pool.mesh.size
        model_heads = [h for prefix, h in HEADS.items() if path.name.startswith(prefix)]
        if model_heads:
            strategy = pool.attention.context_strategy
            ulysses = pool.mesh.context if strategy == "ulysses" and pool.mesh.context > 1 else None
            for heads in model_heads[0]:  # raises LayoutError naming the counts when they do not divide
                validate_layout(
                    MeshSizes(**pool.mesh.as_dict()),
                    num_devices=pool.mesh.size,
                    heads=heads,
                    ulysses_degree=ulysses,
                )
