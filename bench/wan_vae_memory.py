"""Peak memory of the Wan 2.1 VAE decode, from the compiled program (no weights, no run).

    python bench/wan_vae_memory.py                          # 480x832, 21 and 11 latent frames (81 / 41 video)
    python bench/wan_vae_memory.py --height 240 --width 416 --frames 21 11 6

Builds the real-config AutoencoderKLWan abstractly (shapes only), lowers `decode` for fp32 latents
[1, T, H/8, W/8, 16] with jax.ShapeDtypeStruct inputs, compiles it for the CPU and prints XLA's
memory_analysis(): arguments (the weights and the latents), output (the video), temporaries (everything
else the program holds at its peak, the chunk working set and the scan's carried feature cache). If the
lax.scan keeps memory bounded, the temporaries stay flat as T grows and only the output grows with T.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from meshserve.models.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig  # noqa: E402
from meshserve.models.loading import abstract_module  # noqa: E402


def measure(height: int, width: int, latent_frames: int, dtype=jnp.float32) -> dict:
    cfg = AutoencoderKLWanConfig()  # diffusers' defaults = the Wan 2.1 VAE
    model = abstract_module(lambda rngs: AutoencoderKLWan(cfg, dtype=dtype, rngs=rngs))
    graphdef, state = nnx.split(model)
    f = cfg.spatial_compression
    z = jax.ShapeDtypeStruct((1, latent_frames, height // f, width // f, cfg.z_dim), jnp.float32)

    def decode(state, z):
        return nnx.merge(graphdef, state).decode(z)

    start = time.perf_counter()
    compiled = jax.jit(decode).lower(state, z).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    return {
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
    args = parser.parse_args()
    gib = 2**30
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    for t in args.frames:
        r = measure(args.height, args.width, t)
        print(
            f"{r['height']}x{r['width']}, {r['latent_frames']} latent -> {r['video_frames']} video frames: "
            f"arguments {r['argument_bytes']:,} B, output {r['output_bytes']:,} B, "
            f"temporaries {r['temp_bytes']:,} B ({r['temp_bytes'] / gib:.2f} GiB), "
            f"total {r['peak_bytes'] / gib:.2f} GiB; compiled in {r['compile_s']} s"
        )


if __name__ == "__main__":
    main()
