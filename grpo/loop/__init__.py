"""train.py's run: its settings and models, stacked rollouts, held-out evaluation, diagnostics."""
