"""The commands beyond run/check (compare, calibrate, advise, sweep, import, replay, endpoints), each a plugin."""
