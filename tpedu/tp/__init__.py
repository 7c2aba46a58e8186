"""Lessons 01–08: tensor parallelism itself, from one split matmul to the layers of a TP block
(and two later additions: the overlapped backward of lesson 15, the KV cache of lesson 17).

    matmul_split       column and row splits of one matmul, on one process (lesson 01)
    operators          the conjugate operators f, f̄, scatter and gather (lesson 03)
    sharding           shard a dense tensor per rank, and gather it back (lesson 04)
    layers             ColumnParallelLinear, RowParallelLinear (lesson 04)
    dense              the dense single-process references DenseMLP, DenseAttention (lessons 04, 05)
    dropout            dropout with a mask that is a function of (seed, global index) (lesson 04)
    mlp                the tensor-parallel MLP: column -> activation -> row; SwiGLU (lesson 04)
    attention          attention split by heads: fused QKV, GQA, KV-head replication (lesson 05)
    embedding          replicated and vocab-parallel embeddings (lesson 06)
    vocab_parallel     the vocab-parallel cross-entropy, argmax and sampling (lesson 06)
    rope               rotary position embeddings, applied per head (lesson 07)
    sequence_parallel  the sequence-parallel operators: all-gather / reduce-scatter on s (lesson 08)
    overlap            the column-parallel backward all-reduce hidden behind a matmul (lesson 15)
    kv_cache           a key/value cache sharded by heads, for decoding (lesson 17; tpedu.serve)

Each module is tested against (and built from) its dense reference in tpedu.tp.dense.
"""
