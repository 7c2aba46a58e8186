"""Lesson 00: arithmetic about a GPT's training from its shape (used again in lessons 06–15),
each formula checked against small real tensors.

    shape              ModelShape, the one shape every analysis takes; parameter and FLOP counts
    memory             the training-memory ledger: weights, gradients, optimizer, activations
    calculator         the ipywidgets memory calculator over memory.ledger
    activation_memory  what one layer saves for backward, measured against Korthikanti et al.
    whatif             step time and MFU of a cluster, from FLOPs and the α-β model
    dryrun             one rank of a big layout stepped on the meta device: bytes held and sent
"""
