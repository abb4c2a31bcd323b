"""Recorded and generated traffic: a SkyRL database, a service log, synthetic multi-tenant workloads."""
