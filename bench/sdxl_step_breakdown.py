"""Where one SDXL CFG denoise step spends its time, ours and diffusers', by knocking parts out.

    python bench/sdxl_step_breakdown.py [--width 64] [--size 256] [--rounds 3] [--threads 2]

The checkpoint is sdxl_vs_diffusers.py's (same options). Each side, in its own process pinned to the same
`--threads` CPUs (bench/compare_harness.py), times the UNet on the CFG batch of 2 once whole and once with
one kind of part replaced by something nearly free, on the same weights and inputs:

- `transformers`: every Transformer2DModel returns its input (GroupNorm, proj_in/out, the blocks);
- `resnets`: every ResnetBlock2D returns its shortcut (1x1 conv where the channels change, else the input);
- `attention core`: softmax(q k^T) v returns q (the q/k/v/out projections stay);
- `GroupNorm`, `LayerNorm`: the norms return their input.

What a part costs is the whole step's time minus the knocked-out step's. Knocking a part out also changes
what XLA fuses and how it schedules the rest, so the costs do not add up exactly to the whole; they say which
part to work on, not to the millisecond. Each variant is compiled once (ours) and called `--repeats` times
per round; the sides alternate for `--rounds` rounds; medians over rounds with their min-max.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_harness as harness  # noqa: E402
from bench import sdxl_vs_diffusers as sdxl  # noqa: E402

VARIANTS = ("whole", "transformers", "resnets", "attention core", "GroupNorm", "LayerNorm")


def _inputs(size: int):
    import numpy as np

    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 4, size // 8, size // 8)).astype(np.float32)
    context = rng.standard_normal((2, 77, sdxl.UNET["cross_attention_dim"])).astype(np.float32)
    pooled = rng.standard_normal((2, sdxl.TEXT["projection_dim"])).astype(np.float32)
    time_ids = np.tile(np.asarray([[size, size, 0, 0, size, size]], np.float32), (2, 1))
    return latents, context, pooled, time_ids


def run_ours(ckpt: Path, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from meshserve.models.components import layers
    from meshserve.models.sdxl import unet_2d_condition as unet_module

    ours, _ = harness.load_ours(ckpt)
    graph, state = harness.ours_component(ours, "unet")
    latents, context, pooled, time_ids = (jnp.asarray(a) for a in _inputs(args.size))
    x = jnp.transpose(latents, (0, 2, 3, 1))
    t = jnp.full((2,), 500.0)

    def resnet_shortcut(self, x, temb=None):
        return self.conv_shortcut(x) if self.conv_shortcut is not None else x

    def attention_projections_only(self, x, context=None):
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        return self.to_out[0](q + (k.mean(1, keepdims=True) + v.mean(1, keepdims=True)) * 0.0)

    patches = {
        "transformers": (unet_module.Transformer2DModel, lambda self, x, context: x),
        "resnets": (layers.ResnetBlock2D, resnet_shortcut),
        "attention core": (unet_module.Attention, attention_projections_only),
        "GroupNorm": (layers.GroupNorm, lambda self, x: x),
        "LayerNorm": (layers.LayerNorm, lambda self, x: x),
    }

    def compile_variant(name):
        cls, replacement = patches.get(name, (None, None))
        saved = cls.__call__ if cls else None
        if cls:
            cls.__call__ = replacement
        try:

            def step(state, x, t):
                unet = nnx.merge(graph, state)
                return unet(x, t, context, text_embeds=pooled, time_ids=time_ids)

            return jax.jit(step).lower(state, x, t).compile()
        finally:
            if cls:
                cls.__call__ = saved

    programs = {name: compile_variant(name) for name in VARIANTS}
    out = {}
    for name, program in programs.items():
        program(state, x, t).block_until_ready()
        out[name] = harness.median_time(lambda p=program: p(state, x, t).block_until_ready(), args.repeats)
    out["max_abs"] = float(np.abs(np.asarray(programs["whole"](state, x, t))).max())
    return out


def run_diffusers(ckpt: Path, args) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel
    from diffusers.models import attention_processor
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    unet = UNet2DConditionModel.from_pretrained(str(ckpt / "unet"), torch_dtype=torch.float32).eval()
    latents, context, pooled, time_ids = (torch.from_numpy(a) for a in _inputs(args.size))
    added = {"text_embeds": pooled, "time_ids": time_ids}
    t = torch.tensor(500.0)

    def transformer_identity(
        self, hidden_states, *a, **kw
    ):  # the UNet's blocks call it with return_dict=False
        return (hidden_states,)

    def resnet_shortcut(self, input_tensor, temb=None, *a, **kw):
        return self.conv_shortcut(input_tensor) if self.conv_shortcut is not None else input_tensor

    def sdpa_returns_query(query, key, value, *a, **kw):
        return query + (key.mean(-2, keepdim=True) + value.mean(-2, keepdim=True)) * 0.0

    @contextlib.contextmanager
    def patched(name):
        targets = {
            "transformers": [(Transformer2DModel, "forward", transformer_identity)],
            "resnets": [(ResnetBlock2D, "forward", resnet_shortcut)],
            "attention core": [(attention_processor.F, "scaled_dot_product_attention", sdpa_returns_query)],
            "GroupNorm": [(torch.nn.GroupNorm, "forward", lambda self, x: x)],
            "LayerNorm": [(torch.nn.LayerNorm, "forward", lambda self, x: x)],
        }.get(name, [])
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
        for obj, attr, fn in targets:
            setattr(obj, attr, fn)
        try:
            yield
        finally:
            for obj, attr, fn in saved:
                setattr(obj, attr, fn)

    # AttnProcessor2_0 calls F.scaled_dot_product_attention through this module attribute.
    assert attention_processor.F is F
    out = {}
    with torch.inference_mode():
        for name in VARIANTS:
            with patched(name):
                out[name] = harness.warm_median(
                    lambda: unet(latents, t, context, added_cond_kwargs=added, return_dict=False)[0],
                    args.repeats,
                )
        out["max_abs"] = float(
            unet(latents, t, context, added_cond_kwargs=added, return_dict=False)[0].abs().max()
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--width", type=int, default=64)
    harness.add_harness_options(ap)
    ap.set_defaults(repeats=7)
    args = ap.parse_args()
    # A side returns no images: the knocked-out UNets have no output to compare.
    if harness.run_side(
        args,
        lambda ckpt, args: (None, run_ours(ckpt, args)),
        lambda ckpt, args: (None, run_diffusers(ckpt, args)),
    ):
        return

    tmp = Path(tempfile.mkdtemp(prefix="meshserve-sdxl-breakdown-"))
    ckpt = sdxl.build_checkpoint(tmp, args.width)
    flags = ("size", "repeats", "threads")
    runs, started, load_before, load_after = harness.alternate_sides(__file__, args, ckpt, tmp, flags)

    def spread(values):
        return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

    ours, ref = runs["ours"], runs["diffusers"]
    print(
        f"\n{started:%Y-%m-%d %H:%M} UTC, {harness.cpu_name()}, {os.cpu_count()} cores, load average "
        f"{load_before:.2f} before / {load_after:.2f} after (1 min); SDXL-shaped UNet, width {args.width}, "
        f"{args.size}x{args.size}, CFG batch 2, fp32; {args.threads} threads each side; {args.rounds} "
        f"alternating rounds, median (min-max) in ms; max |output| ours {ours[0]['max_abs']:.3f}, "
        f"diffusers {ref[0]['max_abs']:.3f}\n"
    )
    print("| part | ours: its cost (step without it) | diffusers: its cost (step without it) |")
    print("|---|---|---|")
    for name in VARIANTS:
        if name == "whole":
            cells = [spread([r["whole"] * 1e3 for r in side]) for side in (ours, ref)]
            print(f"| whole UNet call | {cells[0]} | {cells[1]} |")
            continue
        cells = []
        for side in (ours, ref):
            cost = [(r["whole"] - r[name]) * 1e3 for r in side]
            cells.append(f"{spread(cost)} ({statistics.median(r[name] * 1e3 for r in side):.1f})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
