"""Integrations of the expert cache into inference frameworks (one subpackage each)."""
