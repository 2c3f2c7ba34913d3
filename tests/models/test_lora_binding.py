"""Which layers the active adapters reach (models/lora/apply.py): the layers `bind` named, and no other, even a
layer built after a bound one was freed. The text_encode program merges one CLIP encoder, runs it and drops it,
then merges the next; CPython gives a freed object's memory, hence its id, to the next object of its size, so
with layers keyed by id alone a layer of the second encoder once took the first encoder's factors (a served
job failed on their shapes; with equal shapes the output would have been silently wrong)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshserve.models.components import clip
from meshserve.models.components.layers import Linear
from meshserve.models.lora.apply import adapted, adapters_active, bind
from tests.fixtures.tiny_sdxl import TEXT_ENCODER

# The tiny SDXL checkpoint's CLIP sizes (tests/fixtures/tiny_sdxl.py).
CONFIG = clip.CLIPTextConfig(vocab_size=100, eos_token_id=99, **TEXT_ENCODER)
TARGETS = ("self_attn.q_proj", "mlp.fc1")


def _split(seed):
    return nnx.split(clip.CLIPTextModel(CONFIG, rngs=nnx.Rngs(seed)))


def _tables(module, prefix):
    tables = {}
    for path, node in nnx.iter_graph(module):
        name = ".".join(str(p) for p in path)
        if name.endswith(TARGETS):
            tables[prefix + name] = (jnp.ones((1, node.in_features, 2)), jnp.ones((1, 2, node.out_features)))
    return tables


def _linears(module):
    return [node for _, node in nnx.iter_graph(module) if isinstance(node, Linear)]


def test_the_bound_layers_and_only_they_are_adapted():
    graph, state = _split(0)
    module = nnx.merge(graph, state)
    tables = _tables(module, "text_encoder.")
    assert len(tables) == 2 * CONFIG.num_hidden_layers
    with adapters_active(tables, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1))):
        bind(module, prefix="text_encoder.")
        changed = 0
        for layer in _linears(module):
            x = jnp.ones((1, 3, layer.in_features))
            y = nnx.Linear.__call__(layer, x)
            changed += not np.array_equal(adapted(layer, x, y), y)
        assert changed == len(tables)


def test_a_layer_built_after_a_bound_one_was_freed_is_not_adapted():
    first, second = _split(0), _split(1)
    tables = _tables(nnx.merge(*first), "text_encoder.")
    with adapters_active(tables, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1))):
        bind(nnx.merge(*first), prefix="text_encoder.")  # bound and dropped, as the program's merged encoders
        for _ in range(20):  # (without the fix, ids were reused within the first few merges)
            module = nnx.merge(*second)
            for layer in _linears(module):
                x = jnp.ones((1, 3, layer.in_features))
                y = nnx.Linear.__call__(layer, x)
                assert adapted(layer, x, y) is y
            del module
