"""A tiny third-party backend over plain numpy, found through its entry point."""
