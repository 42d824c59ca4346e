#!/usr/bin/env python3
"""The turn after an image turn on a vision model (docs/images.md).

    python scripts/bench_vision.py                  # 3 rounds, a 448px 12-layer tower
    python scripts/bench_vision.py --image-size 896 --tower-layers 27   # Gemma 3's own tower

No real Gemma 3 vision checkpoint is reachable here (no model hub), so the script builds a
Gemma 3 shaped one: the embedded Gemma 3 270M text model (its real tokenizer and chat template,
the embedding padded to 262,208 rows and `<image_soft_token>` added as id 262144, as Gemma 3 4B
ships) and a random-weight SigLIP so400m tower (hidden 1152, patch 14, 256 tokens per image) of
the given size and depth. Timings are real; answers are noise.

Turn 1 is a system prompt and a user turn with a 1280x800 screenshot; turn 2 adds the answer
and a question. Three servers, one at a time: this one with the prompt cache on and with
`--no-cache`, and mlx-vlm's own (`python -m mlx_vlm.server`); each round a fresh system
prompt. The table: turn 1's and turn 2's median time to first token, turn 2's cached tokens.
The same screenshot every round: the tower runs on a server's first round only (its features
are kept by their pixel hash), so the tower's own time is measured first, in this process.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench_common import Server, machine, workdir  # noqa: E402
from bench_images import image_turns, screenshot  # noqa: E402

NAME = "vision-bench"
ROWS = 262208  # Gemma 3 4B's embedding rows (its tokenizer's 262,145 ids, padded)


@dataclass
class VisionServer(Server):
    @property
    def model_name(self) -> str:
        return NAME


@dataclass
class VlmServer(Server):
    """mlx-vlm's own server on the same checkpoint (`python -m mlx_vlm.server`)."""

    model: Path | None = None

    @property
    def model_name(self) -> str:
        return str(self.model)

    def command(self) -> list[str]:
        argv = ["mlx_vlm.server", "--model", str(self.model), "--port", str(self.port)]
        launcher = (
            "from mlx_kvserve.blas import preload_optimised_blas; "
            "print('BLAS:', preload_optimised_blas() or 'reference', flush=True); "
            f"import runpy, sys; sys.argv = {argv!r}; "
            "runpy.run_module('mlx_vlm.server', run_name='__main__', alter_sys=True)"
        )
        return [sys.executable, "-c", launcher]


def text_model_dir() -> Path:
    from mlx_kvserve import paths

    found = sorted((paths.data_dir() / "models").glob("gemma3-270m*"))
    if not found:
        sys.exit("the embedded Gemma 3 270M is not here: run `mlx-kvserve pull gemma3-270m`")
    return found[0]


def build_checkpoint(dest: Path, image_size: int, layers: int) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import AddedToken, Tokenizer

    from mlx_kvserve.vision.gemma3 import processor_config, vision_modules

    source = text_model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "chat_template.jinja", dest / "chat_template.jinja")
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["extra_special_tokens"] = {**named, "image_token": "<image_soft_token>"}
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    whole = {"processor_class": "Gemma3Processor", "image_seq_length": 256}  # mlx-vlm's loader
    (dest / "processor_config.json").write_text(json.dumps(whole, indent=2))
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<image_soft_token>", special=True)])
    tokenizer.save(str(dest / "tokenizer.json"))
    text = json.loads((source / "config.json").read_text())
    text.update(model_type="gemma3_text", vocab_size=ROWS)
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vocab_size": ROWS,
        "eos_token_id": [1, 106],
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "patch_size": 14,
            "image_size": image_size,
        },
        "mm_tokens_per_image": 256,
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "image_token_index": 262144,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = {
        f"language_model.{k}": v for k, v in mx.load(str(source / "model.safetensors")).items()
    }
    table = weights["language_model.model.embed_tokens.weight"]
    pad = mx.zeros((ROWS - table.shape[0], table.shape[1]), dtype=table.dtype)
    weights["language_model.model.embed_tokens.weight"] = mx.concatenate([table, pad])
    mx.random.seed(0)
    tower, projector = vision_modules(config)
    projector.mm_input_projection_weight = mx.random.normal((1152, text["hidden_size"])) * 0.03
    weights.update({f"vision_tower.{k}": v for k, v in tree_flatten(tower.parameters())})
    weights.update(
        {f"multi_modal_projector.{k}": v for k, v in tree_flatten(projector.parameters())}
    )
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights, tower, projector
    mx.clear_cache()
    processor = processor_config(image_size)
    (dest / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    return dest


def turns(rounds: int, root: Path, model: Path) -> None:
    url = "data:image/png;base64," + base64.b64encode(screenshot(1280, 800, "PNG")).decode()
    flags = ["--model", str(model), "--served-model-name", NAME]
    servers: dict[str, Server] = {
        "cache": VisionServer("kvserve", root, cache_dir=root / "cache", extra=flags),
        "no-cache": VisionServer(
            "kvserve", root, cache_dir=root / "unused", no_cache=True, extra=flags
        ),
        "mlx-vlm server": VlmServer("mlx_vlm", root, model=model),
    }
    results = {}  # one server at a time: two servers and a tower do not fit beside other jobs
    for name, server in servers.items():
        results.update(image_turns({name: server}, url, rounds))
    print("\n| server | turn 1 TTFT | turn 2 TTFT | turn 2 cached / prompt tokens |")
    print("|---|---:|---:|---:|")
    for name, rows in results.items():
        one = statistics.median(row.first.ttft for row in rows) * 1000
        two = statistics.median(row.second.ttft for row in rows) * 1000
        last = rows[-1].second
        print(
            f"| {name} | {one:.0f} ms | {two:.0f} ms | "
            f"{last.cached_tokens} / {last.prompt_tokens} |"
        )


def tower_time(model: Path, rounds: int) -> None:
    """The tower alone, in this process: an image's features the first time (median over
    fresh caches), and the same pixels again (from the features cache)."""
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer

    from mlx_kvserve.images.pixels import ImageLimits, decode_image
    from mlx_kvserve.vision.encoder import load_vision

    tokenizer = load_tokenizer(model)
    image = decode_image(screenshot(1280, 800, "PNG"), ImageLimits(1 << 26, 1 << 26), "bench")
    first, again = [], []
    for _ in range(rounds):
        vision = load_vision(model, tokenizer.convert_ids_to_tokens)
        assert vision is not None
        for times in (first, again):
            start = time.perf_counter()
            vision.features(image, mx.float32)
            times.append(time.perf_counter() - start)
    del vision
    mx.clear_cache()  # the servers need the memory
    ms = [statistics.median(t) * 1000 for t in (first, again)]
    print(f"\ntower, a 1280x800 screenshot: {ms[0]:.0f} ms the first time, {ms[1]:.2f} ms again")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=448, help="the tower's square (896)")
    parser.add_argument("--tower-layers", type=int, default=12, help="Gemma 3's: 27")
    args = parser.parse_args()
    from mlx_kvserve.blas import preload_optimised_blas  # before MLX, as the server does

    print(machine(), f"(this process's BLAS: {preload_optimised_blas() or 'reference'})")
    print(f"tower: {args.image_size}px, {args.tower_layers} layers, 256 tokens per image")
    with workdir() as root:
        model = build_checkpoint(root / NAME, args.image_size, args.tower_layers)
        tower_time(model, args.rounds)
        turns(args.rounds, root, model)


if __name__ == "__main__":
    main()
