"""meshserve (JAX) against diffusers (PyTorch eager and torch.compile) in one process, on any CUDA machine.

    python bench/gpu_vs_diffusers.py --stages flux,sdxl,wan [--rounds 5] [--out results.json] [--tiny]
                                     [--measures step,program,vae,generation] [--steps N] [--no-compile]
                                     [--deadline S] [--quantize int8|fp8] [--unrolled]
                                     [--profile N] [--variants 'NAME:xla_option=value,...;...']
                                     [--one-side-at-a-time]

Per family (FLUX.1-dev, SDXL base, Wan 2.1 T2V 1.3B), at the real configs and shapes with random weights, bf16
(the VAEs in fp32, as meshserve's pipelines decode; `--vae-dtype` changes both sides):

- step: one call of the denoiser as the family's denoise loop makes it. FLUX.1-dev: batch 1 (guidance
  distilled, no CFG), 1024x1024 = 4096 image + 512 text tokens. SDXL: the UNet on the CFG batch of 2 at 128x128
  latents (1024x1024), 77 text tokens. Wan: 480x832, 81 frames (21 x 60 x 104 latents, 32,760 tokens), 512
  text tokens, CFG: meshserve runs the two rows as one batch of 2, diffusers' WanPipeline two calls of batch 1.
  `wan14b`: the same with Wan 2.1 T2V 14B's transformer (40 blocks of 40 heads, ffn 13,824; built in bf16,
  28 GB), for issue 24's 14B step target (its VAE is the 1.3B's: `--measures step`).
- program: the whole denoise loop of `--steps` steps (default: the family's, 28 / 30 / 50). meshserve: one
  jitted program around models/engine/denoise_loop.py's `denoise_loop` (the loop every pipeline runs: a
  lax.while_loop over a schedule padded to MAX_STEPS, CFG, the family's scheduler from models/schedulers, the
  per-step host callback) with the model closure its pipeline builds (`denoiser` in models/<family>/pipeline.py:
  Flux's timestep t / 1000 rounded as diffusers, SDXL's micro-conditioning, Wan's fp32 latents). diffusers: its
  pipeline's loop written out (set_timesteps as the pipeline calls it, set_begin_index(0), scale_model_input,
  the model, the CFG combine, scheduler.step), with the model eager or torch.compile'd. Text encoding, latent
  preparation and decoding are outside both; the initial latents are the same.
- vae: the VAE decode of one 1024x1024 image (Flux 16-channel, SDXL 4-channel latents) or of the 81-frame video
  (Wan 2.1's causal 3D VAE).
- generation (FLUX.1-dev only, asked by name): the whole pipeline as a user calls it, prompt to pixels on the
  host: CLIP-L and T5-XXL on 512 tokens, `--steps` steps (28), the VAE decode; our load_pipeline against
  diffusers' FluxPipeline on one random checkpoint folder with every component (`flux_generation`).

Weights: diffusers builds each model with its own random initialisation (torch.manual_seed(0)) and saves it
with save_pretrained to a scratch folder (/dev/shm when it has room); then diffusers' `from_pretrained(...,
torch_dtype=...)` and meshserve's loader for that folder (load_flux_transformer, load_unet,
load_autoencoder_kl, load_wan_transformer, load_autoencoder_kl_wan: models/checkpoints/loading.py's conversion)
read the same files, so both sides hold the same weights, converted as a real checkpoint would be (Wan's
_keep_in_fp32_modules stay fp32 on both sides). The inputs are the same numpy draws, in each side's layout.

Method: every measure warms both sides up (meshserve's compile and diffusers' torch.compile are timed apart),
then runs `--rounds` rounds; each round runs every side `--per-round` times (the program once),
the sides' order rotating from round to round, each call timed between device synchronisations
(jax.block_until_ready, torch.cuda.synchronize). A time is the median over all calls with the min-max; a
speed-up (diffusers / meshserve, above 1: meshserve faster) is the median of the per-round ratios of the round
medians, with their min-max. Same computation: the max relative difference max|ours - diffusers| / max|diffusers|
of the outputs on the same inputs (step: the model output; program: the final latents; vae: the decoded pixels)
is printed beside every row, and torch.compile's against eager for scale, so a fast wrong result shows.
`--profile N`: after the timed rounds, N more calls of each side under its profiler, and a table per side of
the device time by kernel category and the longest kernels (bench/kernel_profile.py), kept in the JSON row.
`--variants 'NAME:option=value,...;NAME2:...'`: our program of each row compiled again with those XLA options
(`compiler_options`, so one process and one checkpoint serve them all), checked against the default's output
and timed against it in alternating rounds.

`--tiny`: small configs of the same block types and small shapes (3 steps), so the script runs on the CPU: the
check that it works before a device run (2 minutes on 2 cores with `--no-compile`, 7 with torch.compile's CPU
compiles). On the CPU both sides share the cores in one process, so its times compare nothing.
Results: a markdown row per measure as it finishes, the whole table at the end with the device, the versions
and the date (UTC), and with `--out` a JSON file rewritten after every measure (a killed run keeps what it had).
bench/README.md "GPU (bench/gpu_vs_diffusers.py)" says how to run it with the device tool.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

# JAX would take 75 % of the GPU at its start; torch shares the card in this process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parent.parent
# `bench` (bench/ is no package of the install), and `meshserve` where it is not installed (import_meshserve).
sys.path.insert(0, str(ROOT))
T0 = time.perf_counter()

# black-forest-labs/FLUX.1-dev transformer/config.json and vae/config.json (as bench/flux_memory.py, which sets
# XLA flags for 8 CPU devices when imported, so its constants are not imported here).
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=[16, 56, 56],
)  # fmt: skip
FLUX_VAE = dict(
    act_fn="silu", block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
    in_channels=3, latent_channels=16, layers_per_block=2, norm_num_groups=32, out_channels=3,
    sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, up_block_types=["UpDecoderBlock2D"] * 4,
    use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True,
)  # fmt: skip
# stabilityai/stable-diffusion-xl-base-1.0 unet/, vae/ (sdxl-vae) and scheduler/ configs.
SDXL_UNET = dict(
    act_fn="silu", addition_embed_type="text_time", addition_time_embed_dim=256, attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"], flip_sin_to_cos=True,
    freq_shift=0, in_channels=4, layers_per_block=2, mid_block_type="UNetMidBlock2DCrossAttn", norm_eps=1e-05,
    norm_num_groups=32, out_channels=4, projection_class_embeddings_input_dim=2816, sample_size=128,
    transformer_layers_per_block=[1, 2, 10], up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    use_linear_projection=True,
)  # fmt: skip
SDXL_VAE = dict(
    act_fn="silu", block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
    in_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32, out_channels=3, sample_size=1024,
    scaling_factor=0.13025, up_block_types=["UpDecoderBlock2D"] * 4,
)  # fmt: skip
SDXL_SCHEDULER = dict(
    _class_name="EulerDiscreteScheduler", beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    interpolation_type="linear", num_train_timesteps=1000, prediction_type="epsilon", steps_offset=1,
    timestep_spacing="leading", use_karras_sigmas=False,
)  # fmt: skip
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/ and vae/ configs (bench/wan_memory.py, tests/models/
# test_autoencoder_kl_wan.py WAN21_VAE).
WAN_1_3B = dict(
    patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)  # fmt: skip
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json: the 1.3B's blocks, wider and deeper.
WAN_14B = dict(WAN_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
WAN_VAE = dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0,
)  # fmt: skip

# FLUX.1-dev's text encoders (text_encoder/ and text_encoder_2/ config.json): CLIP ViT-L/14's text model and
# T5 v1.1 XXL's encoder. The vocabularies are the bench's tiny tokenizers' (models/components/*_tokenizer.py):
# the embedding tables shrink, the compute does not.
CLIP_L = dict(
    hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, hidden_act="quick_gelu",
    projection_dim=768, max_position_embeddings=77, layer_norm_eps=1e-5,
)  # fmt: skip
T5_XXL = dict(
    d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
    relative_attention_max_distance=128, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)  # fmt: skip

# Per family: configs, shapes, default steps and guidance; `tiny` overrides (the same block types, small).
FAMILIES = {
    "flux": dict(
        model=FLUX_DEV,
        vae=FLUX_VAE,
        clip=CLIP_L,
        t5=T5_XXL,
        latent=(128, 128),
        text=512,
        steps=28,
        guidance=3.5,
    ),
    "sdxl": dict(model=SDXL_UNET, vae=SDXL_VAE, latent=(128, 128), text=77, steps=30, guidance=5.0),
    "wan": dict(model=WAN_1_3B, vae=WAN_VAE, latent=(21, 60, 104), text=512, steps=50, guidance=5.0),
    # Built in bf16 (28 GB; in fp32 it would be 56 GB on the card before either side loads it).
    "wan14b": dict(
        model=WAN_14B, vae=WAN_VAE, latent=(21, 60, 104), text=512, steps=50, guidance=5.0, build="bfloat16"
    ),
}
_TWO_LEVELS = dict(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)
TINY = {
    "flux": dict(
        model=dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=32,
                   joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=[8, 12, 12]),
        vae=dict(block_out_channels=[32, 32], layers_per_block=1, **_TWO_LEVELS), latent=(16, 16), text=16,
        clip=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=1, projection_dim=32),
        t5=dict(d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4),
    ),
    "sdxl": dict(
        model=dict(block_out_channels=[32, 64, 128], attention_head_dim=[1, 2, 4], layers_per_block=1,
                   transformer_layers_per_block=[1, 1, 1], cross_attention_dim=64, addition_time_embed_dim=8,
                   projection_class_embeddings_input_dim=32 + 6 * 8),
        vae=dict(block_out_channels=[32, 32], layers_per_block=1, **_TWO_LEVELS), latent=(16, 16), text=16,
    ),
    "wan": dict(
        model=dict(num_layers=1, num_attention_heads=2, attention_head_dim=32, ffn_dim=128, text_dim=64),
        vae=dict(base_dim=8, num_res_blocks=1), latent=(3, 8, 8), text=16,
    ),
}  # fmt: skip
TINY["wan14b"] = dict(TINY["wan"], model=dict(TINY["wan"]["model"], num_layers=2))
TINY_STEPS = 3
MEASURES = ("step", "program", "vae", "generation")
SIDES = ("meshserve", "diffusers eager", "diffusers torch.compile")


def log(*parts) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s]", *parts, file=sys.stderr, flush=True)


def import_meshserve() -> None:
    """`meshserve.models` from this checkout, installed or not (the device machine receives the tree alone): the
    repository's top-level folders are subpackages of `meshserve` (pyproject's package-dir)."""
    try:
        import meshserve.models  # noqa: F401
    except ModuleNotFoundError:
        import meshserve

        meshserve.__path__.append(str(ROOT))


# --------------------------------------------------------------------------------------------------
# Timing and comparison


class Bench:
    def __init__(self, args):
        import torch

        self.args = args
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.results: dict = {"env": env_info(), "args": vars(args), "rows": [], "errors": {}}
        self.compile = not args.no_compile

    def as_served(self, model):
        """A DiT with its blocks stacked under a scan, as a pipeline holds it (components/block_stack.py), unless
        --unrolled."""
        from meshserve.models.components.block_stack import stack_blocks

        return model if self.args.unrolled else stack_blocks(model)

    def tsync(self, _out=None) -> None:
        import torch

        if self.dev == "cuda":
            torch.cuda.synchronize()

    @staticmethod
    def jsync(out) -> None:
        import jax

        jax.block_until_ready(out)

    def past_deadline(self) -> bool:
        return bool(self.args.deadline) and time.perf_counter() - T0 > self.args.deadline

    def save(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.results, indent=1, default=str))

    def error(self, where: str, e: BaseException) -> None:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
        self.results["errors"][where] = text
        log(f"ERROR {where}:\n{text}")
        self.save()

    def compare(
        self,
        family: str,
        measure: str,
        what: str,
        ours,
        ours_compile_s: float,
        eager: TorchSide,
        *,
        channels_last: bool,
        per_round: int,
        program: tuple | None = None,
    ) -> None:
        """ours: () -> meshserve's output (its program compiled in `ours_compile_s`); eager: diffusers' side.
        channels_last: ours is [B, ..., C] where diffusers' is [B, C, ...]. Checks the outputs, torch.compiles
        (unless --no-compile), times the sides in alternating rounds, prints and records the row. program:
        (fn, inputs, compiled) that `ours` runs: --variants compiles fn again, --profile reads compiled's text."""
        import numpy as np

        def to_host(side, out):
            out = to_numpy(out)
            return np.moveaxis(out, -1, 1) if channels_last and side == SIDES[0] else out

        sides = {SIDES[0]: (ours, self.jsync), SIDES[1]: (eager, self.tsync)}
        row = {"family": family, "measure": measure, "what": what, "compile_s": {"meshserve": ours_compile_s}}
        ref = to_host(SIDES[1], timed(eager, self.tsync)[1])
        got = to_host(SIDES[0], timed(ours, self.jsync)[1])
        row["rel_diff"] = rel_diff(got, ref)
        if self.compile:
            try:
                compiled = eager.compiled()
                seconds, out = timed(compiled, self.tsync)
                row["compile_s"]["torch.compile"] = seconds
                row["rel_diff_compile_vs_eager"] = rel_diff(to_host(SIDES[2], out), ref)
                timed(compiled, self.tsync)
                sides[SIDES[2]] = (compiled, self.tsync)
            except Exception as e:  # noqa: BLE001
                self.error(f"{family} {measure} torch.compile", e)
        times = alternate(sides, self.args.rounds, per_round)
        row["ms"] = {name: summary(t["all"]) | {"round_medians": t["rounds"]} for name, t in times.items()}
        ours_rounds = times[SIDES[0]]["rounds"]
        row["speedup"] = {
            name: summary([r / o for r, o in zip(times[name]["rounds"], ours_rounds, strict=True)])
            for name in sides
            if name != SIDES[0]
        }
        if self.args.profile:
            self.profile(row, sides, program[2].as_text() if program else None)
        if self.args.variants and program is not None:
            self.variants(row, ours, *program[:2])
        self.results["rows"].append(row)
        self.save()
        print(table_row(row), flush=True)

    def compare_one_side_at_a_time(
        self, family: str, measure: str, what: str, load_ours, load_theirs
    ) -> None:
        """compare() for a measure whose two sides do not fit the card together (FLUX.1-dev's whole generation on
        an 80 GB H100): diffusers' side is loaded, checked and timed (`--rounds` x 1 calls, eager only), then
        freed, and only then ours: torch hands its memory back to the driver (empty_cache), JAX's allocator keeps
        what it took, so ours goes second. The rounds do not alternate: the row says "one side at a time" and
        its speed-up is the ratio of the two medians."""
        import numpy as np

        theirs = load_theirs()
        ref = to_numpy(timed(theirs, self.tsync)[1])
        their_ms = [timed(theirs, self.tsync)[0] * 1e3 for _ in range(self.args.rounds)]
        del theirs
        free_memory(self)
        ours = load_ours()
        seconds, got = timed(ours, self.jsync)  # compiles its programs
        row = {"family": family, "measure": measure, "what": what + "; one side at a time"}
        row["compile_s"] = {"meshserve": seconds}
        row["rel_diff"] = rel_diff(to_numpy(got), ref)
        our_ms = [timed(ours, self.jsync)[0] * 1e3 for _ in range(self.args.rounds)]
        row["ms"] = {SIDES[0]: summary(our_ms), SIDES[1]: summary(their_ms)}
        ratio = float(np.median(their_ms) / np.median(our_ms))
        row["speedup"] = {SIDES[1]: {"median": ratio, "min": ratio, "max": ratio, "n": 1}}
        self.results["rows"].append(row)
        self.save()
        print(table_row(row), flush=True)

    def variants(self, row: dict, ours, fn, inputs) -> None:
        """--variants: our program compiled again with each variant's XLA options (`compiler_options`, so one
        process and one checkpoint serve every variant), its output checked against the default's, and timed
        against the default in alternating rounds. Kept in the row as "variants"."""
        import numpy as np

        row["variants"] = {}
        reference = to_numpy(timed(ours, self.jsync)[1])
        for name, options in self.args.variants.items():
            try:
                compiled, seconds = jit_compiled(fn, *inputs, family=row["family"], compiler_options=options)
                run = partial(compiled, *inputs)
                diff = rel_diff(to_numpy(timed(run, self.jsync)[1]), reference)
                times = alternate(
                    {"default": (ours, self.jsync), name: (run, self.jsync)},
                    self.args.rounds,
                    self.args.per_round,
                )
            except Exception as e:  # noqa: BLE001
                self.error(f"{row['family']} {row['measure']} variant {name}", e)
                continue
            ratios = [d / v for d, v in zip(times["default"]["rounds"], times[name]["rounds"], strict=True)]
            result = {
                "options": options,
                "compile_s": seconds,
                "rel_diff_vs_default": diff,
                "ms": summary(times[name]["all"]),
                "default_ms": summary(times["default"]["all"]),
                "speedup": summary(ratios),
            }
            row["variants"][name] = result
            print(
                f"| {row['family']} | {row['measure']} | variant {name} {options} | {_ms(result['ms'])} "
                f"against {_ms(result['default_ms'])} | **{np.median(ratios):.2f}x** | {diff:.1e} |",
                flush=True,
            )

    def profile(self, row: dict, sides: dict, hlo: str | None) -> None:
        """--profile N: each side's device kernels over N more calls (bench/kernel_profile.py), printed and kept
        in the row (categories and the 40 longest kernels); hlo: our compiled program's text, which says what
        each of our kernels named after a fusion computes and where in the code it comes from."""
        from bench.kernel_profile import annotate, by_category, jax_kernels, report, torch_kernels

        try:
            profiles = {
                name: (jax_kernels if name == SIDES[0] else torch_kernels)(fn, self.args.profile)
                for name, (fn, _sync) in sides.items()
            }
        except Exception as e:  # noqa: BLE001
            self.error(f"{row['family']} {row['measure']} profile", e)
            return
        if hlo:
            annotate(profiles[SIDES[0]], hlo)
        print(f"\n{row['family']} {row['measure']}: device kernels\n\n{report(profiles)}", flush=True)
        row["profile"] = {
            name: {
                "per_call_ms": p["per_call_ms"],
                "categories": by_category(p),
                "kernels": dict(sorted(p["kernels"].items(), key=lambda kv: -kv[1]["ms"])[:40]),
            }
            for name, p in profiles.items()
        }


class TorchSide:
    """diffusers' side of a measure: `fn(model)` with the eager model, and `compiled()` the same with
    torch.compile(model) (compiled on its first call). `model`: a module (torch.compile compiles its forward)
    or a function (the VAE's decode)."""

    def __init__(self, fn, model):
        self.fn, self.model = fn, model

    def __call__(self):
        import torch

        with torch.inference_mode():
            return self.fn(self.model)

    def compiled(self):
        import torch

        target = torch.compile(self.model)

        def run():
            with torch.inference_mode():
                return self.fn(target)

        return run


def timed(fn, sync) -> tuple[float, object]:
    """(seconds, output) of one call between device synchronisations."""
    sync(None)
    t = time.perf_counter()
    out = fn()
    sync(out)
    return time.perf_counter() - t, out


def alternate(sides: dict, rounds: int, per_round: int) -> dict:
    """name -> {"all": ms of every call, "rounds": each round's median}; the sides' order rotates per round."""
    names = list(sides)
    times = {name: {"all": [], "rounds": []} for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, sync = sides[name]
            ms = [timed(fn, sync)[0] * 1e3 for _ in range(per_round)]
            times[name]["all"] += ms
            times[name]["rounds"].append(statistics.median(ms))
    return times


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def rel_diff(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    import numpy as np

    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"outputs of different shapes: {got.shape} vs {ref.shape}")
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def to_numpy(x):
    """A JAX array or a torch tensor (any float dtype, any device) as float32 numpy."""
    import numpy as np

    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


HEADER = (
    "| family | measure | meshserve | diffusers eager | diffusers torch.compile | eager / meshserve "
    "| torch.compile / meshserve | max rel diff vs eager: ours, torch.compile |\n|---|---|---|---|---|---|---|---|"
)


def _ms(s: dict | None) -> str:
    if s is None:
        return "n/a"
    fmt = ".1f" if s["median"] >= 10 else ".2f"
    return f"{s['median']:{fmt}} ms ({s['min']:{fmt}}-{s['max']:{fmt}})"


def _ratio(s: dict | None) -> str:
    return "n/a" if s is None else f"**{s['median']:.2f}x** ({s['min']:.2f}-{s['max']:.2f})"


def table_row(row: dict) -> str:
    ms, up = row["ms"], row["speedup"]
    diff = f"{row['rel_diff']:.1e}"
    if "rel_diff_compile_vs_eager" in row:
        diff += f", {row['rel_diff_compile_vs_eager']:.1e}"
    cells = [
        row["family"],
        f"{row['measure']}: {row['what']}",
        _ms(ms.get(SIDES[0])),
        _ms(ms.get(SIDES[1])),
        _ms(ms.get(SIDES[2])),
        _ratio(up.get(SIDES[1])),
        _ratio(up.get(SIDES[2])),
        diff,
    ]
    return "| " + " | ".join(cells) + " |"


def env_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import jax
    import torch

    info = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "python": platform.python_version(),
    }
    for name in (
        "jax",
        "jaxlib",
        "jax-cuda12-plugin",
        "jax-cuda13-plugin",
        "flax",
        "torch",
        "diffusers",
        "numpy",
    ):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            pass
    info["jax_backend"] = jax.default_backend()
    info["jax_devices"] = [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()]
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["cudnn_torch"] = torch.backends.cudnn.version()
        info["torch_tf32"] = {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        }
    else:
        from bench.compare_harness import cpu_name

        info["device"] = f"CPU: {cpu_name()}, {os.cpu_count()} cores (no GPU)"
    info["jax_default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
    return info


# --------------------------------------------------------------------------------------------------
# Weights: one random checkpoint folder, read by both sides


def scratch_dir(nbytes: int) -> Path:
    """A new folder for a checkpoint of `nbytes`: in /dev/shm (memory) when it has twice that free."""
    shm = Path("/dev/shm")
    if shm.is_dir():
        stat = os.statvfs(shm)
        if stat.f_bavail * stat.f_frsize > 2 * nbytes:
            return Path(tempfile.mkdtemp(prefix="meshserve-gpu-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="meshserve-gpu-bench-"))


def twin(bench: Bench, torch_cls, config: dict, build_dtype, dtype, load_ours, denoiser: bool = True):
    """(ours, diffusers') copies of one random model: diffusers builds it in `build_dtype` (seed 0) and saves it;
    diffusers' from_pretrained(torch_dtype=dtype) and our `load_ours(folder, dtype, settings)` read the folder.
    A denoiser of ours is quantized as a pool with `quantize: --quantize` stores it (diffusers' stays bf16)."""
    import jax.numpy as jnp
    import torch

    from meshserve.models.attention import AttentionSettings

    t = time.perf_counter()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype)  # a 12B model built in fp32 would not fit beside ours
    try:
        with torch.device(bench.dev):
            model = torch_cls(**config)
    finally:
        torch.set_default_dtype(default)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    folder = scratch_dir(nbytes)
    try:
        model.save_pretrained(str(folder / "model"))
        del model
        free_memory(bench)
        ref = torch_cls.from_pretrained(str(folder / "model"), torch_dtype=dtype)
        ref = ref.to(bench.dev).eval().requires_grad_(False)
        settings = AttentionSettings(kernel=bench.args.kernel)
        if denoiser and bench.args.quantize != "none":
            import jax

            from meshserve.models.components.quantize import activation_mode, load_quantized

            mode = bench.args.quantize
            activations = activation_mode(mode, None, jax.devices()[:1])
            bench.results["quantize"] = {"mode": mode, "activations": activations}
            load_ours = partial(load_quantized, load_ours, place=None, mode=mode, activations=activations)
        ours = load_ours(
            folder / "model", dtype=jnp.dtype(str(dtype).removeprefix("torch.")), settings=settings
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log(
        f"{torch_cls.__name__}: {nbytes / 1e9:.2f} GB random weights, both sides loaded in {time.perf_counter() - t:.0f} s"
    )
    return ours, ref


def free_memory(bench: Bench) -> None:
    import torch

    gc.collect()
    if bench.dev == "cuda":
        torch.cuda.empty_cache()


# What XLA:GPU calls for an fp8 dot (cuBLASLt); issue 24: check what the dots lower to, not only their dtype.
FP8_GEMM = "__cublas$lt$matmul$f8"


def served_options(family: str) -> dict:
    """The XLA options a pool of `family` compiles its programs with on this backend (the family's
    `gpu_xla_options` on a GPU), so that our side is compiled as served."""
    import jax

    from meshserve.models.engine.programs import compiler_options
    from meshserve.models.flux.pipeline import FluxPipeline
    from meshserve.models.sdxl.pipeline import StableDiffusionXLPipeline
    from meshserve.models.wan.pipeline import WanPipeline

    cls = {"flux": FluxPipeline, "sdxl": StableDiffusionXLPipeline}.get(family, WanPipeline)
    return compiler_options(cls.gpu_xla_options, jax.devices()[0].platform, None) or {}


def log_memory(name: str, compiled) -> None:
    """The compiled program's memory analysis: its arguments (weights and inputs) and the temporaries it
    allocates on top. The FLUX.1-dev fp8 generation's denoise program asked for one buffer of 8.5 GiB on an H100
    (2026-11-27), about the size of its e4m3 kernels, which the profile of a step never shows."""
    try:
        m = compiled.memory_analysis()
        log(
            f"{name}: memory arguments {m.argument_size_in_bytes / 2**30:.2f} GiB, temporaries "
            f"{m.temp_size_in_bytes / 2**30:.2f} GiB, outputs {m.output_size_in_bytes / 2**30:.2f} GiB"
        )
    except Exception as e:  # noqa: BLE001  (a backend without the analysis)
        log(f"{name}: no memory analysis ({e})")


def jit_compiled(fn, *inputs, family: str, compiler_options: dict | None = None):
    """(compiled fn, seconds) of jax.jit(fn) for these inputs, with `family`'s served options (under
    `compiler_options`). A program that holds e4m3 arrays (--quantize fp8) logs how many fp8 GEMMs it calls:
    none means its dots run upcast."""
    import jax

    compiler_options = served_options(family) | (compiler_options or {})
    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*inputs).compile(compiler_options=compiler_options)
    seconds = time.perf_counter() - t
    log_memory(getattr(fn, "__name__", str(fn)), compiled)
    hlo = compiled.as_text()
    if "f8e4m3fn" in hlo:
        # Every custom call's target with its count too: where the dots went if not to FP8_GEMM.
        targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
        counts = {name: targets.count(name) for name in sorted(set(targets))}
        log(
            f"{getattr(fn, '__name__', fn)}: {hlo.count(FP8_GEMM)} calls of {FP8_GEMM}; custom calls {counts}"
        )
    return compiled, seconds


def denoise_program(graph, scheduler, make_model, do_cfg: bool):
    """meshserve's denoise program: models/engine/denoise_loop.py's loop around `make_model(module, cond)`
    (the closure the family's pipeline builds), the per-step callback compiled in as the pipelines have it."""
    from flax import nnx

    from meshserve.models.engine.denoise_loop import StepReporter, denoise_loop
    from meshserve.models.engine.seeds import row_keys

    reporter = StepReporter()

    def program(state, schedule, latents, key_data, guidance, cond):
        model = make_model(nnx.merge(graph, state), cond)
        out, _ = denoise_loop(
            model, scheduler, schedule, latents, row_keys(key_data), guidance, do_cfg=do_cfg, on_step=reporter
        )
        return out

    return program


def diffusers_loop(scheduler, latents, predict, guidance: float | None, **timesteps):
    """A diffusers pipeline's denoising loop, written out: set_timesteps as the pipeline calls it (on the latents'
    device), set_begin_index(0) (as the pipelines: no device sync at the first step), then per timestep
    `predict(latents, t)`, the model call or calls (with `guidance`: the pair (uncond, cond), combined as
    uncond + guidance (cond - uncond)), and scheduler.step."""
    scheduler.set_timesteps(device=latents.device, **timesteps)
    scheduler.set_begin_index(0)
    for t in scheduler.timesteps:
        out = predict(latents, t)
        if guidance is not None:
            uncond, cond = out
            out = uncond + guidance * (cond - uncond)
        latents = scheduler.step(out, t, latents, return_dict=False)[0]
    return latents


def padded_schedule(scheduler, steps: int, **options):
    """The schedule as the pipelines pass it: padded to MAX_STEPS (one program for every step count)."""
    from meshserve.models.engine.pipeline import MAX_STEPS
    from meshserve.models.schedulers import pad_schedule

    return pad_schedule(scheduler.schedule(steps, **options), MAX_STEPS)


def family_setup(args, name: str) -> dict:
    spec = dict(FAMILIES[name])
    if args.tiny:
        tiny = TINY[name]
        spec.update(model=dict(spec["model"], **tiny["model"]), vae=dict(spec["vae"], **tiny["vae"]))
        spec.update({part: dict(spec[part], **tiny[part]) for part in ("clip", "t5") if part in tiny})
        spec.update(latent=tiny["latent"], text=tiny["text"], steps=TINY_STEPS)
    if args.steps:
        spec["steps"] = args.steps
    return spec


def wanted(bench: Bench, family: str, measure: str) -> bool:
    if measure not in bench.args.measures:
        return False
    if bench.past_deadline():
        bench.results["errors"][f"{family} {measure}"] = "skipped: --deadline passed"
        log(f"{family} {measure}: skipped, --deadline passed")
        return False
    return True


# --------------------------------------------------------------------------------------------------
# The families


def flux_denoiser(bench: Bench, spec: dict) -> None:
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler as TorchScheduler
    from diffusers import FluxTransformer2DModel as TorchFlux
    from flax import nnx

    from meshserve.models.flux.random_tiny import SCHEDULER  # FLUX.1-dev's scheduler_config.json
    from meshserve.models.flux.transformer_flux import flux_rope, image_ids, load_flux_transformer, round_to
    from meshserve.models.schedulers import FlowMatchEulerDiscreteScheduler, flux_mu

    args, dev, bf16 = bench.args, bench.dev, jnp.bfloat16
    cfg, (lh, lw), text, steps, g = (
        spec["model"],
        spec["latent"],
        spec["text"],
        spec["steps"],
        spec["guidance"],
    )
    gh, gw = lh // 2, lw // 2  # the 2x2 packing
    tokens = gh * gw
    ours, ref = twin(bench, TorchFlux, cfg, torch.bfloat16, torch.bfloat16, load_flux_transformer)
    graph, state = nnx.split(bench.as_served(ours))
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((1, tokens, cfg["in_channels"])).astype(np.float32)
    emb_np = rng.standard_normal((1, text, cfg["joint_attention_dim"])).astype(np.float32)
    pooled_np = rng.standard_normal((1, cfg["pooled_projection_dim"])).astype(np.float32)
    x, emb, pooled = (jnp.asarray(a, bf16) for a in (x_np, emb_np, pooled_np))
    guidance = jnp.full((1,), g, jnp.float32)
    ids = np.concatenate([np.zeros((text, 3), np.float32), image_ids(gh, gw)])
    rope = tuple(jnp.asarray(a) for a in flux_rope(ids, cfg["axes_dims_rope"]))
    tx, temb, tpooled = (torch.from_numpy(a).to(dev, torch.bfloat16) for a in (x_np, emb_np, pooled_np))
    tg = torch.full((1,), g, device=dev, dtype=torch.float32)
    img_ids, txt_ids = torch.from_numpy(image_ids(gh, gw)).to(dev), torch.zeros(text, 3, device=dev)

    def transformer(m, latents, timestep):  # FluxPipeline's call
        return m(
            hidden_states=latents,
            timestep=timestep,
            guidance=tg,
            pooled_projections=tpooled,
            encoder_hidden_states=temb,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    what = f"transformer, batch 1, {tokens} + {text} tokens"
    if wanted(bench, "flux", "step"):
        try:

            def fwd(state, x, emb, pooled, t, rope, guidance):
                return nnx.merge(graph, state)(x, emb, pooled, t, rope, guidance)

            inputs = (state, x, emb, pooled, jnp.full((1,), 0.5, jnp.float32), rope, guidance)
            step, seconds = jit_compiled(fwd, *inputs, family="flux")
            tt = torch.full((1,), 0.5, device=dev, dtype=torch.bfloat16)
            bench.compare(
                "flux",
                "step",
                what,
                lambda: step(*inputs),
                seconds,
                TorchSide(lambda m: transformer(m, tx, tt), ref),
                channels_last=False,
                per_round=args.per_round,
                program=(fwd, inputs, step),
            )
        except Exception as e:  # noqa: BLE001
            bench.error("flux step", e)
    if wanted(bench, "flux", "program"):
        try:
            config = {"_class_name": "FlowMatchEulerDiscreteScheduler", **SCHEDULER}
            sched = FlowMatchEulerDiscreteScheduler.from_config(config)
            mu = flux_mu(tokens, config)

            def make_model(module, cond):  # models/flux/pipeline.py FluxPipeline.denoiser
                emb, pooled, rope, guidance = cond

                def model(x, t, i=None):  # i: the step (read by none of these)
                    timestep = jnp.broadcast_to(round_to(round_to(t, bf16) / 1000, bf16), (x.shape[0],))
                    return module(x, emb, pooled, timestep, rope, guidance)

                return model

            program = denoise_program(graph, sched, make_model, do_cfg=False)
            inputs = (
                state,
                padded_schedule(sched, steps, mu=mu, pipeline_sigmas=True),
                x,
                np.zeros((1, 2), np.uint32),
                jnp.ones((1,)),
                (emb, pooled, rope, guidance),
            )
            compiled, seconds = jit_compiled(program, *inputs, family="flux")
            tsched = TorchScheduler(**SCHEDULER)
            sigmas = np.linspace(1.0, 1 / steps, steps)

            # FluxPipeline: timestep = t.expand(B).to(latents.dtype), the model at timestep / 1000.
            def predict(m, latents, t):
                return transformer(m, latents, t.expand(latents.shape[0]).to(latents.dtype) / 1000)

            loop = TorchSide(
                lambda m: diffusers_loop(tsched, tx, partial(predict, m), None, sigmas=sigmas, mu=mu), ref
            )
            bench.compare(
                "flux",
                "program",
                f"{steps} steps flow-match Euler, {what}",
                lambda: compiled(*inputs),
                seconds,
                loop,
                channels_last=False,
                per_round=1,
                program=(program, inputs, compiled),
            )
        except Exception as e:  # noqa: BLE001
            bench.error("flux program", e)


def sdxl_denoiser(bench: Bench, spec: dict) -> None:
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import EulerDiscreteScheduler as TorchScheduler
    from diffusers import UNet2DConditionModel as TorchUNet
    from flax import nnx

    from meshserve.models.engine.denoise_loop import interleave
    from meshserve.models.schedulers import make_scheduler
    from meshserve.models.sdxl.unet_2d_condition import load_unet

    args, dev, bf16 = bench.args, bench.dev, jnp.bfloat16
    cfg, (lh, lw), text, steps, g = (
        spec["model"],
        spec["latent"],
        spec["text"],
        spec["steps"],
        spec["guidance"],
    )
    ours, ref = twin(bench, TorchUNet, cfg, torch.bfloat16, torch.bfloat16, load_unet)
    graph, state = nnx.split(ours)
    rng = np.random.default_rng(0)
    pooled_dim = cfg["projection_class_embeddings_input_dim"] - 6 * cfg["addition_time_embed_dim"]
    x_np = rng.standard_normal((1, cfg["in_channels"], lh, lw)).astype(np.float32)
    # CFG rows [negative, positive]
    ctx_np = rng.standard_normal((2, text, cfg["cross_attention_dim"])).astype(np.float32)
    pooled_np = rng.standard_normal((2, pooled_dim)).astype(np.float32)
    size = (8 * lh, 8 * lw)
    tids_np = np.tile(np.float32([[*size, 0, 0, *size]]), (2, 1))  # micro-conditioning, as the pipelines
    # meshserve: NHWC latents in the pipeline dtype; CFG rows interleaved [u0, c0] (for one image: [neg, pos]).
    x = jnp.asarray(x_np.transpose(0, 2, 3, 1), bf16)
    ctx, pooled, tids = (jnp.asarray(a, bf16) for a in (ctx_np, pooled_np, tids_np))
    tx = torch.from_numpy(x_np).to(dev, torch.bfloat16)
    tctx, tpooled, ttids = (torch.from_numpy(a).to(dev, torch.bfloat16) for a in (ctx_np, pooled_np, tids_np))

    def unet(m, latents, t):  # StableDiffusionXLPipeline's call
        added = {"text_embeds": tpooled, "time_ids": ttids}
        return m(latents, t, encoder_hidden_states=tctx, added_cond_kwargs=added, return_dict=False)[0]

    what = f"UNet, CFG batch 2, {lh}x{lw} latents, {text} text tokens"
    if wanted(bench, "sdxl", "step"):
        try:

            def fwd(state, x, t, ctx, pooled, tids):
                return nnx.merge(graph, state)(x, t, ctx, text_embeds=pooled, time_ids=tids)

            inputs = (state, interleave(x, x), jnp.full((2,), 500.0, jnp.float32), ctx, pooled, tids)
            step, seconds = jit_compiled(fwd, *inputs, family="sdxl")
            tt = torch.tensor(500.0, device=dev)
            bench.compare(
                "sdxl",
                "step",
                what,
                lambda: step(*inputs),
                seconds,
                TorchSide(lambda m: unet(m, torch.cat([tx, tx]), tt), ref),
                channels_last=True,
                per_round=args.per_round,
                program=(fwd, inputs, step),
            )
        except Exception as e:  # noqa: BLE001
            bench.error("sdxl step", e)
    if wanted(bench, "sdxl", "program"):
        try:
            sched = make_scheduler(None, SDXL_SCHEDULER)
            schedule = padded_schedule(sched, steps)
            x0 = x * jnp.asarray(sched.init_noise_sigma(schedule), bf16)

            def make_model(module, cond):  # models/sdxl/pipeline.py SDXLPipeline.denoiser
                ctx, pooled, tids = cond

                def model(x, t, i=None):  # i: the step (read by none of these)
                    return module(
                        x, jnp.broadcast_to(t, (x.shape[0],)), ctx, text_embeds=pooled, time_ids=tids
                    )

                return model

            program = denoise_program(graph, sched, make_model, do_cfg=True)
            inputs = (
                state,
                schedule,
                x0,
                np.zeros((1, 2), np.uint32),
                jnp.full((1,), g),
                (ctx, pooled, tids),
            )
            compiled, seconds = jit_compiled(program, *inputs, family="sdxl")
            tsched = TorchScheduler.from_config(SDXL_SCHEDULER)
            tsched.set_timesteps(steps, device=dev)
            tx0 = tx * tsched.init_noise_sigma  # prepare_latents

            def rows(m, latents, t):  # StableDiffusionXLPipeline: one call on the CFG batch -> (uncond, cond)
                return unet(m, tsched.scale_model_input(torch.cat([latents] * 2), t), t).chunk(2)

            loop = TorchSide(
                lambda m: diffusers_loop(tsched, tx0, partial(rows, m), g, num_inference_steps=steps), ref
            )
            bench.compare(
                "sdxl",
                "program",
                f"{steps} steps Euler, {what}",
                lambda: compiled(*inputs),
                seconds,
                loop,
                channels_last=True,
                per_round=1,
                program=(program, inputs, compiled),
            )
        except Exception as e:  # noqa: BLE001
            bench.error("sdxl program", e)


def wan_denoiser(bench: Bench, spec: dict, family: str = "wan") -> None:
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import UniPCMultistepScheduler as TorchScheduler
    from diffusers import WanTransformer3DModel as TorchWan
    from flax import nnx

    from meshserve.models.engine.denoise_loop import interleave
    from meshserve.models.schedulers import make_scheduler
    from meshserve.models.wan.random_tiny import SCHEDULER  # Wan 2.1's scheduler_config.json
    from meshserve.models.wan.transformer_wan import load_wan_transformer

    args, dev, bf16 = bench.args, bench.dev, jnp.bfloat16
    cfg, (f, h, w), text, steps, g = (
        spec["model"],
        spec["latent"],
        spec["text"],
        spec["steps"],
        spec["guidance"],
    )
    tokens = f * (h // 2) * (w // 2)
    # Built and saved fp32 (as the released checkpoint; wan14b: bf16), read in bf16: both sides keep
    # _keep_in_fp32_modules fp32.
    build = getattr(torch, spec.get("build", "float32"))
    ours, ref = twin(bench, TorchWan, cfg, build, torch.bfloat16, load_wan_transformer)
    rope = tuple(jnp.asarray(a) for a in ours.rope(f, h, w))
    graph, state = nnx.split(bench.as_served(ours))
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((1, cfg["in_channels"], f, h, w)).astype(np.float32)
    ctx_np = rng.standard_normal((2, text, cfg["text_dim"])).astype(np.float32)  # [negative, positive]
    x = jnp.asarray(x_np.transpose(0, 2, 3, 4, 1))  # fp32 latents, as both pipelines keep them
    ctx = jnp.asarray(ctx_np, bf16)
    tx = torch.from_numpy(x_np).to(dev)
    tneg, tpos = (torch.from_numpy(a[None]).to(dev, torch.bfloat16) for a in ctx_np)

    def cfg_calls(m, latents, t):  # WanPipeline: two calls of batch 1 -> (uncond, cond)
        x_in, timestep = latents.to(torch.bfloat16), t.expand(latents.shape[0])
        cond = m(hidden_states=x_in, timestep=timestep, encoder_hidden_states=tpos, return_dict=False)[0]
        uncond = m(hidden_states=x_in, timestep=timestep, encoder_hidden_states=tneg, return_dict=False)[0]
        return uncond, cond

    def make_model(module, cond):  # models/wan/pipeline.py WanPipeline.denoiser
        ctx, rope = cond

        def model(x, t, i=None):  # i: the step (unused)
            return module(x.astype(bf16), jnp.broadcast_to(t, (x.shape[0],)), ctx, rope)

        return model

    what = f"transformer, CFG (2 rows), {tokens} + {text} tokens"
    if wanted(bench, family, "step"):
        try:

            def fwd(state, x, t, ctx, rope):
                return make_model(nnx.merge(graph, state), (ctx, rope))(x, t)

            inputs = (state, interleave(x, x), jnp.float32(500.0), ctx, rope)
            step, seconds = jit_compiled(fwd, *inputs, family=family)
            tt = torch.tensor(500, device=dev)
            bench.compare(
                family,
                "step",
                what,
                lambda: step(*inputs),
                seconds,
                TorchSide(lambda m: torch.cat(cfg_calls(m, tx, tt)), ref),
                channels_last=True,
                per_round=args.per_round,
                program=(fwd, inputs, step),
            )
        except Exception as e:  # noqa: BLE001
            bench.error(f"{family} step", e)
    if wanted(bench, family, "program"):
        try:
            sched = make_scheduler(None, {"_class_name": "UniPCMultistepScheduler", **SCHEDULER})
            program = denoise_program(graph, sched, make_model, do_cfg=True)
            inputs = (
                state,
                padded_schedule(sched, steps),
                x,
                np.zeros((1, 2), np.uint32),
                jnp.full((1,), g),
                (ctx, rope),
            )
            compiled, seconds = jit_compiled(program, *inputs, family=family)
            tsched = TorchScheduler(**SCHEDULER)

            loop = TorchSide(
                lambda m: diffusers_loop(tsched, tx, partial(cfg_calls, m), g, num_inference_steps=steps), ref
            )
            bench.compare(
                family,
                "program",
                f"{steps} steps UniPC, {what}",
                lambda: compiled(*inputs),
                seconds,
                loop,
                channels_last=True,
                per_round=1,
                program=(program, inputs, compiled),
            )
        except Exception as e:  # noqa: BLE001
            bench.error(f"{family} program", e)


def vae_decode(bench: Bench, family: str, spec: dict) -> None:
    """The VAE decode of one latent image (Flux, SDXL: AutoencoderKL) or video (Wan: AutoencoderKLWan), in
    --vae-dtype (float32: as meshserve's pipelines decode)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLWan
    from flax import nnx

    from meshserve.models.components.autoencoder_kl import load_autoencoder_kl
    from meshserve.models.wan.autoencoder_kl_wan import load_autoencoder_kl_wan

    config, latent, name = spec["vae"], spec["latent"], bench.args.vae_dtype
    dtype = getattr(torch, name)
    if family.startswith("wan"):
        ours, ref = twin(
            bench, AutoencoderKLWan, config, torch.float32, dtype, load_autoencoder_kl_wan, denoiser=False
        )
        channels, (f, h, w) = config["z_dim"], latent
        what = f"1x{f}x{h}x{w} -> {1 + 4 * (f - 1)} frames of {8 * h}x{8 * w}, {name}"
    else:
        ours, ref = twin(
            bench, AutoencoderKL, config, torch.float32, dtype, load_autoencoder_kl, denoiser=False
        )
        channels, factor = config["latent_channels"], 2 ** (len(config["block_out_channels"]) - 1)
        what = f"1x{latent[0]}x{latent[1]} -> {latent[0] * factor}x{latent[1] * factor}, {name}"
    graph, state = nnx.split(ours)
    z_np = np.random.default_rng(1).standard_normal((1, channels, *latent)).astype(np.float32)
    z = jnp.asarray(np.moveaxis(z_np, 1, -1), jnp.dtype(name))
    tz = torch.from_numpy(z_np).to(bench.dev, dtype)

    def decode(state, z):
        return nnx.merge(graph, state).decode(z)

    compiled, seconds = jit_compiled(decode, state, z, family=family)
    bench.compare(
        family,
        "vae",
        what,
        lambda: compiled(state, z),
        seconds,
        TorchSide(lambda decode: decode(tz), lambda z: ref.decode(z, return_dict=False)[0]),
        channels_last=True,
        per_round=bench.args.per_round,
        program=(decode, (state, z), compiled),
    )


def flux_generation(bench: Bench, spec: dict) -> None:
    """FLUX.1-dev's whole generation, as a user calls each pipeline: the prompt through CLIP-L and T5-XXL
    (`text` tokens), `steps` steps of the transformer, the VAE decode to pixels ("np": floats on the host), at
    the family's shape, from the same packed latents; our pipeline (load_pipeline, bf16, `--quantize`) against
    diffusers' FluxPipeline (bf16) on one random checkpoint folder that diffusers writes (every model built in
    bf16 on the device; the tokenizers are the tiny ones of the tests, whose ids the real-size embedding tables
    take). Issue 24's target: 28 steps at 1024x1024 under 3.5 s on an H100. Both pipelines sit on the card at
    once (about 34 GB of weights each, and our fp8 denoise program asked for 8.5 GiB more): an H200;
    `--one-side-at-a-time` (an 80 GB H100) times diffusers first, frees it, then loads and times ours."""
    import numpy as np
    import torch
    from diffusers import FluxPipeline

    from meshserve.models import load_pipeline

    args, dev = bench.args, bench.dev
    (lh, lw), text, steps, g = spec["latent"], spec["text"], spec["steps"], spec["guidance"]
    factor = 2 ** (len(spec["vae"]["block_out_channels"]) - 1)  # the VAE's: 8 at the real config
    height, width = factor * lh, factor * lw
    packed = np.random.default_rng(0).standard_normal((1, (lh // 2) * (lw // 2), 64)).astype(np.float32)
    call = dict(height=height, width=width, num_inference_steps=steps, guidance_scale=g, output_type="np")
    call |= dict(max_sequence_length=text)
    prompt = "a red circle on a blue background"
    what = f"{steps} steps at {height}x{width}: CLIP + T5 ({text} tokens), transformer, VAE decode, to host"
    quantize = None if args.quantize == "none" else args.quantize

    def load_theirs(ckpt):
        ref = FluxPipeline.from_pretrained(str(ckpt), torch_dtype=torch.bfloat16).to(dev)
        ref.set_progress_bar_config(disable=True)
        tlatents = torch.from_numpy(packed).to(dev, torch.bfloat16)
        base = ref.transformer

        def theirs(transformer):
            ref.transformer = transformer
            try:
                return ref(prompt, latents=tlatents, **call).images
            finally:
                ref.transformer = base

        return TorchSide(theirs, base)

    programs = []  # our pipeline's compiled programs, for their temporaries (logged at the end, or at a failure)

    def load_ours(ckpt):
        ours = load_pipeline(ckpt, dtype="bfloat16", quantize=quantize, scan_blocks=not args.unrolled)
        programs.append(ours.programs)
        return lambda: ours(prompt, latents=packed, **call).images

    try:
        generation(bench, spec, what, load_ours, load_theirs)
    finally:
        for p in programs:
            temps = ", ".join(f"{stage} {n / 2**30:.2f} GiB" for stage, n in p.temp_bytes.items())
            log(f"our pipeline's programs, temporaries per device: {temps}")


def generation(bench: Bench, spec: dict, what: str, load_ours, load_theirs) -> None:
    """flux_generation's checkpoint and comparison: the folder written once, both sides loaded from it
    (together, or one at a time), the folder removed."""
    import torch

    from bench.flux_vs_diffusers import write_checkpoint

    args, dev = bench.args, bench.dev
    t = time.perf_counter()
    folder = scratch_dir(40 * 10**9 if not args.tiny else 10**8)
    try:
        parts = {part: spec[part] for part in ("vae", "clip", "t5")}
        ckpt = write_checkpoint(folder, spec["model"], **parts, dtype=torch.bfloat16, device=dev)
        free_memory(bench)
        if args.one_side_at_a_time:
            bench.compare_one_side_at_a_time(
                "flux", "generation", what, partial(load_ours, ckpt), partial(load_theirs, ckpt)
            )
            return
        theirs, run_ours = load_theirs(ckpt), load_ours(ckpt)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log(
        f"FLUX.1-dev pipeline ({spec['t5']['num_layers']}-layer T5): both sides loaded in {time.perf_counter() - t:.0f} s"
    )
    seconds = timed(run_ours, bench.jsync)[0]  # compiles its three programs
    bench.compare("flux", "generation", what, run_ours, seconds, theirs, channels_last=False, per_round=1)


GENERATIONS = {"flux": flux_generation}


def parse_variants(text: str) -> dict[str, dict]:
    """'notriton:xla_gpu_enable_triton_gemm=false;nocmd:xla_gpu_enable_command_buffer=' -> {name: options}."""
    variants: dict[str, dict] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, settings = part.partition(":")
        options: dict = {}
        for setting in filter(None, (x.strip() for x in settings.split(","))):
            key, _, value = setting.partition("=")
            low = value.lower()
            options[key] = (
                low == "true" if low in ("true", "false") else int(value) if value.isdigit() else value
            )
        variants[name.strip()] = options
    return variants


DENOISERS = {
    "flux": flux_denoiser,
    "sdxl": sdxl_denoiser,
    "wan": wan_denoiser,
    "wan14b": partial(wan_denoiser, family="wan14b"),
}


def run_family(bench: Bench, family: str) -> None:
    """The family's step and program on one pair of denoisers, then its VAE, then its whole generation (each
    freed before the next)."""
    spec = family_setup(bench.args, family)
    parts = (
        (("step", "program"), lambda: DENOISERS[family](bench, spec)),
        (("vae",), lambda: vae_decode(bench, family, spec)),
        (("generation",), lambda: GENERATIONS[family](bench, spec)),
    )
    if "generation" in bench.args.measures and family not in GENERATIONS:
        bench.results["errors"][f"{family} generation"] = (
            f"no generation measure (only {sorted(GENERATIONS)})"
        )
    for measures, run in parts:
        if measures == ("generation",) and family not in GENERATIONS:
            continue
        if not any([wanted(bench, family, m) for m in measures]):
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001
            bench.error(f"{family} {'/'.join(measures)}", e)
        free_memory(bench)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--stages", default="flux,sdxl,wan", help="families, comma-separated: flux, sdxl, wan, wan14b"
    )
    ap.add_argument(
        "--measures",
        default="step,program,vae",
        help="comma-separated: step, program, vae, generation (Flux: the whole pipeline)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (median, min-max)")
    ap.add_argument("--per-round", type=int, default=3, help="calls of each side per round (step, vae)")
    ap.add_argument(
        "--steps", type=int, default=0, help="denoise program steps (default: 28 / 30 / 50; tiny 3)"
    )
    ap.add_argument("--tiny", action="store_true", help="tiny configs and shapes: a CPU check")
    ap.add_argument("--no-compile", action="store_true", help="leave diffusers' torch.compile out")
    ap.add_argument("--vae-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--unrolled", action="store_true", help="DiT blocks unrolled (a pool's scan_blocks: false)"
    )
    ap.add_argument(
        "--kernel", default="auto", help="meshserve's attention kernel (AttentionSettings.kernel)"
    )
    ap.add_argument(
        "--quantize",
        default="none",
        choices=("none", "int8", "fp8"),
        help="our denoiser's Linear kernels as a pool's `quantize:` stores them (fp8 with activations where "
        "the GPU has fp8 dots); diffusers' stays bf16",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after the timed rounds, N more calls of each side under its profiler: device time by kernel",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="our programs compiled again with other XLA options and timed against the default: "
        "'NAME:option=value,option=value;NAME2:...' (values: true/false, integers, or strings)",
    )
    ap.add_argument(
        "--one-side-at-a-time",
        action="store_true",
        help="generation: diffusers' pipeline loaded, timed and freed before ours loads (an 80 GB card)",
    )
    ap.add_argument("--deadline", type=float, default=0, help="seconds after which no new measure starts")
    ap.add_argument("--out", help="JSON results file (rewritten after every measure)")
    args = ap.parse_args()
    args.variants = parse_variants(args.variants)
    args.stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    args.measures = [m.strip() for m in args.measures.split(",") if m.strip()]
    for name, given, known in (("stage", args.stages, DENOISERS), ("measure", args.measures, MEASURES)):
        if unknown := sorted(set(given) - set(known)):
            ap.error(f"unknown {name} {unknown}; expected {list(known)}")

    import_meshserve()
    from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

    apply_cpu_defaults()  # as meshserve runs, where JAX runs on the CPU (a no-op on a GPU host)
    from meshserve.models.engine.programs import check_compiler_options

    for name, options in args.variants.items():  # a misspelt option fails here, not after a 24 GB load
        try:
            check_compiler_options(options)
        except ValueError as e:
            ap.error(f"--variants {name}: {e}")
    bench = Bench(args)
    env = bench.results["env"]
    versions = ", ".join(f"{k} {env[k]}" for k in ("jax", "jaxlib", "flax", "torch", "diffusers") if k in env)
    header = f"{env['date_utc']} UTC, {env['device']}, JAX on {', '.join(env['jax_devices'])}; {versions}"
    if args.tiny:
        header += "; --tiny configs"
    if args.quantize != "none":
        import jax

        from meshserve.models.components.quantize import activation_mode

        rows = activation_mode(args.quantize, None, jax.devices()[:1])
        header += (
            f"; our denoisers quantize: {args.quantize} ({'activations: ' + rows if rows else 'weight-only'})"
        )
    if bench.dev == "cpu":  # bench/compare_harness.py: in one process XLA's and torch's CPU threads compete
        header += "; no GPU: a check that the script runs, its times compare nothing (both sides share the CPU threads)"
    print(header + "\n\n" + HEADER, flush=True)
    bench.save()
    for family in args.stages:
        run_family(bench, family)
    bench.results["elapsed_s"] = time.perf_counter() - T0
    bench.save()
    print(
        f"\n{header}; {args.rounds} alternating rounds, medians (min-max); speed-up: median of per-round ratios"
    )
    print(HEADER)
    for row in bench.results["rows"]:
        print(table_row(row))
    for where, text in bench.results["errors"].items():
        print(f"error: {where}: {text.strip().splitlines()[-1] if text.strip() else text}")
    print(f"elapsed {bench.results['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
