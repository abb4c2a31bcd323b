"""SkyRL's engine as every backend runs it: scheduling rules, call shapes, the futures table, clients, the loop."""
