"""Views of results: terminal tables, plots, traces, the memory explanation, progress."""
