"""A pool's host inputs (token ids, seeds' keys, schedules, latents) go straight to the pool's own devices with
their shardings: nothing of a request is staged on device 0, which belongs to another pool."""

import jax
import numpy as np

from meshserve.models import load_pipeline


def test_a_pool_on_devices_4_to_7_puts_nothing_on_other_devices(tiny_sdxl_path):
    pool = set(jax.devices()[4:8])
    pipe = load_pipeline(tiny_sdxl_path, mesh={"cfg": 2, "context": 2}, devices="4-7")
    before = {id(a) for a in jax.live_arrays()}
    # Implicit host-to-device transfers (a numpy array handed to a program, which lands on the default
    # device 0 first) are errors here: every input must be placed explicitly, with its pool sharding.
    with jax.transfer_guard_host_to_device("disallow"):
        out = pipe(
            ["a", "b"],
            negative_prompt=["", None],
            height=64,
            width=48,
            num_inference_steps=2,
            guidance_scale=[5.0, 3.0],
            seed=[1, 2],
            scheduler="euler_ancestral",
            output_type="np",
        )
    assert np.isfinite(np.asarray(out.images)).all()
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert new, "the pipeline caches its padded schedule on the pool's devices"
    elsewhere = [(a.shape, sorted(d.id for d in a.devices())) for a in new if not a.devices() <= pool]
    assert not elsewhere, f"arrays outside the pool's devices 4-7: {elsewhere}"
    # Latents and keys are split over the pool's batch axes, not copies on one device.
    keys = pipe.put_keys([1, 2, 3, 4])
    assert keys.sharding.device_set <= pool and len(keys.sharding.device_set) > 1
