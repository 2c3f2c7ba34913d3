"""Flux.1 (dev, schnell): its transformer, its pipeline stages, and the embedded tiny Flux builder."""
