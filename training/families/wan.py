"""tiny-wan: Wan 2.1's text-to-video architecture (UMT5 text, the 3D causal VAE, the DiT with cross-attention,
flow matching with its shift 3) trained on 9-frame clips of the shapes moving (training/clips.py): "a red circle
moving left on a blue background", up, down, right, or still.

Sizes: a VAE that halves three times in space and twice in time, as Wan 2.1's does (64x64x9 clips, 3 x 8 x 8
latents of 16 channels: Wan 2.1's z_dim), the real (1, 2, 2) patch (3 x 4 x 4 = 48 tokens of 16 x 16 pixels,
Wan 2.1's own ratio), and a transformer of width 96 (4 heads of 24, so tensor 2/4 and Ulysses 2/4 divide the
heads) with 3 blocks. Why 16-pixel tokens: Wan's DiT has no absolute position (RoPE gives relative offsets
only, the cross-attention none, the patch embedding pads nothing), so from noise it can place a centred shape
only by what the grid's edges tell it; on a 4 x 4 grid every token is at most one token from an edge. With
8-pixel tokens (an 8 x 8 grid, the VAE halving twice) every run drew blurs and ignored the direction word
(docs/embedded-model.md). The UMT5 text is 16 tokens, the folder's
serving default `max_sequence_length` (Wan zero-pads each prompt's states to that length and attends the
zeros, so the model is served at the length it was trained at). Captions dropped to "" at
`caption_dropout` train the unconditioned branch of Wan's CFG (the pipeline's empty negative prompt).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshserve.models.checkpoints.embedded_folder import write_component, write_json, write_model_index
from meshserve.models.components import t5
from meshserve.models.components.t5_tokenizer import load_t5_tokenizer
from meshserve.models.wan import autoencoder_kl_wan as wan_vae
from meshserve.models.wan import random_tiny
from meshserve.models.wan import transformer_wan as wan
from meshserve.models.wan.text import encode_wan_prompts, tokenize_wan_prompts
from meshserve.training import caption_tokenizer, clips, objectives
from meshserve.training.families.base import Component, TrainingFamily
from meshserve.training.recipe import Recipe

SIZE, FRAMES = 64, 9
# The recipe's (Family's spatial_halvings 3); dim_mult, temperal_downsample and scale_factor_spatial follow
# spatial_halvings (Family._vae_config).
VAE = dict(
    base_dim=16,
    z_dim=16,
    dim_mult=[1, 2, 2, 4],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True, True, False],
    dropout=0.0,
    scale_factor_temporal=4,
    scale_factor_spatial=8,
    # latents_mean and latents_std come from the trained VAE's latents (latent_normalisation).
)
TRANSFORMER = dict(
    patch_size=[1, 2, 2],
    num_attention_heads=4,
    attention_head_dim=24,
    in_channels=16,
    out_channels=16,
    text_dim=32,
    freq_dim=64,
    ffn_dim=384,
    num_layers=3,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=32,
)
# The random tiny Wan's UMT5 (d_model 32 = text_dim; its vocabulary is this tokenizer's) and Wan 2.1's
# scheduler_config.json (UniPC in its flow-matching form, shift 3).
UMT5, SCHEDULER = random_tiny.UMT5, random_tiny.SCHEDULER
MAX_SEQUENCE_LENGTH = 16
SERVING_DEFAULTS = dict(
    width=SIZE, height=SIZE, num_inference_steps=20, max_sequence_length=MAX_SEQUENCE_LENGTH
)


class Family(TrainingFamily):
    name = "wan"
    # vae_crop 32, vae_steps 1,000: the VAE trains on 32 x 32 crops of the clips (Recipe.vae_crop), 0.9 s a step
    # of 8 on a 2-core Xeon, a quarter of a step on whole 64 x 64 clips (1.5 against 5.7 s, both beside another
    # run), so the run fits Wan's 45 minutes on the slower machines too; it gives back held-out clips with the
    # shape readable in 100 % (the 900 whole-clip steps before: 84 %), and the denoiser on its latents drew
    # shape 78 % (67 % before). denoiser_steps 21,000 (0.07 s a step of 16 with 48 tokens there): on a 600-step
    # whole-clip VAE, 6,000 steps drew held-out direction 35 % (most clips still), 24,000 drew 100 %
    # (docs/embedded-model.md). The whole run: 43.1 minutes on that Xeon.
    # The rest comes from the 8-pixel-token runs: denoiser_lr 5e-3, not the shared 1e-3 (the DiT must grow a
    # shape where the noise leans; that came 3x as often in training/wan_probes.py's probe at 3-6e-3); vae_lr
    # 3e-3 (the same denoiser stage drew held-out colour 65 % on it against 38 % on a 1e-3 VAE, one pair of
    # runs); latent_pool 4,096 (the frozen encoder was 0.67 of a 0.97 s step of 16; drawn from a pool encoded
    # once, a step cost a third).
    recipe = Recipe(
        vae_steps=1000,
        vae_batch=8,
        vae_crop=32,
        vae_lr=3e-3,
        denoiser_steps=21000,
        denoiser_batch=16,
        denoiser_lr=5e-3,
        latent_pool=4096,
    )
    vae = Component(
        "vae",
        wan_vae.AutoencoderKLWan,
        wan_vae.AutoencoderKLWanConfig,
        wan_vae.SHARDING_RULES,
        training_attributes=(("unroll_chunks", True),),
    )
    denoiser = (
        Component("transformer", wan.WanTransformer3DModel, wan.WanTransformer3DConfig, wan.SHARDING_RULES),
        Component("text_encoder", t5.T5EncoderModel, t5.T5Config, t5.SHARDING_RULES),
    )
    command = "meshserve train-embedded --family wan --out models/wan/weights/tiny-wan --seed 0"

    def __init__(
        self,
        frames: int = FRAMES,
        *,
        anywhere: bool = False,
        flow_shift: float = SCHEDULER["flow_shift"],
        logit_normal: float = 0.0,
        sizes: tuple[str, ...] = clips.CLIP_SIZES,
        spatial_halvings: int = 3,
        patch: tuple[int, int, int] = (1, 2, 2),
    ):
        """Clips of `frames` frames (1 + 4k, whole latent frames; the tests train on 5 to cut the compile).
        The rest are for recipe trials (docs/embedded-model.md: what each gave): `anywhere` places the clips'
        paths anywhere they fit instead of through the centre (clips.clip_batch), `flow_shift` is the shift
        of both the training sigmas and the folder's scheduler, and a `logit_normal` share of the training
        rows draws its sigma from SD3's logit-normal (objectives.flow_matching), `sizes` are the shape
        sizes the clips draw from, `spatial_halvings` is how often the VAE halves height and width (its
        levels; time is halved twice at the first two, as in the recipe) and `patch` the DiT's patch_size."""
        if frames < 5 or (frames - 1) % 4:
            raise ValueError(f"frames must be 1 + 4k and at least 5, not {frames}")
        self.frames, self.anywhere = frames, anywhere
        self.flow_shift, self.logit_normal, self.sizes = flow_shift, logit_normal, tuple(sizes)
        if spatial_halvings < 2:
            raise ValueError(
                f"the VAE halves time twice, so it needs at least 2 levels, not {spatial_halvings}"
            )
        self.spatial_halvings, self.patch = spatial_halvings, tuple(patch)

    def data(self, rng, batch):
        return clips.clip_batch(rng, batch, self.frames, SIZE, anywhere=self.anywhere, sizes=self.sizes)

    def scene(self, caption):
        return clips.still_caption(caption)

    def write_tokenizers(self, out: Path) -> None:
        words = (*caption_tokenizer.WORDS, *clips.CLIP_WORDS)
        self.vocab = caption_tokenizer.build_caption_t5_tokenizer(out / "tokenizer", words)
        self.tokenizer = load_t5_tokenizer(out / "tokenizer")
        c = TRANSFORMER
        pt, ph, pw = self.patch
        side = SIZE // 2**self.spatial_halvings
        grid = (((self.frames - 1) // 4 + 1) // pt, side // ph, side // pw)
        self.rope = wan.wan_rope(grid, c["attention_head_dim"], c["rope_max_seq_len"])

    def configs(self):
        umt5 = {"architectures": ["UMT5EncoderModel"], "model_type": "umt5", "is_encoder_decoder": True}
        return {
            "vae": {"_class_name": "AutoencoderKLWan", **self._vae_config()},
            "transformer": {
                "_class_name": "WanTransformer3DModel",
                **TRANSFORMER,
                "patch_size": list(self.patch),
            },
            "text_encoder": {**umt5, **UMT5, "vocab_size": self.vocab},
        }

    def _vae_config(self) -> dict:
        """The VAE with `spatial_halvings` levels: the first two halve time as well as space (16 and 32 channels),
        each further one space alone (32, then 64)."""
        extra = self.spatial_halvings - 2
        return dict(
            VAE,
            dim_mult=[1, 2, 2, *[4] * extra],
            temperal_downsample=[True, True, *[False] * extra],
            scale_factor_spatial=2**self.spatial_halvings,
        )

    def latent_normalisation(self, latents):
        # Wan's pipeline decodes latents / (1 / latents_std) + latents_mean, per channel.
        mean, std = latents.mean(axis=(0, 1, 2, 3)), latents.std(axis=(0, 1, 2, 3))
        update = {"latents_mean": [float(v) for v in mean], "latents_std": [float(v) for v in std]}
        return update, mean, 1.0 / std

    def objective(self):
        return objectives.flow_matching(self.flow_shift, self.logit_normal)

    def text_inputs(self, captions, keep):
        captions = [c if k else "" for c, k in zip(captions, keep, strict=True)]
        tokens = tokenize_wan_prompts(self.tokenizer, captions, MAX_SEQUENCE_LENGTH)
        return {"ids": tokens.input_ids, "mask": tokens.attention_mask}

    def predict(self, modules, noisy, t, inputs):
        embeds = encode_wan_prompts(modules["text_encoder"], inputs["ids"], inputs["mask"])
        # The transformer takes the scheduler's timestep, sigma x 1000.
        return modules["transformer"](noisy, t * 1000.0, embeds, self.rope)

    def read_vae(self, folder):
        return wan_vae.diffusers_to_ours(super().read_vae(folder))

    def write_folder(self, out, configs, weights, record):
        # The VAE is stored in float16: in float32 (8.1 MB) it made the folder 10.4 MB, over the 10 MB a shipped
        # model may weigh; in float16 4.1 MB (6.4 MB in all). Loaders cast it back to the pipeline's dtype; on
        # the 2026-11-28 weights every pixel of three clips stayed within 1/255 of the float32 VAE's and the
        # held-out adherence was unchanged (docs/embedded-model.md).
        vae = {k: v.astype(np.float16) for k, v in random_tiny.vae_to_diffusers(weights["vae"]).items()}
        weights = dict(weights, vae=vae)
        entries = {name: write_component(out / name, configs[name], w) for name, w in weights.items()}
        write_model_index(
            out,
            "WanPipeline",
            entries,
            tokenizers={"tokenizer": "T5TokenizerFast"},
            scheduler=("UniPCMultistepScheduler", dict(SCHEDULER, flow_shift=self.flow_shift)),
        )
        defaults = dict(SERVING_DEFAULTS, num_frames=self.frames)
        write_json(out, {"defaults": defaults, "training": record}, "meshserve.json")
