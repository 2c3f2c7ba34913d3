"""Stable Diffusion XL: its UNet, its pipeline stages, and the embedded tiny SDXL (weights shipped in weights/)."""
