"""cudnn: cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only.

Written for NVIDIA GPUs and never run on one in this project's CI (CPU only); what is tested here is the
selection logic (`cudnn_unsupported_reason`) and the argument mapping, by running the same call with
`implementation="xla"` against the reference (tests/parallel/test_attention.py).

Mapping: our layout [B, S, H, D] is jax's BTNH, so q/k/v pass unchanged. kv_mask [B, Sk] becomes a boolean
mask [B, 1, 1, Sk] (jax turns it into an additive bias for cuDNN). jax's `is_causal` is top-left aligned
(query i sees keys
<= i), ours bottom-right (i + Sk - Sq >= j): they agree only when Sq == Sk, so causal cross-length calls
are declined and go to xla_blockwise.
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


def cudnn_attention(
    q, k, v, *, causal: bool = False, kv_mask=None, scale: float | None = None, implementation: str = "cudnn"
):
    """q: [B, Sq, H, D], k/v: [B, Sk, H, D], kv_mask: [B, Sk] bool -> [B, Sq, H, D].

    `implementation` exists for the CPU test of this mapping; serving code always gets "cudnn".
    """
    mask = None if kv_mask is None else kv_mask[:, None, None, :]  # broadcast to jax's [B, N, T, S]
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, implementation=implementation
    )
    if kv_mask is not None:
        # A bias of "large negative" over every key averages them instead of giving the reference's 0.
        out = jnp.where(jnp.any(kv_mask, axis=1)[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out
