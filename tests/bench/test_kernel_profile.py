"""bench/kernel_profile.py, the per-kernel breakdown behind `gpu_vs_diffusers.py --profile`: its categories on
the kernel names a GPU reports, and a real profile of a jitted function on this CPU."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is no package of the install
from bench import kernel_profile as kp  # noqa: E402


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNN", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("sm90_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32", "convolution"),
        ("loop_convert_fusion_12", "fusion"),  # "convert" is no convolution
        ("input_reduce_fusion", "fusion"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4>", "fusion"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_names_fall_in_their_category(name, expected):
    assert kp.category(name) == expected


def test_a_jitted_function_is_profiled_kernel_by_kernel():
    x = jnp.ones((256, 256))
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    profile = kp.jax_kernels(lambda: f(x), calls=2)
    assert profile["per_call_ms"] > 0 and profile["kernels"]
    assert sum(kp.by_category(profile).values()) == pytest.approx(profile["per_call_ms"])
    assert all(entry["count"] > 0 for entry in profile["kernels"].values())
    text = kp.report({"meshserve": profile}, top=3)
    assert text.startswith("**meshserve**") and text.count("\n| `") == min(3, len(profile["kernels"]))


def test_a_kernel_named_after_a_fusion_says_what_it_computes_and_where_it_comes_from():
    """What `annotate` adds from the compiled program's text: the fusion's result shape, the ops inside it and
    the function of this file that traced it; GPU kernel names have "_N" where XLA's instructions have ".N"."""

    def stack(w, x):  # a scan over stacked weights, as the DiTs' blocks run
        def body(carry, weight):
            return jnp.tanh(carry @ weight), None

        return jnp.tanh(jax.lax.scan(body, x, w)[0] @ w[0])  # a second dot: numbered names

    compiled = jax.jit(stack).lower(jnp.ones((3, 8, 8)), jnp.ones((4, 8))).compile()
    described = kp.describe(compiled.as_text(), ours=("test_kernel_profile.py",))
    dots = {name: what for name, what in described.items() if ": dot" in what}
    assert dots, described
    assert all(what.startswith("f32[4,8]: dot") and "stack" in what for what in dots.values()), dots
    assert any("body" in what for what in dots.values()), dots  # the scan's dot, traced in `body`

    assert kp.hlo_name("loop_dynamic_slice_fusion_9") == "loop_dynamic_slice_fusion.9"
    assert kp.hlo_name("input_reduce_fusion") == "input_reduce_fusion"
    numbered = next(name for name in described if re.search(r"\.\d+$", name))
    kernels = {
        numbered.replace(".", "_"): {
            "ms": 1.0,
            "count": 1,
            "hlo_op": "command_buffer_1",
        },  # the GPU's spelling
        "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT": {"ms": 2.0, "count": 1, "hlo_op": "command_buffer_1"},
    }
    annotated = kp.annotate({"kernels": kernels}, compiled.as_text())["kernels"]
    assert annotated[numbered.replace(".", "_")]["what"] == described[numbered]
    assert "what" not in annotated["nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT"]  # a library's kernel
