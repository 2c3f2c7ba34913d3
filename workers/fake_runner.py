"""A model-free runner with the real runner's interface: no JAX, deterministic images, configurable step time
and failure modes. The worker's queue semantics (batching, leases, cancel, dead letters, SIGTERM) are tested
with it, and the load benchmarks use it to measure the serving path without a model.

pools.yaml:   models: {fake: {runner: fake, options: {step_seconds: 0.01, crash_marker: "CRASH"}}}
A prompt containing `raise_marker` makes `run` raise RuntimeError (a worker-side fault: retried, and dead-
lettered after the delivery limit); `crash_marker` kills the process mid-run (os._exit, as an OOM kill would);
`reject_marker` raises InvalidRequest (the job's own fault: failed at once).
"""

from __future__ import annotations

import os
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from meshserve.service.contract import LoraLimits, ModelDefaults, ModelInfo, ModelLimits
from meshserve.service.lora_sources import LoraSource
from meshserve.workers.adapters import LoraLoadError
from meshserve.workers.runner import (
    Cancelled,
    InvalidRequest,
    Runner,
    RunRequest,
    RunResult,
    split_and_encode,
)


class FakeRunner(Runner):
    def __init__(
        self,
        name: str,
        *,
        step_seconds: float = 0.0,
        default_steps: int = 4,
        default_size: int = 64,
        max_n: int = 4,
        raise_marker: str | None = "FAKE_RAISE",
        crash_marker: str | None = "FAKE_CRASH",
        reject_marker: str | None = "FAKE_REJECT",
        lora_slots: int = 0,
        lora_experts: bool = False,
        fetch_seconds: float = 0.0,
        **_ignored,
    ):
        super().__init__(name)
        self.step_seconds = step_seconds
        self.default_steps, self.default_size, self.max_n = default_steps, default_size, max_n
        self.raise_marker, self.crash_marker, self.reject_marker = raise_marker, crash_marker, reject_marker
        # LoRA adapters (`lora_slots` > 0): names only, an LRU of that many; an adapter changes the colour.
        self.slots = lora_slots
        self.fetch_seconds = fetch_seconds  # what fetching an adapter's file takes (a slow Hub download)
        self.takes_loras = lora_slots > 0
        self._resident: OrderedDict[str, int] = OrderedDict()
        # `lora_experts`: two experts, as Wan 2.2's; the adapters loaded into the second, reloads included.
        self.lora_experts, self.into_transformer_2 = lora_experts, set()
        self.calls: deque[list[str]] = deque(
            maxlen=1000
        )  # job ids of recent run() calls, for in-process tests

    def load(self) -> None:
        pass

    def fetch_lora(self, source: LoraSource) -> LoraSource:
        time.sleep(self.fetch_seconds)
        return source

    def load_lora(self, name: str, source: LoraSource, *, load_into_transformer_2: bool = False) -> dict:
        if source.kind != "path" or not os.path.exists(source.value):
            raise LoraLoadError(f"the fake runner loads LoRA files only; {source.value} is not one")
        if load_into_transformer_2 and not self.lora_experts:
            raise LoraLoadError("load_into_transformer_2: the fake runner has one denoiser")
        self.into_transformer_2.discard(name)
        if load_into_transformer_2:
            self.into_transformer_2.add(name)
        self._resident.pop(name, None)
        if len(self._resident) >= self.slots:
            self._resident.popitem(last=False)
        self._resident[name] = os.path.getsize(source.value)
        return {"name": name, "rank": 4, "bytes": self._resident[name]}

    def unload_lora(self, name: str) -> None:
        self._resident.pop(name, None)

    def resident_loras(self) -> list[str]:
        return list(self._resident)

    def touch_loras(self, names: list[str]) -> None:
        for name in names:
            self._resident.move_to_end(name)

    def lora_slots(self) -> int:
        return self.slots

    def info(self) -> ModelInfo:
        return ModelInfo(
            id=self.name,
            family="fake",
            task="text-to-image",
            defaults=ModelDefaults(
                width=self.default_size,
                height=self.default_size,
                num_inference_steps=self.default_steps,
                guidance_scale=5.0,
            ),
            limits=ModelLimits(
                size_multiple=8,
                min_size=8,
                max_size=1024,
                min_steps=1,
                max_steps=100,
                max_n=self.max_n,
                schedulers=["euler", "ddim"],
                loras=LoraLimits(
                    max_per_request=2,
                    max_rank=64,
                    scale_min=-4.0,
                    scale_max=4.0,
                    load_into_transformer_2=self.lora_experts or None,
                )
                if self.takes_loras
                else None,
            ),
        )

    def run(self, batch: Sequence[RunRequest], callback=None) -> list[RunResult]:
        self.calls.append([r.job_id for r in batch])
        for req in batch:
            if self.reject_marker and self.reject_marker in req.params.prompt:
                raise InvalidRequest(f"fake runner rejects prompt with {self.reject_marker!r}")
        if self.adapters is not None:
            self.adapters.ensure([[lora.name for lora in req.params.loras] for req in batch])
        for req in batch:
            missing = [lora.name for lora in req.params.loras if lora.name not in self._resident]
            if missing:
                raise InvalidRequest(f"no LoRA named {missing[0]!r}; loaded: {self.resident_loras()}")
        first = batch[0].params
        total = first.num_inference_steps
        t0 = time.perf_counter()
        for step in range(1, total + 1):
            if self.step_seconds:
                time.sleep(self.step_seconds)
            for req in batch:
                if self.crash_marker and self.crash_marker in req.params.prompt:
                    os._exit(17)  # no cleanup, no ack: exactly what a killed worker leaves behind
                if self.raise_marker and self.raise_marker in req.params.prompt:
                    raise RuntimeError(f"fake runner fault on prompt with {self.raise_marker!r}")
            if callback is not None and callback(step, total) is False:
                raise Cancelled(f"stopped after step {step} of {total}")
        denoise = time.perf_counter() - t0
        # Each image is a flat colour from a hash of (prompt, seed): the same job gives the same bytes.
        rows, seeds = [], []
        for req in batch:
            for seed in req.seeds():
                loras = "".join(f"|{lora.name}:{lora.scale}" for lora in req.params.loras)
                h = zlib.crc32(f"{req.params.prompt}|{seed}{loras}".encode())
                colour = np.array([h & 255, (h >> 8) & 255, (h >> 16) & 255], np.float32) / 255.0
                rows.append(np.broadcast_to(colour, (first.height, first.width, 3)))
                seeds.append(seed)
        images = np.stack(rows)  # [B, H, W, 3]
        timings = {"text_encode": 0.0, "denoise": denoise, "vae_decode": 0.0}
        return split_and_encode(batch, images, seeds, timings, compiled=False)
