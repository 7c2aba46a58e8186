"""Lessons 00–15: arithmetic about a GPT's training from its shape, each formula checked against
small real tensors.

    shape              ModelShape, the one shape every analysis takes: parameters, FLOPs (00)
    memory             the training-memory ledger: weights, gradients, optimizer, activations (00)
    calculator         the ipywidgets memory calculator over memory.ledger (00)
    activation_memory  what one layer saves for backward, measured against Korthikanti et al. (10)
    whatif             step time and MFU of a cluster, from FLOPs and the α-β model (15)
    dryrun             one rank of a big layout stepped on the meta device: bytes held and sent (13)
"""
