"""LoRA files as people publish them -> one adapter: {diffusers module name: (A [in, r], B [r, out])}.

    factors = read_adapter(source, family="sdxl", targets=...)   # alpha / rank already folded into B

Layouts read (the key mapping follows diffusers' loaders/lora_conversion_utils.py; diffusers is not imported):

- diffusers / PEFT (`save_lora_weights`): `unet.<module>.lora_A.weight` / `.lora_B.weight` (Flux and Wan:
  `transformer.`), the older `.lora.down.weight` / `.lora.up.weight` and attention-processor keys
  (`attn1.processor.to_q_lora.down.weight`); a module's `.alpha` when present, else alpha = rank (diffusers'
  `load_lora_weights` on a file without adapter metadata). A `lora_adapter_metadata` entry in the file's
  safetensors metadata (diffusers >= 0.35 writes it) gives `lora_alpha` (and `alpha_pattern`) per module.
- kohya / A1111, SDXL: `lora_unet_<module with "_" for ".">.lora_down.weight` / `.lora_up.weight` / `.alpha`
  (diffusers' `_convert_non_diffusers_lora_to_diffusers` for the diffusers-named UNet). A kohya name is
  matched against the model's own module names written that way, which is the converter's "_" -> "."
  undone exactly, without its guesses. The SGM-named layout (`lora_unet_input_blocks_4_1_...`, what kohya's
  sd-scripts write for SDXL) is first renamed to that form from the UNet's block layout (models/lora/sgm_names.py).
- kohya, Flux: `lora_unet_double_blocks_<i>_img_attn_qkv...` (`_convert_kohya_flux_lora_to_diffusers`): the
  fused q/k/v and single blocks' linear1 (q, k, v, proj_mlp) split by output rows, the down matrix shared.
- Text encoders, for the family's CLIP encoders (`text_encoders`: SDXL's text_encoder and text_encoder_2,
  Flux's text_encoder): diffusers/PEFT `text_encoder.<module>.lora_A/B.weight` (`text_encoder_2.` likewise;
  the module with or without transformers 4's `text_model.` prefix, as diffusers accepts both), the older
  converted keys (`self_attn.to_q_lora.down.weight`, `mlp.fc1.lora_linear_layer.down.weight`), and kohya
  `lora_te_` / `lora_te1_` (text_encoder) and `lora_te2_` (text_encoder_2) + the module with "_" for "."
  (diffusers' `_convert_non_diffusers_lora_to_diffusers` and, for Flux's CLIP, the text-encoder part of
  `_convert_kohya_flux_lora_to_diffusers`), matched against the encoder's own module names. Refused with a
  message naming the key: an encoder the family does not adapt (Flux's T5 `text_encoder_2` / `lora_te2_`,
  Wan's umT5 `text_encoder`, SD3's `lora_te3_`).

alpha / rank is folded into B, as diffusers' scaling (lora_alpha / r, or lora_alpha / sqrt(r) with the
metadata's `use_rslora`) multiplies the adapter's output. The metadata's `alpha_pattern` keys are regexes,
matched as PEFT's `get_pattern_key` does (the first key in the file's order for which
`(.*\\.)?(<key>)$` matches the module's name inside its component).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from meshserve.models.checkpoints.loading import read_safetensors
from meshserve.models.engine.common import PipelineError


class AdapterFormatError(PipelineError):
    """A LoRA file that does not fit the model: unknown keys, wrong shapes, an unsupported layout."""


_PREFIXES = ("unet.", "transformer.")
# kohya's text-encoder prefixes -> the diffusers component (lora_te_ is SD 1.x's and Flux's single CLIP).
_KOHYA_TEXT = {"lora_te_": "text_encoder", "lora_te1_": "text_encoder", "lora_te2_": "text_encoder_2"}
_KOHYA_TEXT_OTHER = ("lora_te3_",)
# What a refused encoder is, for the message.
_ENCODER_KINDS = {("flux", "text_encoder_2"): "T5", ("wan", "text_encoder"): "umT5"}


def _text_component(key: str) -> str | None:
    """The text encoder a LoRA key is for (diffusers' component name), or None for the denoiser's keys."""
    m = re.match(r"(text_encoder(?:_\d+)?)\.", key)
    if m:
        return m[1]
    for prefix, component in _KOHYA_TEXT.items():
        if key.startswith(prefix):
            return component
    if key.startswith(_KOHYA_TEXT_OTHER):
        return "text_encoder_3"
    return None


# --------------------------------------------------------------------------------------------------
# Reading


def read_source(source) -> tuple[dict[str, np.ndarray], dict]:
    """A folder holding one .safetensors file (diffusers' `pytorch_lora_weights.safetensors` preferred), a
    file, or a Hub id `owner/name[/file.safetensors]` -> (tensors as float32, the file's metadata)."""
    path = Path(str(source)).expanduser()
    if not path.exists():
        path = download_from_hub(str(source))
    path = _weights_file(path)
    try:
        tensors = read_safetensors(path)
        metadata = _metadata(path)
    except Exception as e:  # a truncated or foreign file
        raise AdapterFormatError(f"{path}: not a readable safetensors file ({e})") from e
    return {k: np.asarray(v, np.float32) for k, v in tensors.items()}, metadata


def _weights_file(path: Path) -> Path:
    """A LoRA folder's one .safetensors file (diffusers' `pytorch_lora_weights.safetensors` preferred), or the
    file itself."""
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        preferred = [f for f in files if f.name == "pytorch_lora_weights.safetensors"]
        if not files:
            raise AdapterFormatError(f"{path}: no .safetensors file in the folder")
        if len(files) > 1 and not preferred:
            raise AdapterFormatError(
                f"{path}: several .safetensors files ({', '.join(f.name for f in files)}); name one"
            )
        path = (preferred or files)[0]
    if path.suffix != ".safetensors":
        raise AdapterFormatError(f"{path}: LoRA weights must be a .safetensors file")
    return path


def has_conv_factors(path) -> bool:
    """Whether a local LoRA file or folder holds 4-D (conv) factors, which a pool loads only with lora_convs,
    read from the file's header alone (loading reads the tensors once, after); False for anything unreadable
    (loading it then says why) or not on this machine (a Hub id: not fetched)."""
    path = Path(str(path)).expanduser()
    if not path.exists():
        return False
    try:
        header = _header(_weights_file(path))
    except (AdapterFormatError, OSError, ValueError):
        return False
    return any(
        isinstance(entry, dict) and len(entry.get("shape", ())) == 4
        for key, entry in header.items()
        if key != "__metadata__"
    )


def _header(path: Path) -> dict:
    """A safetensors file's JSON header: {tensor: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}."""
    import struct

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        return json.loads(f.read(n))


def _metadata(path: Path) -> dict:
    return _header(path).get("__metadata__", {}) or {}


def download_from_hub(spec: str) -> Path:
    """`owner/name` (the repo's one .safetensors file) or `owner/name/file.safetensors`, via the Hub cache."""
    parts = spec.split("/")
    if len(parts) < 2 or not all(parts):
        raise AdapterFormatError(f"{spec!r} is neither a local file or folder nor a Hub id (owner/name)")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or None
    try:
        from huggingface_hub import hf_hub_download, list_repo_files

        if filename is None:
            names = [n for n in list_repo_files(repo_id) if n.endswith(".safetensors")]
            if len(names) != 1:
                raise AdapterFormatError(
                    f"{spec}: the repo has {len(names)} .safetensors files ({', '.join(names[:5])}); "
                    "name one as owner/name/file.safetensors"
                )
            filename = names[0]
        return Path(hf_hub_download(repo_id, filename))
    except AdapterFormatError:
        raise
    except Exception as e:
        raise AdapterFormatError(f"{spec}: could not fetch the LoRA from the Hub ({e})") from e


# --------------------------------------------------------------------------------------------------
# Layouts -> {module: (down [r, in], up [out, r], alpha or None)} in diffusers' module names


def _pairs_diffusers(tensors: dict) -> dict[str, dict]:
    modules: dict[str, dict] = {}
    for key, value in tensors.items():
        name = key
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        # attention processors of old diffusers files: attn1.processor.to_q_lora.down.weight
        m = re.match(r"(.*)\.processor\.(to_q|to_k|to_v|to_out)_lora\.(down|up)\.weight$", name)
        if m:
            module = m[1] + "." + (m[2] + ".0" if m[2] == "to_out" else m[2])
            modules.setdefault(module, {})[m[3]] = value
            continue
        # text encoders in diffusers' older converted keys: self_attn.to_q_lora.down.weight -> q_proj
        m = re.match(r"(.*\.self_attn)\.(to_q|to_k|to_v|to_out)_lora\.(down|up)\.weight$", name)
        if m:
            module = f"{m[1]}.{m[2][3:]}_proj"
            modules.setdefault(module, {})[m[3]] = value
            continue
        for suffix, part in (
            (".lora_A.weight", "down"),
            (".lora_B.weight", "up"),
            (".lora.down.weight", "down"),
            (".lora.up.weight", "up"),
            (".lora_down.weight", "down"),
            (".lora_up.weight", "up"),
            (".lora_linear_layer.down.weight", "down"),  # a text encoder's MLP, older converted keys
            (".lora_linear_layer.up.weight", "up"),
            (".alpha", "alpha"),
        ):
            if name.endswith(suffix):
                modules.setdefault(name[: -len(suffix)], {})[part] = value
                break
        else:
            raise AdapterFormatError(
                f"unknown LoRA key {key!r} (expected lora_A/lora_B or lora.down/up weights)"
            )
    return modules


# BFL (Flux original) module names in kohya files -> diffusers' modules, each with its share of the output rows
# (None: all of them). After diffusers' _convert_kohya_flux_lora_to_diffusers.
def _flux_kohya_targets(name: str, sizes) -> list[tuple[str, slice | None]] | None:
    m = re.fullmatch(r"double_blocks_(\d+)_(img|txt)_(attn_qkv|attn_proj|mlp_0|mlp_2|mod_lin)", name)
    if m:
        i, stream, part = m[1], m[2], m[3]
        b = f"transformer_blocks.{i}."
        if part == "attn_qkv":
            names = (
                ("attn.to_q", "attn.to_k", "attn.to_v")
                if stream == "img"
                else (
                    "attn.add_q_proj",
                    "attn.add_k_proj",
                    "attn.add_v_proj",
                )
            )
            return _split([b + n for n in names], sizes)
        ff = "ff" if stream == "img" else "ff_context"
        single = {
            "attn_proj": "attn.to_out.0" if stream == "img" else "attn.to_add_out",
            "mlp_0": f"{ff}.net.0.proj",
            "mlp_2": f"{ff}.net.2",
            "mod_lin": "norm1.linear" if stream == "img" else "norm1_context.linear",
        }[part]
        return [(b + single, None)]
    m = re.fullmatch(r"single_blocks_(\d+)_(linear1|linear2|modulation_lin)", name)
    if m:
        b = f"single_transformer_blocks.{m[1]}."
        if m[2] == "linear1":
            return _split([b + n for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")], sizes)
        return [(b + ("proj_out" if m[2] == "linear2" else "norm.linear"), None)]
    return None


def _split(names: list[str], sizes) -> list[tuple[str, slice]] | None:
    out, start = [], 0
    for name in names:
        size = sizes(name)
        if size is None:
            return None
        out.append((name, slice(start, start + size)))
        start += size
    return out


def _pairs_kohya(tensors: dict, family: str, targets: dict) -> dict[str, dict]:
    by_kohya = {}
    for name in targets:
        component = _text_component(name)
        if component is None:
            by_kohya["lora_unet_" + name.replace(".", "_")] = name
            continue
        module = name[len(component) + 1 :].replace(".", "_")
        for prefix, owner in _KOHYA_TEXT.items():
            if owner == component:
                by_kohya[prefix + module] = name
    modules: dict[str, dict] = {}
    for key, value in tensors.items():
        stem, _, part = key.partition(".")
        part = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}.get(part)
        if part is None:
            raise AdapterFormatError(
                f"unknown LoRA key {key!r} (expected lora_down/lora_up weights or alpha)"
            )
        if stem in by_kohya:
            modules.setdefault(by_kohya[stem], {})[part] = value
            continue
        if family == "flux" and stem.startswith("lora_unet_"):

            def out_size(name):
                return targets[name]["out"] if name in targets else None

            split = _flux_kohya_targets(stem.removeprefix("lora_unet_"), out_size)
            if split is not None:
                for name, rows in split:
                    entry = modules.setdefault(name, {})
                    if part == "up" and rows is not None:
                        total = split[-1][1].stop  # q, k, v (and proj_mlp): the fused layer's rows
                        if value.ndim != 2 or value.shape[0] != total:
                            raise AdapterFormatError(
                                f"{key}: up weight of shape {tuple(value.shape)}; the model's "
                                f"{stem.removeprefix('lora_unet_')} ({', '.join(n for n, _ in split)}) has "
                                f"{total} output rows"
                            )
                        entry[part] = value[rows]
                    else:
                        entry[part] = value
                continue
        raise AdapterFormatError(f"LoRA key {key!r} names no {family} module this model has")
    return modules


# --------------------------------------------------------------------------------------------------
# The adapter


def read_adapter(
    source,
    *,
    family: str,
    targets: dict,
    text_encoders: tuple[str, ...] = (),
    unet_layout: dict | None = None,
    refused: dict[str, str] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """source -> {module: (A [in, r], B [r, out] x alpha/r)} for the modules in `targets` ({module: {"in",
    "out"}}: the model's LoRA-able layers, diffusers' names; a text encoder's prefixed "text_encoder.").
    `text_encoders`: the components whose keys are read (others refused). `unet_layout`: a UNet's block layout
    (models/lora/sgm_names.sgm_to_diffusers's arguments), with which SGM-named kohya keys are renamed first.
    `refused`: {module: why} for layers of the model the pool does not adapt (its convs without lora_convs).
    AdapterFormatError naming the first bad key. A conv's factors (targets with "kernel" (kh, kw)) come back
    as A [kh kw in, r] (the kernel's HWI order) and B [r, out]."""
    refused = refused or {}
    tensors, metadata = read_source(source)
    if not tensors:
        raise AdapterFormatError(f"{source}: the file holds no tensors")
    if unet_layout is not None:
        from meshserve.models.lora.sgm_names import is_sgm, sgm_to_diffusers  # it imports this module

        if is_sgm(tensors):
            tensors = sgm_to_diffusers(tensors, **unet_layout)
    for key in tensors:
        component = _text_component(key)
        if component is not None and component not in text_encoders:
            kind = _ENCODER_KINDS.get((family, component))
            raise AdapterFormatError(
                f"text-encoder LoRA for {family}'s {component}{f' ({kind})' if kind else ''} is not "
                f"supported: {key!r} (this model adapts {list(text_encoders) or 'no text encoder'})"
            )
    kohya = any(k.startswith(("lora_unet_", *_KOHYA_TEXT)) for k in tensors)
    known = {**targets, **{name: {} for name in refused}}
    modules = _pairs_kohya(tensors, family, known) if kohya else _pairs_diffusers(tensors)
    alphas = _metadata_alphas(metadata)
    factors = {}
    for name, parts in list(modules.items()):
        component = _text_component(name)
        if component is not None and name not in targets:  # saved without transformers 4's text_model.
            alias = f"{component}.text_model.{name[len(component) + 1 :]}"
            if alias in targets and alias not in modules:
                name = alias
        if name in refused:
            raise AdapterFormatError(f"LoRA module {name!r} {refused[name]}")
        if name not in targets:
            raise AdapterFormatError(f"LoRA module {name!r} is no adaptable layer of this {family} model")
        if "down" not in parts or "up" not in parts:
            raise AdapterFormatError(
                f"LoRA module {name!r} lacks its {'up' if 'down' in parts else 'down'} weight"
            )
        down, up, want = parts["down"], parts["up"], targets[name]
        if down.ndim >= 1 and down.shape[0] < 1:
            raise AdapterFormatError(f"LoRA module {name!r}: rank 0 (down {down.shape} / up {up.shape})")
        if not (np.isfinite(down).all() and np.isfinite(up).all()):
            raise AdapterFormatError(f"LoRA module {name!r}: its factors hold NaN or infinite values")
        down, up = _as_layer_factors(name, down, up, want.get("kernel"))
        rank = down.shape[0]
        kh, kw = want.get("kernel") or (1, 1)
        if down.shape != (rank, want["in"] * kh * kw) or up.shape != (want["out"], rank):
            kernel = f" ({kh}x{kw} kernel)" if want.get("kernel") else ""
            raise AdapterFormatError(
                f"LoRA module {name!r}: down {parts['down'].shape} / up {parts['up'].shape} do not fit the "
                f"layer's {want['in']} inputs and {want['out']} outputs{kernel} at rank {rank}"
            )
        alpha = parts.get("alpha")
        if alpha is not None:
            if np.size(alpha) != 1 or not np.isfinite(alpha).all():
                raise AdapterFormatError(
                    f"LoRA module {name!r}: its alpha must be one finite number, got shape {np.shape(alpha)}"
                )
            scaling = float(np.asarray(alpha).reshape(())) / rank
        else:
            scaling = alphas(name, rank)
        factors[name] = (np.ascontiguousarray(down.T), np.ascontiguousarray(up.T) * np.float32(scaling))
    return factors


def _as_layer_factors(name: str, down: np.ndarray, up: np.ndarray, kernel):
    """A module's down / up weights as 2-D [r, in'] / [out, r], in' = in for a Linear and kh kw in (the kernel's
    HWI order, our conv kernels' HWIO layout) for a conv (`kernel` (kh, kw)): a conv's down is a torch conv
    weight [r, in, kh, kw] and its up a 1x1 conv [out, r, 1, 1] (PEFT's and kohya's LoCon); a 1x1 conv's
    factors may be 2-D, and a Linear's 4-D with 1x1 kernels (kohya writes either; diffusers 0.42.1 refuses such
    a PEFT-keyed file with a size mismatch, where these mean the same product)."""
    if kernel is None or tuple(kernel) == (1, 1):
        ok = down.ndim in (2, 4) and up.ndim in (2, 4)
        ok = ok and (down.ndim == 2 or down.shape[2:] == (1, 1)) and (up.ndim == 2 or up.shape[2:] == (1, 1))
        if not ok:
            raise AdapterFormatError(
                f"LoRA module {name!r}: weights of shape {down.shape} / {up.shape} for a layer with 1x1 inputs"
            )
        return down.reshape(down.shape[:2]), up.reshape(up.shape[:2])
    if down.ndim != 4 or up.ndim not in (2, 4) or (up.ndim == 4 and up.shape[2:] != (1, 1)):
        raise AdapterFormatError(
            f"LoRA module {name!r}: weights of shape {down.shape} / {up.shape}; a {kernel[0]}x{kernel[1]} conv "
            "takes a down conv [r, in, kh, kw] and an up 1x1 conv [out, r, 1, 1]"
        )
    if down.shape[2:] != tuple(kernel):
        raise AdapterFormatError(
            f"LoRA module {name!r}: down kernel {down.shape[2:]} for a {kernel[0]}x{kernel[1]} conv"
        )
    rank = down.shape[0]
    return down.transpose(0, 2, 3, 1).reshape(rank, -1), up.reshape(up.shape[:2])


def _metadata_alphas(metadata: dict):
    """diffusers' lora_adapter_metadata -> scaling(module, rank), the factor B is multiplied by: lora_alpha / r
    (lora_alpha / sqrt(r) with `use_rslora`, as PEFT's LoraLayer.update_layer); without metadata alpha = rank
    (scale 1), as diffusers loads such a file. The metadata is one LoraConfig per component, written flat with
    the component's prefix (`save_lora_weights`: {"unet.lora_alpha": 8, "text_encoder.lora_alpha": 4,
    "text_encoder.alpha_pattern": {...}}), nested ({"unet": {...}}), or unprefixed (one config for all); a
    module takes its own component's (a text encoder's for "text_encoder.<module>"). `alpha_pattern` keys are
    regexes, matched as PEFT's `get_pattern_key` (peft/utils/other.py): the first key, in the file's order,
    for which `re.match(rf"(.*\\.)?({key})$", module)` holds, the module named inside its component (a text
    encoder's with and without transformers 4's `text_model.`). The rank is the tensors' (PEFT's `r` /
    `rank_pattern` must agree with them for diffusers to load the file). Unreadable metadata or a field of the
    wrong type: AdapterFormatError naming the field."""
    raw = metadata.get("lora_adapter_metadata")
    config = {}
    if raw:
        try:
            config = json.loads(raw)
        except ValueError as e:
            raise AdapterFormatError(f"lora_adapter_metadata is not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise AdapterFormatError(
                f"lora_adapter_metadata must be a JSON object (a LoraConfig per component), got {type(config).__name__}"
            )
    components: dict[str, dict] = {}
    for key, value in config.items():
        head, dot, rest = key.partition(".")
        named = head in ("unet", "transformer") or head.startswith("text_encoder")
        if named and not dot and isinstance(value, dict):  # nested: {"unet": {...}}
            components.setdefault(head, {}).update({f"{head}.{k}": (k, v) for k, v in value.items()})
        elif named and dot:  # flat: {"unet.lora_alpha": ...}
            components.setdefault(head, {})[key] = (rest, value)
        else:  # one unprefixed config
            components.setdefault("", {})[key] = (key, value)
    parsed = {component: _lora_config(fields) for component, fields in components.items()}

    def scaling(name: str, rank: int) -> float:
        component = _text_component(name)
        if component is None:
            component = next((c for c in ("unet", "transformer") if c in parsed), "")
            inner = [name]
        else:
            inner = [name[len(component) + 1 :]]
            inner.append(
                inner[0].removeprefix("text_model.")
                if inner[0].startswith("text_model.")
                else f"text_model.{inner[0]}"
            )
        own = parsed.get(component) or parsed.get("", {})
        alpha = own.get("lora_alpha") or rank
        for pattern, value in own.get("alpha_pattern", ()):
            if any(pattern.match(n) for n in inner):
                alpha = value
                break
        return alpha / (np.sqrt(rank) if own.get("use_rslora") else rank)

    return scaling


def _lora_config(fields: dict) -> dict:
    """One component's metadata {written key: (LoraConfig field, value)} -> the fields read, checked:
    {"lora_alpha": float, "use_rslora": bool, "alpha_pattern": [(compiled PEFT pattern, float)]}."""
    out = {}
    for key, (field, value) in fields.items():
        if field == "lora_alpha":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise AdapterFormatError(f"lora_adapter_metadata: {key} must be a number, got {value!r}")
            out["lora_alpha"] = float(value)
        elif field == "use_rslora":
            if not isinstance(value, bool):
                raise AdapterFormatError(f"lora_adapter_metadata: {key} must be true or false, got {value!r}")
            out["use_rslora"] = value
        elif field == "alpha_pattern":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise AdapterFormatError(
                    f"lora_adapter_metadata: {key} must be an object {{module regex: alpha}}, got {value!r}"
                )
            patterns = []
            for pattern, alpha in value.items():
                if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not np.isfinite(alpha):
                    raise AdapterFormatError(
                        f"lora_adapter_metadata: {key}[{pattern!r}] must be a number, got {alpha!r}"
                    )
                try:  # PEFT's get_pattern_key: re.match(rf"(.*\.)?({key})$", module)
                    patterns.append((re.compile(rf"(.*\.)?({pattern})$"), float(alpha)))
                except re.error as e:
                    raise AdapterFormatError(
                        f"lora_adapter_metadata: {key} key {pattern!r} is not a regex ({e})"
                    ) from None
            out["alpha_pattern"] = patterns
    return out
