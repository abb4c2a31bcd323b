"""Tier 1, the description: what a decoder layer, the LM head and the MoE routes are, op by op (shapes, dtypes,
FLOPs, bytes, collectives, and how each op's cost scales). Read by every model; imports no other tier."""
