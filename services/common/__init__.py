"""Pieces shared by the gateway and the control plane."""
