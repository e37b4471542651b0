"""Precision: dtype audit, harmonize, boundary casts (and, later, compare and plan)."""
