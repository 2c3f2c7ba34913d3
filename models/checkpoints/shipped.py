"""A model folder shipped inside the package (the trained embedded models), its weights checked on first use.

Each embedded model's module lists its weights files' sha256 sums as training wrote them, and the command that
made them; a damaged install, or weights retrained without updating the sums, fails loudly here instead of
serving pictures nobody measured.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path

from meshserve.models.checkpoints.loading import CheckpointError


def checked_folder(folder: Path, sha256: Mapping[str, str], command: str, module: str) -> Path:
    """`folder`, after checking every listed file's sha256 (4 ms for tiny-sdxl's 5.8 MB, measured 2026-11-22
    under load); `command` made the files, `module` holds the sums."""
    for name, expected in sha256.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"the embedded model is missing {path}: reinstall meshserve")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise CheckpointError(
                f"the embedded model's {name} has sha256 {digest}, expected {expected}: reinstall meshserve "
                f"(or, after retraining with `{command}`, update {module}'s SHA256)"
            )
    return folder


def shipped_folder(folder: Path, sha256: Mapping[str, str], command: str, module: str) -> Callable[[], Path]:
    """An embedded model's path function (what models/registry.py's EMBEDDED_MODELS names): `folder`, checked by
    `checked_folder` the first time it is asked for in a process."""
    return functools.cache(lambda: checked_folder(folder, sha256, command, module))
