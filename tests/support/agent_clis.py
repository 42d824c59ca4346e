"""The real agent CLIs (Claude Code, Codex, opencode, Qwen Code) from npm, run headless against a
server under test.

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
OPENCODE = "opencode-ai@1.18.33"
QWEN_CODE = "@qwen-code/qwen-code@0.24.4"
EOS_EMBEDDING_SCALE = 12.0  # answers of about 5-20 tokens at temperature 1 (padded weights)
# The thinking model samples its end less eagerly: at 12 it often ends inside the reasoning at
# its first token (a Codex turn with no reasoning to replay); at 7 it reasons, then ends.
THINKING_EOS_SCALE = 7.0
AGENT_CONTEXT = 131072
# One attention head: the agents' 20-30k-token prompts prefill on the CPU in time linear in the
# heads (a 512-token chunk against 24k keys costs about 0.4 s with four, 0.1 s with one), and
# the protocol and cache behaviour tested here does not depend on them.
ONE_HEAD = {"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 16}
NPM_TIMEOUT = 600
UNREACHABLE = "http://127.0.0.1:9/"  # the discard port: nothing listens there


@dataclass(frozen=True)
class Clis:
    claude: Path
    codex: Path
    opencode: Path
    qwen: Path


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
    wanted = [CLAUDE_CODE, CODEX, OPENCODE, QWEN_CODE]
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
    clis = Clis(*(bin_dir / name for name in ("claude", "codex", "opencode", "qwen")))
    for path in (clis.claude, clis.codex, clis.opencode, clis.qwen):
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
        model_dir = make_model_dir(dest, "llama", max_position_embeddings=AGENT_CONTEXT, **ONE_HEAD)
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


def run_opencode(
    clis: Clis, base_url: str, home: Path, workdir: Path, *args: str, timeout: float = 900
) -> CliRun:
    """`opencode run --format json ...` against `base_url` through its OpenAI-compatible provider,
    configured in the opencode.json of a home of its own. opencode installs its plugin package
    into its config directory at start-up; an unreachable npm registry keeps the run off the
    network (the install fails quietly and the run goes on)."""
    config_dir = home / ".config" / "opencode"
    config_dir.mkdir(parents=True, exist_ok=True)
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "mlx-kvserve",
        "options": {"baseURL": f"{base_url}/v1", "apiKey": "unused"},
        "models": {"tiny-agent": {"name": "tiny agent"}},
    }
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlx-kvserve": provider},
        "model": "mlx-kvserve/tiny-agent",
        "autoupdate": False,
        "share": "disabled",
    }
    (config_dir / "opencode.json").write_text(json.dumps(config))
    env = _clean_env(home, ("OPENCODE", "XDG_", "npm_config", "NPM_CONFIG"))
    env.update(
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        npm_config_registry=UNREACHABLE,
    )
    command = [str(clis.opencode), "run", "--format", "json", "-m", "mlx-kvserve/tiny-agent", *args]
    return _run(command, env, workdir, timeout)


def run_qwen(
    clis: Clis, base_url: str, home: Path, workdir: Path, *args: str, timeout: float = 900
) -> CliRun:
    """`qwen --auth-type openai --output-format json ...` against `base_url`, in a home of its own.

    Qwen Code takes an empty answer for a failed stream and retries it, then exits 1; the tiny
    model, asked Qwen Code's 14k-token prompt, samples its end first. So its settings ask for 8
    tokens with the `ignore_eos` extension (through Qwen Code's own `samplingParams` and
    `extra_body`): the answer is 8 gibberish tokens, the prompt is what Qwen Code sends. The
    background memory extraction (a second agent per run) is off to keep the run short."""
    settings_dir = home / ".qwen"
    settings_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
        "model": {
            "generationConfig": {
                "samplingParams": {"max_tokens": 8},
                "extra_body": {"ignore_eos": True},
            }
        },
    }
    (settings_dir / "settings.json").write_text(json.dumps(settings))
    env = _clean_env(home, ("OPENAI", "QWEN", "DASHSCOPE"))
    env.update(OPENAI_BASE_URL=f"{base_url}/v1", OPENAI_API_KEY="unused", OPENAI_MODEL="tiny-agent")
    command = [str(clis.qwen), "--auth-type", "openai", "--output-format", "json", *args]
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
