"""Backend `tinker`: drive a real Tinker-API service (SkyRL) with a scenario."""
