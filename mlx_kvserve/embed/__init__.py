"""Embeddings from the loaded models: pooling over the last hidden state (pooling.py), which
models are embedding models and how they pool (kind.py), and the batches that share a model's
engine thread with generation (batcher.py)."""
