"""meshserve's XLA:CPU defaults: added to XLA_FLAGS for the jaxlib versions they were checked with, never over
a flag the user set, never for an unknown version (an XLA flag a jaxlib does not know aborts the process)."""

import os

from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults, cpu_default_flags

YNN = "--xla_cpu_experimental_ynn_fusion_type"


def test_defaults_are_added_beside_the_users_flags():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    flags = apply_cpu_defaults(env, jaxlib_version="0.10.2")
    assert (
        flags.startswith("--xla_force_host_platform_device_count=8 ")
        and f"{YNN}=-individual_convolution" in flags
    )
    # Dots stay on YNNPACK: Eigen's matmul blocking depends on the batch, so a seed's image would depend on
    # what it was batched with (tests/models/test_seeds.py: ddim 1.9e-5 relative with dots on Eigen).
    assert "individual_dot" not in flags
    assert env["XLA_FLAGS"] == flags
    assert apply_cpu_defaults(env, jaxlib_version="0.10.2") == flags  # idempotent


def test_a_flag_the_user_set_wins():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{YNN}=dot"}
    assert apply_cpu_defaults(env, jaxlib_version="0.10.2") == f"{YNN}=dot"


def test_unchecked_jaxlib_versions_get_nothing():
    assert cpu_default_flags("0.11.0") == () and cpu_default_flags("0.9.1") == ()
    env: dict[str, str] = {"JAX_PLATFORMS": "cpu"}
    assert apply_cpu_defaults(env, jaxlib_version="0.11.0") == "" and "XLA_FLAGS" not in env


def test_this_test_session_runs_with_them():
    """conftest applies them as the CLI does, so the suite checks the configuration that is served."""
    for flag in cpu_default_flags():
        assert flag in os.environ.get("XLA_FLAGS", "")
