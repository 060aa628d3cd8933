"""Experiments on the source article's claims (claims.py) and a plotting tool for any runs (plot.py)."""
