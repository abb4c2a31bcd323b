"""Tier 3, the fast paths: the time model's compiled program and width tiles (``time_program``), the memory walk's
width lanes and the calls answered from their effects (``memory_lanes``, ``memory_fit``). Each equals its reference
bit for bit where it answers, and keeps no state."""
