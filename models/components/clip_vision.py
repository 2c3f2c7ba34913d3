"""CLIP vision encoders in Flax NNX: `CLIPVisionModel` and `CLIPVisionModelWithProjection` (transformers'
names), and `CLIPImagePreprocessor`, transformers' CLIPImageProcessor in numpy/PIL.

Wan 2.1 image-to-video conditions its transformer on the PENULTIMATE hidden states of a CLIP ViT-H/14 (diffusers'
WanImageToVideoPipeline.encode_image reads `hidden_states[-2]`: 257 tokens of 1280 for a 224x224 crop), so the
last layer, the post-layernorm and the projection exist only for the checkpoint's keys; under jit they are dead
code. Nothing here knows about Wan.

Attribute names follow transformers 4's module tree (`vision_model.embeddings.patch_embedding`, ...,
`visual_projection`), the layout of every CLIP folder on the Hub. transformers 5 writes a plain CLIPVisionModel
without the `vision_model.` level; `load_clip_vision_model` accepts both.

Shapes: pixel_values [B, H, W, 3] channel-last (transformers takes [B, 3, H, W]); hidden states
[B, 1 + (H / patch)^2, D] (the class token first); pooled [B, D]; image_embeds [B, projection_dim].

The encoder layers are the text CLIP's (models/components/clip.py: the same pre-norm layer, MLP and weights)
with bidirectional attention: a vision transformer's tokens all see each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.attention import AttentionSettings, attention
from meshserve.models.checkpoints.loading import CheckpointError, read_json
from meshserve.models.components.clip import (
    CLIPMLP,
    CLIPAttention,
    CLIPEncoder,
    _layer_norm,
    check_encoder_config,
    load_clip_encoder,
)
from meshserve.models.components.clip import SHARDING_RULES as CLIP_TEXT_RULES

_DEFAULT_SETTINGS = AttentionSettings()

# Parameter path regex -> logical axes: the text CLIP's rules (models/components/clip.py says why FSDP only),
# which cover the shared encoder layers and the position embedding (their token_embedding and text_projection
# patterns match nothing here), and the vision tower's projection. 257 tokens once per video are a small share
# of a generation (ViT-H/14: 632 M parameters, 2.5 GB in fp32, which the split spreads over the FSDP axes).
SHARDING_RULES: tuple = CLIP_TEXT_RULES + ((r"visual_projection\.weight$", ("embed", None)),)

# transformers' CLIPVisionConfig defaults: a config.json written with only the non-default fields means these.
_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    num_channels=3,
    image_size=224,
    patch_size=32,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    projection_dim=512,
)


@dataclass(frozen=True)
class CLIPVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    projection_dim: int

    @classmethod
    def from_config(cls, config: dict) -> CLIPVisionConfig:
        """From an image encoder's config.json (or a full CLIPConfig's `vision_config`)."""
        config = config.get("vision_config", config)
        out = check_encoder_config(
            cls(**{name: config.get(name, default) for name, default in _DEFAULTS.items()})
        )
        if out.image_size % out.patch_size:
            raise ValueError(f"image_size {out.image_size} is not a multiple of patch_size {out.patch_size}")
        return out

    @property
    def num_positions(self) -> int:
        """The class token and one per patch."""
        return (self.image_size // self.patch_size) ** 2 + 1


class CLIPVisionOutput(NamedTuple):
    """A pytree, so a jitted call returns it whole; what the caller ignores is dead code under jit."""

    last_hidden_state: jax.Array  # [B, N, D], the last layer's output (no post_layernorm, as transformers')
    pooler_output: jax.Array  # [B, D], post_layernorm(last_hidden_state[:, 0]): the class token
    # The encoder's input (embeddings after pre_layrnorm), then every layer's output: num_hidden_layers + 1
    # arrays of [B, N, D], as transformers' output_hidden_states. Wan reads hidden_states[-2].
    hidden_states: tuple[jax.Array, ...]
    image_embeds: jax.Array | None = None  # [B, projection_dim], CLIPVisionModelWithProjection only


# --------------------------------------------------------------------------------------------------
# Blocks


class CLIPPatchEmbedding(nnx.Module):
    """transformers' `nn.Conv2d(C, D, kernel_size=patch, stride=patch, bias=False)` on channel-last pixels: with
    kernel = stride the convolution is one matmul per non-overlapping patch (patches row-major, as the conv's
    `flatten(2)`). Its kernel is stored [p, p, C, D] like any of our convs."""

    def __init__(self, channels: int, dim: int, patch: int, *, dtype, rngs: nnx.Rngs):
        self.patch = patch
        shape = (patch, patch, channels, dim)
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape, dtype))

    def __call__(self, x):  # [B, H, W, C] -> [B, (H / p) * (W / p), D]
        b, h, w, c = x.shape
        p = self.patch
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        kernel = self.kernel[...]
        return x @ kernel.reshape(-1, kernel.shape[-1])


class CLIPVisionEmbeddings(nnx.Module):
    """[class token; patch embeddings] + position embeddings (no interpolation: the image is the config's size)."""

    def __init__(self, config: CLIPVisionConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        self.image_size = c.image_size
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (c.hidden_size,), dtype))
        self.patch_embedding = CLIPPatchEmbedding(
            c.num_channels, c.hidden_size, c.patch_size, dtype=dtype, rngs=rngs
        )
        self.position_embedding = nnx.Embed(
            c.num_positions, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )

    def __call__(self, pixel_values):  # [B, H, W, C] -> [B, N, D]
        b, h, w, _ = pixel_values.shape
        if (h, w) != (self.image_size, self.image_size):
            raise ValueError(
                f"pixel_values are {h}x{w}; the model takes {self.image_size}x{self.image_size} "
                "(CLIPImagePreprocessor crops to it)"
            )
        patches = self.patch_embedding(pixel_values.astype(self.class_embedding.dtype))
        cls = jnp.broadcast_to(self.class_embedding[...], (b, 1, patches.shape[-1]))
        x = jnp.concatenate([cls, patches], axis=1)
        return x + self.position_embedding.embedding[...][None]


class CLIPVisionAttention(CLIPAttention):
    """The text CLIP's attention (same projections and scale) over all tokens, no causal mask."""

    def __call__(self, x, kv_mask=None):  # [B, N, D] -> [B, N, D]
        b, s, d = x.shape
        heads = (b, s, self.num_heads, d // self.num_heads)
        q = self.q_proj(x).reshape(heads)
        k = self.k_proj(x).reshape(heads)
        v = self.v_proj(x).reshape(heads)
        out = attention(q, k, v, settings=self.settings)
        return self.out_proj(out.reshape(b, s, d))


class CLIPVisionEncoderLayer(nnx.Module):
    """Pre-norm layer, as clip.CLIPEncoderLayer: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: CLIPVisionConfig, *, dtype, settings: AttentionSettings, rngs: nnx.Rngs):
        c = config
        self.layer_norm1 = _layer_norm(c.hidden_size, c.layer_norm_eps, dtype, rngs)
        self.self_attn = CLIPVisionAttention(
            c.hidden_size, c.num_attention_heads, dtype=dtype, settings=settings, rngs=rngs
        )
        self.layer_norm2 = _layer_norm(c.hidden_size, c.layer_norm_eps, dtype, rngs)
        self.mlp = CLIPMLP(c.hidden_size, c.intermediate_size, c.hidden_act, dtype=dtype, rngs=rngs)

    def __call__(self, x, kv_mask=None):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTransformer(nnx.Module):
    """transformers' `vision_model`: embeddings, pre_layrnorm (sic, transformers' key), encoder, post_layernorm."""

    def __init__(self, config: CLIPVisionConfig, *, dtype, settings: AttentionSettings, rngs: nnx.Rngs):
        c = config
        self.embeddings = CLIPVisionEmbeddings(c, dtype=dtype, rngs=rngs)
        self.pre_layrnorm = _layer_norm(c.hidden_size, c.layer_norm_eps, dtype, rngs)
        self.encoder = CLIPEncoder(
            [
                CLIPVisionEncoderLayer(c, dtype=dtype, settings=settings, rngs=rngs)
                for _ in range(c.num_hidden_layers)
            ]
        )
        self.post_layernorm = _layer_norm(c.hidden_size, c.layer_norm_eps, dtype, rngs)

    def __call__(self, pixel_values):
        """-> (last_hidden_state, pooled, hidden_states)."""
        hidden_states = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)), None)
        last = hidden_states[-1]
        return last, self.post_layernorm(last[:, 0]), hidden_states


# --------------------------------------------------------------------------------------------------
# The models


class CLIPVisionModel(nnx.Module):
    def __init__(
        self,
        config: CLIPVisionConfig,
        *,
        dtype=jnp.float32,
        settings: AttentionSettings = _DEFAULT_SETTINGS,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.vision_model = CLIPVisionTransformer(config, dtype=dtype, settings=settings, rngs=rngs)

    def __call__(self, pixel_values) -> CLIPVisionOutput:
        """pixel_values [B, H, W, 3] (CLIPImagePreprocessor's output)."""
        return CLIPVisionOutput(*self.vision_model(pixel_values))


class CLIPVisionModelWithProjection(CLIPVisionModel):
    def __init__(
        self,
        config: CLIPVisionConfig,
        *,
        dtype=jnp.float32,
        settings: AttentionSettings = _DEFAULT_SETTINGS,
        rngs: nnx.Rngs,
    ):
        super().__init__(config, dtype=dtype, settings=settings, rngs=rngs)
        self.visual_projection = nnx.Linear(
            config.hidden_size,
            config.projection_dim,
            use_bias=False,
            dtype=dtype,
            param_dtype=dtype,
            rngs=rngs,
        )

    def __call__(self, pixel_values) -> CLIPVisionOutput:
        last, pooled, hidden_states = self.vision_model(pixel_values)
        return CLIPVisionOutput(last, pooled, hidden_states, self.visual_projection(pooled))


_ARCHITECTURES = {cls.__name__: cls for cls in (CLIPVisionModel, CLIPVisionModelWithProjection)}


def _rename(key: str) -> str:
    # transformers 5 saves a plain CLIPVisionModel without the `vision_model.` level; Hub checkpoints and
    # CLIPVisionModelWithProjection keep it.
    return key if key.startswith(("vision_model.", "visual_projection.")) else "vision_model." + key


def load_clip_vision_model(
    folder: Path, dtype=jnp.float32, settings: AttentionSettings = _DEFAULT_SETTINGS, place=None
) -> CLIPVisionModel:
    """An image encoder folder (config.json + safetensors) -> CLIPVisionModel or CLIPVisionModelWithProjection
    (the config's `architectures`). Weights are cast to `dtype` except the layer norms', which stay fp32.
    Raises CheckpointError for another architecture and CheckpointMismatchError when the weights do not fit."""
    return load_clip_encoder(
        folder,
        _ARCHITECTURES,
        CLIPVisionConfig,
        "vision encoder",
        _rename,
        dtype=dtype,
        settings=settings,
        place=place,
    )


# --------------------------------------------------------------------------------------------------
# Preprocessing (host, numpy/PIL)

# PIL's resampling filters by transformers' `resample` number (PIL.Image.Resampling values).
_RESAMPLE_NAMES = {0: "NEAREST", 1: "LANCZOS", 2: "BILINEAR", 3: "BICUBIC", 4: "BOX", 5: "HAMMING"}


@dataclass(frozen=True)
class CLIPImagePreprocessor:
    """transformers' CLIPImageProcessor (its PIL backend, the one it uses without torchvision): convert to RGB,
    resize the shortest side to `size["shortest_edge"]` (the longer one to int(shortest * long / short)) with
    `resample`, center-crop `crop_size` (top and left offsets rounded down), rescale, normalise by the mean/std,
    all from the folder's preprocessor_config.json. -> [B, H, W, 3] float32, channel-last.

    transformers' torchvision backend (used when torchvision is installed) resizes with its own bicubic
    kernel, a few 1e-3 away per pixel; the PIL one is the reference here."""

    shortest_edge: int | None = 224
    height: int | None = None  # size {"height", "width"} instead of a shortest edge
    width: int | None = None
    resample: int = 3
    do_resize: bool = True
    do_center_crop: bool = True
    crop_height: int = 224
    crop_width: int = 224
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    do_convert_rgb: bool = True

    @classmethod
    def from_config(cls, config: dict) -> CLIPImagePreprocessor:
        size = config.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = config.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not ("shortest_edge" in size or {"height", "width"} <= set(size)):
            raise ValueError(f"preprocessor size {size}: expected shortest_edge or height and width")
        resample = int(config.get("resample", 3))
        if resample not in _RESAMPLE_NAMES:
            raise ValueError(f"preprocessor resample {resample} is no PIL filter")
        d = cls()
        return cls(
            shortest_edge=size.get("shortest_edge"),
            height=size.get("height"),
            width=size.get("width"),
            resample=resample,
            do_resize=bool(config.get("do_resize", True)),
            do_center_crop=bool(config.get("do_center_crop", True)),
            crop_height=int(crop["height"]),
            crop_width=int(crop["width"]),
            do_rescale=bool(config.get("do_rescale", True)),
            rescale_factor=float(config.get("rescale_factor", d.rescale_factor)),
            do_normalize=bool(config.get("do_normalize", True)),
            image_mean=tuple(config.get("image_mean", d.image_mean)),
            image_std=tuple(config.get("image_std", d.image_std)),
            do_convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> CLIPImagePreprocessor:
        """From an `image_processor/` folder (preprocessor_config.json)."""
        path = Path(folder) / "preprocessor_config.json"
        try:
            return cls.from_config(read_json(path))
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{path}: {e}") from None

    def output_size(self) -> tuple[int, int] | None:
        """The (height, width) every image comes out at, when the config fixes it."""
        if self.do_center_crop:
            return self.crop_height, self.crop_width
        if self.do_resize and self.height:
            return self.height, self.width
        return None

    def _resize(self, image):
        from PIL import Image

        w, h = image.size
        if self.shortest_edge:
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            size = (new_short, new_long) if w <= h else (new_long, new_short)  # (width, height)
        else:
            size = (self.width, self.height)
        return image.resize(size, getattr(Image.Resampling, _RESAMPLE_NAMES[self.resample]))

    def _center_crop(self, pixels: np.ndarray) -> np.ndarray:
        h, w = pixels.shape[:2]
        ch, cw = self.crop_height, self.crop_width
        if h < ch or w < cw:
            raise ValueError(f"image resized to {h}x{w} is smaller than the {ch}x{cw} crop")
        top, left = (h - ch) // 2, (w - cw) // 2
        return pixels[top : top + ch, left : left + cw]

    def __call__(self, images) -> np.ndarray:
        """PIL images (or uint8 [H, W, 3] arrays) -> pixel_values [B, H, W, 3] float32."""
        from PIL import Image

        out = []
        for image in images:
            if isinstance(image, np.ndarray):
                image = Image.fromarray(image)
            if self.do_convert_rgb:
                image = _to_rgb(image)
            if self.do_resize:
                image = self._resize(image)
            pixels = np.asarray(image)
            if self.do_center_crop:
                pixels = self._center_crop(pixels)
            pixels = pixels.astype(np.float64)
            if self.do_rescale:
                pixels = pixels * self.rescale_factor
            if self.do_normalize:
                pixels = (pixels - np.asarray(self.image_mean)) / np.asarray(self.image_std)
            out.append(pixels.astype(np.float32))
        if len({p.shape for p in out}) > 1:
            raise ValueError(f"images preprocess to different sizes {sorted({p.shape for p in out})}")
        return np.stack(out)


def _to_rgb(image):
    """transformers' convert_to_rgb: an image with transparency is composited onto white first."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert(
            "RGB"
        )
    return image.convert("RGB")
