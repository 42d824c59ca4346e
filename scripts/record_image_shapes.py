#!/usr/bin/env python3
"""Record the requests Claude Code and Codex send with a pasted image, as test fixtures.

    python scripts/record_image_shapes.py

Runs the real CLIs from npm (tests/support/agent_clis.py installs them) against a server of
the tiny agent model through the recording proxy (tests/support/cli_proxy.py): Claude Code
headless with an `image` block on stream-json input, Codex `exec PROMPT --image shot.png`.
Their first requests are written to tests/fixtures/images/ with the vendors' prose redacted
(tests/support/cli_shapes.py) and the image data kept.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.agent_clis import (  # noqa: E402
    _clean_env,
    agent_model_dir,
    install_clis,
    run_codex,
)
from tests.support.cli_proxy import RecordingProxy  # noqa: E402
from tests.support.cli_shapes import redact  # noqa: E402
from tests.support.images import encoded  # noqa: E402
from tests.support.servers import ServerProcess  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "images"
PROMPT = "What is wrong in this screenshot?"


def keep_images(redacted: object, original: object) -> object:
    """`redacted` with the image data of `original` put back."""
    if isinstance(original, dict):
        out = {}
        for key, value in original.items():
            if key == "image_url" and isinstance(value, str) and value.startswith("data:"):
                out[key] = value
            elif key == "source" and isinstance(value, dict) and value.get("type") == "base64":
                out[key] = {**redacted[key], "data": value["data"]}  # type: ignore[index]
            else:
                out[key] = keep_images(redacted[key], value)  # type: ignore[index]
        return out
    if isinstance(original, list):
        return [keep_images(r, o) for r, o in zip(redacted, original, strict=True)]  # type: ignore[arg-type]
    return redacted


def main() -> None:
    clis = install_clis()
    if isinstance(clis, str):
        raise SystemExit(clis)
    with tempfile.TemporaryDirectory(prefix="image-shapes-") as tmp:
        root = Path(tmp)
        (root / "server").mkdir()
        model = agent_model_dir(root / "model")
        server = ServerProcess(root / "server", "--model", f"tiny-agent={model}").wait_ready()
        work = root / "work"
        work.mkdir()
        png = encoded("PNG", 160, 100)
        (work / "shot.png").write_bytes(png)
        try:
            with RecordingProxy(server.base_url) as proxy:
                home = root / "codex-home"
                home.mkdir()
                run_codex(clis, proxy.base_url, home, work, PROMPT, "--image", "shot.png")
                home = root / "claude-home"
                home.mkdir()
                image = {
                    "type": "base64",
                    "media_type": "image/png",
                    "data": base64.b64encode(png).decode(),
                }
                content = [{"type": "image", "source": image}, {"type": "text", "text": PROMPT}]
                line = {"type": "user", "message": {"role": "user", "content": content}}
                env = _clean_env(home, ("ANTHROPIC", "CLAUDE"))
                env.update(
                    ANTHROPIC_BASE_URL=proxy.base_url,
                    ANTHROPIC_API_KEY="unused",
                    ANTHROPIC_MODEL="tiny-agent",
                    ANTHROPIC_DEFAULT_HAIKU_MODEL="tiny-agent",
                    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                    DISABLE_AUTOUPDATER="1",
                )
                command = [str(clis.claude), "-p", "--input-format", "stream-json"]
                command += ["--output-format", "stream-json", "--verbose"]
                subprocess.run(
                    command,
                    input=json.dumps(line) + "\n",
                    text=True,
                    capture_output=True,
                    env=env,
                    cwd=work,
                    timeout=600,
                    check=True,
                )
                exchanges = proxy.exchanges
        finally:
            server.stop()
    firsts = {
        "codex-input-image": next(e for e in exchanges if e.path == "/v1/responses"),
        "claude-code-pasted-screenshot": next(e for e in exchanges if e.path == "/v1/messages"),
    }
    for name, exchange in firsts.items():
        body = keep_images(redact(exchange.body), exchange.body)
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(body, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path.relative_to(ROOT)} ({exchange.status})")


if __name__ == "__main__":
    main()
