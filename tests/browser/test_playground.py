"""The playground page in a real browser: Playwright driving Debian's Chromium against a running `meshserve serve`.

One module-wide set-up, reused by every case (compiling the embedded model dominates): a private redis-server,
`meshserve serve --redis-url` on it (API with keys off + a worker on the embedded tiny SDXL), and a second front
end, `meshserve api` with keys on, over the same Redis (so the same worker serves both). Chromium is the system's
(`/usr/bin/chromium`, installed by .ci/run when missing); Playwright's own browser downloads are never used. The
only reason to skip is that no Chromium can be found.

MESHSERVE_PLAYGROUND_SCREENSHOT=docs/images/playground.png writes the README's screenshot after the generation.
"""

from __future__ import annotations

import base64
import io
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import sync_playwright

from meshserve.service.api.routes.playground import CONTENT_SECURITY_POLICY, STATIC
from meshserve.training.shape_score import read_picture
from meshserve.training.shapes import Scene, render
from meshserve.workers.encoding import encode_video
from meshserve.workers.local_redis import free_port, start_redis_server, stop_redis_server

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (.ci/run installs Debian's package)"
)

README_PROMPT = "a red circle on a blue background"  # README's curl example, with its seed
README_SEED = 7
ADMIN_KEY = "msk_" + secrets.token_urlsafe(32)  # 43 characters: the key format
# The answers the API gives a page that asks it something wrong, and the event stream the polling case refuses
# (expected, so not failures of the page).
EXPECTED_CONSOLE = re.compile(
    r"Failed to load resource: (the server responded with a status of (401|422)|net::ERR_FAILED)"
)


def _wait_until(proc: subprocess.Popen, log: Path, url: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered 200:\n{log.read_text()[-4000:]}"
        time.sleep(0.25)


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "meshserve.cli", *args], cwd=ROOT, env=env, stdout=out, stderr=out
        )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{"open": URL of `meshserve serve` (keys off), "keys": URL of `meshserve api` (keys on)}."""
    folder = tmp_path_factory.mktemp("playground")
    redis_port = free_port()
    redis = start_redis_server(redis_port, folder)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_") or k == "MESHSERVE_CACHE"}
    serve_port, api_port = free_port(), free_port()
    procs = []
    try:
        procs.append(
            serve := _start(
                ["serve", "--port", str(serve_port), "--redis-url", redis_url], env, folder / "serve.log"
            )
        )
        keyed_env = {
            **env,
            "MESHSERVE_AUTH": "keys",
            "MESHSERVE_ADMIN_KEY": ADMIN_KEY,
            "MESHSERVE_REDIS_URL": redis_url,
        }
        procs.append(
            api := _start(
                ["api", "--host", "127.0.0.1", "--port", str(api_port)], keyed_env, folder / "api.log"
            )
        )
        urls = {"open": f"http://127.0.0.1:{serve_port}", "keys": f"http://127.0.0.1:{api_port}"}
        _wait_until(serve, folder / "serve.log", urls["open"] + "/readyz", 300)  # the pool compiled
        _wait_until(api, folder / "api.log", urls["keys"] + "/readyz", 60)
        yield urls
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        stop_redis_server(redis)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        # Playwright passes --no-sandbox by default (chromium_sandbox=False): the CI runs as root.
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A fresh tab (its own sessionStorage) that fails the test on a script error or a CSP violation."""
    context = browser.new_context(viewport={"width": 900, "height": 560})
    page = context.new_page()
    problems = []
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on(
        "console",
        lambda m: (
            problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" and not EXPECTED_CONSOLE.search(m.text)
            else None
        ),
    )
    yield page
    context.close()
    assert not problems, problems


def _ready(page, url: str) -> None:
    page.goto(url + "/")  # `/` redirects to the page
    assert page.url == url + "/playground"
    page.wait_for_selector("#model option", state="attached")


def _generate(page) -> None:
    page.click("#generate")
    page.wait_for_selector("#result img.output, #error:not([hidden])")


def _shown_image(page) -> tuple[bytes, str]:
    """The bytes behind the page's output <img>, once the browser decoded it: what its download link saves (the
    link points at the same blob: URL as the image; the policy lets no script read a blob back)."""
    page.wait_for_function(
        "(img => img.complete && img.naturalWidth > 0)(document.querySelector('img.output'))"
    )
    src = page.get_attribute("img.output", "src")
    link = page.locator("#result a[download]")
    assert src.startswith("blob:") and link.get_attribute("href") == src
    with page.expect_download() as download:
        link.click()
    return Path(download.value.path()).read_bytes(), src


def test_the_page_is_served_self_contained(servers):
    """`/` redirects; the page, its script and style are open (even with keys on) and locked to this origin."""
    with httpx.Client(base_url=servers["keys"]) as client:
        r = client.get("/")
        assert (r.status_code, r.headers["location"]) == (307, "/playground")
        for path, kind in (
            ("/playground", "text/html"),
            ("/playground/playground.js", "text/javascript"),
            ("/playground/playground.css", "text/css"),
        ):
            r = client.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.headers)
            assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert r.headers["x-content-type-options"] == "nosniff"
        assert client.get("/v1/models").status_code == 401  # the API behind it still needs a key
    # No build step, no CDN: every file is the plain one in service/static, and none names another origin.
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(src|href)=\"(https?:)?//|url\((https?:)?//|import\s", text), path
        assert "http://" not in text and "https://" not in text, path


def test_the_policy_holds_in_the_browser(browser, servers):
    """What the content-security-policy is for: markup injected into the page runs no inline script, applies no
    inline style and loads nothing from another origin (Chromium reports each refusal on the console)."""
    page = browser.new_page()
    refused = []
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    _ready(page, servers["open"])
    page.evaluate(
        """() => {
            document.body.insertAdjacentHTML('beforeend',
                '<img src="http://127.0.0.2:9/x.png"><p style="color: red">x</p>');
            const script = document.createElement('script');
            script.textContent = 'window.injected = true';
            document.body.append(script);
        }"""
    )
    for _ in range(50):  # console messages arrive asynchronously
        if len(refused) >= 3:
            break
        page.wait_for_timeout(100)
    assert page.evaluate("window.injected") is None
    assert len(refused) == 3, refused  # the image, the style, the script
    page.close()


def test_generate_the_readme_prompt(page, servers):
    _ready(page, servers["open"])
    assert page.is_hidden("#key-box")  # keys off: no key field
    page.fill("#prompt", README_PROMPT)
    page.fill("#seed", str(README_SEED))
    _generate(page)
    data, src = _shown_image(page)
    assert page.is_hidden("#error")

    # The picture shows what was asked, read by the pixel scorer from the bytes the browser displayed.
    image = Image.open(io.BytesIO(data))
    assert (image.format, image.size) == ("PNG", (64, 64))
    reading = read_picture(np.asarray(image.convert("RGB")))
    assert (reading.colour, reading.shape, reading.background) == ("red", "circle", "blue"), reading
    # ... and they are the job's output, byte for byte.
    job_id = page.inner_text("#job-id")
    assert httpx.get(f"{servers['open']}/v1/jobs/{job_id}/outputs/0").content == data

    # The bar ends full, the seed and timings are shown, the download is named after the job.
    assert page.evaluate(
        "[document.querySelector('#progress').value, document.querySelector('#progress').max]"
    ) == [
        20,
        20,
    ]
    assert page.inner_text("#seed-used") == str(README_SEED)
    assert re.fullmatch(
        r"queue \d+\.\d\d s, inference \d+\.\d\d s, total \d+\.\d\d s", page.inner_text("#timings")
    )
    assert page.get_attribute("#result a[download]", "download") == f"{job_id}-0.png"

    if shot := os.environ.get("MESHSERVE_PLAYGROUND_SCREENSHOT"):
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=shot, full_page=True)
        # A palette PNG: a few tens of KiB in the repository instead of hundreds.
        Image.open(shot).convert("RGB").quantize(64).save(shot, optimize=True)


def test_recent_jobs_are_listed_and_open_again(page, servers):
    """The page lists the caller's last jobs (GET /v1/jobs), newest first, after each generation and when it
    opens; a click on one shows its picture again, the same bytes."""
    _ready(page, servers["open"])
    page.fill("#prompt", README_PROMPT)
    page.fill("#seed", str(README_SEED))
    _generate(page)
    data, _ = _shown_image(page)
    job_id = page.inner_text("#job-id")
    page.wait_for_selector(f"#recent .recent-job[data-job='{job_id}']")
    listed = [j["id"] for j in httpx.get(f"{servers['open']}/v1/jobs?limit=10").json()["data"]]
    shown = page.eval_on_selector_all("#recent .recent-job", "bs => bs.map(b => b.dataset.job)")
    assert shown == listed and listed[0] == job_id
    assert page.inner_text(f"#recent .recent-job[data-job='{job_id}']").endswith(README_PROMPT)

    page.reload()
    page.wait_for_selector(f"#recent .recent-job[data-job='{job_id}']")
    assert page.locator("#result img.output").count() == 0
    page.click(f"#recent .recent-job[data-job='{job_id}']")
    page.wait_for_selector("#result img.output")
    again, _ = _shown_image(page)
    assert again == data and page.inner_text("#job-id") == job_id


def test_progress_and_previews_arrive_over_sse(page, servers):
    """A longer run (100 steps, about 1.5 s here when the machine is quiet), so that the worker's progress
    rounds (every 0.25 s) fall inside it: the bar moved with `progress` events, and once the server has live
    previews (its request schema lists `previews`) the page showed `preview` pictures, none before."""
    _ready(page, servers["open"])
    page.fill("#prompt", README_PROMPT)
    page.fill("#steps", "100")
    _generate(page)
    _shown_image(page)
    assert int(page.get_attribute("#progress", "data-events")) >= 1
    schema = httpx.get(servers["open"] + "/openapi.json").json()["components"]["schemas"]
    shown = int(page.get_attribute("#preview", "data-shown") or 0)
    assert shown >= 1 if "previews" in schema["GenerateRequest"]["properties"] else shown == 0
    assert page.is_hidden("#preview")  # replaced by the output


def test_without_the_event_stream_the_page_polls_the_job(page, servers):
    """A proxy that drops SSE (here: the browser refuses the request) costs the live progress, not the result."""
    page.route("**/v1/jobs/*/events", lambda route: route.abort())
    _ready(page, servers["open"])
    page.fill("#prompt", README_PROMPT)
    page.fill("#seed", str(README_SEED))
    _generate(page)
    data, _ = _shown_image(page)
    assert page.is_hidden("#error")
    reading = read_picture(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    assert (reading.colour, reading.background) == ("red", "blue"), reading


def test_a_page_opened_while_the_pool_compiles_waits_for_it(page, servers):
    """`meshserve serve` answers before its pool is ready: the page says so and retries until a model is listed
    (here the first /v1/models answer is made empty in the browser)."""
    answers = []

    def models(route):
        answers.append(route.request.url)
        if len(answers) == 1:
            route.fulfill(json={"object": "list", "data": []})
        else:
            route.continue_()

    page.route("**/v1/models", models)
    page.goto(servers["open"] + "/playground")
    page.wait_for_selector("#server-status:text('no model is ready yet; retrying')")
    page.wait_for_selector("#model option", state="attached")  # the retry, 2 s later
    assert len(answers) == 2 and page.inner_text("#server-status") == "1 model served"


@pytest.mark.parametrize(
    "fields,body",
    [
        ({"#prompt": ""}, {"prompt": ""}),
        (
            {"#prompt": README_PROMPT, "#width": "128", "#height": "128"},
            {"prompt": README_PROMPT, "width": 128, "height": 128},
        ),
    ],
    ids=["empty-prompt", "size-not-served"],
)
def test_a_refused_request_shows_the_api_message(page, servers, fields, body):
    r = httpx.post(servers["open"] + "/v1/generate", json=body)
    assert r.status_code == 422
    message = r.json()["error"]["message"]
    _ready(page, servers["open"])
    for selector, value in fields.items():
        page.fill(selector, value)
    _generate(page)
    assert page.inner_text("#error") == message
    assert page.locator("#result img").count() == 0


def test_an_input_image_is_sent_once_the_model_takes_one(page, servers, tmp_path):
    """When the served model's card lists image-to-image, the page shows the image field and sends the uploaded
    file as a data URL, with the strength typed. The request is caught at the browser and answered there: run
    for real, the first image-to-image job compiles its programs on the request path (43 s on this machine
    under load, 2026-11-23), far over this file's budget; the API's side of image inputs is tested in
    tests/service/test_image_inputs.py. Before the server takes image inputs the field stays hidden."""
    _ready(page, servers["open"])
    (card,) = httpx.get(servers["open"] + "/v1/models").json()["data"]
    if "image-to-image" not in card.get("tasks", []):
        assert page.is_hidden("#image-inputs")
        return
    assert page.is_visible("#image") and page.is_visible("#strength")
    assert page.is_hidden("#mask-row") == ("inpaint" not in card["tasks"])
    picture = tmp_path / "input.png"
    Image.fromarray(render(Scene("green", "square", "white"))).save(picture)
    sent = []

    def answer(route):
        sent.append(route.request.post_data_json)
        error = {"code": "caught", "message": "caught by the test", "field": None}
        route.fulfill(status=422, json={"error": error})

    page.route("**/v1/generate", answer)
    page.set_input_files("#image", str(picture))
    page.fill("#strength", "0.3")
    page.fill("#prompt", README_PROMPT)
    _generate(page)
    assert page.inner_text("#error") == "caught by the test"
    (body,) = sent
    assert body["image"] == "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    assert (body["strength"], body["prompt"], body["model"]) == (0.3, README_PROMPT, card["id"])
    assert "mask" not in body  # no mask chosen


def test_a_video_model_gets_a_frames_field_and_a_video(page, servers):
    """The video branch, with the API answered in the browser (serving tiny-wan too would cost a second pool's
    compile): a video model's card shows the Frames field at its default, the request carries num_frames, and
    the MP4 output plays in a <video> with a download link."""
    (card,) = httpx.get(servers["open"] + "/v1/models").json()["data"]
    frames = {"min_frames": 1, "max_frames": 81, "step": 4, "offset": 1, "default": 5}
    video_card = {
        **card,
        "id": "tiny-wan",
        "family": "wan",
        "task": "text-to-video",
        "tasks": ["text-to-video"],
        "limits": {**card["limits"], "frames": frames, "output_formats": ["mp4", "webp"]},
    }
    mp4, _ = encode_video(np.tile(render(Scene("red", "circle", "blue"))[None], (5, 1, 1, 1)), "mp4")
    output = {"index": 0, "url": "/v1/jobs/video/outputs/0", "content_type": "video/mp4", "width": 64}
    job = {  # the fields the page reads of a finished job
        "id": "video",
        "status": "succeeded",
        "progress": {"step": 4, "total_steps": 4},
        "params": {"prompt": README_PROMPT, "seed": 3},
        "outputs": [{**output, "height": 64, "seed": 3, "num_frames": 5}],
        "timings": {"queue_s": 0.0, "inference_s": 1.0, "total_s": 1.0},
    }
    sent = []

    def submit(route):
        sent.append(route.request.post_data_json)
        route.fulfill(json=job)

    page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [video_card]}))
    page.route("**/v1/generate", submit)
    page.route("**/v1/jobs/video/outputs/0", lambda r: r.fulfill(body=mp4, content_type="video/mp4"))
    _ready(page, servers["open"])
    assert page.is_visible("#num-frames") and page.input_value("#num-frames") == "5"
    page.fill("#prompt", README_PROMPT)
    page.click("#generate")
    page.wait_for_selector("#result video.output", state="attached")
    assert sent[0]["num_frames"] == 5 and sent[0]["model"] == "tiny-wan"
    assert page.locator("#result a[download]").get_attribute("download").endswith("-0.mp4")
    assert page.get_attribute("video.output", "src").startswith("blob:")


def test_a_control_model_sends_its_control_image_and_an_edit_model_no_strength(page, servers, tmp_path):
    """Answered in the browser, as the video test: a FLUX.1 Canny card (limits.control_image) shows the control
    image field and the request carries it as a data URL; a FLUX.1 Kontext card (image-to-image without a
    strength) shows the image field without the strength, which the API would refuse."""
    (card,) = httpx.get(servers["open"] + "/v1/models").json()["data"]
    control = {
        **card,
        "id": "canny",
        "tasks": ["text-to-image"],
        "limits": {**card["limits"], "control_image": True},
    }
    kontext = {**card, "id": "kontext", "tasks": ["text-to-image", "image-to-image"]}
    kontext["limits"] = {**card["limits"], "strength": None}
    sent = []

    def submit(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=422, json={"error": {"code": "caught", "message": "caught", "field": None}})

    page.route(
        "**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [control, kontext]})
    )
    page.route("**/v1/generate", submit)
    _ready(page, servers["open"])
    assert page.is_visible("#control-image") and page.is_hidden("#image-inputs")
    edges = tmp_path / "edges.png"
    Image.new("RGB", (64, 64), (0, 0, 0)).save(edges)
    page.set_input_files("#control-image", str(edges))
    page.fill("#prompt", README_PROMPT)
    _generate(page)
    assert (
        sent[0]["control_image"] == "data:image/png;base64," + base64.b64encode(edges.read_bytes()).decode()
    )
    assert sent[0]["model"] == "canny" and "image" not in sent[0]
    assert page.is_hidden("#controlnet-row")  # FLUX.1 Canny: no ControlNet fields
    page.select_option("#model", "kontext")
    assert page.is_visible("#image") and page.is_hidden("#strength-row") and page.is_hidden("#control-row")


def test_a_controlnet_model_sends_its_scale_window_and_guess_mode(page, servers, tmp_path):
    """An SDXL ControlNet card (its defaults list controlnet_conditioning_scale and the window): the fields show
    with the defaults as placeholders; typed values and a ticked guess mode are sent, empty ones left out."""
    (card,) = httpx.get(servers["open"] + "/v1/models").json()["data"]
    controlnet = {
        **card,
        "id": "sdxl-canny",
        "tasks": ["text-to-image", "image-to-image", "inpaint"],
        "limits": {**card["limits"], "control_image": True},
        "defaults": {
            **card["defaults"],
            "controlnet_conditioning_scale": 1.0,
            "control_guidance_start": 0.0,
            "control_guidance_end": 1.0,
            "guess_mode": False,
        },
    }
    sent = []

    def submit(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=422, json={"error": {"code": "caught", "message": "caught", "field": None}})

    page.route("**/v1/models", lambda route: route.fulfill(json={"object": "list", "data": [controlnet]}))
    page.route("**/v1/generate", submit)
    _ready(page, servers["open"])
    assert page.is_visible("#controlnet-row") and page.is_visible("#image-inputs")
    assert page.get_attribute("#controlnet-scale", "placeholder") == "1 (default)"
    edges = tmp_path / "edges.png"
    Image.new("RGB", (64, 64), (0, 0, 0)).save(edges)
    page.set_input_files("#control-image", str(edges))
    page.fill("#prompt", README_PROMPT)
    _generate(page)
    assert not {"controlnet_conditioning_scale", "control_guidance_start", "guess_mode"} & set(sent[0])
    page.fill("#controlnet-scale", "0.6")
    page.fill("#control-end", "0.5")
    page.check("#guess-mode")
    _generate(page)
    assert sent[1]["controlnet_conditioning_scale"] == 0.6 and sent[1]["control_guidance_end"] == 0.5
    assert sent[1]["guess_mode"] is True and "control_guidance_start" not in sent[1]


def test_with_keys_on_the_page_asks_for_one(page, servers):
    page.goto(servers["keys"] + "/playground")
    page.wait_for_selector("#key-box:not([hidden])")
    assert page.inner_text("#server-status") == "send Authorization: Bearer <API key>"
    assert page.locator("#model option").count() == 0
    answers = []
    page.on("response", lambda r: answers.append((r.status, r.url)) if "/v1/" in r.url else None)
    page.fill("#api-key", ADMIN_KEY)
    page.click("#key-use")
    page.wait_for_selector("#model option", state="attached")
    page.fill("#prompt", README_PROMPT)
    page.fill("#seed", str(README_SEED))
    _generate(page)
    data, _ = _shown_image(page)
    reading = read_picture(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    assert (reading.colour, reading.background) == ("red", "blue"), reading
    # Every API call from then on carried the key: the models, the submission, the SSE stream, the output.
    called = {re.sub(r"/v1/jobs/\w+", "/v1/jobs/ID", url.split(servers["keys"])[1]) for _, url in answers}
    assert {"/v1/models", "/v1/generate", "/v1/jobs/ID/events", "/v1/jobs/ID/outputs/0"} <= called, called
    assert all(200 <= status < 300 for status, _ in answers), answers
    # The key lives in this tab's sessionStorage only: not in localStorage, cookies or the address.
    assert page.evaluate("sessionStorage.getItem('meshserve.apiKey')") == ADMIN_KEY
    assert page.evaluate("localStorage.length") == 0
    assert page.context.cookies() == [] and ADMIN_KEY not in page.url


def test_a_step_cache_is_asked_for_and_its_skipped_steps_shown(page, servers):
    """A model whose card lists step caches gets the Step cache field (off by default, the method's default
    threshold as the placeholder); the request carries `cache` only when one is chosen, and the finished job's
    `cached_steps` is shown. The API is answered in the browser: a real cached job compiles its program on the
    request path (docs/step-cache.md), and the served side is tested in tests/workers/test_flux_serving.py."""
    (card,) = httpx.get(servers["open"] + "/v1/models").json()["data"]
    assert card["limits"]["cache"]["teacache"] == {"default_threshold": 0.2}  # the embedded tiny SDXL's
    png = io.BytesIO()
    Image.fromarray(render(Scene("red", "circle", "blue"))).save(png, format="PNG")
    output = {"index": 0, "url": "/v1/jobs/cached/outputs/0", "content_type": "image/png", "width": 64}
    job = {
        "id": "cached",
        "status": "succeeded",
        "progress": {"step": 30, "total_steps": 30},
        "params": {"prompt": README_PROMPT, "seed": 3},
        "outputs": [{**output, "height": 64, "seed": 3}],
        "timings": {"queue_s": 0.0, "inference_s": 1.0, "total_s": 1.0},
    }
    sent = []

    def submit(route):
        body = route.request.post_data_json
        sent.append(body)
        route.fulfill(json={**job, "cached_steps": 17} if "cache" in body else job)

    page.route("**/v1/generate", submit)
    page.route(
        "**/v1/jobs/cached/outputs/0", lambda r: r.fulfill(body=png.getvalue(), content_type="image/png")
    )
    _ready(page, servers["open"])
    assert page.is_visible("#cache-method")
    options = page.eval_on_selector_all("#cache-method option", "os => os.map((o) => o.value)")
    assert options == ["", *card["limits"]["cache"]]  # "" is off
    assert page.is_disabled("#cache-threshold")
    page.fill("#prompt", README_PROMPT)

    # Off: no cache in the request, no count shown.
    page.click("#generate")
    page.wait_for_selector("#result img.output", state="attached")
    assert "cache" not in sent[-1] and page.is_hidden("#cached-steps")

    # teacache at 0.3: sent as chosen, and the job's skipped steps shown.
    page.select_option("#cache-method", "teacache")
    assert page.get_attribute("#cache-threshold", "placeholder") == "0.2 (default)"
    page.fill("#cache-threshold", "0.3")
    page.click("#generate")
    page.wait_for_selector("#cached-steps:text('17 of 30')")
    assert sent[-1]["cache"] == {"method": "teacache", "threshold": 0.3}

    # A method without a threshold typed: the server fills its default.
    page.fill("#cache-threshold", "")
    page.click("#generate")
    page.wait_for_selector("#result img.output", state="attached")
    assert sent[-1]["cache"] == {"method": "teacache"}
