"""The families the training loop makes embedded models of: `family(name)`, a new one per run (it holds the
run's tokenizers)."""

from __future__ import annotations

import importlib

from meshserve.training.families.base import TrainingFamily

_FAMILIES = {
    "sdxl": "meshserve.training.families.sdxl",
    "flux": "meshserve.training.families.flux",
    "wan": "meshserve.training.families.wan",
}
NAMES = tuple(_FAMILIES)


def family(name: str) -> TrainingFamily:
    if name not in _FAMILIES:
        raise ValueError(f"unknown family {name!r}; the families are {', '.join(NAMES)}")
    return importlib.import_module(_FAMILIES[name]).Family()
