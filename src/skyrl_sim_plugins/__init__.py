"""Built-in plugins of skyrl-sim. Each is registered through the ``skyrl_sim`` entry-point group like a third-party one."""
