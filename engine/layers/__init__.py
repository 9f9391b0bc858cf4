"""Parallel layers shared by the model definitions."""
