"""LoRA adapters per request: formats (formats.py), the on-device pool (pool.py), the traced layers (apply.py)."""
