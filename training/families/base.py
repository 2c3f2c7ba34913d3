"""What a family gives the training loop (training/train_shapes.py): its data, tokenizers, architecture, the
latent normalisation its pipeline undoes, its objective and forward pass, and the folder it is served from.

The loop is the same for every family: a VAE stage (reconstruction + KL, on the family's pictures or clips),
the latents' statistics, then the denoiser and its text encoders on the frozen VAE's normalised latents.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshserve.training.objectives import Objective
from meshserve.training.recipe import Recipe


@dataclass(frozen=True)
class Component:
    """A trained module: its folder name in the diffusers folder, our NNX class, its config class and the
    serving pipeline's rules table (the weights are placed as the pipeline places them)."""

    name: str
    module_cls: type
    config_cls: type
    rules: object
    # Plain attributes set on the module for training only (not written to the folder), e.g. Wan's VAE
    # unrolling its chunk scans.
    training_attributes: tuple[tuple[str, object], ...] = ()


class TrainingFamily(ABC):
    name: str
    recipe: Recipe
    vae: Component
    # Trained together in stage 2; the first is the denoiser.
    denoiser: tuple[Component, ...]
    # The command that makes the shipped weights (written into the docs and the embedded model's module).
    command: str

    @abstractmethod
    def data(self, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, list[str]]:
        """float32 pixels in [-1, 1] ([B, H, W, 3] pictures or [B, F, H, W, 3] clips) and their captions."""

    def scene(self, caption: str) -> str:
        """What a curriculum (Recipe.curriculum_steps) groups a pool's rows by: the caption itself, unless a
        family's captions vary inside one scene."""
        return caption

    @abstractmethod
    def write_tokenizers(self, out: Path) -> None:
        """Writes the folder's tokenizers and loads them for `text_inputs`."""

    @abstractmethod
    def configs(self) -> dict[str, dict]:
        """Each component's config.json (after write_tokenizers: the text encoders' vocabularies)."""

    @abstractmethod
    def latent_normalisation(self, latents: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
        """From the VAE's latents (means of a probe batch): (the VAE config's update, shift, scale) such that
        the denoiser learns (z - shift) * scale, exactly what the pipeline undoes before decoding."""

    @abstractmethod
    def objective(self) -> Objective: ...

    @abstractmethod
    def text_inputs(self, captions: list[str], keep: np.ndarray) -> dict[str, np.ndarray]:
        """Token ids (and masks) per row; `keep` 0 marks a row trained unconditioned."""

    @abstractmethod
    def predict(self, modules: dict, noisy, t, inputs: dict):
        """The denoiser's output for noisy latents at t, from the text encoders' outputs on `inputs`, as the
        serving pipeline computes it."""

    def read_vae(self, folder: Path) -> dict[str, np.ndarray]:
        """The VAE weights a run wrote to `folder`, named as `vae`'s module exports them (undoing what
        write_folder changed)."""
        from meshserve.models.checkpoints.loading import read_component_weights

        return read_component_weights(Path(folder) / self.vae.name)

    @abstractmethod
    def write_folder(self, out: Path, configs: dict, weights: dict, record: dict) -> None:
        """The diffusers folder (tokenizers already in it): `weights` are each component's exported state
        (PyTorch names and layout), and meshserve.json gets the serving defaults and the run's record."""
