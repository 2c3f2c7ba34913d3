"""Checkpoint loading: diffusers-format folders (config.json + safetensors) into Flax NNX modules.

No torch on this path. Safetensors files are read with a small header parser and `np.memmap`, because
`safetensors`' numpy backend cannot represent bfloat16 (numpy has no such dtype; `ml_dtypes`, a JAX
dependency, does).

Names: our modules carry diffusers' / transformers' attribute names, so a PyTorch key maps to an NNX
path by a handful of rules, applied by the leaf name and the array's rank:

    PyTorch                          NNX
    <path>.weight  (Linear, [O, I])  <path>.kernel  [I, O]        (transpose)
    <path>.weight  (Conv, [O,I,*K])  <path>.kernel  [*K, I, O]    (HWIO; conv1d/conv3d alike)
    <path>.weight  (norms)           <path>.scale
    <path>.weight  (Embedding)       <path>.embedding
    <path>.weight  (Linear, halves)  <path>.halves_kernel [I, 2, O]  (GEGLU's [value | gate] projection)
    <path>.bias    (Linear, halves)  <path>.halves_bias   [2, O]
    <path>.bias                      <path>.bias
    anything else                    the same name

A model whose keys differ beyond that passes `rename` (PyTorch key -> our key, or None to skip).
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}

# Weight file names diffusers and transformers write, in the order we look for them.
_WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
# A variant's weight file: `<stem>.<variant>.safetensors`, sharded `<stem>.<variant>-00001-of-00002.safetensors`
# or (legacy) `<stem>-00001-of-00002.<variant>.safetensors` (diffusers' variant_compatible_siblings).
_VARIANT_FILE = re.compile(
    r"^(?:diffusion_pytorch_model|model)(?:\.(?P<a>\w+)(?:-\d{5}-of-\d{5})?|-\d{5}-of-\d{5}\.(?P<b>\w+))\.safetensors$"
)


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be loaded, with the reason."""


class CheckpointMismatchError(CheckpointError):
    """Checkpoint keys and model parameters do not match; lists what is missing, unexpected or misshapen."""

    def __init__(self, where: str, missing: list[str], unexpected: list[str], misshapen: list[str]):
        self.missing, self.unexpected, self.misshapen = missing, unexpected, misshapen
        parts = [f"checkpoint {where} does not match the model:"]
        for title, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen)):
            if keys:
                shown = ", ".join(keys[:20]) + (f" ... (+{len(keys) - 20} more)" if len(keys) > 20 else "")
                parts.append(f"  {title} ({len(keys)}): {shown}")
        super().__init__("\n".join(parts))


# --------------------------------------------------------------------------------------------------
# Reading files


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    with open(path) as f:
        return json.load(f)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only numpy arrays (memory-mapped, no copy). The header is held
    to the format's rules (each tensor's bytes are its shape's, inside the data, none overlapping another's): a
    LoRA file can come from a client (a path under `lora_root`), and an audit's file with two tensors on the same
    bytes and one of shape [-1] was read as if valid."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise CheckpointError(f"{path}: the header claims {header_len} bytes; the file has {size}")
        header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - header_len
    data = (
        np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
        if data_len
        else np.zeros(0, np.uint8)
    )
    out, spans = {}, []
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has an unsupported dtype or no header entry")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise CheckpointError(f"{path}: tensor {name} has shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise CheckpointError(f"{path}: tensor {name} has data_offsets {offsets!r}, not [start, end]")
        start, end = offsets
        if not 0 <= start <= end <= data_len or end - start != math.prod(shape) * np.dtype(dtype).itemsize:
            raise CheckpointError(
                f"{path}: tensor {name}'s data_offsets {offsets} do not hold {dtype} {shape} within the "
                f"{data_len} data bytes"
            )
        spans.append((start, end, name))
        out[name] = data[start:end].view(dtype).reshape(shape)
    spans.sort()
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise CheckpointError(f"{path}: tensors {first} and {second} overlap")
    return out


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], metadata: dict | None = None) -> None:
    """Writes numpy arrays (bfloat16 included) in the safetensors format."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset, blobs = 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        raw = arr.tobytes()
        header[name] = {
            "dtype": _DTYPE_NAMES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        blobs.append(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for raw in blobs:
            f.write(raw)


def read_component_weights(folder: Path, variant: str | None = None) -> dict[str, np.ndarray]:
    """The state dict of one component folder: a single safetensors file or a sharded one with its index."""
    folder = Path(folder)
    suffix = f".{variant}.safetensors" if variant else ".safetensors"
    for stem in _WEIGHT_STEMS:
        single = folder / f"{stem}{suffix}"
        if single.is_file():
            return read_safetensors(single)
        # A variant's index is `<stem>.safetensors.index.<variant>.json` in diffusers and transformers
        # (legacy: `<stem>.safetensors.<variant>.index.json`).
        indexes = (
            [f"{stem}.safetensors.index.{variant}.json", f"{stem}.safetensors.{variant}.index.json"]
            if variant
            else [f"{stem}.safetensors.index.json"]
        )
        for index in (folder / name for name in indexes):
            if index.is_file():
                shards = sorted(set(read_json(index)["weight_map"].values()))
                state: dict[str, np.ndarray] = {}
                for shard in shards:
                    state.update(read_safetensors(folder / shard))
                return state
    if (
        variant is None
    ):  # no plain weights: a folder fetched with one variant (models/checkpoints/hub.py) holds its files
        variants = {
            m["a"] or m["b"] for p in folder.glob("*.safetensors") if (m := _VARIANT_FILE.match(p.name))
        }
        if "fp16" in variants or len(variants) == 1:
            return read_component_weights(folder, "fp16" if "fp16" in variants else variants.pop())
    found = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
    raise CheckpointError(
        f"no safetensors weights in {folder} (looked for {', '.join(s + suffix for s in _WEIGHT_STEMS)} "
        f"and their .index.json); found: {', '.join(found) or 'nothing'}"
    )


# --------------------------------------------------------------------------------------------------
# PyTorch layout <-> NNX layout


def nnx_leaf_to_torch(leaf: str) -> str:
    return {
        "kernel": "weight",
        "scale": "weight",
        "embedding": "weight",
        "halves_kernel": "weight",
        "halves_bias": "bias",
        "kernel_scale": "weight_scale",  # a quantized Linear's per-channel scale (models/components/quantize.py)
        "kernel_t": "weight_t",  # an fp8 Linear's kernel stored [out, in] (the same file says why)
    }.get(leaf, leaf)


def to_nnx_layout(leaf: str, array: np.ndarray) -> np.ndarray:
    """A PyTorch tensor in the layout of the NNX parameter `leaf`."""
    if leaf == "halves_kernel":  # Linear [2 O, I] whose output is two halves -> [I, 2, O]
        return array.T.reshape(array.shape[1], 2, array.shape[0] // 2)
    if leaf == "halves_bias":  # [2 O] -> [2, O]
        return array.reshape(2, -1)
    if leaf == "kernel":
        if array.ndim == 2:  # Linear [O, I] -> [I, O]
            return array.T
        if array.ndim >= 3:  # Conv [O, I, *K] -> [*K, I, O]
            return np.transpose(array, (*range(2, array.ndim), 1, 0))
    return array


def to_torch_layout(leaf: str, array: np.ndarray) -> np.ndarray:
    """The inverse of `to_nnx_layout`."""
    if leaf == "halves_kernel":
        return array.reshape(array.shape[0], -1).T
    if leaf == "halves_bias":
        return array.reshape(-1)
    if leaf == "kernel":
        if array.ndim == 2:
            return array.T
        if array.ndim >= 3:
            n = array.ndim
            return np.transpose(array, (n - 1, n - 2, *range(0, n - 2)))
    return array


def torch_key(path: tuple) -> str:
    return (
        ".".join(str(p) for p in path[:-1])
        + ("." if len(path) > 1 else "")
        + nnx_leaf_to_torch(str(path[-1]))
    )


def load_weights(
    module: nnx.Module,
    state_dict: Mapping[str, np.ndarray],
    *,
    where: str = "",
    rename: Callable[[str], str | None] | None = None,
    ignore: Iterable[str] = (),
    dtype=None,
    place: Callable[[tuple, np.ndarray], jax.Array] | None = None,
) -> None:
    """Fills every nnx.Param of `module` from a PyTorch-named state dict, in place.

    `rename` maps a checkpoint key to the module's key (None skips it); keys ending with one of `ignore`'s
    suffixes are skipped (non-persistent buffers such as `position_ids`). `dtype` casts floating weights.
    `place(path, array)` puts an array on devices (default: `jax.device_put`); the parallel engine passes one
    that device_puts straight into the parameter's sharding, so no device ever holds a full copy it
    does not need. Raises CheckpointMismatchError naming every missing, unexpected and misshapen key.
    """
    ignore = tuple(ignore)
    renamed: dict[str, np.ndarray] = {}
    for key, value in state_dict.items():
        if ignore and key.endswith(ignore):
            continue
        new = rename(key) if rename else key
        if new is not None:
            renamed[new] = value

    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    missing, misshapen, used = [], [], set()
    updates = {}
    for path, var in flat:
        key = torch_key(path)
        if key not in renamed:
            missing.append(key)
            continue
        used.add(key)
        array = to_nnx_layout(str(path[-1]), renamed[key])
        target = var.get_value()
        if tuple(array.shape) != tuple(target.shape):
            misshapen.append(f"{key} {tuple(renamed[key].shape)} -> expected {tuple(target.shape)}")
            continue
        want = (
            dtype
            if (dtype is not None and jax.numpy.issubdtype(array.dtype, jax.numpy.floating))
            else target.dtype
        )
        array = np.asarray(array).astype(want, copy=False)
        # device_put, not jnp.asarray: that stages the array through a program compiled per shape and dtype
        # (48 of them for the tiny SDXL, about 1 s of a process's first load).
        updates[path] = place(path, array) if place else jax.device_put(array)
    unexpected = sorted(set(renamed) - used)
    if missing or unexpected or misshapen:
        raise CheckpointMismatchError(where or type(module).__name__, sorted(missing), unexpected, misshapen)
    for path, var in flat:
        var.set_value(updates[path])


def export_weights(module: nnx.Module, rename: Callable[[str], str] | None = None) -> dict[str, np.ndarray]:
    """The module's parameters as a PyTorch-named, PyTorch-layout state dict (the inverse of load_weights)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        key = torch_key(path)
        key = rename(key) if rename else key
        out[key] = np.ascontiguousarray(to_torch_layout(str(path[-1]), np.asarray(var.get_value())))
    return out


class _ShapeOnlyRngs:
    """Stands in for nnx.Rngs when only shapes are wanted: every stream returns one fixed key.

    Under tracing, each draw from a real nnx.Rngs updates its counter, and that update asks the tracer for a
    `sharding` it does not have; the AttributeError's message walks the whole trace so far, so building a
    module abstractly is quadratic in its parameter count (13.3 s for the tiny test UNet on 2 cores,
    1.4 s with this stand-in; measured). The values are never used: load_weights replaces them all.
    """

    def __init__(self):
        self._key = jax.random.key(0)

    def __call__(self):
        return self._key

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._key


def abstract_module(cls: type[nnx.Module], *args, **kwargs) -> nnx.Module:
    """`cls(*args, **kwargs, rngs=...)` built with shapes only (no random initialisation), ready for
    load_weights: a new module on every call, which load_weights then fills.

    Building one traces every initialiser of the model (the tiny SDXL's UNet: 0.4-0.7 s on 2 cores; its second
    load in a process 1.09 -> 0.37 s), so the structure is built once per class and arguments in a process and
    each call merges a copy from it (13 ms): a process that loads a model again (a test suite, a pool
    reloading a folder) does not trace it again. Every Variable is the new module's own (`copy=True`: merged
    without it, two loads shared them and the second's weights replaced the first's). Arguments that cannot
    be hashed build it every time."""
    key = (cls, args, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return _abstract(cls, args, kwargs)
    return nnx.merge(*_abstract_parts(key), copy=True)


@functools.lru_cache(maxsize=64)
def _abstract_parts(key: tuple) -> tuple:
    cls, args, kwargs = key
    return nnx.split(_abstract(cls, args, dict(kwargs)))


def _abstract(cls: type[nnx.Module], args: tuple, kwargs: dict) -> nnx.Module:
    return nnx.eval_shape(lambda: cls(*args, **kwargs, rngs=_ShapeOnlyRngs()))
