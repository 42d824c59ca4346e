"""Vision models: the text model stays mlx-lm's (the engine, batching, prompt cache and
speculation run on it unchanged), and the vision tower and projector of the same checkpoint
come from mlx-vlm's model classes (the optional `vision` extra). docs/images.md.

`family.py` says which checkpoints see images, `base.py` what each family's module
(`gemma3.py`, `gemma4.py`, `qwen2_5_vl.py`, `qwen3_vl.py`) does: turn an image into the rows its
placeholder tokens get, and `encoder.py` looks those rows up by the image's pixel hash where the
prompt cache keeps them (cache/features.py) and builds a prefill chunk's input embeddings. The
prompt's side, each image's placeholder tokens and its `ImageSpan`, is chat/image_markup.py.
"""

from mlx_kvserve.vision.family import vision_family, vision_library

__all__ = ["vision_family", "vision_library"]
