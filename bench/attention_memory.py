"""Per-device memory and communication of attention, read from compiled programs (no accelerator needed).

    python bench/attention_memory.py                  # prints the markdown tables
    python bench/attention_memory.py --write-docs     # and replaces the generated part of docs/attention.md
    python bench/attention_memory.py --lengths 65536 [--donate | --dtype bfloat16]   # variants in the docs

For each sequence length and context degree N, the attention entry point is compiled (jax.jit(...).lower(...)
.compile()) on N of 8 host CPU devices and two things are read back:

- memory: `memory_analysis()` argument + output + temp bytes of the per-device (SPMD) program, less the
  bytes of outputs that alias a donated argument (none unless --donate: then q, k and v are donated and the
  output may take q's buffer);
- communication: every collective in the compiled HLO, its operand bytes times the known trip count of the
  loops around it (ring attention permutes inside a loop over pieces of each chunk).

Two programs are measured: the bare attention op (q, k, v in, output out) and a transformer block around it
(x -> q/k/v projections -> attention -> output projection -> 4x MLP, residuals), the way a model calls it,
where q/k/v are intermediates rather than arguments. Sizes are small-width on purpose (B=1, H=8, D=64): what
is measured is how memory scales with length and context degree, not a production model.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory_analysis import host_cpu_devices, write_docs_section  # noqa: E402

host_cpu_devices(memory_minimizing=False)  # before JAX is imported

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshserve.models.attention import AttentionSettings, attention  # noqa: E402
from meshserve.models.parallel.mesh import MeshSizes, make_mesh  # noqa: E402

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
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
_COLLECTIVE_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


# --- reading the compiled HLO -------------------------------------------------------------------------------


def _shape_sizes(text: str) -> list[int]:
    return [
        _DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text)
    ]


def _group_size(line: str) -> int:
    """Devices per replica group, in the three spellings XLA prints."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)  # [groups, size]<=[...]
    if iota:
        return int(iota.group(2))
    groups = re.search(r"replica_groups=\{\{([\d,]+)\}", line)  # {{0,1},{2,3}}
    if groups:
        return len(groups.group(1).split(","))
    named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)  # mesh['a'=2,'b'=4] {'b'}
    if named:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", named.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", named.group(2)))
    return 1


def _split_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
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
    return computations, entry


def collectives(hlo: str) -> list[dict]:
    """Every collective of a compiled SPMD program, once per execution: loops unrolled by known trip count.

    One dict per collective instruction: kind, operand (bytes of its input on one device), sent (bytes one
    device puts on the wire, averaged over the program's devices), times (executions per call: the product
    of the known trip counts of the loops around it), loops (op names of the enclosing while loops whose trip
    count XLA does not know, outermost first: counted once) and op_name (the jax op it came from).

    sent: a permute sends its operand from each source of its pairs; an all-gather sends its shard to the
    g - 1 others of its group; an all-to-all (g - 1)/g of its operand; a ring all-reduce 2 (g - 1)/g of it
    (reduce-scatter then all-gather); a reduce-scatter (g - 1)/g of its input.
    """
    computations, entry = _split_computations(hlo)
    partitions = re.search(r"num_partitions=(\d+)", hlo)
    devices = int(partitions.group(1)) if partitions else 1

    def visit(name: str, times: int, loops: tuple[str, ...]) -> list[dict]:
        found: list[dict] = []
        for line in computations.get(name, []):
            op = _COLLECTIVE_OP.search(line)
            if op:
                kind, group = op.group(1), _group_size(line)
                sizes = _shape_sizes(line.split("=", 1)[1].split(op.group(0).strip())[0])
                # An async -start returns (operand, result, ...): take the result; a sync op its result(s).
                result = sizes[1] if op.group(2) and len(sizes) > 1 else sum(sizes)
                operand = {"all-gather": result // group, "reduce-scatter": result * group}.get(kind, result)
                pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
                senders = len(re.findall(r"\{\d+,\d+", pairs.group(1) + "}")) if pairs else 0
                sent = {
                    "collective-permute": operand * senders / devices,
                    "all-gather": operand * (group - 1),
                    "all-to-all": operand * (group - 1) / group,
                    "all-reduce": 2 * operand * (group - 1) / group,
                    "reduce-scatter": operand * (group - 1) / group,
                }[kind]
                op_name = re.search(r'op_name="([^"]*)"', line)
                found.append(
                    dict(
                        kind=kind,
                        operand=operand,
                        sent=sent,
                        times=times,
                        loops=loops,
                        op_name=op_name.group(1) if op_name else "",
                    )
                )
            if " while(" in line:
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
                where = re.search(r'op_name="([^"]*)"', line)
                found += visit(
                    re.search(r"body=%([\w.\-]+)", line).group(1),
                    times * (int(trips.group(1)) if trips else 1),
                    loops if trips else (*loops, where.group(1) if where else "while"),
                )
            for callee in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line):
                found += visit(callee, times, loops)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            sides = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
            sides += re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line)
            if sides:
                # One branch runs per execution (ring attention's lax.switch over its N - 1 permutations, all
                # the same size): count the heaviest, an upper bound that is exact when they are alike.
                taken = [visit(side, times, loops) for side in sides]
                found += max(taken, key=lambda cs: sum(c["times"] * c["sent"] for c in cs))
        return found

    return visit(entry, 1, ())


def collective_bytes(hlo: str) -> dict[str, dict[str, float]]:
    """{kind: {"operand": bytes, "sent": bytes}} per device for one call of the program (see collectives)."""
    totals = {kind: {"operand": 0.0, "sent": 0.0} for kind in COLLECTIVES}
    for c in collectives(hlo):
        totals[c["kind"]]["operand"] += c["times"] * c["operand"]
        totals[c["kind"]]["sent"] += c["times"] * c["sent"]
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


@functools.cache
def compile_attention(
    seq: int,
    degree: int,
    strategy: str,
    *,
    heads: int,
    head_dim: int,
    block: int,
    kernel: str = "xla_blockwise",
    dtype=jnp.float32,
    donate: bool = False,
):
    settings = _settings(degree, strategy, block)
    if kernel == "reference":
        settings = AttentionSettings(kernel="reference")
    spec = jax.ShapeDtypeStruct((1, seq, heads, head_dim), dtype)
    shardings = None
    if settings.mesh is not None:
        shardings = (NamedSharding(settings.mesh, P(None, "context", None, None)),) * 3
    fn = jax.jit(
        lambda q, k, v: attention(q, k, v, settings=settings),
        in_shardings=shardings,
        donate_argnums=(0, 1, 2) if donate else (),
    )
    return fn.lower(spec, spec, spec).compile()


@functools.cache
def compile_block(
    seq: int, degree: int, strategy: str, *, heads: int, head_dim: int, block: int, dtype=jnp.float32, **_
):
    """A pre-norm-free transformer block: x + attn(x) then h + mlp(h), weights replicated (they are small)."""
    settings = _settings(degree, strategy, block)
    width = heads * head_dim

    def block_fn(x, w_qkv, w_out, w_up, w_down):
        b, s, _ = x.shape
        q, k, v = (jnp.einsum("bsc,cd->bsd", x, w).reshape(b, s, heads, head_dim) for w in w_qkv)
        h = x + jnp.einsum("bsd,dc->bsc", attention(q, k, v, settings=settings).reshape(b, s, width), w_out)
        return h + jnp.einsum("bsf,fc->bsc", jax.nn.gelu(jnp.einsum("bsc,cf->bsf", h, w_up)), w_down)

    x = jax.ShapeDtypeStruct((1, seq, width), dtype)
    w = jax.ShapeDtypeStruct((width, width), dtype)
    w_up = jax.ShapeDtypeStruct((width, 4 * width), dtype)
    w_down = jax.ShapeDtypeStruct((4 * width, width), dtype)
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


def memory_parts(compiled) -> dict[str, int]:
    """Per-device bytes: arguments, output (less what aliases a donated argument), temporaries."""
    m = compiled.memory_analysis()
    return {
        "arguments": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes - m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
    }


def memory_bytes(compiled) -> int:
    return sum(memory_parts(compiled).values())


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


def parts_table(seq, degrees, strategies, **kw) -> list[str]:
    """What is counted, for the bare op at one length: arguments, output, temporaries (MiB per device)."""
    rows = [
        "| strategy | N | arguments | output | temporaries | total | x N / N=1 |",
        "|---|---|---|---|---|---|---|",
    ]
    base = memory_bytes(compile_attention(seq, 1, "none", **kw))
    for strategy in ("-", *strategies):
        for n in [1] if strategy == "-" else [d for d in degrees if d > 1]:
            parts = memory_parts(compile_attention(seq, n, "none" if n == 1 else strategy, **kw))
            total = sum(parts.values())
            cells = " | ".join(f"{parts[k] / MIB:.1f}" for k in ("arguments", "output", "temporaries"))
            rows.append(f"| {strategy} | {n} | {cells} | {total / MIB:.1f} | {total * n / base:.2f} |")
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
            ops = " | ".join(
                f"{counts[op]['operand'] / MIB:.1f}"
                for op in ("collective-permute", "all-to-all", "all-gather")
            )
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
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--donate", action="store_true", help="donate q, k, v to the bare op's program")
    parser.add_argument("--write-docs", action="store_true", help=f"replace the generated section of {DOCS}")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    degrees = [int(x) for x in args.degrees.split(",")]
    dtype = jnp.dtype(args.dtype)
    kw = dict(heads=args.heads, head_dim=args.head_dim, block=args.block, dtype=dtype, donate=args.donate)
    strategies = ("ring", "ulysses", "allgather", "hybrid")

    out = [
        f"Sizes: B=1, H={args.heads}, D={args.head_dim}, {dtype.name}, blocks {args.block}x{args.block}"
        f"{', q/k/v donated' if args.donate else ''}; {len(jax.devices())} host CPU devices, "
        f"jax {jax.__version__}.",
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
        f"What is counted: the bare op at {lengths[-1]} tokens, MiB per device.",
        "",
    ]
    out += parts_table(lengths[-1], degrees, strategies, **kw)
    out += [
        "",
        f"Communication per attention call at {args.comm_length} tokens, per device (operand bytes of "
        "each collective kind, and bytes one device sends).",
        "",
    ]
    out += comm_table(args.comm_length, [n for n in degrees if n > 1], strategies, **kw)
    text = "\n".join(out)
    print(text)
    if args.write_docs:
        write_docs_section(DOCS, START, END, text)


if __name__ == "__main__":
    main()
