"""LoRA inside a compiled program: the adapted layers add sum_k s[row, k] (x A_k) B_k to their output.

    with adapters_active(tables, index, scale):        # traced, around the denoiser's calls
                                                        # (adapters_from: the denoise program's form)
        module = bind(module)                           # after nnx.merge: which layers are adapted
        y = layer(x)                                    # layers.Linear / LinearHalves call `adapted`

`tables` {module: (A [N, in, r], B [N, r, *out])}: every adapter slot of the pool (models/lora/pool.py),
padded to the pool's max rank (zero padding is exact). `index` [B, K] int32 picks each row's K adapter slots,
`scale` [B, K] their scales (0 for an empty slot, whose index is any). A row's factors are gathered and its K
adapters concatenated along the rank axis with the scales folded into B, so a layer costs two batched matmuls
[S, in] x [in, K r] x [K r, out] per row, whatever the adapters. With CFG the model batch is [u0, c0, u1, c1...]
and each row's adapters apply to both halves (as diffusers' do).

The same machinery runs the text_encode program with text-encoder adapters: the tables then hold the CLIP
encoders' Linears (keys "text_encoder.<module>", `bind(module, prefix="text_encoder.")`), and `index` /
`scale` are per text row [T, K] (prompts, then negatives with CFG: each its prompt's adapters).

The layers find their factors through a context variable set while the program is traced (never at run time):
the denoiser's modules are merged from their state inside the trace, so `bind` maps the merged modules' ids
to their names. Outside a trace with adapters, `adapted` returns y unchanged: the program without adapters is
the plain model, and costs nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("meshserve_lora", default=None)


class _Active:
    def __init__(self, tables, index, scale):
        self.tables, self.index, self.scale = tables, index, scale
        # id(layer) -> (layer, its name). The layer is held so that its id cannot be reused while these
        # adapters are active: a merged module freed mid-trace (one text encoder's, then the next one's) once
        # gave a layer of the second the stale id of an adapted layer of the first, which then added the
        # wrong factors (a served job failed on their shapes; with equal shapes it would have been silent).
        self.names: dict[int, tuple[object, str]] = {}
        self.stacks: dict[int, tuple[object, str]] = {}  # id(BlockStack) -> (it, its name): bind

    def row_factors(self, name: str, batch: int):
        """Each model row's adapters of layer `name`, concatenated along the rank with the scales folded into
        B: (A [b, in, K r], B [b, K r, out]) for a model batch of `batch` rows."""
        a, b = self.tables[name]  # [N, in, r], [N, r, *out]
        rows, k = self.index.shape
        index, scale = self.index, self.scale
        if batch == 2 * rows:  # CFG: the interleaved model batch, each row's pair shares its adapters
            index, scale = jnp.repeat(index, 2, axis=0), jnp.repeat(scale, 2, axis=0)
        elif batch != rows:
            raise ValueError(f"LoRA on {name}: input batch {batch} is neither {rows} rows nor 2 x {rows}")
        n_in, rank = a.shape[1], a.shape[2]
        a_rows = jnp.take(a, index, axis=0)  # [b, K, in, r]
        a_rows = a_rows.transpose(0, 2, 1, 3).reshape(batch, n_in, k * rank)
        b_rows = jnp.take(b, index, axis=0).reshape(batch, k, rank, -1)
        b_rows = (b_rows * scale[:, :, None, None].astype(b_rows.dtype)).reshape(batch, k * rank, -1)
        return a_rows, b_rows

    def delta(self, name: str, x, out_shape):
        batch = x.shape[0]
        a_rows, b_rows = self.row_factors(name, batch)
        h = jnp.einsum("bsi,bir->bsr", x.reshape(batch, -1, a_rows.shape[1]), a_rows.astype(x.dtype))
        d = jnp.einsum("bsr,bro->bso", h, b_rows.astype(x.dtype))
        return d.reshape(*x.shape[:-1], *out_shape)

    def conv_delta(self, name: str, x, conv):
        """A conv's adapters (LoCon: A a kh x kw conv to K r channels at the layer's strides, padding and
        dilation; B a 1x1 conv) as the Linear delta of the input's kh x kw patches (the table holds A as
        [N, kh kw in, r], the patches' order). x [B, H, W, in] -> [B, H', W', out].

        Patches, not a per-row conv: vmapped over the rows, a conv becomes one grouped conv, which XLA's SPMD
        partitioner computed wrong on the 8-device mesh (cfg 2 x context 2 x tensor 2, the tiny SDXL: 0.65
        max abs pixel against one device); the patches are slices, partitioned exactly."""
        kh, kw = conv.kernel.shape[:2]
        return self.delta(name, conv.patches(x, kh, kw), (conv.kernel.shape[3],))


@contextlib.contextmanager
def adapters_active(tables, index, scale):
    """While tracing: the denoiser's layers named in `tables` add their adapters (module docstring)."""
    token = _ACTIVE.set(_Active(tables, index, scale))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def adapters_from(state, lora):
    """Around the denoise program's body: `lora` None (no row has adapters) yields `state`, the plain model's
    weights, and changes nothing; else `state` is (weights, tables), `lora` {"index", "scale"} [B, K], and
    the body runs with those adapters active, yielding the weights."""
    if lora is None:
        yield state
        return
    weights, tables = state
    with adapters_active(tables, lora["index"], lora["scale"]):
        yield weights


def bind(module, prefix: str = ""):
    """Registers a merged module's adapted layers (by diffusers' dotted names, after `prefix`: a text
    encoder's "text_encoder." as in the tables' keys; the denoiser's names have none) with the active
    adapters; the module unchanged, and nothing done without active adapters. A BlockStack's stacked
    blocks are bound per trip of its scan (`layer_adapters`); the stack itself is registered under its name."""
    active = _ACTIVE.get()
    if active is None:
        return module
    from meshserve.models.components.block_stack import BlockStack, named_nodes

    for name, node, stacked in named_nodes(module):
        if stacked:
            continue
        if isinstance(node, BlockStack):
            active.stacks[id(node)] = (node, prefix + name)
        elif prefix + name in active.tables:
            active.names[id(node)] = (node, prefix + name)
    return module


def bind_stacked(stack, index: int, block):
    """A block sliced out of a BlockStack (`index`: its place in the block list) bound to the active adapters
    under the list's name, as `bind` binds an unstacked block; the block unchanged."""
    active = _ACTIVE.get()
    entry = None if active is None else active.stacks.get(id(stack))
    if entry is None or entry[0] is not stack:
        return block
    return bind(block, prefix=f"{entry[1]}.{index}.")


def stacked_adapters(stack, first: int, n: int):
    """Inside a BlockStack's scan: the active adapters' factors of its blocks first .. first + n - 1 (their
    indices in the block list), stacked per layer: {name within a block: (A [n, N, in, r], B [n, N, r,
    *out])}, zeros for a block the table does not hold that layer of; None when no active table names one of
    these blocks. Stacked in the program from the per-layer tables: a copy the size of the table's share for
    these blocks, not of their weights."""
    active = _ACTIVE.get()
    entry = None if active is None else active.stacks.get(id(stack))
    if entry is None or entry[0] is not stack:
        return None
    prefix = entry[1] + "."
    per_layer: dict[str, dict[int, tuple]] = {}
    for name, factors in active.tables.items():
        if name.startswith(prefix):
            index, _, layer = name[len(prefix) :].partition(".")
            if index.isdigit() and first <= int(index) < first + n:
                per_layer.setdefault(layer, {})[int(index)] = factors
    stacked = {}
    for layer, blocks in per_layer.items():
        a0, b0 = next(iter(blocks.values()))
        stacked[layer] = tuple(
            jnp.stack(
                [blocks[i][k] if i in blocks else jnp.zeros_like(zero) for i in range(first, first + n)]
            )
            for k, zero in enumerate((a0, b0))
        )
    return stacked or None


@contextlib.contextmanager
def layer_adapters(block, tables):
    """Inside one trip of a BlockStack's scan: `block`'s layers add the factors `tables` ({name within the
    block: (A, B)}, this trip's slice of `stacked_adapters`); nothing when None."""
    if tables is None:
        yield
        return
    parent = _ACTIVE.get()
    token = _ACTIVE.set(_Active(tables, parent.index, parent.scale))
    try:
        bind(block)
        yield
    finally:
        _ACTIVE.reset(token)


def adapted_conv(conv, x, y):
    """A 2-D conv's output y [B, H', W', out] with its adapters added (y unchanged when none is active for it);
    x [B, H, W, in] its input."""
    bound = _bound(conv)
    if bound is None:
        return y
    active, name = bound
    return y + active.conv_delta(name, x, conv).astype(y.dtype)


def adapted(layer, x, y):
    """A layer's output y with its adapters added (y unchanged when none is active for it). x [B, ..., in],
    y [B, ..., *out]."""
    bound = _bound(layer)
    if bound is None:
        return y
    active, name = bound
    return y + active.delta(name, x, y.shape[x.ndim - 1 :]).astype(y.dtype)


def _bound(layer):
    """(the active adapters, the layer's name) when this trace's adapters cover the layer, else None."""
    active = _ACTIVE.get()
    if active is None:
        return None
    entry = active.names.get(id(layer))
    if entry is None or entry[0] is not layer:
        return None
    return active, entry[1]
