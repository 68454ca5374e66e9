"""The demo model's tokenizer: the tiny byte-level BPE plus merges learned from the demo's corpus.

A byte-only tokenizer spells every caption letter by letter ("a square that is red, then blue"
is 43 tokens); the decisions that matter (which colour, which shape, stop or go on) are then a
few tokens among many trivially predictable ones, the answer outgrows the 32-token sliding window,
and a tiny model spends its capacity on spelling. Real MiMo tokenizers are BPE over a corpus; ours
is BPE over the demo's own text -- the system prompt, the three task prompts, the role names and
captions of training specs -- so the same caption is 11 tokens (``a`` `` square`` `` that`` ...).
Any text still encodes (the 256 byte tokens stay), timestamps included.

The merges are a pure function of the corpus (:func:`learn_bpe_merges` breaks ties by the pair),
and the corpus draws captions from training seeds only.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from samples.checkpoints.tiny_omni import (BYTE_VOCAB, DEFAULT_SYSTEM, EXTRA_TAGS, build_tiny_tokenizer,
                                         learn_bpe_merges, tiny_special_tokens)
from mm_pipeline.model.config import STRINGS
from samples.synthetic.generate import ItemJob, sample_spec
from samples.synthetic.spec import PROMPTS

VOCAB_SIZE = 512                      # the text model's embedding rows
CORPUS_SEED = 10_099                  # a training seed (10_000..10_099) that the training set never uses
CORPUS_ITEMS = 600                    # captions per modality


def demo_corpus() -> list[str]:
    texts = [DEFAULT_SYSTEM, "system\n", "user\n", "assistant\n", *PROMPTS.values()]
    for modality in ("image", "video", "audio"):
        texts += [sample_spec(ItemJob(modality, CORPUS_SEED, i, None, 60.0)).caption for i in range(CORPUS_ITEMS)]
    return texts


@lru_cache(maxsize=1)
def demo_merges() -> tuple[tuple[str, str], ...]:
    free = VOCAB_SIZE - BYTE_VOCAB - len(STRINGS) - len(EXTRA_TAGS)
    return tuple(learn_bpe_merges(demo_corpus(), free))


def demo_tokenizer() -> Any:
    return build_tiny_tokenizer(tiny_special_tokens(), demo_merges())
