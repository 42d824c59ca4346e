"""lm-evaluation-harness itself (`lm_eval --model local-completions`, with the server's own
tokenizer through `tokenizer_backend=remote`) against a real server, on two tiny tasks whose data
this test writes: a multiple-choice task (loglikelihood: `echo` with `logprobs` and
`max_tokens: 1`, several prompts a request) and a generate_until task. lm-eval's
loglikelihoods must be those of a plain mlx-lm forward of the same tokens, and its generations
the server's own greedy answers.

lm-eval is an optional extra (`pip install -e '.[eval]'`, about 500 MB with torch): the test
is skipped when it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

from tests.support.servers import ServerProcess
from tests.support.tiny_models import VOCAB, make_model_dir

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed (the `eval` extra)",
)

QUESTIONS = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Paris is in", "choices": [" France", " Spain", " Peru"], "answer": 0},
]
PROMPTS = [
    {"question": "Once upon a time", "answer": " there"},
    {"question": "The capital of France is", "answer": " Paris"},
]
MC_TASK = """
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN_TASK = """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 5
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("lm-eval-model"), "llama")


@pytest.fixture(scope="module")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("lm-eval"), "--model", f"tiny={model_dir}")
    yield proc.wait_ready()
    proc.stop()


def _tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows, template in (
        ("mc", QUESTIONS, MC_TASK),
        ("gen", PROMPTS, GEN_TASK),
    ):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tasks / f"tiny_{name}.yaml").write_text(template.format(data=data))
    return tasks


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_runs_a_loglikelihood_and_a_generation_task(
    served: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    from mlx_lm import load

    out = tmp_path / "out"
    url = served.base_url + "/v1/completions"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            f"model=tiny,base_url={url},tokenizer_backend=remote,num_concurrent=1,max_retries=1",
            "--batch_size",
            "4",
            "--tasks",
            "tiny_mc,tiny_gen",
            "--include_path",
            str(_tasks(tmp_path)),
            "--output_path",
            str(out),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (results,) = out.rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert "acc,none" in scores["tiny_mc"] and "exact_match,none" in scores["tiny_gen"]

    model, tokenizer = load(str(model_dir))
    for sample, doc in zip(_samples(out, "tiny_mc"), QUESTIONS, strict=True):
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        for (loglikelihood, _greedy), choice in zip(
            [r[0] for r in sample["resps"]], doc["choices"], strict=True
        ):
            whole = tokenizer.encode(doc["question"] + choice, add_special_tokens=False)
            assert whole[: len(context)] == context  # the choice starts a token of its own
            logits = model(mx.array([whole]))[0][:, :VOCAB].astype(mx.float32)
            logprobs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            want = sum(logprobs[i - 1, whole[i]] for i in range(len(context), len(whole)))
            assert abs(float(loglikelihood) - float(want)) < 1e-3, (doc, choice)

    for sample, doc in zip(_samples(out, "tiny_gen"), PROMPTS, strict=True):
        reply = httpx.post(
            url,
            json={"model": "tiny", "prompt": doc["question"], "max_tokens": 5, "temperature": 0},
            timeout=60,
        )
        assert sample["resps"][0][0] == reply.json()["choices"][0]["text"].split("<|im_end|>")[0]
