"""Pricing rules of the project (a package, imported from the mount like the rest)."""
