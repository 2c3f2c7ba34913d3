"""A model's repeated blocks held stacked and run under one `lax.scan`: a program compiles one block, not n.

    stack_blocks(model)                                   # once, after loading (engine/pipeline.py)
    x = run_blocks(model.blocks, lambda block, x: block(x, context), x)      # a Python loop or the scan
    first = block_at(model.blocks, 0)                     # one block, e.g. the step caches' first

A model names its repeated blocks in a class attribute `scanned_blocks` (attribute paths: "blocks",
"encoder.block") and calls them through `run_blocks` / `block_at`, which take both forms: the nnx.List that
loading fills (checkpoint names map one to one: `blocks.3.attn1.to_q.weight`), and, after `stack_blocks`, a
BlockStack. A BlockStack holds the blocks whose structure repeats as one block module whose every parameter
has a leading axis of their count (path `blocks.stacked.attn1.to_q.weight`; Placement.param_spec leaves that
axis unsplit), and the leading blocks whose structure differs as `head` (T5's first block, which alone holds
the relative position bias).

Why: XLA compiles an unrolled stack block by block, so compile time grows with depth (FLUX.1-dev's 57 blocks,
Wan 14B's 40, T5-XXL's 24); under a scan it compiles the body once (bench/compile_time.py, docs/compilation.md:
FLUX.1-dev's denoise program 4-5x faster to compile on the CPU). Each trip reads its block's weights by a
dynamic slice at the loop counter. What that costs a step on an accelerator is not measured yet (no device
in the session that built this): a pool's `scan_blocks: false` keeps the blocks unrolled to compare.

What follows the blocks: LoRA factors (models/lora/apply.py: `stacked_adapters` stacks the per-layer tables of
a stack's blocks in the program, each trip binds its own); FSDP gathers (Placement.gather_blocks: one block's
weights at a time, inside the loop); the step caches' first block (`block_at`); int8 kernels and their scales
(stacked like any parameter).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from meshserve.models.lora.apply import bind_stacked, layer_adapters, stacked_adapters

# The attribute of a BlockStack that holds the stacked block, as it appears in parameter paths (Placement.
# param_spec and the LoRA table's names read it).
STACKED = "stacked"


class BlockStack(nnx.Module):
    """`head` (blocks that differ, run first in order) then `size` blocks of one structure as `stacked`, one
    block module whose parameters have a leading axis of `size`."""

    def __init__(self, head: Sequence[nnx.Module], stacked: nnx.Module, size: int):
        self.head = nnx.List(list(head))
        self.stacked = stacked
        self.size = size
        # Inside a program with FSDP-split weights: gather(block state) -> the block's weights gathered
        # (Placement.gather_blocks sets it after the merge), applied to each block where it runs.
        self.gather = None

    def __len__(self) -> int:
        return len(self.head) + self.size

    def layer(self, i: int) -> nnx.Module:
        """Stacked block i (0-based within the stack) as a block module (its weights sliced), bound to the
        active LoRA adapters by its name in the block list."""
        graph, state = nnx.split(self.stacked)
        return bind_stacked(
            self, len(self.head) + i, nnx.merge(graph, self._gathered(jax.tree.map(lambda a: a[i], state)))
        )

    def _gathered(self, block_state):
        return block_state if self.gather is None else self.gather(block_state)


def stack_blocks(model: nnx.Module, *, consume: bool = True) -> nnx.Module:
    """`model` with every block list its modules name in `scanned_blocks` replaced by a BlockStack, in place
    (every submodule is visited, so a pipeline's text encoder inside a wrapper is found). `consume`: delete
    each source array once it is stacked, so the conversion never holds two copies of a stack's weights (the
    loaded model is not usable afterwards). Shapes-only models (ShapeDtypeStruct values) stack too."""
    for _, node in list(nnx.iter_graph(model)):
        for attribute in getattr(type(node), "scanned_blocks", ()):
            *parents, name = attribute.split(".")
            owner = node
            for parent in parents:
                owner = getattr(owner, parent)
            blocks = getattr(owner, name)
            if isinstance(blocks, nnx.List) and len(blocks) > 1:
                setattr(owner, name, _stack(list(blocks), consume))
    return model


def _stack(blocks: list[nnx.Module], consume: bool) -> BlockStack:
    graph = nnx.graphdef(blocks[-1])
    head = 0
    while head < len(blocks) and nnx.graphdef(blocks[head]) != graph:
        head += 1
    rest = blocks[head:]
    if any(nnx.graphdef(block) != graph for block in rest):
        raise ValueError("blocks of different structures after the first that differs: cannot be stacked")
    states = [nnx.state(block) for block in rest]

    def stack(*leaves):
        stacked = _stack_leaves(leaves)
        if consume:
            for leaf in leaves:
                if isinstance(leaf, jax.Array):
                    leaf.delete()
        return stacked

    return BlockStack(blocks[:head], nnx.merge(graph, jax.tree.map(stack, *states)), len(rest))


def _stack_leaves(leaves):
    first = leaves[0]
    sharding = getattr(first, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
    elif sharding is not None and not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        raise ValueError(f"cannot stack arrays placed by {type(sharding).__name__}")
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)
    stacked = jnp.stack(leaves)
    return stacked if sharding is None else jax.device_put(stacked, sharding)


def block_at(blocks, i: int) -> nnx.Module:
    """Block i of a block list or BlockStack."""
    if not isinstance(blocks, BlockStack):
        return blocks[i]
    head = len(blocks.head)
    return blocks.head[i] if i < head else blocks.layer(i - head)


def run_blocks(blocks, fn: Callable, carry, start: int = 0):
    """carry through fn(block, carry) -> carry for the blocks from `start` on, in order: a Python loop over a
    block list, the head's blocks then one lax.scan over a BlockStack's stacked blocks."""
    if not isinstance(blocks, BlockStack):
        for block in list(blocks)[start:]:
            carry = fn(block, carry)
        return carry
    for block in list(blocks.head)[start:]:
        carry = fn(block, carry)
    first = max(start - len(blocks.head), 0)
    if first >= blocks.size:
        return carry
    graph, state = nnx.split(blocks.stacked)
    adapters = stacked_adapters(blocks, len(blocks.head) + first, blocks.size - first)

    def body(carry, xs):
        i, tables = xs
        # The block's weights read at the loop counter (a dynamic slice), rather than scanned over as xs:
        # scanning over state[first:] would copy the stack's weights when `first` > 0.
        layer = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), state)
        block = nnx.merge(graph, blocks._gathered(layer))
        with layer_adapters(block, tables):
            return fn(block, carry), None

    carry, _ = lax.scan(body, carry, (jnp.arange(first, blocks.size), adapters))
    return carry


def named_nodes(module):
    """(checkpoint name, node, stacked) for every node of `module`, by the names the unstacked model has: a
    BlockStack's head blocks as the list's leading entries, its stacked block's nodes once per block they
    stand for (`stacked` True: their parameters carry the leading axis), and the BlockStack itself under the
    list's name."""
    nodes = [(tuple(str(p) for p in path), node) for path, node in nnx.iter_graph(module)]
    stacks = {path: node for path, node in nodes if isinstance(node, BlockStack)}
    for path, node in nodes:
        for at, stack in stacks.items():
            if len(path) > len(at) and path[: len(at)] == at:
                kind, rest = path[len(at)], path[len(at) + 1 :]
                if kind == "head" and rest:
                    yield ".".join((*at, *rest)), node, False
                elif kind == STACKED:
                    for i in range(len(stack.head), len(stack)):
                        yield ".".join((*at, str(i), *rest)), node, True
                break
        else:
            yield ".".join(path), node, False


def gather_blocks_with(module, gather: Callable) -> nnx.Module:
    """`module` with each of its BlockStacks gathering a block's weights with gather(list name, block state)
    where the block runs; the module itself (Placement.gather_blocks)."""
    for name, node, stacked in named_nodes(module):
        if isinstance(node, BlockStack) and not stacked:
            node.gather = functools.partial(gather, name)
    return module
