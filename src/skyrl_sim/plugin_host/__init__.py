"""The plugin interface (hookspecs), the host that loads plugins, the run driver and the cost contracts."""
