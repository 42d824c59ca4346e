"""Which half-precision activation dtype keeps the default model's greedy answers right?

Converts the embedded SmolLM2 GGUF to the quantized (Metal) variant in a temporary directory,
then runs it with its float tensors (norms) in float32, float16 and bfloat16 (`set_dtype`, which
also casts the quantization scales/biases, as they must match the activations) and compares,
against the float32 reference model, the greedy next-token argmax at every position of a few
prompts (teacher-forced) and a free greedy answer to a few chat questions. Also prints the KV
bytes per token of each. Runs on the CPU here; Metal kernels round differently, but the
precision of the dtype is what decides.

    python scripts/kv_dtype_check.py
"""

from __future__ import annotations

import argparse

from mlx_kvserve.blas import preload_optimised_blas

preload_optimised_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from mlx_kvserve import paths  # noqa: E402
from mlx_kvserve.models.default_model import ensure_default_model  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 12 times 12?",
    "Write one sentence about the sea.",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
]
TEXTS = [
    "The history of the Roman Empire spans many centuries, from the founding of the city to the "
    "fall of Constantinople. Its institutions, laws and languages shaped Europe for a millennium.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
    "Photosynthesis converts light energy into chemical energy. Plants absorb carbon dioxide and "
    "water, and with sunlight they produce glucose and release oxygen into the atmosphere.",
]


def kv_bytes_per_token(model) -> int:
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2, 3, 4]]), cache=caches)
    total = 0
    for c in caches:
        k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        total += k.nbytes + v.nbytes
    return total // 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--questions", type=int, default=2, help="chat questions answered freely (slow on CPU)"
    )
    parser.add_argument(
        "--dtypes",
        default="float32,float16,bfloat16",
        help="activation dtypes of the quantized variant to compare (bfloat16 is very slow on "
        "this CPU: over 15 minutes per dtype under load)",
    )
    args = parser.parse_args()
    data = paths.data_dir()
    fdir = ensure_default_model(data, progress=False, quantized=False)
    ref, tok = load(str(fdir))
    qdir = ensure_default_model(data, progress=False, quantized=True)
    greedy = make_sampler(temp=0.0)
    questions = QUESTIONS[: args.questions]
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    texts = [tok.encode(t) for t in TEXTS] + chats

    def answers(model) -> list[str]:
        return [
            generate(model, tok, c, max_tokens=args.max_tokens, sampler=greedy)
            for c in chats[: len(questions)]
        ]

    ref_answers = answers(ref)
    ref_argmax = [ref(mx.array(t)[None])[0].argmax(-1) for t in texts]
    print(f"reference float32 model: KV {kv_bytes_per_token(ref)} bytes/token")
    for q, a in zip(questions, ref_answers, strict=True):
        print(f"  {q!r} -> {a!r}")
    for name in args.dtypes.split(","):
        model, _ = load(str(qdir))
        if name != "float32":
            model.set_dtype(getattr(mx, name))
        agree = total = 0
        for t, want in zip(texts, ref_argmax, strict=True):
            got = model(mx.array(t)[None])[0].argmax(-1)
            agree += int((got == want).sum().item())
            total += len(t)
        outs = answers(model)
        same = sum(a == b for a, b in zip(outs, ref_answers, strict=True))
        print(
            f"q4_1, activations {name}: KV {kv_bytes_per_token(model)} bytes/token, "
            f"argmax agreement {agree}/{total} = {agree / total:.1%}, "
            f"greedy answers identical {same}/{len(outs)}"
        )
        for q, a, b in zip(questions, outs, ref_answers, strict=True):
            if a != b:
                print(f"  {q!r} -> {a!r}")


if __name__ == "__main__":
    main()
