"""cudnn: cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only.

Never run on a GPU in this project's CI (CPU only). What the CPU tests check (tests/parallel/test_attention.py):
the selection logic (`cudnn_unsupported_reason`); the argument mapping, by making the same call with
`implementation="xla"` against the reference; and that cuDNN's own path accepts the arguments built here, by
tracing it with jax's cuDNN checks (`check_layout`, `check_is_flash_attention`) and lowering it for "cuda"
with `jax.export` on the CPU host (a `[B, 1, 1, Sk]` mask fails there exactly as it did on an H100: "Bias must
have same seq length as QKV, got 1 and 77").

Mapping: our layout [B, S, H, D] is jax's BTNH, so q/k/v pass unchanged. kv_mask [B, Sk] becomes
`key_value_seq_lengths` (its True count per row): cuDNN's padding mask, which switches off the keys from that
length on. That equals the mask only when each row's True entries are a prefix (keys padded at the end),
which is what every caller passes: context parallelism pads at the end (models.attention.context), and a
text encoder's attention mask comes from right-padding tokenizers. A mask that is not a prefix is the
caller's error with this kernel (use xla_blockwise). No bias is built: a boolean mask becomes an additive
bias that cuDNN wants full-shape [B, H or 1, Sq, Sk] (jax's check_layout), which would be Sq x Sk per example.

jax's `is_causal` is top-left aligned (query i sees keys <= i), ours bottom-right (i + Sk - Sq >= j): they
agree only when Sq == Sk, so causal cross-length calls are declined and go to xla_blockwise.

`return_lse` (for ring attention, which merges the partial results of each K/V chunk by their log-sum-exp):
cuDNN's softmax statistics, fp32 [B, H, Sq], through jax's cuDNN function itself
(`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`): `jax.nn.dot_product_attention`'s
`return_residual` casts them to the output dtype, and a bf16 log-sum-exp (spacing 1/32 at 4..8) would weigh
the chunks with errors of up to ~1.6 %.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# cuDNN's fused attention takes fp16/bf16 (fp8 aside) and a head dim that is a multiple of 8 up to 128 on
# every supported GPU (256 on Hopper and later: jax/_src/cudnn/fused_attention_stablehlo.py
# check_is_flash_attention).
_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
_MAX_HEAD_DIM = 128


def cudnn_unsupported_reason(*, head_dim: int, dtype, causal: bool, sq: int, sk: int) -> str | None:
    """Why cuDNN can't run this call (None when it can). Pure: the platform check is the caller's."""
    if np.dtype(dtype) not in _DTYPES:
        return f"cuDNN flash attention needs float16/bfloat16, got {np.dtype(dtype).name}"
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        return f"cuDNN flash attention needs a head dim that is a multiple of 8 and <= {_MAX_HEAD_DIM}"
    if causal and sq != sk:
        return "jax's cuDNN causal mask is top-left aligned; ours is bottom-right, equal only when Sq == Sk"
    return None


def kv_lengths(kv_mask):
    """[B, Sk] bool -> [B] int32: the number of keys each row may see (the mask must be a valid prefix)."""
    return jnp.sum(kv_mask, axis=1, dtype=jnp.int32)


def cudnn_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    kv_mask=None,
    scale: float | None = None,
    return_lse: bool = False,
    out_dtype=None,
    implementation: str = "cudnn",
):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool (a prefix per row) -> [B, Sq, H, D]
    (, lse [B, Sq, H] fp32 when return_lse; -inf where a row sees no key).

    `implementation` exists for the CPU test of this mapping; serving code always gets "cudnn".
    """
    b, sq = q.shape[:2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lengths = None if kv_mask is None else kv_lengths(kv_mask)
    lse = None
    if not return_lse:
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            key_value_seq_lengths=lengths,
            scale=scale,
            is_causal=causal,
            implementation=implementation,
        )
    elif implementation == "cudnn":
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_lib

        mask_type = {
            (False, False): cudnn_lib.MaskType.NO_MASK,
            (False, True): cudnn_lib.MaskType.CAUSAL,
            (True, False): cudnn_lib.MaskType.PADDING,
            (True, True): cudnn_lib.MaskType.PADDING_CAUSAL,
        }[(lengths is not None, causal)]
        q_lengths = None if lengths is None else jnp.full((b,), sq, jnp.int32)
        out, stats = cudnn_lib.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=q_lengths,
            kv_seqlen=lengths,
            scale=scale,
            mask_type=mask_type,
            qkv_layout="BTNH",
            return_residual=True,
        )
        lse = jnp.transpose(stats, (0, 2, 1)).astype(jnp.float32)  # [B, H, Sq] -> [B, Sq, H]
    else:  # the CPU test's stand-in: the same semantics, jax's residual (in the input dtype) as the lse
        out, lse = jax.nn.dot_product_attention(
            q,
            k,
            v,
            key_value_seq_lengths=lengths,
            scale=scale,
            is_causal=causal,
            implementation=implementation,
            return_residual=True,
        )
        lse = lse.astype(jnp.float32)
    if out_dtype is not None:
        out = out.astype(out_dtype)
    if kv_mask is not None:
        # A row with no key: cuDNN's padding mask leaves it undefined; the reference's answer is 0 (lse -inf).
        seen = jnp.any(kv_mask, axis=1)
        out = jnp.where(seen[:, None, None, None], out, jnp.zeros((), out.dtype))
        if lse is not None:
            lse = jnp.where(seen[:, None, None], lse, -jnp.inf)
    return out if lse is None else (out, lse)
