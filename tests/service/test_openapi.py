"""`openapi.yaml` is the app's generated schema (regenerate with `python -m meshserve.service.openapi_export`) and a valid
OpenAPI 3 document."""

from __future__ import annotations

import yaml
from openapi_spec_validator import validate

from meshserve.service.openapi_export import DEFAULT_PATH, openapi_schema


def test_openapi_file_matches_app():
    on_disk = yaml.safe_load(DEFAULT_PATH.read_text())
    assert on_disk == openapi_schema(), (
        "openapi.yaml is stale: run `python -m meshserve.service.openapi_export`"
    )


def test_openapi_file_is_valid():
    spec = yaml.safe_load(DEFAULT_PATH.read_text())
    validate(spec)
    paths = spec["paths"]
    for path in (
        "/v1/generate",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/outputs/{index}",
        "/v1/models",
        "/v1/images/generations",
        "/livez",
        "/readyz",
        "/metrics",
    ):
        assert path in paths, path
    errors = paths["/v1/generate"]["post"]["responses"]
    assert {"202", "200", "404", "422", "429", "503"} <= set(errors)
    assert errors["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    # The HTTP protocol's 431 (tests/service/test_http_protocol.py) comes before any route: every operation.
    assert all("431" in op["responses"] for ops in paths.values() for op in ops.values())


def test_the_export_takes_no_option_for_a_path(tmp_path, monkeypatch, capsys):
    """`--help` prints the usage; it once wrote the schema to a file named `--help`."""
    from meshserve.service.openapi_export import main

    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0 and main(["-x"]) == 2
    assert "openapi.yaml" in capsys.readouterr().out and not list(tmp_path.iterdir())
    assert main([str(tmp_path / "schema.yaml")]) == 0 and (tmp_path / "schema.yaml").stat().st_size > 0
