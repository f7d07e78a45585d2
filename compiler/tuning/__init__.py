"""Kernel autotuning: tunable spaces beside the templates, the per-target tuning database, `llmc tune`."""
