"""Bytes communicated per SDXL denoise step, per context strategy and mesh, read from the compiled program.

    python bench/denoise_comm.py                  # prints the markdown tables (5-10 minutes on 2 CPU cores)
    python bench/denoise_comm.py --write-docs     # and replaces the generated part of docs/attention.md

Model: the SDXL-shaped checkpoint of bench/sdxl_vs_diffusers.py (built once with diffusers into
.cache/bench_denoise/): SDXL's UNet layout at channels / 5, attention at the latent's 1/2 and 1/4 resolution
with heads of dim 64 (2 and 4 heads; SDXL has 10 and 20) and 2 transformer layers per attention block at both
levels (SDXL: 2 and 10), 22 self-attention calls per UNet pass. Not tests/fixtures/tiny_sdxl.py: its single
attention level with heads of dim 16 has nothing like SDXL's ratio of attention to convolution traffic, and
this model compiles in 10-25 s per program. Its 2-head level cannot run Ulysses over 4 devices, nor over 2
with tensor=2 (the rows say LayoutError; SDXL's 10 heads cannot either). Hybrid is left out: it does not
compile inside the pipeline (docs/attention.md).

For each mesh and strategy the pipeline is loaded with `load_pipeline(path, mesh=..., attention=
AttentionSettings(context_strategy=...))` and its own denoise program (`pipe._denoise` with the static settings
and input shardings `pipe.programs` compiles it with: the lax.while_loop over steps, with CFG) is lowered and
compiled from abstract inputs; nothing runs. The loop's trip count is
not known to XLA (a host callback may stop it), so the collectives inside its body are exactly one denoise
step: the UNet on the CFG batch, the guidance combine and the scheduler step. Each collective (all-gather,
all-to-all, collective-permute, all-reduce, reduce-scatter) is counted with bench/attention_memory.py's HLO
reader: bytes one device sends, averaged over the mesh, times the trip counts of the loops around it (ring
attention's loop over chunks). Collectives whose jax op sits inside the attention's shard_map are the
attention's; the rest come from XLA's partitioning of the convolutions, norms and the guidance combine.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory_analysis import host_cpu_devices, write_docs_section  # noqa: E402

host_cpu_devices(memory_minimizing=False)  # before JAX is imported

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.attention_memory import COLLECTIVES, MIB, collectives, memory_bytes  # noqa: E402
from meshserve.models import load_pipeline  # noqa: E402
from meshserve.models.attention import AttentionSettings  # noqa: E402
from meshserve.models.parallel import LayoutError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "attention.md"
START, END = "<!-- bench/denoise_comm.py: start -->", "<!-- bench/denoise_comm.py: end -->"
CACHE = ROOT / ".cache" / "bench_denoise"

# (mesh sizes, strategies); the cfg x tensor mesh without context shows what the other axes send alone.
LAYOUTS = [
    ({"context": 2}, ("ring", "ulysses", "allgather", "auto")),
    ({"context": 4}, ("ring", "ulysses", "allgather", "auto")),
    ({"cfg": 2, "tensor": 2}, ("-",)),
    ({"cfg": 2, "context": 2, "tensor": 2}, ("ring", "ulysses", "allgather", "auto")),
]


def checkpoint() -> Path:
    ckpt = CACHE / "ckpt"
    if not (ckpt / "model_index.json").is_file():
        from bench.sdxl_vs_diffusers import build_checkpoint

        build_checkpoint(CACHE)
    return ckpt


def compile_denoise_step(ckpt: Path, sizes: dict, strategy: str, size: int, weights: dict | None = None):
    """The pipeline's compiled denoise program for one CFG generation of a size x size image: the same
    function, static settings and input shardings as `pipe.programs.run("denoise", ...)`, lowered from
    abstract inputs (the schedule is the pool's padded one: the trip count stays a traced value)."""
    devices = list(range(math.prod(sizes.values())))
    settings = AttentionSettings(context_strategy="auto" if strategy == "-" else strategy)
    pipe = load_pipeline(ckpt, mesh=sizes, devices=devices, attention=settings, weights=weights)
    sched, schedule, _ = pipe.schedule(None, 1)
    latent = size // pipe.vae_scale_factor
    latent_shape = (latent, latent, pipe.unet_config.in_channels)

    def batch(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=pipe.placement.batch_spec(shape[0], len(shape)))

    cross = pipe.unet_config.cross_attention_dim
    inputs = (
        schedule,
        None,  # latents: drawn from the row's key inside the program, as a seeded request does
        batch((1, 2), jnp.uint32),  # key data
        # embeds and pooled, CFG-interleaved
        (batch((2, 77, cross), jnp.float32), batch((2, pipe.projection_dim), jnp.float32)),
        {"guidance_scale": batch((1,), jnp.float32)},  # the row fields
        batch((1,), jnp.bool_),  # the rows that run CFG
        None,  # no extras
    )
    static = {"scheduler": sched, "do_cfg": True, "shape": latent_shape}
    return jax.jit(functools.partial(pipe._denoise, **static)).lower(pipe._states["unet"], *inputs).compile()


def per_step(hlo: str) -> dict:
    """Bytes sent per device in one denoise step: by kind, inside attention and elsewhere; and op counts."""
    found = collectives(hlo)
    step = [c for c in found if c["loops"][:1] == ("jit(_denoise)/while",)]
    if any(len(c["loops"]) > 1 for c in step):
        raise RuntimeError(
            "a loop of unknown trip count inside the denoise step: bytes would be undercounted"
        )
    out = {kind: 0.0 for kind in COLLECTIVES}
    out.update(attention=0.0, elsewhere=0.0, ops=0, by_op=Counter())
    for c in step:
        sent = c["times"] * c["sent"]
        out[c["kind"]] += sent
        out["attention" if "shard_map" in c["op_name"] else "elsewhere"] += sent
        out["ops"] += c["times"]
        # "jit(_denoise)/while/body/shard_map/.../ppermute" -> "shard_map/.../ppermute"
        out["by_op"][(c["kind"], c["op_name"].split("/while/body/", 1)[-1])] += sent
    return out


def _mesh_name(sizes: dict) -> str:
    return " x ".join(f"{axis}{n}" for axis, n in sizes.items())


def table(ckpt: Path, size: int, explain: int = 0, layouts=LAYOUTS) -> list[str]:
    rows = [
        "| mesh | strategy | "
        + " | ".join(COLLECTIVES)
        + " | total | in attention | elsewhere | collectives | memory MiB |",
        "|---|---|" + "---|" * (len(COLLECTIVES) + 5),
    ]
    for sizes, strategies in layouts:
        for strategy in strategies:
            t0 = time.perf_counter()
            try:
                compiled = compile_denoise_step(ckpt, sizes, strategy, size)
            except LayoutError as e:
                rows.append(f"| {_mesh_name(sizes)} | {strategy} | LayoutError: {e} |" + " |" * 9)
                print(rows[-1], file=sys.stderr)
                continue
            step = per_step(compiled.as_text())
            total = sum(step[kind] for kind in COLLECTIVES)
            cells = " | ".join(f"{step[kind] / MIB:.2f}" for kind in COLLECTIVES)
            rows.append(
                f"| {_mesh_name(sizes)} | {strategy} | {cells} | **{total / MIB:.2f}** | "
                f"{step['attention'] / MIB:.2f} | {step['elsewhere'] / MIB:.2f} | {step['ops']} | "
                f"{memory_bytes(compiled) / MIB:.0f} |"
            )
            print(rows[-1], f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            for (kind, op), sent in step["by_op"].most_common(explain):
                print(f"    {sent / MIB:8.2f} MiB  {kind:18s}  {op}", file=sys.stderr)
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="512,1024", help="image sizes (square), comma separated")
    parser.add_argument("--explain", type=int, default=0, help="print each program's top N senders by jax op")
    parser.add_argument(
        "--mesh", default=None, help='only this mesh, named as in the table ("context2", "cfg2 x tensor2")'
    )
    parser.add_argument("--strategy", default=None, help="only this context strategy (ring, ulysses, ...)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the generated section of {DOCS}")
    args = parser.parse_args()
    layouts = [
        (sizes, tuple(s for s in strategies if args.strategy in (None, s)))
        for sizes, strategies in LAYOUTS
        if args.mesh in (None, _mesh_name(sizes))
    ]
    if not any(strategies for _, strategies in layouts):
        parser.error(f"no layout matches --mesh {args.mesh} --strategy {args.strategy}")
    if args.write_docs and layouts != LAYOUTS:
        parser.error("--write-docs writes the whole table: leave out --mesh and --strategy")
    jax.config.update("jax_compilation_cache_dir", str(ROOT / ".cache" / "jax"))
    ckpt = checkpoint()

    out = [
        "SDXL-shaped UNet (bench/sdxl_vs_diffusers.py), fp32, batch 1 with CFG (UNet batch 2), one denoise "
        "step: MiB sent per device per step (averaged over the mesh's devices) by collective kind, the part "
        "sent inside attention's shard_map and elsewhere, collectives executed per step, and the per-device "
        f"memory of the whole denoise program (weights included); {len(jax.devices())} host CPU devices, "
        f"jax {jax.__version__}.",
    ]
    for size in (int(s) for s in args.sizes.split(",")):
        latent = size // 8
        out += [
            "",
            f"{size}x{size} (latent {latent}x{latent}; self-attention over {(latent // 2) ** 2} and "
            f"{(latent // 4) ** 2} tokens, cross-attention to 77 text tokens).",
            "",
        ]
        out += table(ckpt, size, args.explain, layouts)
    text = "\n".join(out)
    print(text)
    if args.write_docs:
        write_docs_section(DOCS, START, END, text)


if __name__ == "__main__":
    main()
