"""Wan 2.1: its transformer, causal 3D VAE, text handling, pipeline stages, and the embedded tiny Wan builder."""
