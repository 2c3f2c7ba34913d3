"""Conditional and partial downloads of a job's outputs (RFC 9110 sections 13 and 14): a strong ETag, 304 for a
matching `If-None-Match`, and one byte range (206, `Content-Range`; 416 when it starts past the end).

An output never changes once its job has succeeded, so its ETag names it (job id and index) and costs no hash. A
browser's `<video>` asks for ranges to seek and Safari plays an MP4 only from ranged answers; a resumed download
asks for the rest. Several ranges in one request are answered whole (200), which the RFC allows, as is a range
under an `If-Range` that no longer matches.
"""

from __future__ import annotations

import re

from fastapi import Request, Response

_RANGE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})", re.IGNORECASE)


def output_response(request: Request, data: bytes, media_type: str, etag: str, headers: dict) -> Response:
    """`data` as the answer to this GET or HEAD: whole, a 304, one range, or a 416."""
    headers = {**headers, "ETag": etag, "Accept-Ranges": "bytes"}
    if _matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    wanted = request.headers.get("range")
    if_range = request.headers.get("if-range")
    if wanted is None or (if_range is not None and if_range.strip() != etag):
        return Response(data, media_type=media_type, headers=headers)
    m = _RANGE.fullmatch(wanted.strip())
    if m is None or m.group(1) == m.group(2) == "":  # several ranges, another unit, or unreadable: whole
        return Response(data, media_type=media_type, headers=headers)
    size = len(data)
    first, last = m.group(1), m.group(2)
    if first == "":  # the last N bytes
        start, end = size - min(int(last), size), size - 1
    elif last != "" and int(last) < int(first):  # an invalid range-spec is ignored (14.1.1)
        return Response(data, media_type=media_type, headers=headers)
    else:
        start, end = int(first), size - 1 if last == "" else min(int(last), size - 1)
    if start >= size or start > end:  # past the end, or a suffix of 0 bytes
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    return Response(data[start : end + 1], status_code=206, media_type=media_type, headers=headers)


def _matches(if_none_match: str | None, etag: str) -> bool:
    """Weak comparison, as If-None-Match uses: `*`, or the tag among the listed ones (W/ ignored)."""
    if if_none_match is None:
        return False
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags
