"""The kernel templates: one folder per target family (cpu, cuda), read by compiler/codegen/render.py and the
tuning spaces beside them (<op>.tune.toml)."""

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent
