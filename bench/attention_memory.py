"""Per-device memory and communication of attention, read from compiled programs (no accelerator needed).

    python bench/attention_memory.py                  # prints the markdown tables
    python bench/attention_memory.py --write-docs     # and replaces the generated part of docs/attention.md

For each sequence length and context degree N, the attention entry point is compiled (jax.jit(...).lower(...)
.compile()) on N of 8 host CPU devices and two things are read back:

- memory: `memory_analysis()` argument + output + temp bytes of the per-device (SPMD) program;
- communication: every collective-permute / all-to-all / all-gather in the compiled HLO, its operand bytes
  times the known trip count of the loops around it (ring attention permutes inside a while loop).

Two programs are measured: the bare attention op (q, k, v in, output out) and a transformer block around it
(x -> q/k/v projections -> attention -> output projection -> 4x MLP, residuals), the way a model calls it,
where q/k/v are intermediates rather than arguments. Sizes are small-width on purpose (B=1, H=8, D=64): what
is measured is how memory scales with length and context degree, not a production model.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models.attention import AttentionSettings, attention  # noqa: E402
from models.parallel.mesh import MeshSizes, make_mesh  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "attention.md"
START, END = "<!-- bench/attention_memory.py: start -->", "<!-- bench/attention_memory.py: end -->"
MIB = 2**20
_DTYPE_BYTES = {
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVES = ("collective-permute", "all-to-all", "all-gather")


# --- reading the compiled HLO -------------------------------------------------------------------------------


def _shape_bytes(text: str) -> int:
    return sum(
        _DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text)
    )


def _group_size(line: str) -> int:
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    return len(groups.group(1).split(",")) if groups else 1


def collective_bytes(hlo: str) -> dict[str, dict[str, int]]:
    """{op: {"operand": bytes, "sent": bytes}} per device for one call, loops unrolled by known trip count.

    operand: the sum of the collectives' operand sizes. sent: what one device puts on the wire: a permute
    sends its operand, an all-to-all (g-1)/g of it, an all-gather its operand to each of the g-1 others.
    """
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) .*\{\s*$", line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif current is not None:
            computations[current].append(line)

    totals = {op: {"operand": 0, "sent": 0} for op in _COLLECTIVES}

    def visit(name: str, times: int):
        for line in computations.get(name, []):
            op = re.search(r"\s(collective-permute|all-to-all|all-gather)(-start)?\(", line)
            if op:
                result = line.split("=", 1)[1].split(op.group(0).strip())[0]
                size, group = _shape_bytes(result), _group_size(line)
                operand = size // group if op.group(1) == "all-gather" else size
                sent = {
                    "collective-permute": operand,
                    "all-to-all": operand * (group - 1) // group,
                    "all-gather": operand * (group - 1),
                }[op.group(1)]
                totals[op.group(1)]["operand"] += times * operand
                totals[op.group(1)]["sent"] += times * sent
            if " while(" in line:
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
                visit(
                    re.search(r"body=%([\w.\-]+)", line).group(1),
                    times * (int(trips.group(1)) if trips else 1),
                )
            for callee in re.findall(r"(?:calls|true_computation|false_computation)=%([\w.\-]+)", line):
                visit(callee, times)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            for callee in re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []:
                visit(callee, times)  # an upper bound: every branch counted

    visit(entry, 1)
    return totals


# --- the programs -------------------------------------------------------------------------------------------


def _settings(degree: int, strategy: str, block: int) -> AttentionSettings:
    if degree == 1:
        return AttentionSettings(kernel="xla_blockwise", block_q=block, block_kv=block)
    mesh = make_mesh(MeshSizes(context=degree), jax.devices()[:degree])
    return AttentionSettings(
        kernel="xla_blockwise",
        context_strategy=strategy,
        mesh=mesh,
        block_q=block,
        block_kv=block,
        allgather_max_kv=0,
    )


def compile_attention(
    seq: int,
    degree: int,
    strategy: str,
    *,
    heads: int,
    head_dim: int,
    block: int,
    kernel: str = "xla_blockwise",
):
    settings = _settings(degree, strategy, block)
    if kernel == "reference":
        settings = AttentionSettings(kernel="reference")
    spec = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32)
    shardings = None
    if settings.mesh is not None:
        shardings = (NamedSharding(settings.mesh, P(None, "context", None, None)),) * 3
    fn = jax.jit(lambda q, k, v: attention(q, k, v, settings=settings), in_shardings=shardings)
    return fn.lower(spec, spec, spec).compile()


def compile_block(seq: int, degree: int, strategy: str, *, heads: int, head_dim: int, block: int):
    """A pre-norm-free transformer block: x + attn(x) then h + mlp(h), weights replicated (they are small)."""
    settings = _settings(degree, strategy, block)
    width = heads * head_dim

    def block_fn(x, w_qkv, w_out, w_up, w_down):
        b, s, _ = x.shape
        q, k, v = (jnp.einsum("bsc,cd->bsd", x, w).reshape(b, s, heads, head_dim) for w in w_qkv)
        h = x + jnp.einsum("bsd,dc->bsc", attention(q, k, v, settings=settings).reshape(b, s, width), w_out)
        return h + jnp.einsum("bsf,fc->bsc", jax.nn.gelu(jnp.einsum("bsc,cf->bsf", h, w_up)), w_down)

    x = jax.ShapeDtypeStruct((1, seq, width), jnp.float32)
    w = jax.ShapeDtypeStruct((width, width), jnp.float32)
    w_up = jax.ShapeDtypeStruct((width, 4 * width), jnp.float32)
    w_down = jax.ShapeDtypeStruct((4 * width, width), jnp.float32)
    shardings = None
    if settings.mesh is not None:
        replicated = NamedSharding(settings.mesh, P())
        shardings = (
            NamedSharding(settings.mesh, P(None, "context", None)),
            (replicated,) * 3,
            replicated,
            replicated,
            replicated,
        )
    fn = jax.jit(block_fn, in_shardings=shardings)
    return fn.lower(x, (w, w, w), w, w_up, w_down).compile()


def memory_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


# --- tables -------------------------------------------------------------------------------------------------


def memory_table(lengths, degrees, strategies, compile_fn, **kw) -> list[str]:
    """Rows: strategy x N; columns: lengths; cells: MiB per device (bytes x N / bytes at N=1)."""
    rows = [
        "| strategy | N | " + " | ".join(f"{s} tokens" for s in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    base = {seq: memory_bytes(compile_fn(seq, 1, "none", **kw)) for seq in lengths}
    rows.append("| - | 1 | " + " | ".join(f"{base[seq] / MIB:.1f}" for seq in lengths) + " |")
    for strategy in strategies:
        for n in (d for d in degrees if d > 1):
            cells = []
            for seq in lengths:
                total = memory_bytes(compile_fn(seq, n, strategy, **kw))
                cells.append(f"{total / MIB:.1f} ({total * n / base[seq]:.2f})")
            rows.append(f"| {strategy} | {n} | " + " | ".join(cells) + " |")
            print(rows[-1], file=sys.stderr)
    return rows


def comm_table(seq, degrees, strategies, **kw) -> list[str]:
    rows = [
        "| strategy | N | collective-permute MiB | all-to-all MiB | all-gather MiB | sent per device MiB |",
        "|---|---|---|---|---|---|",
    ]
    for strategy in strategies:
        for n in degrees:
            counts = collective_bytes(compile_attention(seq, n, strategy, **kw).as_text())
            sent = sum(c["sent"] for c in counts.values())
            ops = " | ".join(f"{counts[op]['operand'] / MIB:.1f}" for op in _COLLECTIVES)
            rows.append(f"| {strategy} | {n} | {ops} | {sent / MIB:.1f} |")
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    parser.add_argument("--degrees", default="1,2,4,8")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--comm-length", type=int, default=16384)
    parser.add_argument("--write-docs", action="store_true", help=f"replace the generated section of {DOCS}")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    degrees = [int(x) for x in args.degrees.split(",")]
    kw = dict(heads=args.heads, head_dim=args.head_dim, block=args.block)
    strategies = ("ring", "ulysses", "allgather", "hybrid")

    out = [
        f"Sizes: B=1, H={args.heads}, D={args.head_dim}, fp32, blocks {args.block}x{args.block}; "
        f"{len(jax.devices())} host CPU devices, jax {jax.__version__}.",
        "",
    ]
    out += [
        "Context 1, bare attention op: xla_blockwise vs the reference kernel (argument + output + temp MiB).",
        "",
        "| tokens | xla_blockwise | reference |",
        "|---|---|---|",
    ]
    for seq in lengths:
        blockwise = memory_bytes(compile_attention(seq, 1, "none", **kw)) / MIB
        reference = memory_bytes(compile_attention(seq, 1, "none", kernel="reference", **kw)) / MIB
        out.append(f"| {seq} | {blockwise:.1f} | {reference:.1f} |")
    out += [
        "",
        "Bare attention op per device, context N (in brackets: bytes x N / bytes at N=1; 1.25 is the "
        "target).",
        "",
    ]
    out += memory_table(lengths, degrees, strategies, compile_attention, **kw)
    out += [
        "",
        "Transformer block around it (projections, attention, 4x MLP), per device, same notation.",
        "",
    ]
    out += memory_table(lengths, degrees, ("ring", "ulysses", "hybrid"), compile_block, **kw)
    out += [
        "",
        f"Communication per attention call at {args.comm_length} tokens, per device (operand bytes of "
        "each collective kind, and bytes one device sends).",
        "",
    ]
    out += comm_table(
        args.comm_length, [n for n in degrees if n > 1], ("ring", "ulysses", "allgather", "hybrid"), **kw
    )
    text = "\n".join(out)
    print(text)
    if args.write_docs:
        docs = DOCS.read_text()
        head, rest = docs.split(START, 1)
        DOCS.write_text(head + START + "\n" + text + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
