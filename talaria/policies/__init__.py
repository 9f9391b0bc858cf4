"""Admission policies of an instance: one concept per module."""
