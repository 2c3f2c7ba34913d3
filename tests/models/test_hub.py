"""Hub ids (models/checkpoints/hub.py), fully offline: the tests build a Hugging Face cache folder by hand, in the layout
huggingface_hub reads (models--owner--name/{blobs, refs/<name>, snapshots/<commit>/..., trees/<commit>.json}),
and resolve through the library with HF_HUB_OFFLINE=1. No test reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from meshserve.models.checkpoints.hub import (
    components,
    explain_hub_error,
    files_to_download,
    is_hub_id,
    parse_hub_id,
    resolve_model_path,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"

# The diffusers-format SDXL base repo (stabilityai/stable-diffusion-xl-base-1.0) as listed on the Hub: plain and
# fp16 safetensors, flax, ONNX and OpenVINO copies, a second VAE folder and single-file checkpoints at the root.
SDXL_BASE_FILES = """
.gitattributes 01.png LICENSE.md README.md comparison.png model_index.json pipeline.png
sd_xl_base_1.0.safetensors sd_xl_base_1.0_0.9vae.safetensors sd_xl_offset_example-lora_1.0.safetensors
scheduler/scheduler_config.json
text_encoder/config.json text_encoder/flax_model.msgpack text_encoder/model.fp16.safetensors
text_encoder/model.onnx text_encoder/model.safetensors text_encoder/openvino_model.bin
text_encoder/openvino_model.xml
text_encoder_2/config.json text_encoder_2/flax_model.msgpack text_encoder_2/model.fp16.safetensors
text_encoder_2/model.onnx text_encoder_2/model.onnx_data text_encoder_2/model.safetensors
text_encoder_2/openvino_model.bin text_encoder_2/openvino_model.xml
tokenizer/merges.txt tokenizer/special_tokens_map.json tokenizer/tokenizer_config.json tokenizer/vocab.json
tokenizer_2/merges.txt tokenizer_2/special_tokens_map.json tokenizer_2/tokenizer_config.json tokenizer_2/vocab.json
unet/config.json unet/diffusion_flax_model.msgpack unet/diffusion_pytorch_model.fp16.safetensors
unet/diffusion_pytorch_model.safetensors unet/model.onnx unet/model.onnx_data unet/openvino_model.bin
unet/openvino_model.xml
vae/config.json vae/diffusion_flax_model.msgpack vae/diffusion_pytorch_model.fp16.safetensors
vae/diffusion_pytorch_model.safetensors
vae_1_0/config.json vae_1_0/diffusion_pytorch_model.fp16.safetensors vae_1_0/diffusion_pytorch_model.safetensors
vae_decoder/config.json vae_decoder/model.onnx vae_decoder/openvino_model.bin vae_decoder/openvino_model.xml
vae_encoder/config.json vae_encoder/model.onnx vae_encoder/openvino_model.bin vae_encoder/openvino_model.xml
""".split()
SDXL_BASE_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    "_diffusers_version": "0.19.0.dev0",
    "force_zeros_for_empty_prompt": True,
    "add_watermarker": None,
    "scheduler": ["diffusers", "EulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
_CONFIGS = [
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder_2/config.json",
    "tokenizer/merges.txt",
    "tokenizer/special_tokens_map.json",
    "tokenizer/tokenizer_config.json",
    "tokenizer/vocab.json",
    "tokenizer_2/merges.txt",
    "tokenizer_2/special_tokens_map.json",
    "tokenizer_2/tokenizer_config.json",
    "tokenizer_2/vocab.json",
    "unet/config.json",
    "vae/config.json",
]


def test_sdxl_base_downloads_configs_and_the_plain_safetensors_only():
    got = files_to_download(SDXL_BASE_INDEX, SDXL_BASE_FILES)
    assert sorted(got) == sorted(
        ["model_index.json", *_CONFIGS]
        + [
            "text_encoder/model.safetensors",
            "text_encoder_2/model.safetensors",
            "unet/diffusion_pytorch_model.safetensors",
            "vae/diffusion_pytorch_model.safetensors",
        ]
    )
    assert not [f for f in got if f.endswith((".bin", ".onnx", ".onnx_data", ".msgpack", ".xml"))]


def test_sdxl_base_fp16_variant_downloads_the_variant_weights_only():
    got = files_to_download(SDXL_BASE_INDEX, SDXL_BASE_FILES, variant="fp16")
    weights = sorted(f for f in got if f.endswith(".safetensors"))
    assert weights == [
        "text_encoder/model.fp16.safetensors",
        "text_encoder_2/model.fp16.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "vae/diffusion_pytorch_model.fp16.safetensors",
    ]
    assert sorted(set(got) - set(weights)) == sorted(["model_index.json", *_CONFIGS])


def test_sharded_weights_variants_and_fallbacks():
    index = {
        "_class_name": "FluxPipeline",
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "image_encoder": [None, None],  # absent component: nothing of its folder
    }
    files = [
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        # diffusers' sharded variant naming: shards `.bf16-0000N-of-0000M`, index `.safetensors.index.bf16.json`
        "transformer/diffusion_pytorch_model.bf16-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.bf16-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.bf16.json",
        "text_encoder_2/config.json",
        "text_encoder_2/model-00001-of-00002.safetensors",
        "text_encoder_2/model-00002-of-00002.safetensors",
        "text_encoder_2/model.safetensors.index.json",
        "text_encoder_2/pytorch_model-00001-of-00002.bin",
        "text_encoder_2/pytorch_model.bin.index.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.fp16.safetensors",  # only a variant: the loader's fp16 fallback reads it
        "image_encoder/config.json",
        "image_encoder/model.safetensors",
    ]
    plain = set(files_to_download(index, files))
    assert plain == {
        "model_index.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder_2/config.json",
        "text_encoder_2/model-00001-of-00002.safetensors",
        "text_encoder_2/model-00002-of-00002.safetensors",
        "text_encoder_2/model.safetensors.index.json",
        "vae/config.json",
        "vae/diffusion_pytorch_model.fp16.safetensors",
    }
    bf16 = set(files_to_download(index, files, variant="bf16"))
    # The variant where a component has it, the plain weights where it does not (diffusers' rule).
    assert {f for f in bf16 if f.startswith("transformer/")} == {
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.bf16-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.bf16-00002-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.bf16.json",
    }
    assert "text_encoder_2/model-00001-of-00002.safetensors" in bf16
    assert components(index) == ["text_encoder_2", "transformer", "vae"]


def test_unreadable_weights_and_unknown_variants_are_clear_errors():
    from meshserve.models import ModelFolderError

    index = {"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
    with pytest.raises(ModelFolderError, match="'unet' has no safetensors .* diffusion_pytorch_model.bin"):
        files_to_download(index, ["unet/config.json", "unet/diffusion_pytorch_model.bin"])
    with pytest.raises(ModelFolderError, match="no component has weights of variant 'int8'"):
        files_to_download(index, ["unet/config.json", "unet/diffusion_pytorch_model.safetensors"], "int8")


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    assert parse_hub_id("stabilityai/stable-diffusion-xl-base-1.0") == (
        "stabilityai/stable-diffusion-xl-base-1.0",
        None,
    )
    assert parse_hub_id("owner/name@v1.0") == ("owner/name", "v1.0")
    assert parse_hub_id(f"owner/name@{COMMIT}") == ("owner/name", COMMIT)
    assert parse_hub_id("owner/name@refs/pr/3") == ("owner/name", "refs/pr/3")
    for not_an_id in (
        "tiny-sdxl",
        "embedded:tiny-flux",
        "/models/sdxl",
        "./a/b",
        "~/a/b",
        "a/b/c",
        "a--b/c",
        "a/b@",
    ):
        assert not is_hub_id(not_an_id), not_an_id
    assert not is_hub_id(None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not is_hub_id("owner/name")  # a local folder of that name wins
    assert resolve_model_path("owner/name") == Path("owner/name")
    assert is_hub_id("owner/other")


# --------------------------------------------------------------------------------------------------
# A hand-made Hugging Face cache


def _write_repo(
    cache: Path, repo_id: str, snapshot: dict[str, bytes], refs: dict[str, str], tree=None
) -> Path:
    """One repo in huggingface_hub's cache layout: content-addressed blobs, snapshot files as relative symlinks
    to them, refs/<name> holding the commit (no newline), and optionally the commit's tree listing."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    folder = storage / "snapshots" / COMMIT
    for rel, data in snapshot.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for name, commit in refs.items():
        (storage / "refs" / name).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / name).write_text(commit)
    if tree is not None:
        files = {p: {"size": len(d), "blob_id": hashlib.sha1(d).hexdigest()} for p, d in sorted(tree.items())}
        (storage / "trees").mkdir(exist_ok=True)
        (storage / "trees" / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": files}))
    return folder


def _fp16_copy(path: Path, tmp: Path) -> bytes:
    from meshserve.models.checkpoints.loading import read_safetensors, write_safetensors

    state = {k: np.asarray(v).astype(np.float16) for k, v in read_safetensors(path).items()}
    write_safetensors(tmp, state)
    return tmp.read_bytes()


@pytest.fixture(scope="module")
def hub_cache(tiny_sdxl_path, tmp_path_factory) -> Path:
    """Two repos of the tiny SDXL folder. tiny/sdxl: the whole repo cached (plain and fp16 weights, and .bin /
    flax decoys that cannot be read); tiny/sdxl-partial: only what a plain download fetches, while the cached
    tree listing names the whole repo (as after a real `resolve_model_path` without a variant)."""
    root = tmp_path_factory.mktemp("hf_home")
    cache = root / "hub"
    plain = {
        p.relative_to(tiny_sdxl_path).as_posix(): p.read_bytes()
        for p in tiny_sdxl_path.rglob("*")
        if p.is_file()
    }
    extra = {}
    for rel in list(plain):
        if rel.endswith(".safetensors"):
            extra[rel.replace(".safetensors", ".fp16.safetensors")] = _fp16_copy(
                tiny_sdxl_path / rel, root / "x"
            )
    extra["unet/diffusion_pytorch_model.bin"] = b"a pickle the loader must never read"
    extra["text_encoder/pytorch_model.bin"] = b"a pickle the loader must never read"
    extra["vae/diffusion_flax_model.msgpack"] = b"flax weights the loader must never read"
    extra["sd_xl_base_1.0.safetensors"] = b"a single-file checkpoint"
    whole = plain | extra
    _write_repo(cache, "tiny/sdxl", whole, {"main": COMMIT, "v1": COMMIT}, tree=whole)
    _write_repo(cache, "tiny/sdxl-partial", plain, {"main": COMMIT}, tree=whole)
    _write_repo(cache, "tiny/sdxl-notree", whole, {"main": COMMIT})  # no listing: the snapshot's files decide
    return root


@pytest.fixture
def offline(hub_cache, monkeypatch):
    """HF_HUB_OFFLINE=1 and HF_HOME at the hand-made cache. huggingface_hub reads its environment once, at
    import, into `constants`: patch both (the subprocess test below checks the environment alone)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(hub_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache / "hub"))
    return hub_cache / "hub"


def test_resolves_to_the_snapshot_through_the_library(offline):
    from huggingface_hub import hf_hub_download, snapshot_download

    snapshot = offline / "models--tiny--sdxl" / "snapshots" / COMMIT
    # The library itself reads the hand-made cache offline (not just our own path logic).
    assert Path(snapshot_download("tiny/sdxl")) == snapshot
    assert Path(hf_hub_download("tiny/sdxl", "unet/config.json")).parent == snapshot / "unet"
    assert resolve_model_path("tiny/sdxl") == snapshot
    assert resolve_model_path("tiny/sdxl@v1") == snapshot  # a tag, through refs/v1
    assert resolve_model_path("tiny/sdxl", revision=COMMIT) == snapshot
    assert resolve_model_path("tiny/sdxl", variant="fp16") == snapshot
    assert (
        resolve_model_path("tiny/sdxl-notree") == offline / "models--tiny--sdxl-notree" / "snapshots" / COMMIT
    )
    assert (
        resolve_model_path("tiny/sdxl-partial")
        == offline / "models--tiny--sdxl-partial" / "snapshots" / COMMIT
    )


def test_missing_repo_revision_or_variant_offline_is_a_clear_error(offline):
    from meshserve.models import ModelFolderError

    with pytest.raises(
        ModelFolderError, match="nobody/missing is not in the Hugging Face cache .* HF_HUB_OFFLINE"
    ):
        resolve_model_path("nobody/missing")
    with pytest.raises(ModelFolderError, match="revision 'v2' is not in the Hugging Face cache"):
        resolve_model_path("tiny/sdxl@v2")
    with pytest.raises(ModelFolderError, match="contradicts"):
        resolve_model_path("tiny/sdxl@v1", revision="main")
    # The partial snapshot has no fp16 files, and the cached listing says the repo has them: incomplete.
    with pytest.raises(ModelFolderError, match="cached copy of tiny/sdxl-partial lacks files"):
        resolve_model_path("tiny/sdxl-partial", variant="fp16")


def test_hub_errors_say_what_to_do():
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/o/n"))
    gated = explain_hub_error(GatedRepoError("gated", response=response), "o/n", "o/n", None)
    assert "accept its licence at https://huggingface.co/o/n" in gated and "HF_TOKEN" in gated
    missing = explain_hub_error(RepositoryNotFoundError("404", response=response), "o/n", "o/n", None)
    assert "neither a local folder nor a Hugging Face Hub repository" in missing and "check" in missing
    revision = explain_hub_error(RevisionNotFoundError("404", response=response), "o/n@x", "o/n", "x")
    assert "has no revision 'x'" in revision
    assert explain_hub_error(ValueError("not the Hub's"), "o/n", "o/n", None) is None


def test_load_pipeline_from_a_hub_id_equals_the_folder(offline, tiny_sdxl_path):
    from meshserve.models import load_pipeline

    kwargs = dict(height=64, width=64, num_inference_steps=2, seed=3, output_type="np")
    hub = load_pipeline("tiny/sdxl")(["a lighthouse"], **kwargs).images
    folder = load_pipeline(tiny_sdxl_path)(["a lighthouse"], **kwargs).images
    assert hub.shape == (1, 64, 64, 3) and hub.std() > 1e-3
    # The plain fp32 weights, not the fp16 copies beside them (rounded to fp16, they change the image).
    np.testing.assert_allclose(hub, folder, rtol=0, atol=1e-6)


def test_the_environment_alone_configures_the_library(hub_cache):
    """HF_HOME and HF_HUB_OFFLINE set in the environment of a fresh process (the library reads them at import)."""
    env = {**os.environ, "HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = "from meshserve.models.checkpoints.hub import resolve_model_path; print(resolve_model_path('tiny/sdxl'))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()) == hub_cache / "hub" / "models--tiny--sdxl" / "snapshots" / COMMIT


def test_cli_reports_a_missing_hub_model_in_one_line(offline, tmp_path, capsys):
    from meshserve.cli import main

    assert (
        main(["generate", "--prompt", "x", "--model", "nobody/missing", "-o", str(tmp_path / "o.png")]) == 2
    )
    err = capsys.readouterr().err
    assert "nobody/missing is not in the Hugging Face cache" in err and "Traceback" not in err


def test_serve_names_a_hub_model_after_the_repo():
    from meshserve.workers.config import single_model_config

    config = single_model_config("stabilityai/stable-diffusion-xl-base-1.0@v1.0")
    assert list(config.models) == ["stable-diffusion-xl-base-1.0"]
    assert (
        config.models["stable-diffusion-xl-base-1.0"].path == "stabilityai/stable-diffusion-xl-base-1.0@v1.0"
    )


@pytest.mark.parametrize(
    "shards,index",
    [
        # diffusers' and transformers' names for a sharded variant, and the legacy ones
        (
            ["model.bf16-00001-of-00002.safetensors", "model.bf16-00002-of-00002.safetensors"],
            "model.safetensors.index.bf16.json",
        ),
        (
            ["model-00001-of-00002.bf16.safetensors", "model-00002-of-00002.bf16.safetensors"],
            "model.safetensors.bf16.index.json",
        ),
    ],
)
def test_a_folder_fetched_with_one_variant_loads(tmp_path, shards, index):
    """What `files_to_download(..., variant="bf16")` fetches is what the loader reads."""
    import ml_dtypes

    from meshserve.models.checkpoints.loading import read_component_weights, write_safetensors

    state = {f"w{i}": np.full((2, 3), i, ml_dtypes.bfloat16) for i in range(4)}
    weight_map = {}
    for i, shard in enumerate(shards):
        part = {k: v for k, v in state.items() if int(k[1:]) % 2 == i}
        write_safetensors(tmp_path / shard, part)
        weight_map |= dict.fromkeys(part, shard)
    (tmp_path / index).write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text("{}")
    names = [p.name for p in tmp_path.iterdir()]
    model_index = {"_class_name": "FluxPipeline", "text_encoder_2": ["transformers", "T5EncoderModel"]}
    fetched = files_to_download(model_index, [f"text_encoder_2/{n}" for n in names], variant="bf16")
    assert sorted(fetched) == sorted(["model_index.json", *(f"text_encoder_2/{n}" for n in names)])
    read = read_component_weights(tmp_path)
    assert read.keys() == state.keys()
    assert all(np.array_equal(read[k], v) for k, v in state.items())
