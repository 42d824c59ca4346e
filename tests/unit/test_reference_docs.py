"""docs/reference/*.md are what scripts/reference_docs.py makes from the code now.

A setting, metric or route added, renamed or re-described without running
`python scripts/reference_docs.py` fails here, naming the file to regenerate.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import reference_docs  # noqa: E402

from mlx_kvserve.api.app import api_routes  # noqa: E402
from mlx_kvserve.config.settings import Settings  # noqa: E402
from mlx_kvserve.observe.metrics import Metrics  # noqa: E402


def test_reference_files_match_the_code() -> None:
    stale = [str(path.relative_to(ROOT)) for path in reference_docs.stale()]
    assert not stale, f"out of date: {stale}; run `{reference_docs.COMMAND}` and commit the result"


def test_every_setting_metric_and_route_is_listed() -> None:
    """The generator itself leaves nothing out."""
    configuration = reference_docs.configuration()
    for f in dataclasses.fields(Settings):
        assert f"| `{f.name}` |" in configuration
        if not f.metadata.get("file_only"):
            assert f"`--{f.name.replace('_', '-')}`" in configuration
            assert f"`MLX_KVSERVE_{f.name.upper()}`" in configuration
    metrics = reference_docs.metrics()
    for family in Metrics(lambda: []).registry.collect():
        assert f"`{family.name}" in metrics
    assert "| `mlx_kvserve_requests_total` | counter | `route`, `protocol`, `status` |" in metrics
    endpoints = reference_docs.endpoints()
    for route in api_routes():
        assert f"`{route.path}`" in endpoints


def test_check_mode_names_a_stale_or_missing_file(tmp_path: Path) -> None:
    assert {p.name for p in reference_docs.stale(tmp_path)} == set(reference_docs.PAGES)
    reference_docs.write(tmp_path)
    assert reference_docs.stale(tmp_path) == []
    page = tmp_path / "metrics.md"
    page.write_text(page.read_text(encoding="utf-8") + "edited by hand\n", encoding="utf-8")
    assert reference_docs.stale(tmp_path) == [page]
