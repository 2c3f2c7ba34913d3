"""diffusers' `generator=`: the starting noise a torch.Generator on the CPU draws, reproduced with numpy.

diffusers draws a pipeline's starting latents with `randn_tensor(shape, generator=g)`, on the CPU
`torch.randn(shape, generator=g)` (a list of generators: one row each, `shape[1:]`). torch's CPU generator is
mt19937, the engine numpy's MT19937 also runs; `torch.randn` of a float tensor of 16 values or more takes one
32-bit word per value as a float32 uniform (its low 24 bits x 2^-24), then turns each block of 16 into normals
by Box-Muller (`normal_fill`: u1 = 1 - u[j], u2 = u[j + 8] -> r cos(2 pi u2), r sin(2 pi u2) for j < 8), and
a size that is not a multiple of 16 draws 16 more uniforms for its last 16 values. A bfloat16 draw is the
float32 one rounded where the size is a multiple of 16 (torch 2.13; its tail differs, and is refused).

The generator is read and advanced through its state bytes (`get_state` / `set_state`, a uint8 tensor that
numpy views without a copy), so runtime code never imports torch and a generator reused over calls draws what
diffusers' would. Against `torch.randn`: at most 2.4e-7 apart (torch's vectorised log / sin / cos round
differently), tests/models/test_torch_generator.py. The same draws replay a stochastic step's noise where
diffusers' pipeline hands the step its generator (SDXL's), at the calls the scheduler's `generator_draws` names.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from meshserve.models.engine.common import PipelineError

_WORDS = 624  # mt19937's state
# torch's CPUGeneratorImplState: {the_initial_seed u64, left i32, seeded i32, next u64, state u64[624]}, then
# the cached normals of its other draws (left untouched: `randn` of 16 values or more does not use them).
_STATE_BYTES = 5056
_LEFT, _NEXT, _KEY = 8, 16, 24


def _check(generator) -> None:
    if not (hasattr(generator, "get_state") and hasattr(generator, "set_state")):
        raise PipelineError(
            f"generator must be a torch.Generator (or a list of them), got {type(generator).__name__}"
        )
    device = getattr(getattr(generator, "device", None), "type", "cpu")
    if device != "cpu":
        raise PipelineError(
            f"generator: a torch.Generator on the CPU draws diffusers' noise here; one on {device!r} draws "
            "other numbers (create it with torch.Generator('cpu'))"
        )


class _Stream:
    """One generator's mt19937, read from its state; `commit` writes where it got to back into the generator."""

    def __init__(self, generator):
        _check(generator)
        self.generator, self.state = generator, generator.get_state()
        raw = np.asarray(self.state)
        if raw.dtype != np.uint8 or raw.shape != (_STATE_BYTES,):
            raise PipelineError("generator: not a CPU torch.Generator's state (5056 bytes expected)")
        left = int(raw[_LEFT : _LEFT + 4].view(np.int32)[0])
        self.bits = np.random.MT19937()
        # torch's `left` counts down to the next twist (1: twist before the next word); numpy's `pos` counts up.
        key = raw[_KEY : _KEY + 8 * _WORDS].view(np.uint64).astype(np.uint32)
        self.bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": _WORDS + 1 - left}}

    def uniforms(self, size: int) -> np.ndarray:
        words = self.bits.random_raw(size).astype(np.uint32)
        return (words & 0xFFFFFF).astype(np.float32) * np.float32(2.0**-24)

    def randn(self, size: int) -> np.ndarray:
        if size < 16:  # torch's other path (doubles, a cached second sample): no latents are that small
            raise PipelineError(f"generator: drawing {size} values (< 16) is not reproduced")
        out = _box_muller(self.uniforms(size)[: size // 16 * 16])
        if size % 16:
            out = np.concatenate([out[: size - 16], _box_muller(self.uniforms(16))])
        return out

    def peek(self) -> int:
        """The next 32-bit word, not consumed."""
        bits = np.random.MT19937()
        bits.state = self.bits.state
        return int(bits.random_raw())

    def commit(self) -> None:
        raw = np.asarray(self.state)  # a view of the state tensor: writing it writes the tensor
        state = self.bits.state["state"]
        raw[_KEY : _KEY + 8 * _WORDS] = state["key"].astype(np.uint64).view(np.uint8)
        raw[_NEXT : _NEXT + 8] = np.array([state["pos"]], np.uint64).view(np.uint8)
        raw[_LEFT : _LEFT + 4] = np.array([_WORDS + 1 - state["pos"]], np.int32).view(np.uint8)
        self.generator.set_state(self.state)


def _box_muller(u: np.ndarray) -> np.ndarray:
    """torch's normal_fill on blocks of 16 uniforms."""
    blocks = u.reshape(-1, 16)
    radius = np.sqrt(np.float32(-2.0) * np.log(np.float32(1.0) - blocks[:, :8]))
    theta = np.float32(2.0 * np.pi) * blocks[:, 8:]
    return np.concatenate([radius * np.cos(theta), radius * np.sin(theta)], axis=1).reshape(-1)


def generators_of(generator, rows: int) -> list:
    """One generator for all rows, or a list with one per row (diffusers' rule; a list of one is one)."""
    if isinstance(generator, list | tuple):
        if len(generator) == 1:
            return [generator[0]]
        if len(generator) != rows:
            raise PipelineError(
                f"generator: a list of {len(generator)} generators for {rows} output rows; give one, or one per "
                "row (prompts x num_images_per_prompt)"
            )
        return list(generator)
    return [generator]


def draw_noise(generator, shape: tuple[int, ...], *, bfloat16: bool = False) -> np.ndarray:
    """`randn_tensor(shape, generator=generator)` on the CPU -> float32 [B, ...] (bfloat16: rounded to its
    values, as diffusers' bf16 pipelines draw), advancing the generator(s) as torch does."""
    gens = generators_of(generator, shape[0])
    per_draw = shape if len(gens) == 1 else (1, *shape[1:])
    size = int(np.prod(per_draw))
    if bfloat16 and size % 16:
        raise PipelineError(
            f"generator: a bfloat16 draw of {size} values (not a multiple of 16) is not reproduced"
        )
    streams = [_Stream(g) for g in gens]
    noise = np.concatenate([s.randn(size).reshape(per_draw) for s in streams])
    for s in streams:
        s.commit()
    if bfloat16:
        noise = noise.astype(ml_dtypes.bfloat16).astype(np.float32)
    return noise


def generator_seeds(generator, rows: int) -> list[int]:
    """Seeds for what the generator does not draw here (a stochastic scheduler's step noise, which stays the
    engine's own): each generator's next word, not consumed; one generator's rows take it, it + 1, ..."""
    gens = generators_of(generator, rows)
    if len(gens) == 1:
        first = _Stream(gens[0]).peek()
        return [(first + i) % 2**32 for i in range(rows)]
    return [_Stream(g).peek() for g in gens]
