"""The simpy simulator backend: SkyRL's engine queue in simulated time, with memory and time models."""
