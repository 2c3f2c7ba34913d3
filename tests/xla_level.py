"""XLA's optimisation level for the programs a test runs many times.

The test processes compile at XLA's backend optimisation level 0 (tests/conftest.py): the suite is mostly
compiling, and level 0 compiles a third faster. It also runs what it compiled slower: element-wise code is not
vectorised (jnp.tanh and jnp.sin over 2048 x 2048, 20 times: 2.3 s at level 0, 0.49 s at 2). A test that runs
its programs many times (the held-out evaluations of the trained models: 24 captions x 20 steps; the Wan VAE's
training step) gives them serving's level back through the pipeline's `xla_options` (docs/compilation.md) or
the training's, which also makes them the code serving runs.
"""

# XLA's default (DebugOptions' xla_backend_optimization_level), the level `meshserve serve` compiles at.
SERVING_LEVEL = {"xla_backend_optimization_level": 3}
