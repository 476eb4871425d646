"""DLRM-family models."""
