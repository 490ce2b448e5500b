"""Adapter registry (ids per loaded weights, in-flight counts) and device slot residency."""
