"""The real agent CLIs (Claude Code, Codex) from npm, run headless against a server under test.

`install_clis()` installs the pinned versions once into a per-user cache directory and returns
their executables, or None with the reason when npm or the registry is unavailable (the tests then
skip and say why). `agent_model_dir()` builds the model they talk to: these agents send 10k-20k
token prompts that the default model's 8k context cannot hold, so the tests serve a tiny
random-weight llama with a 128k context. Its answers are gibberish; what is tested is the protocol
and the prompt cache. Its end-of-turn token's embedding is scaled up so that it is sampled after a
few tokens: an agent asks for up to 32,000 output tokens and a random model would otherwise use
them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from tests.support.thinking_models import build_thinking_model
from tests.support.tiny_models import make_model_dir, scale_output_row

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"
CODEX = "@openai/codex@0.171.0"
EOS_EMBEDDING_SCALE = 12.0  # answers of about 5-20 tokens at temperature 1 (padded weights)
# The thinking model samples its end less eagerly: at 12 it often ends inside the reasoning at
# its first token (a Codex turn with no reasoning to replay); at 7 it reasons, then ends.
THINKING_EOS_SCALE = 7.0
AGENT_CONTEXT = 131072
NPM_TIMEOUT = 600


@dataclass(frozen=True)
class Clis:
    claude: Path
    codex: Path


def cli_cache_dir() -> Path:
    """Where the CLIs are installed once and reused by later runs."""
    override = os.environ.get("MLX_KVSERVE_TEST_CLI_DIR")
    return Path(override or platformdirs.user_cache_dir("mlx-kvserve-tests")) / "agent-clis"


def install_clis() -> Clis | str:
    """The installed CLIs, or the reason they cannot be had here."""
    npm = shutil.which("npm")
    if npm is None:
        return "npm is not installed"
    root = cli_cache_dir()
    bin_dir = root / "node_modules" / ".bin"
    stamp = root / "installed.json"
    wanted = [CLAUDE_CODE, CODEX]
    if not (stamp.is_file() and json.loads(stamp.read_text()) == wanted):
        root.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", "--prefix", str(root), *wanted],
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return f"npm install {' '.join(wanted)} timed out"
        if done.returncode != 0:
            return f"npm install {' '.join(wanted)} failed: {done.stderr.strip()[-500:]}"
        stamp.write_text(json.dumps(wanted))
    clis = Clis(bin_dir / "claude", bin_dir / "codex")
    for path in (clis.claude, clis.codex):
        try:
            subprocess.run([str(path), "--version"], capture_output=True, timeout=60, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{path.name} does not run: {exc}"
    return clis


def agent_model_dir(dest: Path, *, thinking: bool = False) -> Path:
    """A tiny llama with a 128k context whose answers end after a few tokens; `thinking` gives it
    `<think>` tokens and Qwen3.5's real template, whose generation prompt opens the reasoning."""
    if thinking:
        model_dir = build_thinking_model(dest, "qwen3.5", architecture="llama")
        config_path = model_dir / "config.json"
        config = json.loads(config_path.read_text())
        config_path.write_text(json.dumps({**config, "max_position_embeddings": AGENT_CONTEXT}))
    else:
        model_dir = make_model_dir(dest, "llama", max_position_embeddings=AGENT_CONTEXT)
    scale = THINKING_EOS_SCALE if thinking else EOS_EMBEDDING_SCALE
    scale_output_row(model_dir, _eos_token(model_dir), scale)  # tied: the embedding row too
    return model_dir


def _eos_token(model_dir: Path) -> str:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    eos = config["eos_token"]
    return eos["content"] if isinstance(eos, dict) else eos


@dataclass
class CliRun:
    returncode: int
    stdout: str
    stderr: str

    def json_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


def _clean_env(home: Path, drop: tuple[str, ...]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["HOME"] = str(home)
    return env


def run_claude(
    clis: Clis, base_url: str, home: Path, workdir: Path, *args: str, timeout: float = 900
) -> CliRun:
    """`claude -p ... --output-format json` against `base_url`, in a home of its own."""
    env = _clean_env(home, ("ANTHROPIC", "CLAUDE"))
    env.update(
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="unused",
        ANTHROPIC_MODEL="tiny-agent",
        ANTHROPIC_DEFAULT_HAIKU_MODEL="tiny-agent",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    return _run([str(clis.claude), "--output-format", "json", *args], env, workdir, timeout)


def codex_home(home: Path, base_url: str) -> Path:
    """A CODEX_HOME whose config points Codex at `base_url` over the Responses API."""
    path = home / ".codex"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.toml").write_text(
        'model = "tiny-agent"\n'
        'model_provider = "mlx-kvserve"\n'
        "[model_providers.mlx-kvserve]\n"
        'name = "mlx-kvserve"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "MLX_KVSERVE_TEST_KEY"\n'
    )
    return path


def run_codex(
    clis: Clis, base_url: str, home: Path, workdir: Path, *args: str, timeout: float = 900
) -> CliRun:
    """`codex exec --json ...` against `base_url`, in a home of its own."""
    env = _clean_env(home, ("OPENAI", "CODEX"))
    env.update(CODEX_HOME=str(codex_home(home, base_url)), MLX_KVSERVE_TEST_KEY="unused")
    command = [str(clis.codex), "exec", "--skip-git-repo-check", "--json", *args]
    return _run(command, env, workdir, timeout)


def _run(command: list[str], env: dict[str, str], workdir: Path, timeout: float) -> CliRun:
    """A CLI run headless: no terminal, no standard input (the CLIs would wait for one)."""
    done = subprocess.run(
        command,
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return CliRun(done.returncode, done.stdout, done.stderr)
