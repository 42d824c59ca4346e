"""A JavaScript client from npm, installed once into the test cache and driven by a small node
script (the official `ollama` and `openai` packages): the npm side of "real clients".

`run_node_script` skips the test, with the reason, where npm or node is missing or the registry
cannot be reached; a script that fails is a failed test with its stderr."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.agent_clis import NPM_TIMEOUT, cli_cache_dir

SCRIPT_TIMEOUT = 300  # a guard against a hung script, never a speed assertion


def npm_package(spec: str, directory: str) -> Path:
    """`spec` (`name@version`) installed under the test cache's `directory`; its node_modules."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("npm is not installed")
    root = cli_cache_dir().parent / directory
    stamp = root / "installed.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == [spec]):
        root.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(root), spec],
            capture_output=True,
            text=True,
            timeout=NPM_TIMEOUT,
        )
        if done.returncode != 0:
            pytest.skip(f"npm install {spec} failed: {done.stderr.strip()[-300:]}")
        stamp.write_text(json.dumps([spec]))
    return root / "node_modules"


def run_node_script(
    spec: str, directory: str, script: str, workdir: Path, env: dict[str, str]
) -> dict:
    """Run `script` (CommonJS) with `spec` installed; the JSON object of its last output line."""
    modules = npm_package(spec, directory)
    node = shutil.which("node")
    assert node is not None  # npm_package skipped otherwise
    path = workdir / "run.cjs"
    path.write_text(script)
    ran = subprocess.run(
        [node, str(path)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT,
        env={"PATH": str(Path(node).parent), "NODE_PATH": str(modules), **env},
        cwd=modules.parent,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout.strip().splitlines()[-1])
