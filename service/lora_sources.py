"""Where a served LoRA may come from: a file or folder under the allowed root, or a Hugging Face Hub id; never a
URL, never a path elsewhere. The one rule for pools.yaml (workers/config.py, checked when the worker starts) and
`POST /v1/loras` (checked by the API, then again by each pool where the files are).

    resolve_source("style/lora.safetensors", root="/loras")        -> LoraSource("path", "/loras/style/lora.safetensors")
    resolve_source("owner/name", root="/loras")                    -> LoraSource("hub", "owner/name")  (no such file)
    resolve_source("/etc/passwd", root="/loras")                   -> LoraSourceError("outside_root")
    resolve_source("https://example.com/x.safetensors", root=...)  -> LoraSourceError("url_not_allowed")

A relative source names a file or folder under the root when one exists there (as the library reads a local
file before trying the Hub); otherwise it must be written as a Hub id, `owner/name` or
`owner/name/file.safetensors`. Paths are resolved with `os.path.realpath` (symlinks followed) and must stay inside
the root's own real path, so neither `..` nor a symlink leads out (a `..` component is refused outright: it is
never needed under a root). `must_exist=False` is the API's check: the files live where the pools run, so a
relative source that is not there is taken as written (a Hub id when it reads as one) and the pools decide.

Pure Python (os, re): the API imports it, and never imports JAX.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# The Hub's repo id rule (models/checkpoints/hub.py: letters, digits, "-", "_", "."; no "--" or ".."), plus an
# optional file in the repo; no revision: an adapter names one file.
_HUB = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}(/[\w.-]+)*\Z")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, https:, file:, s3:, hf:, C: ...
# An adapter's name, as requests and routes carry it (a path segment of DELETE /v1/loras/{model}/{name}).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_SOURCE_CHARS = 1024


class LoraSourceError(ValueError):
    """A source the rules refuse: `rule` is the 422 code (url_not_allowed, outside_root, parent_reference,
    no_lora_root, hub_not_allowed, not_found, invalid_source)."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class LoraSource:
    kind: str  # "path" (value: the real path) or "hub" (value: owner/name[/file.safetensors])
    value: str


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_form(source: str) -> None:
    """The checks that need no root and no files: a source, not a URL, no `..` (pools.yaml, when read)."""
    resolve_source(source, root="/", must_exist=False)


def resolve_source(
    source: str, *, root: str | None, allow_hub: bool = True, must_exist: bool = True
) -> LoraSource:
    """The source as the rules allow it (module docstring), or LoraSourceError naming the rule."""
    if not isinstance(source, str) or not source.strip() or len(source) > MAX_SOURCE_CHARS:
        raise LoraSourceError(
            "invalid_source", f"a LoRA source is a path or a Hub id of 1 to {MAX_SOURCE_CHARS} characters"
        )
    if "\x00" in source or "\\" in source:
        raise LoraSourceError("invalid_source", "a LoRA source may not hold NUL or backslash characters")
    if "://" in source or _SCHEME.match(source):
        raise LoraSourceError(
            "url_not_allowed",
            f"{source[:80]!r}: URLs are not LoRA sources; name a file under the LoRA root or a Hub id "
            "owner/name[/file.safetensors]",
        )
    parts = source.split("/")
    if ".." in parts:
        raise LoraSourceError("parent_reference", f"{source[:80]!r}: '..' is not allowed in a LoRA source")
    real_root = os.path.realpath(root) if root else None
    if os.path.isabs(source):
        if real_root is None:
            raise LoraSourceError(
                "no_lora_root",
                "no LoRA root is configured (MESHSERVE_LORA_ROOT / lora_root): files are refused",
            )
        return LoraSource("path", _under_root(source, real_root, must_exist))
    if real_root is not None and os.path.lexists(os.path.join(real_root, source)):
        return LoraSource("path", _under_root(os.path.join(real_root, source), real_root, must_exist))
    if _HUB.match(source) and "--" not in parts[0] + "/" + parts[1] and "." not in (parts[0], parts[1]):
        if not allow_hub:
            raise LoraSourceError("hub_not_allowed", f"{source!r}: Hub LoRAs are not allowed here")
        return LoraSource("hub", source)
    if real_root is None:
        raise LoraSourceError(
            "no_lora_root",
            f"{source[:80]!r} is not a Hub id (owner/name[/file.safetensors]) and no LoRA root is configured",
        )
    return LoraSource("path", _under_root(os.path.join(real_root, source), real_root, must_exist))


def _under_root(path: str, real_root: str, must_exist: bool) -> str:
    real = os.path.realpath(path)  # follows every symlink that exists on this machine
    if not _inside(real, real_root):
        raise LoraSourceError("outside_root", f"LoRA files must be under the LoRA root {real_root}")
    if must_exist and not os.path.exists(real):
        raise LoraSourceError("not_found", f"no file or folder {real} under the LoRA root")
    return real
