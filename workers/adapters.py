"""One model's LoRA adapters in one pool: the ones it may use (pools.yaml's, and those added with
`POST /v1/loras`), where each came from, and which are resident on the devices now.

    adapters = Adapters(runner, model="tiny-sdxl", root="/loras")
    adapters.add("style", LoraSpec(source="style.safetensors"), origin="config")  # pool thread; errors kept
    fetched = adapters.fetch("owner/ink")                          # any thread: a Hub file into the local cache
    adapters.add("ink", LoraSpec(source="owner/ink"), origin="api", fetched=fetched)  # the device part, pool thread
    adapters.ensure([["style"], []])                               # pool thread, before a batch runs
    adapters.published()                                           # -> [AdapterInfo]: the registry entry

The library keeps adapters in a table of fixed size on the devices and evicts the least recently used one when
it is full (models/lora/pool.py). A registered adapter may therefore have been evicted when a job names it:
`ensure` loads it again from its source before the batch runs (a `meshserve_worker_lora_loads_total{reason=
"reload"}`), after marking the batch's resident adapters used so that none of them is the one evicted. A job
that finds its adapter resident counts a hit. A batch naming more distinct adapters than the table holds
cannot run as one call: `ensure` raises, and the job loop runs its jobs one by one (each job names at most
`max_per_request`, which the table always holds).

Sources are checked again here, where the files are (service/lora_sources.py: under the root, symlinks
resolved, or a Hub id), whatever the API checked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from meshserve.service.contract import AdapterInfo, LoraSpec
from meshserve.service.lora_sources import LoraSource, LoraSourceError, resolve_source
from meshserve.workers import metrics

log = logging.getLogger(__name__)


class TooManyAdapters(Exception):
    """A batch names more distinct adapters than the pool's table holds at once (its jobs then run alone)."""


class Adapters:
    def __init__(self, runner, *, model: str, root: str | None, allow_hub: bool = True):
        self.runner, self.model, self.root, self.allow_hub = runner, model, root, allow_hub
        self._entries: dict[str, AdapterInfo] = {}  # name -> what the registry shows
        self._sources: dict[str, LoraSource] = {}  # name -> where to (re)load it from
        # Set by the pool when it started without adapters: compiles the LoRA programs, once, when the first
        # adapter is added (before it is published, so no job naming it compiles them).
        self.warm_up_loras: Callable[[], None] | None = None

    # -- registration (pool thread) --------------------------------------------------------------------------

    def fetch(self, source: str) -> LoraSource | Exception:
        """Resolve `source` and fetch its file (a Hub download) without touching the devices: any thread. The
        refusal or failure is returned, for `add` to record."""
        try:
            resolved = resolve_source(source, root=self.root, allow_hub=self.allow_hub, must_exist=True)
            return self.runner.fetch_lora(resolved)
        except (LoraSourceError, LoraLoadError) as e:
            return e

    def add(
        self, name: str, spec: LoraSpec, *, origin: str, fetched: LoraSource | Exception | None = None
    ) -> AdapterInfo:
        """Load the adapter (`fetched`: what `fetch(spec.source)` returned, when it ran beforehand off the pool
        thread); a refused source or a file that does not fit is recorded as the entry's `error` (the registry
        shows it; requests may not name it). The local file is what a later reload reads."""
        self.remove(name)
        source, expert = spec.source, spec.load_into_transformer_2
        described = dict(name=name, source=source, load_into_transformer_2=expert, origin=origin)
        try:
            resolved = self.fetch(source) if fetched is None else fetched
            if isinstance(resolved, Exception):
                raise resolved
            before = set(self.runner.resident_loras())
            loaded = self.runner.load_lora(name, resolved, load_into_transformer_2=expert)
        except (LoraSourceError, LoraLoadError) as e:
            log.warning("model %s: LoRA %r from %r not loaded: %s", self.model, name, source, e)
            entry = AdapterInfo(**described, error=str(e))
        except Exception as e:  # the engine's (device memory...): reported the same way, the pool goes on
            log.exception("model %s: LoRA %r from %r failed to load", self.model, name, source)
            entry = AdapterInfo(**described, error=f"{type(e).__name__}: {e}")
        else:
            self._count_load("register", before, name)
            self._sources[name] = resolved
            self._first_adapter_warm_up()
            entry = AdapterInfo(**described, rank=loaded.get("rank"), bytes=loaded.get("bytes"))
        self._entries[name] = entry
        return entry

    def _first_adapter_warm_up(self) -> None:
        warm_up, self.warm_up_loras = self.warm_up_loras, None
        if warm_up is None:
            return
        try:
            warm_up()
        except Exception:  # the adapter is loaded: its first job compiles the programs instead
            log.exception("model %s: compiling the LoRA programs failed", self.model)

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)
        if self._sources.pop(name, None) is not None and name in self.runner.resident_loras():
            self.runner.unload_lora(name)

    def published(self) -> list[AdapterInfo]:
        return list(self._entries.values())

    def by_origin(self, origin: str) -> dict[str, LoraSpec]:
        return {n: e.spec for n, e in self._entries.items() if e.origin == origin}

    # -- before a batch (pool thread) ------------------------------------------------------------------------

    def ensure(self, jobs: Sequence[Sequence[str]]) -> None:
        """Make every adapter the batch's jobs name resident (one list of names per job), counting hits and
        loads. Raises TooManyAdapters when they cannot all be resident at once."""
        wanted = list(dict.fromkeys(n for names in jobs for n in names))
        if not wanted:
            return
        if len(wanted) > self.runner.lora_slots():
            raise TooManyAdapters(
                f"{len(wanted)} different adapters in one batch; the pool's table holds {self.runner.lora_slots()}"
            )
        resident = set(self.runner.resident_loras())
        hits = sum(1 for names in jobs for n in names if n in resident)
        if hits:
            metrics.LORA_HITS.labels(self.model).inc(hits)
        present = [n for n in wanted if n in resident]
        if present:
            self.runner.touch_loras(present)  # most recently used: never the one a reload below evicts
        for name in wanted:
            if name in resident:
                continue
            source = self._sources.get(name)
            if source is None:  # removed since the API admitted the job: the runner fails the job
                continue
            before = set(self.runner.resident_loras())
            expert = self._entries[name].load_into_transformer_2  # the part it was registered into
            try:
                self.runner.load_lora(name, source, load_into_transformer_2=expert)
            except LoraLoadError as e:  # its file changed or went away since it was registered
                from meshserve.workers.runner import InvalidRequest  # runner imports this module

                raise InvalidRequest(
                    f"LoRA {name!r} could not be loaded again from {source.value}: {e}"
                ) from e
            self._count_load("reload", before, name)

    def _count_load(self, reason: str, before: set[str], name: str) -> None:
        metrics.LORA_LOADS.labels(self.model, reason).inc()
        evicted = before - set(self.runner.resident_loras()) - {name}
        if evicted:
            metrics.LORA_EVICTIONS.labels(self.model).inc(len(evicted))
            log.info("model %s: LoRA %s evicted to load %s", self.model, sorted(evicted), name)


class LoraLoadError(Exception):
    """The runner could not load an adapter (a file that does not fit the model, a Hub fetch that failed)."""
