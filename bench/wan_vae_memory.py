"""Peak memory of the Wan 2.1 VAE decode, from the compiled program (no weights, no run).

    python bench/wan_vae_memory.py                          # 480x832, 21 and 11 latent frames (81 / 41 video)
    python bench/wan_vae_memory.py --height 240 --width 416 --frames 21 11 6
    python bench/wan_vae_memory.py --height 240 --width 416 --frames 21 --meshes 1 context4 cfg2-context4

Builds the real-config AutoencoderKLWan abstractly (shapes only), lowers `decode` for fp32 latents
[1, T, H/8, W/8, 16] with jax.ShapeDtypeStruct inputs, compiles it for the CPU and prints XLA's
memory_analysis(): arguments (the weights and the latents), output (the video), temporaries (everything
else the program holds at its peak, the chunk working set and the scan's carried feature cache). If the
lax.scan keeps memory bounded, the temporaries stay flat as T grows and only the output grows with T.

`--meshes`: the decode as the pipeline compiles it on a pool's mesh (XLA:CPU host devices, 8 of them): the
activations constrained to `models/registry.py/wan.decode_sharding` (batch over data/cfg, the larger spatial
dimension over the other axes), the latents placed with the pool's batch sharding; memory_analysis() is then
per device. Names: "1" (one device, unplaced), or axis sizes joined by "-" ("context4", "cfg2-context4").
"""

from __future__ import annotations

import argparse
import math
import os
import time
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshserve.models.checkpoints.loading import abstract_module  # noqa: E402
from meshserve.models.parallel.mesh import MeshSizes, make_mesh  # noqa: E402
from meshserve.models.wan.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig  # noqa: E402
from meshserve.models.wan.pipeline import decode_sharding  # noqa: E402


def parse_mesh(name: str) -> dict[str, int]:
    if name == "1":
        return {}
    sizes = {}
    for part in name.split("-"):
        axis = part.rstrip("0123456789")
        sizes[axis] = int(part[len(axis) :])
    return sizes


def measure(
    height: int, width: int, latent_frames: int, dtype=jnp.float32, mesh: str = "1", vae: dict | None = None
) -> dict:
    """`vae`: a vae/config.json's fields (None: diffusers' defaults, the Wan 2.1 VAE)."""
    cfg = AutoencoderKLWanConfig.from_config(vae or {})
    model = abstract_module(AutoencoderKLWan, cfg, dtype=dtype)
    graphdef, state = nnx.split(model)
    f = cfg.spatial_compression
    shape = (1, latent_frames, height // f, width // f, cfg.z_dim)
    z = jax.ShapeDtypeStruct(shape, jnp.float32)
    constrain = None
    sizes = parse_mesh(mesh)
    if sizes:
        m = make_mesh(MeshSizes(**sizes), jax.devices()[: math.prod(sizes.values())])
        # As the pipeline: weights replicated (no shard_over), latents in the batch sharding (batch 1 over
        # no axis: replicated), every activation of the decode in decode_sharding.
        state = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, P())), state
        )
        z = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(m, P()))
        constrain = partial(
            jax.lax.with_sharding_constraint, shardings=decode_sharding(m, *shape[:1], *shape[2:4])
        )

    def decode(state, z):
        return nnx.merge(graphdef, state).decode(z, constrain)

    start = time.perf_counter()
    compiled = jax.jit(decode).lower(state, z).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {
        "mesh": mesh,
        "height": height,
        "width": width,
        "latent_frames": latent_frames,
        "video_frames": 1 + 4 * (latent_frames - 1),
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
        "peak_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes,
        "compile_s": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, nargs="+", default=[21, 11], help="latent frames")
    parser.add_argument("--meshes", nargs="+", default=["1"], help='"1", "context4", "cfg2-context4", ...')
    args = parser.parse_args()
    gib = 2**30
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    for mesh in args.meshes:
        for t in args.frames:
            report(measure(args.height, args.width, t, mesh=mesh), gib)


def report(r: dict, gib: int) -> None:
    print(
        f"mesh {r['mesh']}: "
        f"{r['height']}x{r['width']}, {r['latent_frames']} latent -> {r['video_frames']} video frames: "
        f"arguments {r['argument_bytes']:,} B, output {r['output_bytes']:,} B, "
        f"temporaries {r['temp_bytes']:,} B ({r['temp_bytes'] / gib:.2f} GiB), "
        f"total {r['peak_bytes'] / gib:.2f} GiB per device; compiled in {r['compile_s']} s"
    )


if __name__ == "__main__":
    main()
