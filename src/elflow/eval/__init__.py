"""Evaluation: the paper's metrics and protocol, the judges, MAUVE, and the learning diagnostics."""
