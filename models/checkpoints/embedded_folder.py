"""Writing an embedded tiny model's diffusers pipeline folder, and building it once into the cache.

What models/flux/embedded.py (tiny Flux) and models/wan/embedded.py (tiny Wan) share, and the embedded SDXL's
training script (training/train_shapes.py) writes its folder with: random weights for our NNX modules, filled by numpy from a seed and named and laid out as PyTorch has
them (random_weights); each component written as its library writes it, config.json beside its safetensors
(RandomComponent); the scheduler's config and model_index.json (write_pipeline_folder); and the build-once
cache folder keyed by the model's VERSION, made by an atomic rename (cached_model_folder).

Each builder keeps its own architecture constants, tokenizers and the renames that make our parameter names
the checkpoint's. The constants stay per model on purpose, even where two models' sizes coincide (the tiny
CLIP of SDXL and Flux, the tiny T5 of Flux and Wan): a model's cache folder is keyed by its own VERSION, so a
constant shared between models could change one model's bytes without its VERSION being bumped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.checkpoints.loading import (
    abstract_module,
    to_torch_layout,
    torch_key,
    write_safetensors,
)


def cache_root() -> Path:
    """$MESHSERVE_CACHE, else $XDG_CACHE_HOME/meshserve (~/.cache/meshserve)."""
    base = os.environ.get("MESHSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "meshserve"
    )
    return Path(base)


def cached_model_folder(version: str, write: Callable[[Path], object]) -> Path:
    """The folder `cache_root()/models/<version>`, written by `write(folder)` on first use and reused after.

    `write` fills a fresh temporary folder beside the target, which is then renamed into place: two processes
    starting at once never see half a folder, and the one that loses the race uses the winner's (identical)
    folder. A folder counts as built once its model_index.json exists.
    """
    path = cache_root() / "models" / version
    if (path / "model_index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=path.parent))
    try:
        write(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its folder is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def random_weights(module: nnx.Module, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """PyTorch-named, PyTorch-layout random weights for an (abstract) module, by numpy alone.

    numpy rather than the modules' own initialisers: eager JAX init dispatches one small program per
    parameter (46 s for the tiny SDXL on 2 cores, measured), numpy takes well under a second, and
    numpy's generator gives the same bits on every platform. Kernels ~ N(0, 1/fan_in), norms 1, biases 0.
    """
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        leaf, shape = str(path[-1]), tuple(var.get_value().shape)
        if leaf == "scale":
            value = np.ones(shape, np.float32)
        elif leaf == "bias":
            value = np.zeros(shape, np.float32)
        else:
            fan_in = int(np.prod(shape[:-1])) if leaf == "kernel" else shape[-1]
            value = (rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))).astype(np.float32)
        out[torch_key(path)] = np.ascontiguousarray(to_torch_layout(leaf, value))
    return out


def clip_text_config(architecture: str, vocab_size: int, sizes: dict) -> dict:
    """A transformers CLIP text encoder's config.json for the tiny CLIP tokenizer's vocabulary
    (models/components/clip_tokenizer.py): <|startoftext|> and <|endoftext|> are its last two ids, and the pooled output
    reads the first end-of-text token, which also pads."""
    return {
        "architectures": [architecture],
        "model_type": "clip_text_model",
        "vocab_size": vocab_size,
        "bos_token_id": vocab_size - 2,
        "eos_token_id": vocab_size - 1,
        "pad_token_id": vocab_size - 1,
        **sizes,
    }


def write_json(folder: Path, config: dict, name: str = "config.json") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(config, indent=2))


# Our parameter names and layouts -> the checkpoint's, where a component's differ from what random_weights
# gives; the generator is the component's own, continued after its weights.
ToCheckpoint = Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]]


@dataclass(frozen=True)
class RandomComponent:
    """One model component of a pipeline folder: our NNX class built from `config` (its config.json) with
    random weights."""

    name: str
    module_cls: type[nnx.Module]
    config_cls: type
    config: dict
    to_checkpoint: ToCheckpoint | None = None

    def write(self, folder: Path, rng: np.random.Generator) -> list[str]:
        config = self.config_cls.from_config(self.config)
        module = abstract_module(self.module_cls, config, dtype=jnp.float32)
        weights = random_weights(module, rng)
        if self.to_checkpoint is not None:
            weights = self.to_checkpoint(weights, rng)
        return write_component(folder, self.config, weights)


def write_component(folder: Path, config: dict, weights: dict[str, np.ndarray]) -> list[str]:
    """config.json and the weights (PyTorch names and layout) of one component, named as its library names
    them; returns its model_index.json entry. A diffusers config names its `_class_name`, a transformers one
    its `architectures`."""
    if "_class_name" in config:
        entry, weights_name = ["diffusers", config["_class_name"]], "diffusion_pytorch_model.safetensors"
    else:
        entry, weights_name = ["transformers", config["architectures"][0]], "model.safetensors"
    write_json(folder, config)
    write_safetensors(folder / weights_name, weights)
    return entry


def write_pipeline_folder(
    out: Path,
    pipeline_class: str,
    components: list[RandomComponent],
    *,
    tokenizers: dict[str, str],
    scheduler: tuple[str, dict],
    seed: int,
    pipeline_config: dict | None = None,
) -> Path:
    """The rest of a diffusers pipeline folder beside its tokenizers (already written, by their builders):
    each component with weights from `np.random.default_rng(seed + i)` (i its place in `components`), the
    scheduler's config and model_index.json (write_model_index)."""
    out = Path(out)
    entries = {
        c.name: c.write(out / c.name, np.random.default_rng(seed + i)) for i, c in enumerate(components)
    }
    return write_model_index(
        out,
        pipeline_class,
        entries,
        tokenizers=tokenizers,
        scheduler=scheduler,
        pipeline_config=pipeline_config,
    )


def write_model_index(
    out: Path,
    pipeline_class: str,
    components: dict[str, list[str]],
    *,
    tokenizers: dict[str, str],
    scheduler: tuple[str, dict],
    pipeline_config: dict | None = None,
) -> Path:
    """The scheduler's config and model_index.json of a pipeline folder whose components (name -> their
    model_index entry, from write_component) and tokenizers are written. diffusers writes the entries sorted by
    name after the pipeline's own settings (`pipeline_config`)."""
    out = Path(out)
    scheduler_class, scheduler_config = scheduler
    entries = {"scheduler": ["diffusers", scheduler_class]}
    entries |= {name: ["transformers", cls] for name, cls in tokenizers.items()}
    entries |= components
    write_json(
        out / "scheduler", {"_class_name": scheduler_class, **scheduler_config}, "scheduler_config.json"
    )
    model_index = {"_class_name": pipeline_class, **(pipeline_config or {}), **dict(sorted(entries.items()))}
    write_json(out, model_index, "model_index.json")
    return out
