"""The worker's pool configuration (`pools.yaml`), validated with pydantic before anything loads or compiles.

    models:
      sdxl: {path: /models/sdxl-base-1.0, dtype: bfloat16}
    pools:
      - name: sdxl-0
        devices: "0-3"
        mesh: {cfg: 2, context: 2}
        models: [sdxl]
        max_batch: 4
        buckets: [[1024, 1024], [832, 1216]]   # the sizes it serves: compiled at start, nothing else admitted

A pool's `buckets` are the only (width, height) sizes it serves: compiled at start-up and published in
`/v1/models`, so the API refuses any other size and nothing compiles on the request path. No buckets: the
model's default size alone. `any_size: true` (with `max_programs`, the bound on compiled programs kept) serves
every size the model allows, compiling new ones on the request path.

A video model's pool also lists `frames: [81, 49]`, the frame counts it serves (every bucket is compiled with
each); no frames: the model's default count alone. The API refuses any other `num_frames` (422). An
`any_size` pool serves every frame count the model allows too (its `frames` are then only warmed up).

A model's `runner` picks its implementation by name: "pipeline" (the default) wraps `meshserve.models.load_pipeline`;
"fake" is the model-free runner of `meshserve.workers.fake_runner` (tests, load benchmarks); anything with a colon is an
import path "module:Class". Redis, lease and TTL settings are not here: they are the service package's
`Settings` (environment `MESHSERVE_*`), shared by API and workers so both sides agree on them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

# JAX-free: the same slice parser, mesh-size rules and attention option names the pool's mesh and attention are
# built with (one parser, one error, one set of names).
from meshserve.models.attention.options import ContextStrategy, Kernel
from meshserve.models.checkpoints.hub import is_hub_id, parse_hub_id
from meshserve.models.parallel.layout_spec import (
    AXES,
    LayoutError,
    check_mesh_sizes,
    parse_device_slice,
    validate_weight_sharding,
)
from meshserve.service.contract import LoraSpec
from meshserve.service.lora_sources import NAME_PATTERN, check_form


class _Strict(BaseModel):
    # A typo in pools.yaml ("max_bacth") must be an error, not a silently ignored key.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    # A diffusers folder; None: the embedded model of the key's name (a key tiny-sdxl, tiny-flux or tiny-wan),
    # else the embedded tiny default model (tiny-sdxl); "tiny-flux" (or "embedded:tiny-flux"):
    # the embedded tiny Flux, "tiny-wan" the tiny Wan (meshserve.models.load_pipeline resolves the names); a Hub id
    # "owner/name" or "owner/name@revision" (models/checkpoints/hub.py; `options: {variant: fp16}` picks a weights variant).
    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    runner: str = "pipeline"
    options: dict[str, Any] = Field(default_factory=dict)  # passed to the runner as keyword arguments
    # LoRA adapters requests may name (docs/lora.md, "Served"): name -> a file or folder under the LoRA root
    # (`lora_root`, else MESHSERVE_LORA_ROOT) or a Hub id owner/name[/file.safetensors]; never a URL. Every
    # pool of the model loads them at start, before its warm-up (all pools of a model read one stream, so all
    # hold the same adapters). Checked here for their form, at start against the root (service/lora_sources.py).
    # Wan 2.2's two experts: `name: {source: ..., load_into_transformer_2: true}` adapts the low-noise expert.
    loras: dict[str, LoraSpec] = Field(default_factory=dict)

    @field_validator("loras", mode="before")
    @classmethod
    def _bare_sources(cls, loras: Any) -> Any:
        if not isinstance(loras, Mapping):
            return loras  # pydantic says what is wrong
        for name, declared in loras.items():
            if isinstance(declared, Mapping) and (unknown := set(declared) - set(LoraSpec.model_fields)):
                raise ValueError(
                    f"LoRA {name!r}: unknown keys {sorted(unknown)}; it takes {list(LoraSpec.model_fields)}"
                )
        return {name: {"source": d} if isinstance(d, str) else d for name, d in loras.items()}

    @field_validator("loras")
    @classmethod
    def _lora_sources_written_right(cls, loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
        for name, declared in loras.items():
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"LoRA name {name!r} must match {NAME_PATTERN}")
            check_form(declared.source)
        return loras


class MeshSizes(_Strict):
    """The pool's `mesh:` sizes. A pydantic model (not models.parallel.mesh.MeshSizes) so a typo is a config
    error naming the field; the axes and the size rules are `layout_spec`'s, which the real mesh uses too."""

    data: int = 1
    cfg: int = 1
    context: int = 1
    tensor: int = 1

    @model_validator(mode="before")
    @classmethod
    def _sizes_are_valid(cls, raw):
        if isinstance(raw, Mapping):
            check_mesh_sizes(raw)
        return raw

    @property
    def size(self) -> int:
        return math.prod(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}


class AttentionOptions(_Strict):
    """How the pool's attention runs (models.attention.AttentionSettings); unset fields keep its defaults."""

    kernel: Kernel | None = None
    context_strategy: ContextStrategy | None = None
    block_q: int | None = Field(None, ge=1)
    block_kv: int | None = Field(None, ge=1)
    ulysses_degree: int | None = Field(None, ge=1)
    allgather_max_kv: int | None = Field(None, ge=0)


class WeightOptions(_Strict):
    """How the pool stores its models' weights: `shard_over` names mesh axes (data, cfg, context) over which
    every large weight is split besides tensor parallelism (FSDP / ZeRO-3: a 12 B denoiser that does not fit one
    device replicated). Checked against the pool's mesh by the same rule the placement applies."""

    shard_over: list[str] = Field(default_factory=list)


class PoolConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    # Device indices into jax.devices(); None: the first `mesh.size` devices; "all": every device of the
    # process group (a multi-host pool, workers/multihost.py), checked against the mesh when the pool starts.
    devices: str | int | list[int] | None = None
    mesh: MeshSizes = Field(default_factory=MeshSizes)
    attention: AttentionOptions = Field(default_factory=AttentionOptions)
    weights: WeightOptions = Field(default_factory=WeightOptions)
    # The denoiser's Linear weights: int8 (weight-only, per-channel scales), fp8 (e4m3 with per-channel scales;
    # the activations too on GPUs with fp8 dots, weight-only elsewhere) or as the model's dtype
    # (models/components/quantize.py, docs/weights.md "Quantization").
    quantize: Literal["none", "int8", "fp8"] = "none"
    # The VAE's dtype (load_pipeline's vae_dtype; docs/outputs.md): None keeps the family's default. A pool-level
    # field rather than a model option, since it trades the decode's error for its time per pool.
    vae_dtype: Literal["float32", "bfloat16"] | None = None
    # The DiTs' and T5's repeated blocks under one lax.scan (load_pipeline's scan_blocks): each program compiles
    # one block, not every one. False unrolls them, to compare a step's speed on an accelerator.
    scan_blocks: bool = True
    # XLA options for this pool's programs alone (load_pipeline's xla_options: XLA's names, e.g.
    # xla_gpu_enable_latency_hiding_scheduler: true), where XLA_FLAGS would bind every pool of the process.
    # A name XLA does not know fails the pool's start with XLA's reason (docs/compilation.md).
    xla_options: dict[
        Annotated[str, StringConstraints(pattern=r"^xla_[a-z0-9_]+$")], bool | int | float | str
    ] = Field(default_factory=dict)
    models: list[str] = Field(min_length=1)
    max_batch: int = Field(1, ge=1)  # images per device batch, summed over the jobs in it
    batch_wait_ms: float = Field(5.0, ge=0)  # how long a first job waits for compatible company
    # The (width, height) sizes the pool serves, compiled at start; empty: the model's default size alone.
    buckets: list[tuple[int, int]] = Field(default_factory=list)
    # Video models: the frame counts (`num_frames`) the pool serves, compiled at start for every bucket (a frame
    # count is a shape like the size); empty: the model's default frame count alone. Image models: must be empty.
    frames: list[int] = Field(default_factory=list)
    # Serve any size the model allows (buckets are then only warmed up), keeping at most `max_programs`
    # compiled programs (the runner's bound): an explicit choice, since each new size compiles on the request
    # path (seconds to minutes on a real model).
    any_size: bool = False
    max_programs: int | None = Field(None, ge=1)
    # The batch sizes compiled at start. None: every size a batch runs as (1 to max_batch rows: the runner pads
    # images to powers of two, so max_batch 4 compiles 1, 2 and 4), so that no batch and no job's n (run in
    # parts of at most max_batch rows) compiles on the request path. A shorter list starts faster and
    # compiles the sizes it leaves out when a batch first needs them.
    warm_up_batch_sizes: list[Annotated[int, Field(ge=1)]] | None = None
    warm_up_steps: int | None = Field(None, ge=1)  # None: the model's default step count
    # The tasks compiled at start (an image task has its own image_encode and denoise programs): None, the
    # model's text task (every task of a model without one, e.g. Wan I2V); a list, or "all" (every task the
    # model takes: what `meshserve serve` does), so that no image job compiles on the request path (each task
    # adds a denoise program per bucket and batch size).
    warm_up_tasks: list[str] | Literal["all"] | None = None
    # Compile each model's step cache programs at start too (docs/step-cache.md): a cached job then compiles
    # nothing; it adds one denoise program per bucket, batch size and CFG on/off for each method (Flux and Wan
    # have two, first_block and teacache; SDXL one).
    warm_up_cache: bool = False
    # The schedulers compiled at start besides the model's own (a scheduler is part of the denoise program: a
    # request naming another compiles it on first use): a list of the model's scheduler names, or "all". Each
    # adds one denoise program per bucket, batch size, task and CFG on/off.
    warm_up_schedulers: list[str] | Literal["all"] | None = None
    # The prompt-embedding cache's bound per model, in MiB of device memory (models/engine/prompt_cache.py;
    # 0: none). 64 MiB holds ~200 SDXL text rows or ~16 of Flux's or Wan's (bf16).
    prompt_cache_mb: float = Field(64.0, ge=0)
    # The pool's LoRA table (load_pipeline's max_loras, max_lora_rank, lora_budget_mb, lora_targets; docs/lora.md):
    # adapters per request, the largest rank, the table's MiB on the devices (its slots: adapters resident at
    # once, least recently used evicted and loaded again when a request names it), and a regex narrowing the
    # adapted layers (each adds work to the LoRA program). None: the library's defaults (4, 64, 512, all).
    # lora_convs: the UNet's convolutions join the table (LoCon files and LCM-LoRA adapt them); off by default,
    # as each adds a matmul of its input's patches at the table's rank to every step of the LoRA program
    # (docs/lora.md).
    max_loras: int | None = Field(None, ge=1)
    max_lora_rank: int | None = Field(None, ge=1)
    lora_budget_mb: float | None = Field(None, gt=0)
    lora_targets: str | None = None
    lora_convs: bool | None = None

    @field_validator("lora_targets")
    @classmethod
    def _targets_compile(cls, v):
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"lora_targets is not a regular expression: {e}") from None
        return v

    def batch_sizes(self) -> list[int]:
        """The batch sizes the pool warms up: `warm_up_batch_sizes`, or every row count up to max_batch."""
        return list(self.warm_up_batch_sizes or range(1, self.max_batch + 1))

    def lora_options(self) -> dict[str, Any]:
        """The LoRA table's load_pipeline arguments this pool sets."""
        names = ("max_loras", "max_lora_rank", "lora_budget_mb", "lora_targets", "lora_convs")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @field_validator("devices")
    @classmethod
    def _devices_readable(cls, v):
        if v is not None and v != "all":
            parse_device_slice(v)
        return v

    @property
    def device_ids(self) -> list[int]:
        if self.devices is None or self.devices == "all":  # "all" spans mesh.size devices (checked at start)
            return list(range(self.mesh.size))
        return parse_device_slice(self.devices)

    @model_validator(mode="after")
    def _mesh_fits_slice(self):
        n = len(self.device_ids)
        if self.mesh.size != n:
            raise ValueError(
                f"pool {self.name!r}: mesh {self.mesh.as_dict()} needs {self.mesh.size} devices but the slice "
                f"{self.devices!r} has {n}"
            )
        if self.max_batch % self.mesh.data:
            raise ValueError(
                f"pool {self.name!r}: max_batch {self.max_batch} must be a multiple of mesh data={self.mesh.data}"
            )
        if self.any_size != (self.max_programs is not None):
            raise ValueError(
                f"pool {self.name!r}: any_size and max_programs go together (any_size: true serves every size "
                "and needs max_programs, the bound on compiled programs; without it only buckets are served)"
            )
        try:
            validate_weight_sharding(self.weights.model_dump(), self.mesh)
        except LayoutError as e:
            raise ValueError(f"pool {self.name!r}: {e}") from None
        degree, strategy = self.attention.ulysses_degree, self.attention.context_strategy
        if degree is not None and strategy != "hybrid":  # any other strategy would ignore it
            raise ValueError(
                f"pool {self.name!r}: attention.ulysses_degree applies to context_strategy 'hybrid' only "
                f"(the pool's is {strategy or 'auto'!r})"
            )
        if degree is not None and self.mesh.context % degree:
            raise ValueError(
                f"pool {self.name!r}: attention.ulysses_degree {degree} does not divide mesh context="
                f"{self.mesh.context}"
            )
        if len(set(self.buckets)) != len(self.buckets):
            raise ValueError(f"pool {self.name!r}: buckets {self.buckets} repeat a size")
        if len(set(self.frames)) != len(self.frames):
            raise ValueError(f"pool {self.name!r}: frames {self.frames} repeat a frame count")
        if any(f < 1 for f in self.frames):
            raise ValueError(f"pool {self.name!r}: frames {self.frames} must be positive frame counts")
        over = sorted(b for b in self.warm_up_batch_sizes or () if b > self.max_batch)
        if over:  # a batch never has more rows than max_batch: those programs would never run
            raise ValueError(
                f"pool {self.name!r}: warm_up_batch_sizes {over} are over max_batch {self.max_batch}"
            )
        return self


class WorkerConfig(_Strict):
    models: dict[str, ModelSpec]
    pools: list[PoolConfig] = Field(min_length=1)
    name: str | None = None  # the consumer name prefix; default "<hostname>-<pid>"
    metrics_port: int | None = Field(9400, ge=0, le=65535)  # None: no /metrics server (0: any free port)
    redis_url: str | None = None  # overrides MESHSERVE_REDIS_URL when set
    drain_seconds: float = Field(30.0, ge=0)  # SIGTERM: how long a running batch may take before release
    compilation_cache_dir: str | None = None  # JAX's persistent compilation cache: restarts skip compiling
    # The folder LoRA files must be under (overrides MESHSERVE_LORA_ROOT; service/lora_sources.py).
    lora_root: str | None = None

    @model_validator(mode="after")
    def _consistent(self):
        names = [p.name for p in self.pools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"pool names must be unique; repeated: {dupes}")
        for pool in self.pools:
            unknown = [m for m in pool.models if m not in self.models]
            if unknown:
                raise ValueError(
                    f"pool {pool.name!r} serves unknown models {unknown}; declared: {sorted(self.models)}"
                )
        owner: dict[int, str] = {}
        for pool in self.pools:
            for d in pool.device_ids:
                if d in owner:
                    raise ValueError(f"device {d} is in two pools: {owner[d]!r} and {pool.name!r}")
                owner[d] = pool.name
        return self


def load_config(path: str | Path) -> WorkerConfig:
    """Read and validate a pools.yaml; errors name the file and the offending field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read worker config {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with `models` and `pools`")
    return WorkerConfig.model_validate(raw)


def single_model_config(
    model: str | None = None, *, model_name: str | None = None, metrics_port: int | None = None
) -> WorkerConfig:
    """One pool on one device serving one model: `model` is a diffusers folder, an embedded model's name
    ("tiny-flux", "embedded:tiny-flux") or None for the embedded default. Used by `meshserve serve`."""
    name = model_name or (Path(model.removeprefix("embedded:")).name if model else "tiny-sdxl")
    if model and is_hub_id(model):  # "owner/name@rev" serves as "name"
        name = model_name or parse_hub_id(model)[0].split("/")[1]
    return WorkerConfig(
        models={name: ModelSpec(path=model)},
        # Every task and batch size warmed up: no text or image job compiles on the request path (a step cache
        # or another scheduler compiles on its first use: warming them up would take the embedded model's start
        # from 40 s to 111 s).
        pools=[
            PoolConfig(
                name=re.sub(r"[^A-Za-z0-9_.-]", "-", name) + "-0",
                models=[name],
                devices="0",
                warm_up_tasks="all",
            )
        ],
        metrics_port=metrics_port,
    )
