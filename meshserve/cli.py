"""The `meshserve` command: generate | serve | api | worker | keys | webhooks.

Each subcommand imports only what it needs, so `meshserve api` never loads JAX. Errors a user can fix are
printed as one line (exit code 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path


class UsageError(Exception):
    """A problem with the command line or its inputs that the user can fix."""


def _generate(args: argparse.Namespace) -> int:
    # Sizes are checked by the pipeline (its limits: a family's size multiple, frame rules), after loading.
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if args.fps is not None and not 1 <= args.fps <= 120:
        raise UsageError(f"--fps must be between 1 and 120, got {args.fps}")
    out = Path(args.output)
    if out.suffix.lower() not in (".png", ".jpg", ".jpeg", ".webp", ".mp4"):
        raise UsageError(f"-o/--output must end in .png, .jpg, .jpeg, .webp or .mp4, got {out.name}")

    fmt = {".jpg": "jpeg"}.get(out.suffix.lower(), out.suffix.lower().lstrip("."))
    switch = _refiner_switch(args)
    images = _image_inputs(args)  # before loading anything: a bad file is a one-line error at once
    loras = _lora_arguments(args.lora)
    cache = _cache_argument(args.cache)

    from tqdm import tqdm

    from meshserve.limits import LimitError, check_request, check_scheduler_arguments
    from meshserve.models import PipelineError, load_pipeline
    from meshserve.models.engine.compile_cache import enable_compilation_cache
    from meshserve.workers.encoding import can_encode, encode_output  # numpy, PIL, PyAV: no JAX, no Redis

    enable_compilation_cache()

    bar = None
    try:
        # A file with conv factors (LoCon, LCM-LoRA) needs the convs in the adapter table: one run, so no reason
        # to keep them out when a local file has them (a pool does, for the LoRA program's cost: docs/lora.md);
        # a Hub id's file is not fetched to look: --lora-convs.
        from meshserve.models.lora.formats import has_conv_factors

        convs = args.lora_convs or any(has_conv_factors(source) for _, source, _ in loras)
        pipe = load_pipeline(args.model, dtype=args.dtype, variant=args.variant, lora_convs=convs)
        for name, source, _ in loras:  # a file that does not fit the model: one line naming its first bad key
            try:
                pipe.load_lora(name, source)
            except PipelineError as e:
                hint = " (--lora-convs)" if "only with lora_convs" in str(e) else ""
                raise UsageError(f"--lora {name}: {e}{hint}") from None
        refiner = None if switch is None else _load_refiner(args, pipe, load_pipeline)
        # Before generating anything: a format the model's outputs cannot be written in (an image model to
        # .mp4, a video model to .png), frames or a frame rate for images.
        # The scheduler and the step cache too, so that a typo is told before the progress bar starts.
        video_args = {
            "output_format": fmt,
            "output_compression": args.compression,
            "fps": args.fps,
            "num_frames": args.frames,
            "scheduler": args.scheduler,
        }
        try:
            check_request(pipe.limits, video_args, model=pipe.model_id)
        except LimitError as e:
            raise UsageError(str(e)) from None
        schedule_args = {"sigmas": args.sigmas, "timesteps": args.timesteps, "eta": args.eta}
        try:
            custom_steps = check_scheduler_arguments(
                pipe.limits,
                {**schedule_args, "scheduler": args.scheduler, "num_inference_steps": args.steps},
                model=pipe.model_id,
            )
        except LimitError as e:
            flag = "--steps" if e.field == "num_inference_steps" else f"--{e.field}"
            raise UsageError(f"{flag}: {e}") from None
        if cache:
            from meshserve.models.engine.step_cache import parse_cache

            try:
                parse_cache(
                    cache, {m: v["default_threshold"] for m, v in (pipe.limits.get("cache") or {}).items()}
                )
            except PipelineError as e:
                raise UsageError(f"--cache {args.cache!r}: {e}") from None
        if not can_encode(fmt):
            raise UsageError(f"-o/--output {out.name}: this install cannot write {fmt} (pip install av)")
        settings = {"num_frames": args.frames} if args.frames is not None else {}
        if args.true_cfg_scale is not None:
            # Only a family with the row field takes it (Flux); elsewhere it would be silently ignored.
            if "true_cfg_scale" not in pipe.row_fields:
                raise UsageError(f"--true-cfg-scale: the {pipe.family} model has no true CFG; leave it out")
            settings["true_cfg_scale"] = args.true_cfg_scale
        if args.guidance_rescale is not None:
            if "guidance_rescale" not in pipe.row_fields:
                raise UsageError(f"--guidance-rescale: the {pipe.family} model takes none; leave it out")
            settings["guidance_rescale"] = args.guidance_rescale
        if args.guidance_scale_2 is not None:
            if "guidance_scale_2" not in pipe.row_fields:
                raise UsageError(
                    f"--guidance-scale-2: the {pipe.family} model has one denoiser (Wan 2.2's two experts take "
                    "it); leave it out"
                )
            settings["guidance_scale_2"] = args.guidance_scale_2
        for flag, name in (("--prompt-2", "prompt_2"), ("--negative-prompt-2", "negative_prompt_2")):
            if getattr(args, name) is not None:
                if not pipe.second_prompt:
                    raise UsageError(f"{flag}: the {pipe.family} model has one text encoder; leave it out")
                settings[name] = getattr(args, name)
        if args.clip_skip is not None:
            if "clip_skip" not in pipe.text_fields:
                raise UsageError(f"--clip-skip: the {pipe.family} model takes none; leave it out")
            settings["clip_skip"] = args.clip_skip
        # The scheduler arguments, checked above.
        settings |= {name: value for name, value in schedule_args.items() if value is not None}
        if "image" in images and getattr(pipe, "first_last", False) and "last_image" not in images:
            raise UsageError(
                f"--last-image: {pipe.model_id or pipe.family} is a first-last-frame model; it needs the video's "
                "last frame (--image is the first)"
            )
        # The bar starts once every check of the arguments passed; the pipeline's own (sizes, frames) come
        # with its call and clear it (below).
        steps = custom_steps or args.steps or pipe.defaults["num_inference_steps"]
        bar = tqdm(total=steps, desc="denoise", unit="step")

        def on_step(step: int, total: int) -> None:
            bar.total = total
            bar.update(step - bar.n)

        result = pipe(
            args.prompt,
            negative_prompt=args.negative_prompt,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            seed=args.seed,
            num_images_per_prompt=args.n,
            scheduler=args.scheduler,
            output_type="np" if refiner is None else "latent",  # with a refiner, the base's latents go on
            callback=on_step,
            **images,
            **settings,
            **({"loras": [{"name": n, "scale": scale} for n, _, scale in loras]} if loras else {}),
            **({"cache": cache} if cache else {}),
            **({"denoising_end": switch} if refiner is not None else {}),
        )
        if refiner is not None:
            # The base's step count (a refiner folder's default may be another): the split lines up.
            steps = None if {"sigmas", "timesteps"} & settings.keys() else steps
            result = _refine(args, refiner, result, switch, bar, settings, steps, images.get("mask_image"))
        bar.close()
    except PipelineError as e:
        if bar is not None:  # a request the pipeline refuses (a size, frames): the error on a line of its own
            bar.leave = False
            bar.close()
        raise UsageError(str(e)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    outputs = list(result.images)  # each [H, W, 3] (image) or [F, H, W, 3] (video) in [0, 1]
    paths = (
        [out]
        if len(outputs) == 1
        else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(len(outputs))]
    )
    for output, path in zip(outputs, paths, strict=True):
        data, _ = encode_output(
            output, fmt, fps=args.fps or pipe.defaults.get("fps", 16), quality=args.compression
        )
        path.write_bytes(data)
    stages = ", ".join(f"{stage} {seconds:.2f}s" for stage, seconds in result.timings.items())
    skipped = f"; cached steps {', '.join(map(str, result.cached_steps))}" if cache else ""
    print(f"wrote {', '.join(map(str, paths))} (seed {', '.join(map(str, result.seeds))}; {stages}{skipped})")
    return 0


def _refiner_switch(args: argparse.Namespace) -> float | None:
    """--refiner's switch (diffusers' denoising_end / denoising_start; default 0.8, diffusers' own example), or
    None without a refiner."""
    if args.refiner is None:
        if args.denoising_end is not None:
            raise UsageError(
                "--denoising-end: the steps after it are a refiner's; give its folder (--refiner)"
            )
        return None
    switch = 0.8 if args.denoising_end is None else args.denoising_end
    if not 0.0 < switch < 1.0:
        raise UsageError(f"--denoising-end must be between 0 and 1 (exclusive), got {switch}")
    return switch


def _load_refiner(args: argparse.Namespace, pipe, load_pipeline):
    """The refiner's pipeline: an image-to-image model that takes the base's latents (SDXL's)."""
    if not getattr(pipe, "denoising_split", False):
        raise UsageError(f"--refiner: the {pipe.family} model cannot hand its latents on (SDXL can)")
    refiner = load_pipeline(args.refiner, dtype=args.dtype, variant=args.variant)
    if not getattr(refiner, "denoising_split", False) or "image-to-image" not in refiner.tasks:
        raise UsageError(
            f"--refiner {args.refiner}: a {refiner.family} model; the refiner must be an SDXL one"
        )
    return refiner


def _refine(
    args: argparse.Namespace, refiner, base, switch: float, bar, settings: dict, steps: int | None, mask=None
):
    """The refiner's call on the base's latents from the switch on, on the same schedule (the base's `steps`,
    or its custom sigmas / timesteps) and, inpainting, the same mask (diffusers' inpaint + refiner: the known
    region stays the picture's), counted on the same progress bar after the base's steps."""
    done = bar.n

    def on_step(step: int, total: int) -> None:
        bar.total = done + total
        bar.update(done + step - bar.n)

    refined = refiner(
        args.prompt,
        negative_prompt=args.negative_prompt,
        image=base.images,
        **({"mask_image": mask} if mask is not None else {}),
        denoising_start=switch,
        num_inference_steps=steps,
        seed=base.seeds[0],  # rows take it, it + 1, ... (a stochastic scheduler's noise)
        num_images_per_prompt=args.n,
        scheduler=args.scheduler,
        output_type="np",
        callback=on_step,
        **{k: v for k, v in settings.items() if k in ("sigmas", "timesteps", "eta")},
    )
    # The base's seeds and step-cache counts, both calls' stages.
    refined.seeds, refined.cached_steps = base.seeds, base.cached_steps
    refined.timings = {**base.timings, **{f"refiner {k}": v for k, v in refined.timings.items()}}
    return refined


def _lora_arguments(specs: list[str]) -> list[tuple[str, str, float]]:
    """--lora NAME=PATH[:SCALE] (repeatable) -> (name, path or Hub id, scale); the scale defaults to 1. A
    trailing ":<number>" is the scale, so a path holding ":" needs one (NAME=a:b.safetensors:1)."""
    out = []
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise UsageError(f"--lora {spec!r}: expected NAME=PATH[:SCALE]")
        source, colon, tail = rest.rpartition(":")
        try:
            scale = float(tail) if colon else 1.0
        except ValueError:
            colon, scale = "", 1.0
        source = source if colon else rest
        if not source:
            raise UsageError(f"--lora {spec!r}: expected NAME=PATH[:SCALE]")
        if any(name == other for other, _, _ in out):
            raise UsageError(f"--lora: the name {name!r} is given twice")
        out.append((name, source, scale))
    return out


def _cache_argument(spec: str | None) -> dict | None:
    """--cache METHOD[:THRESHOLD] -> the pipeline's `cache` (the method and threshold are checked by the
    pipeline against the model's `limits["cache"]`; no threshold: the method's default)."""
    if spec is None:
        return None
    method, colon, threshold = spec.partition(":")
    if not method or (colon and not threshold):
        raise UsageError(f"--cache {spec!r}: expected METHOD[:THRESHOLD]")
    if not colon:
        return {"method": method}
    try:
        return {"method": method, "threshold": float(threshold)}
    except ValueError:
        raise UsageError(f"--cache {spec!r}: the threshold must be a number") from None


def _image_inputs(args: argparse.Namespace) -> dict:
    """--image / --mask / --strength / --padding-mask-crop (and --control-image with a ControlNet's settings)
    as the pipeline's image, mask_image, strength and padding_mask_crop (and control_image,
    controlnet_conditioning_scale, control_guidance_start / _end, guess_mode), read under the API's decoding
    rules (service/image_inputs.py: PNG, JPEG or WebP, one frame, EXIF orientation applied)."""
    control = {}
    if args.control_image is not None:
        control["control_image"] = _read_image(args.control_image, "control-image")
    controlnet = {
        "controlnet_conditioning_scale": args.controlnet_scale,
        "control_guidance_start": args.control_guidance_start,
        "control_guidance_end": args.control_guidance_end,
        "guess_mode": args.guess_mode or None,
    }
    for name, value in controlnet.items():
        if value is not None:
            if args.control_image is None:
                raise UsageError(f"--{name.replace('_', '-')} needs --control-image")
            control[name] = value
    if args.image is None:
        for flag, value in (
            ("--mask", args.mask),
            ("--strength", args.strength),
            ("--last-image", args.last_image),
            ("--padding-mask-crop", args.padding_mask_crop),
        ):
            if value is not None:
                raise UsageError(f"{flag} needs --image")
        return control
    if args.strength is not None and not 0 < args.strength <= 1:
        raise UsageError(f"--strength must be in (0, 1], got {args.strength}")
    if args.padding_mask_crop is not None and (args.mask is None or args.padding_mask_crop < 0):
        raise UsageError(f"--padding-mask-crop needs --mask and pixels >= 0, got {args.padding_mask_crop}")
    image = _read_image(args.image, "image")
    inputs = {"image": image, **control}
    if args.mask is not None:
        inputs["mask_image"] = _read_image(args.mask, "mask", mode="L", size=image.size)
    if args.last_image is not None:
        inputs["last_image"] = _read_image(args.last_image, "last-image")
    if args.strength is not None:
        inputs["strength"] = args.strength
    if args.padding_mask_crop is not None:
        inputs["padding_mask_crop"] = args.padding_mask_crop
    return inputs


def _read_image(path: str, field: str, **kw):
    from meshserve.service.image_inputs import ImageInputError, decode_image  # PIL only

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--{field} {path}: {e.strerror or e}") from None
    try:
        return decode_image(data, field=f"--{field} {path}", max_pixels=8192 * 8192, **kw).image
    except ImageInputError as e:
        raise UsageError(e.message) from None


def _serve(args: argparse.Namespace) -> int:
    from meshserve.workers.serve import run_serve

    run_serve(port=args.port, redis_url=args.redis_url, model=args.model, host=args.host)
    return 0


def _api(args: argparse.Namespace) -> int:
    from meshserve.service.app import run_api

    run_api(host=args.host, port=args.port)
    return 0


def _worker(args: argparse.Namespace) -> int:
    if not Path(args.config).is_file():
        raise UsageError(f"--config: {args.config} not found")
    from meshserve.workers.config import load_config
    from meshserve.workers.main import check_group_config, run_worker
    from meshserve.workers.multihost import group_from_environment

    try:
        config = load_config(args.config)  # a bad file is the user's to fix: one line, before anything starts
        group = group_from_environment(args.coordinator, args.num_processes, args.process_id)
        if group is not None:
            check_group_config(config, group)
    except ValueError as e:
        raise UsageError(str(e)) from None
    run_worker(
        args.config,
        coordinator=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    return 0


def _train_embedded(args: argparse.Namespace) -> int:
    from meshserve.training.train_shapes import run

    return run(args)


def _numbers(kind: type) -> Callable[[str], list]:
    """An argparse type: comma-separated numbers of `kind`."""

    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {kind.__name__}s, got {text!r}"
            ) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate an image locally (no server)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default=None)
    gen.add_argument(
        "--prompt-2", default=None, help="SDXL: the second CLIP's text; Flux: T5's (default: --prompt)"
    )
    gen.add_argument(
        "--clip-skip",
        type=int,
        default=None,
        help="SDXL: diffusers' clip_skip, the text states this many layers before the penultimate (0: it)",
    )
    gen.add_argument(
        "--negative-prompt-2",
        default=None,
        help="the second text encoder's negative (default: --negative-prompt)",
    )
    gen.add_argument(
        "--model",
        default=None,
        help="diffusers folder, Hugging Face Hub id (owner/name[@revision]; HF_TOKEN, HF_HOME, HF_HUB_OFFLINE "
        "apply) or an embedded model: tiny-sdxl (the default), tiny-flux or tiny-wan (video)",
    )
    gen.add_argument(
        "--variant", default=None, help="Hub ids: the weights variant to download, e.g. fp16 (default: plain)"
    )
    gen.add_argument("-o", "--output", default="out.png")
    gen.add_argument("--height", type=int, default=None)
    gen.add_argument("--width", type=int, default=None)
    gen.add_argument("--steps", type=int, default=None)
    gen.add_argument("--guidance-scale", type=float, default=None)
    gen.add_argument(
        "--true-cfg-scale",
        type=float,
        default=None,
        help="Flux: true CFG on --negative-prompt (acts when > 1 and a negative prompt is given)",
    )
    gen.add_argument(
        "--guidance-rescale",
        type=float,
        default=None,
        help="SDXL: diffusers' guidance_rescale, 0 (off) to 1 (acts with --guidance-scale > 1)",
    )
    gen.add_argument(
        "--guidance-scale-2",
        type=float,
        default=None,
        help="Wan 2.2's two experts: the low-noise expert's CFG scale (default: --guidance-scale, as diffusers)",
    )
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--refiner",
        default=None,
        help="SDXL: a refiner folder (or Hub id) that runs the schedule's last steps on the base's latents "
        "(diffusers' ensemble of experts; with --image / --mask both run image-to-image / inpaint); --lora and "
        "--cache apply to the base",
    )
    gen.add_argument(
        "--denoising-end",
        type=float,
        default=None,
        help="with --refiner: the share of the schedule the base runs (default 0.8)",
    )
    gen.add_argument(
        "--sigmas",
        type=_numbers(float),
        default=None,
        metavar="S0,S1,...",
        help="diffusers' custom sigmas, strictly decreasing (SDXL euler: one per step and the last step's end, "
        "e.g. 14.6,6,1.1,0; Flux: one per step in (0, 1]); they set the steps",
    )
    gen.add_argument(
        "--eta",
        type=float,
        default=None,
        help="SDXL with --scheduler ddim or tcd: diffusers' eta, the noise each step adds (0: deterministic; "
        "ddim 1: DDPM-like; tcd: its gamma, 0.3 in TCD's recipe)",
    )
    gen.add_argument(
        "--timesteps",
        type=_numbers(int),
        default=None,
        metavar="T0,T1,...",
        help="diffusers' custom timesteps (SDXL euler, dpmpp_2m, lcm), strictly decreasing; they set the steps",
    )
    gen.add_argument(
        "--scheduler",
        default=None,
        help="euler | euler_ancestral | ddim | dpmpp_2m | dpmpp_2m_sde | lcm, or euler / dpmpp_2m / dpmpp_2m_sde "
        "+ _karras",
    )
    gen.add_argument("-n", type=int, default=1, help="images (or videos) for the prompt")
    gen.add_argument("--frames", type=int, default=None, help="video models: frames per video")
    gen.add_argument(
        "--fps",
        type=int,
        default=None,
        help="video models: frame rate of the .mp4/.webp (default: the model's)",
    )
    gen.add_argument(
        "--compression",
        type=int,
        default=None,
        metavar="0-100",
        help="quality of a .jpg/.webp output (the API's output_compression; default: 90)",
    )
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument(
        "--image",
        default=None,
        help="an input image (PNG, JPEG, WebP): image-to-image, or image-to-video for a Wan I2V folder (-o .mp4)",
    )
    gen.add_argument(
        "--mask", default=None, help="inpainting: white is repainted, black kept; the image's size"
    )
    gen.add_argument(
        "--last-image",
        default=None,
        help="the video's last frame (--image is the first): Wan 2.1 FLF2V needs one, Wan 2.2 I2V takes one",
    )
    gen.add_argument(
        "--control-image",
        default=None,
        help="a FLUX.1 Canny / Depth or SDXL ControlNet folder's control image (an edge or depth map; it needs one)",
    )
    gen.add_argument(
        "--controlnet-scale",
        type=float,
        default=None,
        help="an SDXL ControlNet's controlnet_conditioning_scale (default: the model's, 1.0)",
    )
    gen.add_argument(
        "--control-guidance-start",
        type=float,
        default=None,
        help="the fraction of the steps after which the ControlNet starts steering (default 0)",
    )
    gen.add_argument(
        "--control-guidance-end",
        type=float,
        default=None,
        help="the fraction of the steps after which the ControlNet stops steering (default 1)",
    )
    gen.add_argument(
        "--guess-mode", action="store_true", help="the ControlNet's guess mode (diffusers' guess_mode)"
    )
    gen.add_argument(
        "--strength", type=float, default=None, help="(0, 1]: how much is repainted (default: the task's)"
    )
    gen.add_argument(
        "--padding-mask-crop",
        type=int,
        default=None,
        help="inpaint only the mask's region grown by this many pixels, at the model's size, laid back into "
        "the image (the output has the image's size)",
    )
    gen.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH[:SCALE]",
        help="apply a LoRA adapter (a .safetensors file or folder, or a Hub id owner/name[/file.safetensors]) at "
        "SCALE (default 1); repeatable (docs/lora.md)",
    )
    gen.add_argument(
        "--lora-convs",
        action="store_true",
        help="adapt the UNet's convolutions too (LoCon, LCM-LoRA); automatic for a local file that has them",
    )
    gen.add_argument(
        "--cache",
        default=None,
        metavar="METHOD[:THRESHOLD]",
        help="a step cache: teacache, first_block (Flux, Wan) or deep_features (SDXL), at THRESHOLD (default: "
        "the method's; docs/step-cache.md)",
    )
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="API + one worker (+ a local redis-server when no URL is given)")
    serve.add_argument("--host", default=None, help="bind address (default $MESHSERVE_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--redis-url", default=os.environ.get("MESHSERVE_REDIS_URL"))
    serve.add_argument(
        "--model",
        default=None,
        help="diffusers folder, Hugging Face Hub id (owner/name[@revision]; HF_TOKEN, HF_HOME, HF_HUB_OFFLINE "
        "apply) or an embedded model: tiny-sdxl (the default), tiny-flux or tiny-wan (video)",
    )
    serve.set_defaults(func=_serve)

    api = sub.add_parser(
        "api", help="the HTTP front end alone (API keys required unless MESHSERVE_AUTH=none)"
    )
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=8000)
    api.set_defaults(func=_api)

    worker = sub.add_parser("worker", help="a worker process with the pools of a config file")
    worker.add_argument("--config", required=True, help="pools.yaml")
    # A multi-host pool (docs/multihost.md); default: MESHSERVE_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID,
    # else a LeaderWorkerSet's or a Cloud TPU slice's environment, else one process.
    worker.add_argument("--coordinator", default=None, help="HOST:PORT of process 0's coordination service")
    worker.add_argument("--num-processes", type=int, default=None, help="processes in the pool's group")
    worker.add_argument("--process-id", type=int, default=None, help="this process's index (0: the leader)")
    worker.set_defaults(func=_worker)

    train = sub.add_parser(
        "train-embedded",
        help="train an embedded model (tiny-sdxl, tiny-flux or tiny-wan: coloured shapes) into a folder",
    )
    from meshserve.training.train_shapes import add_arguments as add_training_arguments  # argparse only

    add_training_arguments(train)
    train.set_defaults(func=_train_embedded)

    from meshserve.service.keys_cli import add_keys_parser  # argparse only: Redis is imported when it runs

    add_keys_parser(sub, UsageError)
    from meshserve.service.webhooks.cli import add_webhooks_parser  # argparse only

    add_webhooks_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Before any command starts JAX's CPU backend (it reads XLA_FLAGS once): models/cpu/xla_cpu_flags.py says why.
    from meshserve.models.cpu.xla_cpu_flags import apply_cpu_defaults

    apply_cpu_defaults()
    try:
        return args.func(args)
    except UsageError as e:
        print(f"meshserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
