"""Multi-host pools: one pool over the devices of several processes (hosts), process 0 leading.

    spec = group_from_environment(coordinator, num_processes, process_id)  # None: a one-process worker
    initialize_group(spec)                                                  # jax.distributed, before any JAX use
    group = Group(leader=jax.process_index() == 0)

How a group serves (docs/multihost.md has the whole story):

- Every process loads the same models and warms up the same programs in the same order (workers/pool.py
  `load_runners`): each compiled program is one SPMD program over all the group's devices, so every process
  must run every program, with the same arguments, in the same order.
- Only the leader (process 0) talks to Redis: it claims, heartbeats leases, publishes progress, writes
  results. Before each batch it sends the batch's call arguments to the followers over `Group.send`: JSON in
  fixed-size uint8 frames, broadcast with `multihost_utils.broadcast_one_to_all` (a JAX collective over the
  group's devices), so a follower blocks in a collective, never on Redis. Then every process calls the same
  runner with the same requests; the outputs reach the leader's host whole (`models/engine/pipeline.py` `to_host`).
- Cancel and progress: the denoise loop's step callback is an `io_callback`, which XLA runs on the process
  that owns the mesh's first device (the leader) only; its answer (go on / stop) is an operand of the loop
  condition on every device, so all processes stop at the same step (measured here: with the leader's
  callback stopping after 3 steps, the follower's loop also ran 3 steps and its callback ran 0 times).
- Idle: the leader pings every `ping_s` so that followers know it is alive; a follower that waits longer than
  `silence_s` for a message exits non-zero (its watchdog: a leader that is alive but wedged, which the
  coordination service cannot see). Timings: `GroupTiming`.
- Failure: a process that dies closes its gloo/NCCL connections, so the others' next collective fails at once
  (CPU/gloo, tests/workers/test_multihost.py: the leader exited 0.51 s after the follower's SIGKILL mid-batch,
  with "Gloo all-reduce failed: Connection closed by peer"); a process that hangs stops its coordination-service
  heartbeats, and after `heartbeat_s` JAX's client terminates every other process of the group. A dead leader
  takes the coordination service with it: its followers abort (SIGABRT, 0.28 s after the leader's SIGKILL in
  the same test). A collective with a dead peer does not always fail at once (a leader resumed after SIGSTOP
  hung in its ping until the coordination heartbeat ended it): the heartbeat is the bound. The leader exits non-zero (GroupFailed) without acknowledging the running job, so its lease
  lapses and another pool (or the restarted group) takes it over; LeaderWorkerSet restarts the whole group
  when any of its pods exits.

A group's engine error (anything but a request's own fault or a cancel) ends the group: after a one-sided
error the processes could no longer be sure to enter the same collectives, and a mismatched collective hangs
or mixes data. The job's delivery count still rises, so a job that kills its group is dead-lettered after
`max_deliveries` like any poison job.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from meshserve.service.contract import JobParams
from meshserve.workers.runner import Cancelled, InvalidRequest, Runner, RunRequest, encode_job

log = logging.getLogger(__name__)

# The coordinator's port when the environment names only its host (LeaderWorkerSet). JAX's own Cloud TPU
# default is 8482; ours differs so that a TPU job's coordinator and ours never collide on one host.
DEFAULT_COORDINATOR_PORT = 8476
# Each broadcast moves one frame of this many bytes: one compiled broadcast program serves every message (a
# message's length would otherwise be a new shape, a new compilation). A batch's arguments fit one frame
# unless its prompts are long; longer messages take several frames. The size hardly matters: on CPU/gloo, 2
# processes x 2 devices (2026-11-22, a loaded 2-core machine, load average ~10), the median of 50 broadcasts
# was 1.73 ms for 16 B, 1.87 ms for 16 KiB and 1.87 ms for 64 KiB.
FRAME_BYTES = 16384
_LENGTH = struct.Struct("<I")

# Exit codes of a group member that stops because of the group (the process manager restarts the group).
EXIT_GROUP_FAILED = 3  # a collective with the other processes failed
EXIT_LEADER_SILENT = 4  # a follower heard nothing from the leader for `silence_s`


class GroupFailed(RuntimeError):
    """The pool's process group can no longer run collectives together: a member died or an engine error left
    the members out of step. The worker exits non-zero; the group is restarted as a whole."""


@dataclass(frozen=True)
class GroupTiming:
    """The group's failure bounds, in seconds (environment: MESHSERVE_GROUP_PING_S, MESHSERVE_GROUP_SILENCE_S,
    MESHSERVE_GROUP_HEARTBEAT_S).

    ping_s: how often an idle leader pings (~2 ms each on CPU/gloo). silence_s: how long a follower waits for
    any message before it exits (EXIT_LEADER_SILENT); it covers a leader that is alive but wedged, which the
    coordination service cannot see. heartbeat_s: the coordination service's timeout for a silent process,
    after which JAX terminates the group's other processes (JAX's default is 100 s; a pool should give its
    jobs back sooner than that)."""

    ping_s: float = 2.0
    silence_s: float = 60.0
    heartbeat_s: int = 30

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> GroupTiming:
        env = os.environ if environ is None else environ
        out = cls()
        for field, name, cast in (
            ("ping_s", "MESHSERVE_GROUP_PING_S", float),
            ("silence_s", "MESHSERVE_GROUP_SILENCE_S", float),
            ("heartbeat_s", "MESHSERVE_GROUP_HEARTBEAT_S", int),
        ):
            raw = env.get(name)
            if raw not in (None, ""):
                try:
                    value = cast(raw)
                except ValueError:
                    raise ValueError(f"{name} must be a number, got {raw!r}") from None
                if value <= 0:
                    raise ValueError(f"{name} must be positive, got {raw!r}")
                out = replace(out, **{field: value})
        if out.silence_s <= out.ping_s:
            raise ValueError(
                f"MESHSERVE_GROUP_SILENCE_S ({out.silence_s}) must exceed the ping ({out.ping_s})"
            )
        return out


# --------------------------------------------------------------------------------------------------------------
# Which group this process belongs to


@dataclass(frozen=True)
class GroupSpec:
    """jax.distributed.initialize's arguments. `coordinator`, `num_processes`, `process_id` are None for a
    Cloud TPU slice, where JAX reads them from the TPU environment itself."""

    source: str  # "flags", "env" (MESHSERVE_*), "lws" (LeaderWorkerSet), "tpu" (GKE / Cloud TPU slice)
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def is_leader(self) -> bool | None:
        return None if self.process_id is None else self.process_id == 0


def group_from_environment(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> GroupSpec | None:
    """The process group this worker joins, or None for a one-process worker. First match wins:

    1. the command line (`--coordinator HOST:PORT --num-processes N --process-id I`), each value falling back
       to `MESHSERVE_COORDINATOR`, `MESHSERVE_NUM_PROCESSES`, `MESHSERVE_PROCESS_ID`;
    2. a LeaderWorkerSet group: `LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE`, `LWS_WORKER_INDEX` (the port:
       `MESHSERVE_COORDINATOR_PORT`, default 8476);
    3. a multi-host Cloud TPU slice on GKE: `TPU_WORKER_HOSTNAMES` (or `TPU_PROCESS_ADDRESSES`) naming more
       than one host; JAX's cluster detection fills in the rest (not runnable here: no TPU).

    A group of one process is no group (None). Raises ValueError for a partial or inconsistent setting."""
    env = os.environ if environ is None else environ
    values = {
        "coordinator": coordinator if coordinator is not None else env.get("MESHSERVE_COORDINATOR"),
        "num_processes": num_processes
        if num_processes is not None
        else _int_env(env, "MESHSERVE_NUM_PROCESSES"),
        "process_id": process_id if process_id is not None else _int_env(env, "MESHSERVE_PROCESS_ID"),
    }
    given = {k for k, v in values.items() if v not in (None, "")}
    if given:
        missing = sorted(set(values) - given)
        if missing:
            raise ValueError(
                f"a multi-host worker needs --coordinator, --num-processes and --process-id (or "
                f"MESHSERVE_COORDINATOR, MESHSERVE_NUM_PROCESSES, MESHSERVE_PROCESS_ID); missing: {missing}"
            )
        source = "flags" if any(v is not None for v in (coordinator, num_processes, process_id)) else "env"
        return _checked(
            GroupSpec(source, values["coordinator"], values["num_processes"], values["process_id"])
        )
    if "LWS_LEADER_ADDRESS" in env and "LWS_GROUP_SIZE" in env:
        port = _int_env(env, "MESHSERVE_COORDINATOR_PORT") or DEFAULT_COORDINATOR_PORT
        spec = GroupSpec(
            "lws",
            f"{env['LWS_LEADER_ADDRESS']}:{port}",
            _int_env(env, "LWS_GROUP_SIZE"),
            _int_env(env, "LWS_WORKER_INDEX") or 0,
        )
        return _checked(spec)
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([h for h in hosts.split(",") if h.strip()]) > 1:
        return GroupSpec("tpu")
    return None


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _checked(spec: GroupSpec) -> GroupSpec | None:
    host, sep, port = (spec.coordinator or "").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator must be HOST:PORT, got {spec.coordinator!r} (from {spec.source})")
    if spec.num_processes is None or spec.num_processes < 1:
        raise ValueError(f"the number of processes must be at least 1, got {spec.num_processes}")
    if spec.process_id is None or not 0 <= spec.process_id < spec.num_processes:
        raise ValueError(
            f"the process id must be in [0, {spec.num_processes - 1}], got {spec.process_id} (from {spec.source})"
        )
    return spec if spec.num_processes > 1 else None


def initialize_group(
    spec: GroupSpec,
    *,
    heartbeat_timeout_s: int = GroupTiming.heartbeat_s,
    init_timeout_s: int = 300,
    shutdown_timeout_s: int = 30,
) -> None:
    """jax.distributed.initialize for `spec`; call before anything else touches JAX's backends.

    heartbeat_timeout_s: how long the coordination service waits for a silent process before it declares it
    dead, after which every other process of the group is terminated by JAX (JAX's default is 100 s; a pool
    should give its jobs back sooner). init_timeout_s: how long to wait for the whole group to connect.
    shutdown_timeout_s: how long a clean exit waits for the others at the shutdown barrier."""
    import jax

    # CPU processes exchange collectives over gloo (TCP); XLA:CPU has no cross-process collectives without it.
    # The option concerns the CPU backend only, so it is harmless on GPU and TPU hosts.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        initialization_timeout=init_timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    log.info(
        "process %d of %d joined the group (%s, coordinator %s): %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        spec.source,
        spec.coordinator or "auto-detected",
        jax.local_device_count(),
        jax.device_count(),
    )


def check_same_pool(pool_and_models: Mapping) -> None:
    """Every process of the group must build the same programs, so they must read the same pool and model
    settings (a follower started from an older config would enter other collectives than the leader: a hang
    or mixed data). Compares a digest of `pool_and_models` (JSON-able) across the group; GroupFailed on every
    process when they differ. One all-gather of 32 bytes, before anything loads."""
    import hashlib

    import numpy as np
    from jax.experimental import multihost_utils

    text = json.dumps(pool_and_models, sort_keys=True, separators=(",", ":"), default=str)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
    differ = [i for i, row in enumerate(gathered) if not np.array_equal(row, digest)]
    if differ:
        raise GroupFailed(
            f"processes {differ} of the group have another pool or model config than this one: start every "
            "process of a group from the same pools.yaml"
        )


# --------------------------------------------------------------------------------------------------------------
# The leader -> followers channel


class Group:
    """This process's end of the group's message channel. The leader `send`s, followers `receive`; both block
    in the same broadcast collective, so they must be called in the same order on every process (the pool
    thread makes every call of a pool, in order). After a failed collective the group is `failed` for good."""

    def __init__(self, *, leader: bool, timing: GroupTiming | None = None, frame_bytes: int = FRAME_BYTES):
        self.leader, self.frame_bytes = leader, frame_bytes
        self.timing = timing or GroupTiming()
        self.failed: BaseException | None = None
        self.waiting_since: float | None = None  # a follower blocked in receive(), since (monotonic)

    def send(self, message: Mapping) -> None:
        """Leader: broadcast one JSON message to every follower."""
        assert self.leader, "only the leader sends"
        data = json.dumps(message, separators=(",", ":")).encode()
        payload = _LENGTH.pack(len(data)) + data
        for offset in range(0, len(payload), self.frame_bytes):
            self._broadcast(payload[offset : offset + self.frame_bytes])

    def ping(self) -> None:
        self.send({"op": "ping"})

    def stop_followers(self) -> None:
        self.send({"op": "stop"})

    def receive(self) -> dict:
        """Follower: the leader's next message (blocks in the broadcast until the leader sends one)."""
        assert not self.leader, "the leader does not receive"
        self.waiting_since = time.monotonic()
        try:
            first = self._broadcast(b"")
            (length,) = _LENGTH.unpack(first[: _LENGTH.size])
            chunks, got = [first[_LENGTH.size :]], self.frame_bytes - _LENGTH.size
            while got < length:
                chunks.append(self._broadcast(b""))
                got += self.frame_bytes
            return json.loads(b"".join(chunks)[:length])
        finally:
            self.waiting_since = None

    def _broadcast(self, chunk: bytes) -> bytes:
        import numpy as np
        from jax.experimental import multihost_utils

        if self.failed is not None:
            raise GroupFailed(f"the process group failed earlier: {self.failed}")
        frame = np.zeros(self.frame_bytes, np.uint8)
        frame[: len(chunk)] = np.frombuffer(chunk, np.uint8)
        try:
            out = multihost_utils.broadcast_one_to_all(frame, is_source=self.leader)
        except Exception as e:  # a collective that fails means a member is gone
            self.fail(e)
            raise GroupFailed(f"broadcast to the process group failed: {e}") from e
        return np.asarray(out, np.uint8).tobytes()

    def fail(self, error: BaseException) -> None:
        if self.failed is None:
            self.failed = error
            log.error("process group failed: %s", error)


def run_message(requests: Sequence[RunRequest], model: str) -> dict:
    """The message that tells followers to run `requests` on `model` (their RunRequests, as JSON). Image
    inputs, which the leader read from the store, travel with them (PNG, base64): every process must make the
    same call, and followers do not read the store."""
    return {
        "op": "run",
        "model": model,
        "jobs": [[r.job_id, r.params.model_dump(mode="json"), _inputs_of(r)] for r in requests],
    }


def requests_of(message: Mapping) -> list[RunRequest]:
    return [
        RunRequest(job_id, JobParams.model_validate(p), **_inputs_from(inputs))
        for job_id, p, inputs in message["jobs"]
    ]


def _inputs_of(request: RunRequest) -> dict:
    inputs: dict = {"missing": request.missing} if request.missing is not None else {}
    if request.tenant is not None:  # the prompt cache's scope: every process must key its rows alike
        inputs["tenant"] = request.tenant
    for name in ("image", "mask", "last_image", "control_image"):
        image = getattr(request, name)
        if image is not None:
            buf = io.BytesIO()
            image.save(buf, format="PNG", compress_level=1)
            inputs[name] = base64.b64encode(buf.getvalue()).decode()
    return inputs


def _inputs_from(inputs: Mapping) -> dict:
    from PIL import Image

    out = {
        name: Image.open(io.BytesIO(base64.b64decode(inputs[name])))
        for name in ("image", "mask", "last_image", "control_image")
        if name in inputs
    }
    for image in out.values():
        image.load()
    for name in ("missing", "tenant"):
        if name in inputs:
            out[name] = inputs[name]
    return out


class LeaderRunner(Runner):
    """The leader's runner for a multi-host pool: sends each batch to the followers, then runs it here; the
    followers run the same call (`follow`). Everything else is the wrapped runner's."""

    def __init__(self, inner: Runner, group: Group):
        super().__init__(inner.name)
        self.inner, self.group = inner, group

    def load(self) -> None:
        self.inner.load()

    def info(self):
        return self.inner.info()

    def warm_up(self, buckets, batch_sizes, num_inference_steps, frames=(), **tasks) -> float:
        return self.inner.warm_up(buckets, batch_sizes, num_inference_steps, frames, **tasks)

    def batch_key(self, params: JobParams) -> tuple:
        return self.inner.batch_key(params)

    @property
    def takes_previews(self) -> bool:
        return self.inner.takes_previews

    def run(self, batch, callback=None, **previews):
        return [
            encode_job(r, g) for r, g in zip(batch, self.generate(batch, callback, **previews), strict=True)
        ]

    def generate(self, batch, callback=None, **previews):
        """The model's half (the job loop encodes off the pool thread): sent to the followers, then run here."""
        self.group.send(run_message(batch, self.name))  # GroupFailed when a member is gone
        try:
            return self.inner.generate(batch, callback, **previews)
        except (Cancelled, InvalidRequest):
            raise  # the same on every process: the loop stopped everywhere / the request failed its checks
        except Exception as e:
            self.group.fail(e)
            raise GroupFailed(f"engine error in a multi-host batch; the group must restart: {e!r}") from e

    def shutdown(self) -> None:
        self.inner.shutdown()

    @property
    def compilations(self) -> int:
        return self.inner.compilations


# --------------------------------------------------------------------------------------------------------------
# The follower's side


def follow(group: Group, runners: Mapping[str, Runner]) -> None:
    """A follower's life after loading: run what the leader sends until it says stop. Raises GroupFailed
    when a collective fails; exits the process (EXIT_LEADER_SILENT) when the leader is silent too long."""
    watchdog = threading.Thread(
        target=_watch, args=(group, group.timing.silence_s), name="leader-watchdog", daemon=True
    )
    watchdog.start()
    batches = 0
    while True:
        message = group.receive()
        op = message.get("op")
        if op == "stop":
            log.info("follower: the leader stopped the group after %d batches", batches)
            return
        if op == "ping":
            continue
        if op != "run":
            raise GroupFailed(f"unknown message from the leader: {op!r}")
        batches += 1
        try:
            # The model's half only: the leader encodes and writes the outputs.
            runners[message["model"]].generate(requests_of(message), None)
        except (Cancelled, InvalidRequest) as e:
            log.info("follower: batch ended as on the leader: %s", e)
        except Exception as e:
            group.fail(e)
            raise GroupFailed(f"engine error in a multi-host batch: {e!r}") from e


def _watch(group: Group, silence_s: float) -> None:
    while True:
        time.sleep(min(1.0, silence_s / 4))
        since = group.waiting_since
        if since is not None and time.monotonic() - since > silence_s:
            log.error(
                "follower: no message from the leader for %.0f s; exiting so the group restarts", silence_s
            )
            logging.shutdown()
            os._exit(EXIT_LEADER_SILENT)
