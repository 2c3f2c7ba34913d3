"""Checkpoint reading and the PyTorch -> NNX key and layout rules."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from meshserve.models.checkpoints.loading import (
    CheckpointError,
    CheckpointMismatchError,
    abstract_module,
    export_weights,
    load_weights,
    read_component_weights,
    read_safetensors,
    to_nnx_layout,
    to_torch_layout,
    write_safetensors,
)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(3, 5, rngs=rngs)
        self.conv = nnx.Conv(5, 2, (3, 3), rngs=rngs)
        self.norm = nnx.LayerNorm(2, rngs=rngs)
        self.blocks = nnx.List([nnx.Embed(7, 2, rngs=rngs)])


def _torch_state(dtype=np.float32):
    rng = np.random.default_rng(0)
    shapes = {
        "proj.weight": (5, 3),
        "proj.bias": (5,),
        "conv.weight": (2, 5, 3, 3),
        "conv.bias": (2,),
        "norm.weight": (2,),
        "norm.bias": (2,),
        "blocks.0.weight": (7, 2),
    }
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


def test_rules_map_names_and_layouts():
    state = _torch_state()
    m = Tiny(nnx.Rngs(0))
    load_weights(m, state)
    np.testing.assert_array_equal(np.asarray(m.proj.kernel[...]), state["proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(m.conv.kernel[...]), state["conv.weight"].transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(np.asarray(m.norm.scale[...]), state["norm.weight"])
    np.testing.assert_array_equal(np.asarray(m.blocks[0].embedding[...]), state["blocks.0.weight"])
    back = export_weights(m)
    assert back.keys() == state.keys() and all(np.array_equal(back[k], state[k]) for k in state)


class Counted(Tiny):
    """Tiny, counting how often it is built (traced, when built abstractly)."""

    built = 0

    def __init__(self, tag, rngs):
        Counted.built += 1
        super().__init__(rngs)


def test_an_abstract_module_is_built_once_per_arguments_and_each_load_holds_its_own_weights():
    before = Counted.built
    first, second = abstract_module(Counted, "a"), abstract_module(Counted, "a")
    assert Counted.built == before + 1  # the second came from the first's structure, not traced again
    abstract_module(Counted, "b")
    assert Counted.built == before + 2
    state, other = _torch_state(), {k: v + 1 for k, v in _torch_state().items()}
    load_weights(first, state)
    load_weights(second, other)
    # Each module's Variables are its own: loading the second left the first's weights as loaded.
    np.testing.assert_array_equal(np.asarray(first.proj.kernel[...]), state["proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(second.proj.kernel[...]), other["proj.weight"].T)
    assert isinstance(abstract_module(Counted, "a").proj.kernel.get_value(), jax.ShapeDtypeStruct)


@pytest.mark.parametrize("ndim", [2, 3, 4, 5])
def test_layout_round_trip(ndim):
    x = np.arange(2 * 3 * 4 * 5 * 6)[: int(np.prod((2, 3, 4, 5, 6)[:ndim]))].reshape((2, 3, 4, 5, 6)[:ndim])
    np.testing.assert_array_equal(to_torch_layout("kernel", to_nnx_layout("kernel", x)), x)


def test_halves_layout_puts_value_and_gate_on_their_own_axis_and_round_trips():
    """A [value | gate] Linear, torch [2 O, I] -> [I, 2, O]: [:, 0] are the first O output rows, [:, 1] the rest."""
    weight, bias = np.arange(6 * 4).reshape(6, 4), np.arange(6)
    kernel = to_nnx_layout("halves_kernel", weight)
    assert kernel.shape == (4, 2, 3)
    np.testing.assert_array_equal(kernel[:, 0], weight[:3].T)
    np.testing.assert_array_equal(kernel[:, 1], weight[3:].T)
    np.testing.assert_array_equal(to_nnx_layout("halves_bias", bias), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(to_torch_layout("halves_kernel", kernel), weight)
    np.testing.assert_array_equal(to_torch_layout("halves_bias", to_nnx_layout("halves_bias", bias)), bias)


def test_mismatch_names_missing_unexpected_and_misshapen():
    state = _torch_state()
    del state["proj.bias"]
    state["extra.weight"] = np.zeros(1, np.float32)
    state["norm.weight"] = np.zeros(3, np.float32)
    with pytest.raises(CheckpointMismatchError) as e:
        load_weights(Tiny(nnx.Rngs(0)), state, where="tiny")
    assert e.value.missing == ["proj.bias"] and e.value.unexpected == ["extra.weight"]
    assert e.value.misshapen and "norm.weight" in e.value.misshapen[0]
    assert "tiny" in str(e.value) and "proj.bias" in str(e.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_half_precision_files_load_and_cast(tmp_path, dtype):
    state = _torch_state(dtype)
    write_safetensors(tmp_path / "model.safetensors", state)
    read = read_safetensors(tmp_path / "model.safetensors")
    assert all(read[k].dtype == np.dtype(dtype) and np.array_equal(read[k], state[k]) for k in state)
    m = Tiny(nnx.Rngs(0))
    load_weights(m, read, dtype=np.float32)
    assert m.proj.kernel[...].dtype == np.float32


def test_diffusers_reads_our_files(tmp_path):
    import torch
    from safetensors.torch import load_file

    state = _torch_state(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "x.safetensors", state)
    theirs = load_file(str(tmp_path / "x.safetensors"))
    assert theirs["proj.weight"].dtype == torch.bfloat16
    np.testing.assert_array_equal(
        theirs["conv.weight"].float().numpy(), state["conv.weight"].astype(np.float32)
    )


def test_sharded_index_and_fp16_variant(tmp_path):
    state = _torch_state()
    keys = sorted(state)
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: state[k] for k in keys[:3]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: state[k] for k in keys[3:]})
    index = {
        "weight_map": {k: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    read = read_component_weights(tmp_path)
    assert read.keys() == state.keys()

    variant = tmp_path / "v"
    variant.mkdir()
    write_safetensors(variant / "diffusion_pytorch_model.fp16.safetensors", _torch_state(np.float16))
    assert read_component_weights(variant)["proj.weight"].dtype == np.float16


def test_no_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no safetensors weights .* found: config.json"):
        read_component_weights(tmp_path)


def _raw_safetensors(path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}}, "not a list of sizes"),
        ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 16]}}, "do not hold"),
        ({"a": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, "do not hold"),  # past the data
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [-16, 0]}}, "do not hold"),
        ({"a": {"dtype": "F32", "shape": [4]}}, r"not \[start, end\]"),
        ({"a": {"dtype": "OBJ", "shape": [4], "data_offsets": [0, 16]}}, "unsupported dtype"),
        ({"a": [1, 2]}, "unsupported dtype"),
    ],
)
def test_a_safetensors_header_that_breaks_the_format_is_refused(tmp_path, header, why):
    """LoRA files can come from clients (a path under lora_root): the header is held to the format's rules."""
    path = tmp_path / "bad.safetensors"
    _raw_safetensors(path, header, bytes(24))
    with pytest.raises(CheckpointError, match=why):
        read_safetensors(path)
    _raw_safetensors(path, {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, bytes(24))
    assert read_safetensors(path)["a"].shape == (2, 3)
    path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="the header claims"):
        read_safetensors(path)
