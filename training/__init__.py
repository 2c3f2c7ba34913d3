"""Training the embedded default model: a tiny SDXL that draws coloured shapes (docs/embedded-model.md).

`shapes` makes the procedural images and their captions, `shape_score` reads a picture back (the prompt
adherence the tests measure), `caption_tokenizer` builds the CLIP tokenizers whose words are the captions',
`config` holds the architecture and the training recipe, and `train_shapes` runs it and writes the diffusers
folder that ships with the package. JAX/Flax NNX and optax on the serving models and the serving mesh rules;
no torch.
"""
