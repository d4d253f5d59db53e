"""Test support: small configs, test envs, process helpers, used by every test module."""

__all__: list[str] = []
