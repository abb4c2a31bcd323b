"""The documents a user writes: scenarios, endpoints, model architectures, hardware profiles, and their limits."""
