"""Checkpoints: reading diffusers folders and safetensors, Hub ids, and writing the embedded tiny models' folders."""
