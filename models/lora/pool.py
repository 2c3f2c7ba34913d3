"""The pool's adapters: a fixed-shape table of slots on the pool's devices, an LRU over them, per-row indices.

    pool = AdapterPool(pipe, max_per_request=4, max_rank=64, budget_mb=512)
    pool.load("style", "/path/lora.safetensors")      # -> {"name", "rank", "targets", "bytes", "text_encoders"}
    index, scale = pool.rows(loras, prompts, n)        # host: [B, K] int32 / float32, or None (no adapters)
    text = pool.text_rows(loras, (index, scale), prompts, n)   # [P, K] per prompt, or None (no TE adapter)

The table holds, per adaptable layer of the denoiser (every Linear; SDXL's GEGLU projection; Flux's single
blocks' proj_out as its two input halves), A [N, in, r] and B [N, r, *out] for N slots at the pool's max rank
r: its shapes never change, so loading, switching or scaling adapters compiles nothing (the denoise program
takes the table as an input). The family's CLIP text encoders (`lora_text_encoders`: SDXL's two, Flux's
CLIP; not T5 or umT5) have their Linears in the same table under "text_encoder.<module>" keys, in the same
slots: one adapter is one slot across the denoiser and the encoders, and `tables()` / `text_tables()` give
the two parts to the denoise and text_encode programs. N = the byte budget // one slot's bytes (a slot costs
the same whatever the adapter's rank or targets: it is padded; the encoders' layers count in it), at least
`max_per_request`. Loading an adapter writes its factors
(zero elsewhere) into a free slot, or the least recently used one's; a call marks its adapters used. An
adapter that a call in flight uses is never evicted by that call's own loads (there are none: loads and
calls alternate on the pool's one thread).

Sharding: a factor follows the weight it adapts (the family's SHARDING_RULES for that weight, tensor axes
only): A's input axis as the weight's input axis, B's output axes as the weight's output axes, the slot and
rank axes replicated. So a tensor-split q projection ([embed, heads]) gets B split by heads and its delta
lands already split like the layer's output; a row-split to_out gets A split by heads (its input) and the
partial sums join the layer's own all-reduce. FSDP (shard_over) leaves the factors replicated over those axes:
they are small (a rank-64 slot is 2 x 64 x (in + out) per layer) and gathering them per step would cost more.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np

from meshserve.models.engine.common import PipelineError
from meshserve.models.lora.formats import AdapterFormatError, read_adapter


class UnknownAdapter(PipelineError):
    """A call names an adapter the pool has not loaded."""


class _ZeroScales:
    def __repr__(self) -> str:
        return "ZERO_SCALES"


# `loras=ZERO_SCALES`: the LoRA program with every row's slots at scale 0, which computes the plain model's
# output. warm_up compiles the LoRA program with it, adapters loaded or not (a Python object: no request can
# send it).
ZERO_SCALES = _ZeroScales()


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # the table's key: our module path (diffusers' name; Flux proj_out's halves add .from_attn/mlp)
    n_in: int
    out: tuple[int, ...]  # the kernel's output axes ([out], or SDXL's GEGLU [2, out])
    spec_key: str  # the weight's checkpoint name inside its module, for its sharding rule
    kernel_shape: tuple[int, ...]
    owner: str = ""  # the module whose rules apply: a text encoder's name ("": the denoiser)


def conv_layers(module) -> dict[str, dict]:
    """{module: {"in", "out", "kernel": (kh, kw)}} for every 2-D convolution of the denoiser (LoCon targets)."""
    from meshserve.models.components.block_stack import named_nodes
    from meshserve.models.components.layers import Conv

    convs = {}
    for name, node, stacked in named_nodes(module):
        if isinstance(node, Conv) and len(node.kernel.shape) == 4 and not stacked:
            kh, kw, n_in, n_out = node.kernel.shape
            convs[name] = {"in": n_in, "out": n_out, "kernel": (kh, kw)}
    return convs


def adaptable_layers(module, convs: bool = False) -> tuple[dict[str, list[Target]], dict[str, dict]]:
    """(diffusers' module name -> the table targets it writes, {module: {"in", "out"}} as a LoRA file sees
    it) for every Linear, GEGLU projection and two-input Linear of the denoiser, and with `convs` its 2-D
    convolutions (LoCon: A a kh x kw conv to r channels, held as [kh kw in, r]; B a 1x1 conv [r, out]; their
    shapes add "kernel" (kh, kw))."""
    from meshserve.models.components.block_stack import named_nodes
    from meshserve.models.components.layers import Linear

    writes, shapes = {}, {}
    if convs:
        for name, shape in conv_layers(module).items():
            kh, kw = shape["kernel"]
            kernel = (kh, kw, shape["in"], shape["out"])
            writes[name] = [Target(name, kh * kw * shape["in"], (shape["out"],), name + ".weight", kernel)]
            shapes[name] = shape
    for name, node, stacked in named_nodes(module):  # a BlockStack's blocks one by one, by their own names
        per_block = slice(1 if stacked else 0, None)  # a stacked parameter's leading axis is the blocks'
        if isinstance(node, Linear):
            kernel = node.kernel_shape[per_block]
            writes[name] = [Target(name, kernel[0], kernel[1:], name + ".weight", kernel)]
            shapes[name] = {"in": kernel[0], "out": kernel[1]}
        elif hasattr(node, "halves_kernel"):  # SDXL GEGLU: [in, 2, out] holds the checkpoint's [2 out, in]
            kernel = tuple(node.halves_kernel.shape)[per_block]
            writes[name] = [Target(name, kernel[0], kernel[1:], name + ".weight", kernel)]
            shapes[name] = {"in": kernel[0], "out": kernel[1] * kernel[2]}
        elif hasattr(node, "from_attn") and hasattr(node, "from_mlp"):  # Flux: proj_out over cat[attn, mlp]
            ka, km = (
                node.from_attn.kernel_shape[per_block],
                node.from_mlp.kernel_shape[per_block],
            )
            writes[name] = [
                Target(f"{name}.from_attn", ka[0], ka[1:], f"{name}.from_attn.weight", ka),
                Target(f"{name}.from_mlp", km[0], km[1:], f"{name}.from_mlp.weight", km),
            ]
            shapes[name] = {"in": ka[0] + km[0], "out": ka[1]}
    # A two-input Linear's halves are Linears too: they are written through their parent only.
    for name in [n for n in writes if n.endswith((".from_attn", ".from_mlp"))]:
        del writes[name], shapes[name]
    return writes, shapes


class AdapterPool:
    def __init__(
        self,
        pipe,
        *,
        max_per_request: int = 4,
        max_rank: int = 64,
        budget_mb: float = 512.0,
        scale_min: float = -4.0,
        scale_max: float = 4.0,
        targets: str | None = None,
        convs: bool = False,
    ):
        if max_per_request < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.pipe = pipe
        self.max_per_request, self.max_rank = int(max_per_request), int(max_rank)
        self.budget_bytes = int(budget_mb * 2**20)
        self.scale_min, self.scale_max = float(scale_min), float(scale_max)
        # A regex over diffusers' module names: the layers the table holds (None: every adaptable layer). Each
        # layer in the table adds its gather and matmuls to the LoRA program, used or not (docs/lora.md).
        self.targets = re.compile(targets) if targets else None
        # The denoiser's 2-D convolutions in the table too (LoCon files, LCM-LoRA): each adds a matmul of its
        # input's kh x kw patches at the table's rank to every step of the LoRA program (the tiny SDXL's 23 convs
        # took a rank-16 pool's step from ~1.1x to 1.86x the plain program: bench/README.md), so only when asked.
        self.convs = bool(convs)
        self._tables = None  # made on the first load: {target: (A, B)}, text-encoder targets included
        self._slot_text = None  # [N] bool: the slot's adapter has text-encoder factors
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._info: dict[str, dict] = {}

    @property
    def limits(self) -> dict:
        return {
            "max_per_request": self.max_per_request,
            "max_rank": self.max_rank,
            "scale_min": self.scale_min,
            "scale_max": self.scale_max,
        }

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    # --- the table

    def _layers(self):
        if not hasattr(self, "_writes"):
            from flax import nnx

            name = self.pipe.denoiser_name
            module = nnx.merge(self.pipe._graphs[name], self.pipe._states[name])
            writes, shapes = adaptable_layers(module, convs=self.convs)
            # Convs out of the table: a file adapting one is told why it is refused.
            self._refused = {
                name: "is a convolution: this pool's LoRA table holds convolutions only with lora_convs "
                "(LoCon files, LCM-LoRA)"
                for name in conv_layers(module)
                if not self.convs
            }
            for encoder in self.pipe.lora_text_encoders:  # "text_encoder.<module>", as diffusers' keys
                module = nnx.merge(self.pipe._graphs[encoder], self.pipe._states[encoder])
                enc_writes, enc_shapes = adaptable_layers(module)
                for layer, targets in enc_writes.items():
                    writes[f"{encoder}.{layer}"] = [
                        dataclasses.replace(t, name=f"{encoder}.{t.name}", owner=encoder) for t in targets
                    ]
                    shapes[f"{encoder}.{layer}"] = enc_shapes[layer]
            if self.targets is not None:
                writes = {k: v for k, v in writes.items() if self.targets.search(k)}
                shapes = {k: v for k, v in shapes.items() if k in writes}
            self._writes, self._shapes = writes, shapes
        return self._writes, self._shapes

    def slot_bytes(self) -> int:
        writes, _ = self._layers()
        size = jnp.dtype(self.pipe.dtype).itemsize
        return sum(
            size * self.max_rank * (t.n_in + int(np.prod(t.out))) for ts in writes.values() for t in ts
        )

    @property
    def slots(self) -> int:
        return max(self.max_per_request, self.budget_bytes // max(self.slot_bytes(), 1))

    def _specs(self, target: Target):
        placement = self.pipe.placement
        if placement is None:
            return None, None
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        rules = self.pipe._rules.get(target.owner or self.pipe.denoiser_name) or ()
        tensor_only = dataclasses.replace(placement, shard_over=())
        spec = tuple(tensor_only.param_spec(rules, target.spec_key, target.kernel_shape))
        spec = spec + (None,) * (len(target.kernel_shape) - len(spec))
        if len(target.kernel_shape) == 4:  # a conv (HWIO): A's [kh kw in] axis whole, B's out as the kernel's
            return NamedSharding(placement.mesh, P(None, None, None)), NamedSharding(
                placement.mesh, P(None, None, spec[3])
            )
        a = NamedSharding(placement.mesh, P(None, spec[0], None))
        b = NamedSharding(placement.mesh, P(None, None, *spec[1:]))
        return a, b

    def tables(self):
        """The denoiser's part of the table (the denoise program's input)."""
        return {k: v for k, v in self._all_tables().items() if not self._is_text(k)}

    def text_tables(self):
        """The text encoders' part (the text_encode program's input with text-encoder adapters)."""
        return {k: v for k, v in self._all_tables().items() if self._is_text(k)}

    def _is_text(self, target: str) -> bool:
        return target.split(".", 1)[0] in self.pipe.lora_text_encoders

    def _in_part(self, by_layer: dict, prefix: str) -> dict:
        """{layer: value} -> the layers of the denoiser part `prefix` ("transformer_2."), named inside it, and
        the text encoders' as they are; another part's layers left out."""
        return {
            k if self._is_text(k) else k.removeprefix(prefix): v
            for k, v in by_layer.items()
            if self._is_text(k) or k.startswith(prefix)
        }

    @property
    def has_text_targets(self) -> bool:
        if not hasattr(self, "_has_text"):  # asked per call: computed once
            writes, _ = self._layers()
            self._has_text = any(self._is_text(name) for name in writes)
        return self._has_text

    def _all_tables(self):
        if self._tables is None:
            writes, _ = self._layers()
            n, r, dtype = self.slots, self.max_rank, self.pipe.dtype
            self._tables = {}
            for ts in writes.values():
                for t in ts:
                    a_spec, b_spec = self._specs(t)
                    a = jnp.zeros((n, t.n_in, r), dtype, device=a_spec)
                    b = jnp.zeros((n, r, *t.out), dtype, device=b_spec)
                    self._tables[t.name] = (a, b)
            self._slot_text = np.zeros(n, bool)
        return self._tables

    # --- loading

    def load(self, name: str, source, *, into: str | None = None) -> dict:
        """`into`: the part of the denoiser the adapter's denoiser keys belong under (Wan 2.2's two experts,
        "transformer" or "transformer_2": a file names one transformer's layers, diffusers'
        `load_into_transformer_2` picks which); None: the denoiser itself."""
        if not isinstance(name, str) or not name:
            raise PipelineError("a LoRA needs a non-empty name")
        writes, shapes = self._layers()
        targets, refused = shapes, self._refused
        if into is not None:  # the file's names are the part's own: read against them, then put back under it
            prefix = f"{into}."
            if not any(k.startswith(prefix) for k in shapes):
                raise PipelineError(f"LoRA {name!r}: the denoiser has no part {into!r}")
            targets, refused = self._in_part(shapes, prefix), self._in_part(refused, prefix)
        unet = getattr(self.pipe, "unet_config", None)  # SDXL: SGM-named kohya keys need its block layout
        layout = None
        if unet is not None:
            names = ("down_block_types", "up_block_types", "layers_per_block")
            layout = {n: getattr(unet, n) for n in names}
        factors = read_adapter(
            source,
            family=self.pipe.family,
            targets=targets,
            text_encoders=self.pipe.lora_text_encoders,
            unet_layout=layout,
            refused=refused,
        )
        if into is not None:
            factors = {k if self._is_text(k) else f"{into}.{k}": v for k, v in factors.items()}
        rank = max(a.shape[1] for a, _ in factors.values())
        if rank > self.max_rank:
            raise AdapterFormatError(
                f"LoRA {name!r} has rank {rank}; this pool takes at most {self.max_rank}"
            )
        tables = self._all_tables()
        if name in self._slots:
            slot = self._slots.pop(name)
        elif len(self._slots) < self.slots:
            slot = next(i for i in range(self.slots) if i not in self._slots.values())
        else:
            evicted, slot = next(iter(self._slots.items()))
            self.unload(evicted)
        size = jnp.dtype(self.pipe.dtype).itemsize
        nbytes = 0
        for module, targets in writes.items():
            a, b = factors.get(module, (None, None))
            offset = 0
            for t in targets:
                a_new = np.zeros((t.n_in, self.max_rank), np.float32)
                b_new = np.zeros((self.max_rank, int(np.prod(t.out))), np.float32)
                if a is not None:
                    a_new[:, : a.shape[1]] = a[offset : offset + t.n_in]
                    b_new[: b.shape[0]] = b
                    nbytes += size * a.shape[1] * (t.n_in + b.shape[1])
                offset += t.n_in
                ta, tb = tables[t.name]
                tables[t.name] = (
                    _write(ta, slot, a_new.astype(ta.dtype)),
                    _write(tb, slot, b_new.reshape(self.max_rank, *t.out).astype(tb.dtype)),
                )
        self._slots[name] = slot
        encoders = sorted({m.split(".", 1)[0] for m in factors if self._is_text(m)})
        self._slot_text[slot] = bool(encoders)
        self._info[name] = {
            "name": name,
            "rank": rank,
            "targets": sorted(factors),
            "bytes": nbytes,
            "text_encoders": encoders,
        }
        return dict(self._info[name])

    def unload(self, name: str) -> None:
        if name not in self._slots:
            raise UnknownAdapter(f"no LoRA named {name!r}; loaded: {self.names}")
        # The slot's factors stay until overwritten: no row can reach them once the name is gone.
        del self._slots[name], self._info[name]

    # --- a call's rows

    def rows(self, loras, prompts: int, n: int, lora_scale: float = 1.0):
        """`loras` (None; a list of {"name", "scale"} for every row; or one such list per prompt or per output
        row; or ZERO_SCALES) -> (index [B, K] int32, scale [B, K] float32), or None when no row has an adapter.
        `lora_scale` multiplies every adapter's scale (diffusers' attention kwargs' "scale": lora_scale())."""
        if loras is None:
            return None
        if loras is ZERO_SCALES:
            rows = prompts * n
            return np.zeros((rows, self.max_per_request), np.int32), np.zeros(
                (rows, self.max_per_request), np.float32
            )
        if not isinstance(loras, (list, tuple)):
            raise PipelineError("loras must be a list of {'name', 'scale'} (or one such list per prompt)")
        per_row_lists = len(loras) > 0 and all(isinstance(x, (list, tuple)) for x in loras)
        if per_row_lists:
            if len(loras) == prompts:
                lists = [lst for lst in loras for _ in range(n)]
            elif len(loras) == prompts * n:
                lists = list(loras)
            else:
                raise PipelineError(
                    f"loras: {len(loras)} lists for {prompts} prompts x {n} images (one per prompt or per row)"
                )
        else:
            lists = [loras] * (prompts * n)
        if not any(lists):
            return None
        index = np.zeros((len(lists), self.max_per_request), np.int32)
        scale = np.zeros((len(lists), self.max_per_request), np.float32)
        for row, adapters in enumerate(lists):
            if len(adapters) > self.max_per_request:
                raise PipelineError(
                    f"loras: {len(adapters)} adapters in one row; this pool takes at most {self.max_per_request}"
                )
            seen = set()
            for k, entry in enumerate(adapters):
                if isinstance(entry, str):
                    entry = {"name": entry}
                if not isinstance(entry, dict) or "name" not in entry:
                    raise PipelineError("loras: each adapter is {'name': str, 'scale': float}")
                name, s = entry["name"], entry.get("scale", 1.0)
                # One adapter twice in a row: summing the scales here, while diffusers' set_adapters does not,
                # would make one request mean two things (the service refuses it too: 422 not_unique).
                if isinstance(name, str):
                    if name in seen:
                        raise PipelineError(
                            f"loras: {name!r} is named twice in one row; name each adapter once"
                        )
                    seen.add(name)
                if name not in self._slots:
                    raise UnknownAdapter(f"no LoRA named {name!r}; loaded: {self.names}")
                try:
                    s = float(s) * lora_scale
                except (TypeError, ValueError):
                    raise PipelineError(f"loras: scale of {name!r} must be a number, got {s!r}") from None
                if not (np.isfinite(s) and self.scale_min <= s <= self.scale_max):
                    times = f" (x the call's lora scale {lora_scale})" if lora_scale != 1.0 else ""
                    raise PipelineError(
                        f"loras: scale of {name!r}{times} must be in [{self.scale_min}, {self.scale_max}], got {s}"
                    )
                index[row, k], scale[row, k] = self._slots[name], s
                self._slots.move_to_end(name)
        return index, scale

    def text_rows(self, loras, rows, prompts: int, n: int):
        """The text_encode program's adapters: (index [P, K], scale [P, K]) per prompt, its adapters that have
        text-encoder factors (the others at scale 0), or None when no row has one (the plain text program:
        no cost). `rows` is `rows()`'s result. ZERO_SCALES (warm-up) gives zeros when the table has
        text-encoder targets. A prompt's n output rows share one text encoding, so they must carry the same
        text-encoder adapters; rows of one prompt that differ there are refused (give them as separate
        prompts; the served path passes one prompt per row)."""
        if rows is None or not self.has_text_targets:
            return None
        index, scale = rows
        k = index.shape[1]
        if loras is ZERO_SCALES:
            return index[::n], scale[::n]
        used = self._slot_text[index] & (scale != 0)
        if not used.any():
            return None
        index, scale = np.where(used, index, 0), np.where(used, scale, 0).astype(np.float32)
        index, scale = index.reshape(prompts, n, k), scale.reshape(prompts, n, k)
        for p in range(prompts):
            sets = {
                tuple(sorted((int(i), float(s)) for i, s in zip(index[p, j], scale[p, j], strict=True) if s))
                for j in range(n)
            }
            if len(sets) > 1:
                raise PipelineError(
                    f"loras: the {n} images of prompt {p} carry different text-encoder adapters; one prompt is "
                    "encoded once, so give such rows as separate prompts"
                )
        return np.ascontiguousarray(index[:, 0]), np.ascontiguousarray(scale[:, 0])


@jax.jit
def _write(table, slot, value):
    # One small program per table shape, outside the pipeline's counted programs; the slot is traced.
    return jax.lax.dynamic_update_index_in_dim(table, value, slot, 0)
