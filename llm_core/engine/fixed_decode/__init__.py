"""Fixed-shape decode steps per batch bucket (``--compile-decode``):

    persistent_batch.py   PersistentDecodeBatch: decode rows kept between steps, padding, scratch page
    decode_graphs.py      DecodeGraphs: the bucketed step, eager / torch.compile (CPU) / CUDA graphs
"""
