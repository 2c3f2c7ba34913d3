"""The training hyperparameters: every run is a function of a family's recipe and the seed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator


class Recipe(BaseModel):
    """Both stages' steps, batch sizes and learning rates (each family's defaults: training/families/)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    vae_steps: int = 600
    vae_batch: int = 16
    vae_lr: float = 1e-3
    vae_kl_weight: float = 1e-6
    # 0: the VAE trains on whole pictures (clips). N: on a random N x N crop of each (one crop through all of a
    # clip's frames), so a step costs about (N / side)^2 of a whole one. The VAEs are convolutional but for
    # their middle block's attention, and the weights serve whole pictures (tiny-wan, trained on 32 x 32 crops
    # of 64 x 64 clips, gives back whole held-out clips better than on whole ones: docs/embedded-model.md).
    # A multiple of 8: every family's VAE halves at most three times.
    vae_crop: int = 0
    denoiser_steps: int = 2000
    denoiser_batch: int = 32
    denoiser_lr: float = 1e-3
    # 0: the denoiser stage encodes each step's fresh pictures with the frozen VAE. N: it encodes N pictures
    # once, after the VAE stage, and draws each step's rows from them (a new posterior sample every time),
    # for when the encoder costs more than the denoiser's step (Wan's: 0.67 of the 0.97 s per step of 16).
    latent_pool: int = 0
    # Pictures (Wan: clips) the trained VAE encodes once to measure its latents' per-channel statistics, the
    # normalisation written to its config. The tests' 2-step runs take a few: 512 Wan clips are most of such
    # a run's forward work.
    latent_stats: int = 512
    # 0: every denoiser step draws its rows from the whole pool. N: the first N steps draw from a prefix of the
    # pool grouped by scene (TrainingFamily.scene: a clip's scene without its motion; train_shapes.
    # curriculum_order), which widens geometrically from `curriculum_start` clips (about two scenes in every
    # motion) to the whole pool. A trial, off in every recipe: the tiny Wan DiT learnt every direction of one
    # scene in 1,000 steps (training/wan_probes.py motion), but widening over 3,000 of 6,000 steps left tiny-wan
    # painting the shape's colour on the background (held-out background 14-22 % against 100 % without).
    curriculum_steps: int = 0
    curriculum_start: int = 32
    warmup_steps: int = 200
    weight_decay: float = 1e-4
    caption_dropout: float = 0.1  # rows trained unconditioned, for classifier-free guidance
    ema_decay: float = 0.999

    @model_validator(mode="after")
    def _crop_fits_the_vae(self):
        if self.vae_crop % 8 or self.vae_crop < 0:
            raise ValueError(f"vae_crop must be 0 or a positive multiple of 8, not {self.vae_crop}")
        return self

    @model_validator(mode="after")
    def _curriculum_needs_a_pool(self):
        if self.curriculum_steps and not self.latent_pool:
            raise ValueError("a curriculum draws from the latent pool: set latent_pool too")
        return self
