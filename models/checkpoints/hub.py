"""Model ids from the Hugging Face Hub: `owner/name` (or `owner/name@revision`) -> a local diffusers folder.

    resolve_model_path("stabilityai/stable-diffusion-xl-base-1.0")            # -> .../snapshots/<commit>
    resolve_model_path("stabilityai/stable-diffusion-xl-base-1.0@v1.0", variant="fp16")
    resolve_model_path("/models/sdxl")                                       # a local folder stays as is

`huggingface_hub` does the fetching and owns everything about it: its cache (`HF_HOME`, `HF_HUB_CACHE`),
`HF_TOKEN`, `HF_HUB_OFFLINE` (then only the cache is read), revisions (branch, tag or commit), and its
progress bars (`HF_HUB_DISABLE_PROGRESS_BARS=1` turns them off). This module only decides *which* files to
fetch and turns the library's errors into a `ModelFolderError` that says what to do.

Which files: exactly what the pipelines read (`files_to_download`), computed from the repo's
`model_index.json` (fetched first) and the repo's file list at that commit: `model_index.json`, and for each
component it names, its configs and tokenizer files (.json, .txt, .model) and its safetensors weights; never
.bin / .ckpt / .pt / .onnx / .msgpack (flax) / .h5 duplicates, which the loader does not read (the SDXL base
repo holds 13.9 GB of safetensors and as much again in those formats and in the variant). Weights follow
diffusers' own rule (`variant_compatible_siblings`): with a `variant` (e.g. "fp16"), a component's variant
files where it has them, otherwise its plain ones; without one, the plain files (or, where a component has
none, its fp16 files: the only variant the loader falls back to, `loading.read_component_weights`).

The whole resolution is pinned to one commit (the one `model_index.json` came from), so a branch that moves
between the two calls cannot mix files of two commits. Models stay free of HTTP and Redis concepts: the Hub
client here is a file fetcher, and it is kept in this one file.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

# A Hub repo id: "owner/name", letters, digits, "-", "_", "." (the Hub's own rule, which also bans "--" and
# ".." and caps the length at 96); optionally "@revision" (a branch, tag or commit; a branch may hold "/").
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@(?P<revision>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")

# The weight file stems the loader reads (loading._WEIGHT_STEMS): diffusers' and transformers' names.
_WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
_SHARD = r"\d{5}-of-\d{5}"
# Component files that are not weights: configs, tokenizer vocabularies and merges, sentencepiece models.
_CONFIG_SUFFIXES = (".json", ".txt", ".model")
# Weight formats of any kind: a component holding only these (no safetensors) cannot be loaded.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".onnx", ".onnx_data", ".msgpack", ".h5")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when `spec` is written like a Hub id, else None. Says nothing about a
    local folder of that name: `resolve_model_path` looks for one first."""
    m = _HUB_ID.match(spec)
    if m is None or "--" in m["repo"] or ".." in m["repo"]:
        return None
    return m["repo"], m["revision"]


def is_hub_id(spec: str | Path | None) -> bool:
    """True when `spec` names a Hub repo rather than a folder: written as `owner/name[@revision]` and no local
    folder or file of that name exists (a local folder always wins)."""
    if spec is None or isinstance(spec, Path):
        return False
    if Path(spec).expanduser().exists():
        return False
    return parse_hub_id(spec) is not None


def _weight_patterns(stems: str, variant: str | None) -> tuple[re.Pattern, ...]:
    """Regexes for a component's weight files (and their shard index) of `variant` (None: the plain ones),
    after diffusers' `variant_compatible_siblings`: `model.fp16.safetensors`, `model.fp16-00001-of-00002
    .safetensors` + `model.safetensors.index.fp16.json`, or the legacy `model-00001-of-00002.fp16.safetensors`
    + `model.safetensors.fp16.index.json`."""
    if variant is None:
        return (
            re.compile(rf"^({stems})(-{_SHARD})?\.safetensors$"),
            re.compile(rf"^({stems})\.safetensors\.index\.json$"),
        )
    v = re.escape(variant)
    return (
        re.compile(rf"^({stems})\.({v}|{v}-{_SHARD})\.safetensors$"),
        re.compile(rf"^({stems})\.safetensors\.index\.{v}\.json$"),
        re.compile(rf"^({stems})-{_SHARD}\.{v}\.safetensors$"),
        re.compile(rf"^({stems})\.safetensors\.{v}\.index\.json$"),
    )


def _matching(names: list[str], patterns: tuple[re.Pattern, ...]) -> list[str]:
    return [n for n in names if any(p.match(n) for p in patterns)]


def components(model_index: dict) -> list[str]:
    """The component folders a `model_index.json` names: entries `[library, class]` that are not null (an SDXL
    refiner's `"text_encoder": [null, null]` is absent) and not settings such as `force_zeros_for_empty_prompt`."""
    return sorted(
        name
        for name, value in model_index.items()
        if not name.startswith("_") and isinstance(value, list | tuple) and len(value) == 2 and all(value)
    )


def files_to_download(model_index: dict, repo_files: Iterable[str], variant: str | None = None) -> list[str]:
    """The repo files the pipeline reads, as exact paths (snapshot_download's `allow_patterns`).

    `model_index`: the repo's model_index.json; `repo_files`: every file path in the repo at the commit;
    `variant`: e.g. "fp16" for `*.fp16.safetensors`. Raises ModelFolderError when a component's weights exist
    only in formats the loader does not read, or when no component has the variant asked for."""
    from meshserve.models.registry import ModelFolderError

    stems = "|".join(_WEIGHT_STEMS)
    by_component: dict[str, list[str]] = {}
    for path in repo_files:
        folder, _, name = path.partition("/")
        if name and "/" not in name:  # files directly in a component folder (not e.g. unet/flax/...)
            by_component.setdefault(folder, []).append(name)
    chosen = ["model_index.json"]
    variant_found = False
    for component in components(model_index):
        names = sorted(by_component.get(component, []))
        configs = [n for n in names if n.endswith(_CONFIG_SUFFIXES) and ".index." not in n]
        weights = _matching(names, _weight_patterns(stems, variant)) if variant else []
        variant_found = variant_found or bool(weights)
        if not weights:
            weights = _matching(names, _weight_patterns(stems, None))
        if not weights:  # only fp16 files: the loader falls back to those (see the docstring)
            weights = _matching(names, _weight_patterns(stems, "fp16"))
        if not weights and any(n.endswith(_WEIGHT_SUFFIXES) for n in names):
            others = ", ".join(n for n in names if n.endswith(_WEIGHT_SUFFIXES))
            raise ModelFolderError(
                f"component {component!r} has no safetensors weights meshserve can read"
                f"{f' (variant {variant!r} or plain)' if variant else ''}; it holds: {others}. meshserve reads "
                "diffusers-format .safetensors only (convert the weights, or pick another variant or repo)"
            )
        chosen += [f"{component}/{n}" for n in configs + weights]
    if variant and not variant_found:
        raise ModelFolderError(
            f"no component has weights of variant {variant!r}; leave the variant out to use the plain weights"
        )
    return chosen


def resolve_model_path(
    spec: str | Path,
    *,
    revision: str | None = None,
    variant: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """A local folder for `spec`: a local path as is (checked by the loader), a Hub id (`owner/name`,
    `owner/name@revision`) fetched into the Hugging Face cache (or found there) and returned as its snapshot
    folder. `revision` (branch, tag or commit) is the same as `@revision`; `token` defaults to HF_TOKEN or the
    saved login (huggingface_hub's rule). Errors: ModelFolderError, saying what to do."""
    if not is_hub_id(spec):
        return Path(spec).expanduser()
    from meshserve.models.registry import ModelFolderError

    repo_id, at_revision = parse_hub_id(str(spec))
    if revision and at_revision and revision != at_revision:
        raise ModelFolderError(f"{spec}: revision {revision!r} contradicts the id's @{at_revision}")
    revision = revision or at_revision
    try:
        return _fetch(repo_id, revision, variant, token)
    except ModelFolderError:
        raise
    except Exception as e:  # the library's errors, explained; anything else is not ours to rename
        message = explain_hub_error(e, str(spec), repo_id, revision)
        if message is None:
            raise
        raise ModelFolderError(message) from e


def _fetch(repo_id: str, revision: str | None, variant: str | None, token) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from meshserve.models.checkpoints.loading import read_json

    index = Path(hf_hub_download(repo_id, "model_index.json", revision=revision, token=token))
    snapshot = index.parent  # <cache>/models--owner--name/snapshots/<commit>/model_index.json
    commit = snapshot.name if _COMMIT.match(snapshot.name) else revision
    files = _repo_files(repo_id, commit, snapshot, token)
    wanted = files_to_download(read_json(index), files, variant)
    log.info(
        "%s@%s: %d of the repo's %d files to fetch or find in the cache",
        repo_id,
        commit,
        len(wanted),
        len(files),
    )
    # Exact paths as patterns: fnmatch would read "[" in a name as a character class, so escape it.
    patterns = [re.sub(r"([\[\]*?])", r"[\1]", f) for f in wanted]
    try:
        return Path(snapshot_download(repo_id, revision=commit, allow_patterns=patterns, token=token))
    except LocalEntryNotFoundError as e:  # model_index.json was found: the snapshot lacks some of the rest
        from meshserve.models.registry import ModelFolderError

        raise ModelFolderError(_incomplete(repo_id, revision)) from e


def _repo_files(repo_id: str, commit: str | None, snapshot: Path, token) -> list[str]:
    """Every file of the repo at `commit`: the library's cached tree listing (written by an earlier
    snapshot_download; a commit's listing never changes), else the Hub's listing, else (offline, or the Hub out
    of reach) the files already in the cached snapshot."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    try:
        from huggingface_hub import get_cached_repo_tree

        return [f.path for f in get_cached_repo_tree(repo_id, revision=commit)]
    except Exception:  # ImportError (older library) or no cached listing yet
        pass
    if not constants.is_offline_mode():
        try:
            return list(HfApi(token=token).list_repo_files(repo_id, revision=commit))
        except HfHubHTTPError:
            raise  # not found, gated, no such revision: the user's to fix
        except Exception as e:  # unreachable: the cache decides, as snapshot_download does
            log.warning("cannot list %s on the Hub (%s); using the cached files", repo_id, e)
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _incomplete(repo_id: str, revision: str | None) -> str:
    from huggingface_hub import constants

    at = f" at revision {revision!r}" if revision else ""
    return (
        f"the cached copy of {repo_id}{at} lacks files this model needs (another variant was fetched, or a "
        "download stopped) and the Hub cannot be reached: run once with network access (HF_HUB_OFFLINE unset) "
        f"to complete it. Cache: {constants.HF_HUB_CACHE}"
    )


def explain_hub_error(error: Exception, spec: str, repo_id: str, revision: str | None) -> str | None:
    """What a huggingface_hub error means for `spec` and what to do about it (None: not a Hub error)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(error, GatedRepoError):  # before RepositoryNotFoundError: it is one
        return (
            f"{repo_id} is a gated repository: accept its licence at https://huggingface.co/{repo_id} with your "
            "Hugging Face account, then set HF_TOKEN to a token of that account (or run `hf auth login`)"
        )
    if isinstance(error, RepositoryNotFoundError):
        return (
            f"{spec!r} is neither a local folder nor a Hugging Face Hub repository that can be seen: check the "
            "path or the id (owner/name); a private repository needs HF_TOKEN"
        )
    if isinstance(error, RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r}: check the branch, tag or commit after '@'"
    if isinstance(error, RemoteEntryNotFoundError):
        return f"{repo_id}{at} is not a diffusers model repository (it has no model_index.json)"
    if isinstance(error, IncompleteSnapshotError):
        return _incomplete(repo_id, revision)
    if isinstance(error, LocalEntryNotFoundError):
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.is_offline_mode()
            else "the Hugging Face Hub cannot be reached (network, proxy or HF_ENDPOINT)"
        )
        return (
            f"{repo_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: run once "
            "with network access to download it, or point HF_HOME / HF_HUB_CACHE at a cache that holds it"
        )
    if isinstance(error, HfHubHTTPError):
        return f"Hugging Face Hub error for {repo_id}{at}: {error}"
    return None


__all__ = ["resolve_model_path", "files_to_download", "components", "is_hub_id", "parse_hub_id"]
