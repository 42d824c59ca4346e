"""Tiny random-weight encoder embedding models, laid out as sentence-transformers ships them.
`tiny_bert_dir`: mlx-vlm's `bert` weights, a WordPiece tokenizer in BERT's configuration
(lower-casing, BERT's pre-tokenizer, `[CLS] ... [SEP]`, `[PAD]` 0) trained here on a small
corpus, and the `modules.json` and `1_Pooling/config.json` that say its pooling.
`tiny_embeddinggemma_dir`: EmbeddingGemma's layout. Both need the `embeddings` extra (mlx-vlm);
their tests skip without it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.support.tiny_models import EMBEDDING_MODULES

CORPUS = [
    "The sky is blue because of Rayleigh scattering.",
    "Embeddings map text to vectors; similar texts get similar vectors.",
    "def add(a, b): return a + b",
    "A quick brown fox jumps over the lazy dog.",
    "Servers batch requests of like length together.",
] * 4


def _tokenizer(dest: Path) -> int:
    """Write a WordPiece tokenizer into `dest`; return its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, WordPieceTrainer(vocab_size=300, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    wrapped = BertTokenizerFast(tokenizer_object=tok, model_max_length=512)
    wrapped.save_pretrained(str(dest))
    return tok.get_vocab_size()


def tiny_bert_dir(
    dest: Path,
    pooling: str = "pooling_mode_cls_token",
    seed: int = 0,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
) -> Path:
    """A tiny BERT embedding model in `dest` (created), pooling as `pooling` says (`hidden=384,
    layers=6, heads=12`: all-MiniLM-L6-v2's shape, for scripts/bench_embeddings.py)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.bert import Model, ModelConfig

    dest.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(dest)
    config = {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "intermediate_size": 4 * hidden if hidden > 32 else 64,
        "max_position_embeddings": 512 if hidden > 32 else 64,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
    }
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "modules.json").write_text(json.dumps(EMBEDDING_MODULES))
    (dest / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}
    (dest / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, **modes, pooling: True})
    )
    return dest


def tiny_embeddinggemma_dir(dest: Path, seed: int = 0) -> Path:
    """A tiny EmbeddingGemma laid out as google/embeddinggemma-300m ships: a bidirectional
    `gemma3_text` (the tiny Gemma 3 of tiny_models, the default model's tokenizer), mean
    pooling, then two Dense layers (`2_Dense`, `3_Dense`: hidden -> 4x hidden -> hidden)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models.gemma3_embedding import Model, ModelConfig

    from tests.support.tiny_models import TOKENIZER_FILES, default_tokenizer_dir, model_config

    dest.mkdir(parents=True, exist_ok=True)
    config = model_config("gemma3_text", max_position_embeddings=128)
    config["use_bidirectional_attention"] = True
    config["architectures"] = ["Gemma3TextModel"]
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    dense = {k: weights.pop(k) for k in [k for k in weights if k.startswith("dense.")]}
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    for index, folder in ((0, "2_Dense"), (1, "3_Dense")):
        (dest / folder).mkdir(exist_ok=True)
        layer = {"linear.weight": dense[f"dense.{index}.weight"]}
        mx.save_safetensors(str(dest / folder / "model.safetensors"), layer)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    dense_modules = [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (dest / "modules.json").write_text(json.dumps([*EMBEDDING_MODULES[:2], *dense_modules]))
    (dest / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": config["hidden_size"], "pooling_mode_mean_tokens": True}
    (dest / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    source = default_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    return dest
