"""The playground: one static page (`service/static/`) where a person tries the served models in a browser.

`/` redirects to `/playground`; the page's script and style are two files beside it, served from memory. No
build step, no CDN: the page works offline, and the content-security-policy allows only this origin (plus
`data:` and `blob:` images, which are the previews and the fetched outputs). The page holds no tenant data, so
its three paths are open (`OPEN_PATHS`); everything it does goes through the authenticated API with the key a
person types (kept in sessionStorage at most). Not in the OpenAPI schema: it is not part of the API.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

router = APIRouter(include_in_schema=False)

STATIC = Path(__file__).resolve().parents[2] / "static"
# path -> (file under service/static, content type)
FILES = {
    "/playground": ("playground.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
PATHS = frozenset({"/", *FILES})
# 'self' only: no inline script or style (an injected <script> does nothing), no other origin to load from or
# send to. data: images are the live previews; blob: images and media are the outputs, which the page fetches
# with the API key and shows from memory.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Small files that change with the package: revalidate, never serve a stale page against a newer API.
    "Cache-Control": "no-cache",
}


def content_security_policy(settings) -> str:
    """The page's policy: outputs served from another origin (`output_url_base`, or an object store's signed
    URLs) are shown from there, straight by the browser, so that origin (https: for signed URLs, whose host is
    the bucket's) may give images and media. The page never sends the API key there (playground.js)."""
    extra = ""
    if settings.output_url_base:
        url = urlsplit(settings.output_url_base)
        if url.scheme in ("http", "https") and url.netloc:
            extra = f" {url.scheme}://{url.netloc}"
    elif settings.output_dir and urlsplit(settings.output_dir).scheme in ("gs", "s3", "az"):
        extra = " https:"
    if not extra:
        return CONTENT_SECURITY_POLICY
    return CONTENT_SECURITY_POLICY.replace(
        "img-src 'self' data: blob:;", f"img-src 'self' data: blob:{extra};"
    ).replace("media-src 'self' blob:;", f"media-src 'self' blob:{extra};")


@cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/playground", status_code=307)


def _serve(path: str):
    name, content_type = FILES[path]

    async def endpoint(request: Request) -> Response:
        policy = content_security_policy(request.app.state.settings)
        return Response(
            _read(name), media_type=content_type, headers={**HEADERS, "Content-Security-Policy": policy}
        )

    endpoint.__name__ = "playground_" + name.replace(".", "_")
    return endpoint


for _path in FILES:
    router.add_api_route(_path, _serve(_path), methods=["GET"])
